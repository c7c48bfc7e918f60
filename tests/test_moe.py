"""Mixtures of experts (issue 24): qwen3_moe, mixtral and olmoe on tiny random configs (8 experts of 32
neurons, top 2; transformers 5's stacked 3-D experts). Input sparsity per expert on the gate/up and down
inputs, the router dense; FLOPs metered with the routed experts; per-expert calibration token counts and
the shared-threshold fallback in the plan; batch-1 decoding through the expert-indexed masked GEMV,
compiled without a graph break; save / rana.load in a fresh process and export; the methods that cannot
compress experts refuse in one line."""
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from rana.accounting import layer_dims
from rana.archs import UnsupportedArchitectureError, decoder_layers, get_arch, supported_model_types
from rana.compress import compress_model
from rana.io import save
from rana.kernels.route import decode_expert_masked
from rana.kernels.torch_gemv import expert_masked_gemv_gather, expert_masked_gemv_reference
from rana.kernels.weights import FloatWeight
from rana.math.moe import per_expert_thresholds, routed_tokens, split_candidates
from rana.methods import moe, names, unsupported_reason
from rana.modules import InputSparseExperts
from decode_harness import compiled_matches
from helpers import tiny_calibration, tiny_compress_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = [t for t in supported_model_types() if get_arch(t).moe]  # every registered mixture of experts
CAPABLE = {"rana", "teal", "rana-dense-head", "rana-heads"}  # magnitude input sparsity per expert
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def _route_expert(w_t, v, idx, thr):
    """The decode route's expert entry point with the stacked (E, K, N) weights as an operand (E, N, K)."""
    return decode_expert_masked(FloatWeight(w_t.transpose(1, 2)), v, idx, thr)


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _compressed(arch, **kw):
    model = tiny_model(arch)
    dense = _logits(model)
    return model, dense, compress_model(model, None, tiny_compress_config(**kw), tiny_calibration())


def _close(a, b, tol=1e-5):
    return torch.allclose(a, b, atol=tol * b.abs().max(), rtol=0)


@pytest.mark.parametrize("arch", MOE)
def test_spec_and_dense_cost_count_the_routed_experts(arch):
    model = tiny_model(arch)
    spec = get_arch(model.config)
    layer = decoder_layers(model, spec)[0]
    experts = layer.get_submodule(spec.experts_path())
    E, two_i, H = experts.gate_up_proj.shape
    assert experts.down_proj.shape == (E, H, two_i // 2)
    assert layer.get_submodule(spec.role_path("mlp_in")) is experts and spec.mlp_paths() == {}
    assert isinstance(layer.get_submodule(spec.router_path()).weight, torch.nn.Parameter)
    d = layer_dims(model.config)[0]
    assert (d.experts, d.top_k, d.intermediate) == (8, 2, 32)
    from rana.math.flops import dense_layer_macs
    macs = dense_layer_macs(d)
    assert macs["up"] == macs["gate"] == macs["down"] == 2 * 32 * 64  # top-2 of 8 experts: active parameters only
    assert macs["router"] == 8 * 64


def test_qwen3_moe_with_dense_mlp_layers_refuses_in_one_line():
    with pytest.raises(UnsupportedArchitectureError, match="dense MLP layers") as err:
        layer_dims(tiny_model("qwen3_moe", mlp_only_layers=[1]).config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", MOE)
def test_flops_one_is_the_dense_model(arch):
    model, dense, result = _compressed(arch, flops=1.0)
    assert result.plan["measured_flops"] == pytest.approx(1.0, abs=1e-6)
    assert _close(_logits(result.model), dense)


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("method", sorted(CAPABLE))
def test_budget_met_with_routed_expert_flops(arch, method):
    model, dense, result = _compressed(arch, method=method, flops=0.7)
    plan = result.plan
    assert plan["measured_flops"] == pytest.approx(0.7, abs=0.01)
    assert plan["budget"]["dense_macs"]["up"] == 2 * (2 * 32 * 64)  # two layers of top-2 experts, not all eight
    entry = plan["layers"][0]["mlp"]["components"]["experts"]
    assert entry["kind"] == "moe_input_sparse" and entry["top_k"] == 2 and entry["num_experts"] == 8
    assert entry["dense_macs"] == 2 * 3 * 32 * 64
    assert entry["measured_macs"] == pytest.approx(entry["expected_macs"], rel=0.1)
    logits = _logits(result.model)
    assert torch.isfinite(logits).all() and not _close(logits, dense, 1e-3)


@pytest.mark.parametrize("method", names())
def test_methods_that_cannot_compress_experts_refuse_in_one_line(method):
    if method in CAPABLE:
        assert unsupported_reason(method, get_arch("mixtral")) is None
        return
    model = tiny_model("mixtral")
    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts") as err:
        compress_model(model, None, tiny_compress_config(method=method, flops=0.7), tiny_calibration())
    assert "\n" not in str(err.value) and str(err.value) == unsupported_reason(method, get_arch(model.config))


@pytest.mark.parametrize("arch", MOE)
def test_thresholds_that_keep_everything_give_the_dense_logits_prefill_and_decode(arch):
    model, dense, result = _compressed(arch, flops=0.7)
    adapters = [m for m in result.model.modules() if isinstance(m, InputSparseExperts)]
    assert len(adapters) == 2
    with torch.no_grad():
        for m in result.model.modules():
            for name in ("threshold", "in_threshold", "down_threshold"):
                if isinstance(getattr(m, name, None), torch.Tensor):
                    getattr(m, name).fill_(-math.inf)
    assert _close(_logits(result.model), dense)
    reference = tiny_model(arch)  # the same seed: the dense model again
    with torch.no_grad():  # one-token steps take the expert-indexed decode path
        a = result.model(IDS[:1], use_cache=True)
        b = reference(IDS[:1], use_cache=True)
        tok = IDS[:1, -1:]
        step_a = result.model(tok, past_key_values=a.past_key_values).logits
        step_b = reference(tok, past_key_values=b.past_key_values).logits
    assert _close(step_a, step_b)


@pytest.mark.parametrize("arch", MOE)
def test_routing_is_unchanged(arch):
    """The router is the dense module with its dense weights, reading the experts' (dense) input."""
    dense_model = tiny_model(arch)
    _, _, result = _compressed(arch, flops=0.7)
    spec = get_arch(result.model.config)
    seen = []
    for i, layer in enumerate(decoder_layers(result.model, spec)):
        router, experts = layer.get_submodule(spec.router_path()), layer.get_submodule(spec.experts_path())
        assert type(router) is type(decoder_layers(dense_model, spec)[i].get_submodule(spec.router_path()))
        w = decoder_layers(dense_model, spec)[i].get_submodule(spec.router_path()).weight
        assert torch.equal(router.weight, w)
        router.register_forward_hook(lambda m, a, out, w=w: seen.append((a[0], out[0], w)))
        experts.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    _logits(result.model)
    for k in range(0, len(seen), 2):
        (x, logits, w), experts_in = seen[k], seen[k + 1]
        assert torch.equal(experts_in, x.reshape(experts_in.shape))  # the experts read what the router read
        assert torch.equal(logits, F.linear(x.reshape(-1, x.shape[-1]), w))


def test_per_expert_token_counts_and_the_shared_fallback(monkeypatch):
    _, _, result = _compressed("mixtral", flops=0.7)
    for layer in result.plan["layers"]:
        entry = layer["mlp"]["components"]["experts"]
        counts = [e["calibration_tokens"] for e in entry["experts"]]
        assert len(counts) == 8 and sum(counts) % 2 == 0 and min(counts) >= moe.MIN_EXPERT_TOKENS
        assert entry["experts_on_shared_threshold"] == 0
        assert {e["threshold_source"] for e in entry["experts"]} == {"own"}
        assert len({e["in_threshold"] for e in entry["experts"]}) == 8  # one threshold per expert
    monkeypatch.setattr(moe, "MIN_EXPERT_TOKENS", 10 ** 9)  # every expert saw too few tokens
    _, _, result = _compressed("mixtral", flops=0.7)
    entry = result.plan["layers"][0]["mlp"]["components"]["experts"]
    assert entry["experts_on_shared_threshold"] == 8
    assert all(e["threshold_source"] == "shared" and e["in_threshold"] == entry["shared_in_threshold"]
               and e["down_threshold"] == entry["shared_down_threshold"] for e in entry["experts"])
    assert result.plan["measured_flops"] == pytest.approx(0.7, abs=0.02)


def test_per_expert_thresholds_pure():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(100, 16, generator=g) * (e + 1) for e in range(3)] + [torch.rand(3, 16, generator=g)]
    t, shared, fell_back = per_expert_thresholds(scores, 0.5, 32)
    assert fell_back == [False, False, False, True] and t[3] == shared
    for e in range(3):
        assert float((scores[e] >= t[e]).float().mean()) == pytest.approx(0.5, abs=0.01)
    assert per_expert_thresholds(scores, 1.0, 32)[0] == [-math.inf] * 4
    idx = torch.tensor([[0, 2], [2, 1], [0, 1]])
    assert [r.tolist() for r in routed_tokens(idx, 4)] == [[0, 2], [1, 2], [0, 1], []]


def test_expert_indexed_gemv_matches_the_reference_and_decoding():
    g = torch.Generator().manual_seed(0)
    w_t = torch.randn(8, 64, 48, generator=g)
    v = torch.randn(3, 64, generator=g)
    idx, thr = torch.tensor([5, 0, 5]), torch.rand(8, generator=g)
    ref = expert_masked_gemv_reference(w_t, v, idx, thr)
    torch.testing.assert_close(expert_masked_gemv_gather(w_t, v, idx, thr), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_route_expert(w_t, v, idx, thr), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.ops.rana.expert_masked_gemv(w_t, v, idx, thr), ref, atol=1e-5, rtol=1e-5)
    # the adapter: one token's decode path = its several-token path on that token
    m = InputSparseExperts(torch.randn(8, 64, 16, generator=g), torch.randn(8, 16, 32, generator=g), "silu",
                           torch.rand(8, generator=g) * 0.5, torch.rand(8, generator=g) * 0.1, 2).eval()
    x, top = torch.randn(1, 16, generator=g), torch.tensor([[3, 6]])
    weights = torch.tensor([[0.7, 0.3]])
    with torch.no_grad():
        decoded = m(x, top, weights)
        m.meter_on = True  # metering takes the several-token path
        routed = m(x, top, weights)
    torch.testing.assert_close(decoded, routed, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", MOE)
def test_compiled_decode_step_traces_without_a_graph_break(arch):
    _, _, result = _compressed(arch, flops=0.7)
    assert "rana.expert_masked_gemv" in compiled_matches(result.model)


LOAD_IN_A_FRESH_PROCESS = textwrap.dedent('''
    import json, sys, torch
    import rana.io
    from rana.modules import InputSparseExperts
    out = {}
    for arch, folder in json.loads(sys.argv[1]).items():
        model, _ = rana.io.load(folder)
        assert sum(isinstance(m, InputSparseExperts) for m in model.modules()) == 2
        with torch.no_grad():
            out[arch] = model(torch.tensor(json.loads(sys.argv[2]))).logits.tolist()
    print(json.dumps(out))
''')


def test_save_rana_load_in_a_fresh_process_and_export(tmp_path):
    from rana.export import export
    from test_export import PROMPT, run_isolated

    folders, refs, exports = {}, {}, {}
    for arch in MOE:
        _, _, result = _compressed(arch, flops=0.7)
        refs[arch] = _logits(result.model)
        folders[arch] = str(tmp_path / arch)
        save(result.model, None, folders[arch], plan=result.plan)
        plan = json.loads((tmp_path / arch / "plan.json").read_text())
        assert "calibration_tokens" in plan["layers"][0]["mlp"]["components"]["experts"]["experts"][0]
        exports[arch] = tmp_path / f"{arch}_export"
        export(tmp_path / arch, exports[arch])
    proc = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, json.dumps(folders),
                           json.dumps(IDS.tolist())], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in MOE:
        assert _close(torch.tensor(got[arch]), refs[arch]), arch
    isolated = run_isolated(exports, tmp_path, resave=False)
    import rana.io as rio
    for arch in MOE:
        r = isolated[arch]
        assert "InputSparseExperts" in r["adapters"] and r["missing"] == [] and r["unexpected"] == []
        model, _ = rio.load(folders[arch])
        with torch.no_grad():
            ref = model(PROMPT).logits
        assert _close(r["logits"], ref), arch


def test_split_candidates_spend_the_budget_pure():
    for f in (0.2, 0.5, 0.7, 0.95):
        pairs = split_candidates(f, steps=8)
        assert (f, f) in [(round(a, 6), round(b, 6)) for a, b in pairs] or any(abs(a - f) < 1e-6 for a, _ in pairs)
        assert len(pairs) >= 5
        for a, b in pairs:
            assert 0.0 <= a <= 1.0 and 0.0 <= b <= 1.0
            assert (2 * a + b) / 3 == pytest.approx(f, abs=1e-6)
    assert split_candidates(1.0) == [(1.0, 1.0)]


def test_the_default_searches_the_experts_split_and_teal_does_not():
    _, _, rana = _compressed("qwen3_moe", method="rana", flops=0.6)
    for layer in rana.plan["layers"]:
        split = layer["mlp"]["components"]["experts"]["split"]
        assert split["mode"] == "grid" and len(split["searched"]) >= 5
        errors = {(r["in_keep"], r["down_keep"]): r["error"] for r in split["searched"]}
        chosen = errors[(split["in_keep"], split["down_keep"])]
        assert chosen == min(errors.values())
        equal = [e for (a, b), e in errors.items() if abs(a - b) < 1e-6]  # the layer's own fraction on both
        assert equal and chosen <= equal[0]  # never worse than the equal split on the held-aside tokens
    assert rana.plan["measured_flops"] == pytest.approx(0.6, abs=0.02)
    _, _, teal = _compressed("qwen3_moe", method="teal", flops=0.6)
    split = teal.plan["layers"][0]["mlp"]["components"]["experts"]["split"]
    assert split["mode"] == "equal" and split["searched"] == [] and split["in_keep"] == split["down_keep"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_expert_indexed_triton_kernel_under_the_interpreter(dtype):
    from rana.kernels import triton_gemv as tg
    if not (tg.triton_available() and tg.interpreting()):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(1)
    w_t = torch.randn(6, 40, 24, generator=g).to(dtype)  # K, N not multiples of the blocks
    token = torch.randn(1, 40, generator=g).to(dtype)
    idx = torch.tensor([4, 1, 4])
    thr = torch.rand(6, generator=g)
    thr[1] = -math.inf  # expert 1 keeps every input
    for v in (token.expand(3, -1), torch.randn(3, 40, generator=g).to(dtype)):  # expanded (stride 0) and own rows
        ref = expert_masked_gemv_reference(w_t.float(), v.float(), idx, thr)
        got = tg.expert_masked_gemv_triton(w_t, v, idx, thr)
        assert got.dtype == dtype and got.shape == (3, 24)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    thr_all = torch.full((6,), math.inf)  # nothing kept: zeros
    assert tg.expert_masked_gemv_triton(w_t, v, idx, thr_all).abs().max() == 0


def test_moe_decode_takes_the_expert_kernel_under_the_interpreter(tmp_path):
    """With the Triton path switched on for CPU tensors (RANA_TRITON_ON_CPU=1 under the interpreter), one
    decode token of a compressed MoE runs rana_expert_masked_gemv and gives the gather path's logits."""
    from rana.kernels import triton_gemv as tg
    if not (tg.triton_available() and tg.interpreting()):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    _, _, result = _compressed("mixtral", flops=0.7)
    save(result.model, None, tmp_path / "m", plan=result.plan)
    script = textwrap.dedent(f"""
        import json, sys, torch
        import rana.io
        from rana.kernels import triton_gemv as tg
        calls = []
        original = tg.expert_masked_gemv_triton
        def counting(*a, **k):
            calls.append(1)
            return original(*a, **k)
        import rana.kernels.route as route
        route.expert_masked_gemv_triton = counting
        model, _ = rana.io.load({str(tmp_path / 'm')!r})
        ids = torch.tensor([[1, 5, 9, 2]])
        with torch.no_grad():
            out = model(ids, use_cache=True)
            step = model(ids[:, -1:], past_key_values=out.past_key_values).logits
        print(json.dumps({{"calls": len(calls), "logits": step.flatten().tolist()}}))
    """)
    runs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "TRITON_INTERPRET": "1", "RANA_TRITON_ON_CPU": flag, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[flag] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["0"]["calls"] == 0 and runs["1"]["calls"] == 4  # two MoE layers, gate/up and down each
    torch.testing.assert_close(torch.tensor(runs["1"]["logits"]), torch.tensor(runs["0"]["logits"]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_expert_indexed_native_kernel(threads):
    from rana.kernels import cpu_gemv as cg
    if cg.native_kernel() is None:
        pytest.skip(cg.native_status())
    g = torch.Generator().manual_seed(2)
    w_t = torch.randn(8, 72, 200, generator=g)  # N split over threads, K not a multiple of 4
    token = torch.randn(1, 72, generator=g)
    idx, thr = torch.tensor([6, 2, 6, 0]), torch.rand(8, generator=g)
    thr[2], thr[0] = -math.inf, math.inf  # expert 2 keeps everything, expert 0 nothing
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for v in (token.expand(4, -1), torch.randn(4, 72, generator=g)):
            ref = expert_masked_gemv_reference(w_t, v, idx, thr)
            got = cg.expert_masked_gemv_native(w_t, v, idx, thr)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            assert got[3].abs().max() == 0
            torch.testing.assert_close(_route_expert(w_t, v, idx, thr), ref, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(old)
    # what it does not take goes to the torch paths (same results)
    assert cg.expert_masked_gemv_native(w_t.to(torch.bfloat16), token.expand(4, -1).bfloat16(), idx, thr) is None
    assert cg.expert_masked_gemv_native(w_t.transpose(1, 2).contiguous().transpose(1, 2), token.expand(4, -1), idx,
                                        thr) is None
