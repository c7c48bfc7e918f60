"""Grouped decode of sibling adapters that read one input (rana.modules.groups): q/k/v and gate/up in one
masked-GEMV call, linked wherever adapters are installed (compress, rana.load, exports), equal to the
per-projection path (GQA, q/k/v biases, empty and full masks, every dtype), traced by
torch.compile(fullgraph=True), relinked after deepcopy, never used for peft-wrapped children; and the
adapters' sparsity bin, kept through save/load (older folders without it load with the default bin)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from decode_harness import STEPS, decode_step, greedy_static
from helpers import tiny_model
from rana.archs import get_arch
from rana.kernels import ops, route
from rana.modules import (InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear, groups, link_decode_groups,
                          relink)

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- models
def _quantile_threshold(x: torch.Tensor, q: float = 0.5) -> float:
    return float(x.float().flatten().quantile(q))


def adapted(arch: str = "qwen2", qkv=("abs", "abs", "abs"), mlp_in="square", thresholds=None, seed=0):
    """A tiny model whose q/k/v are input-sparse ("abs": InputSparseLinear) or neuron-thresholded
    ("abs_scaled"), gate/up rank adapters ("square") or input-sparse ("abs"), o/down input-sparse, with
    thresholds near the median of real inputs (`thresholds` overrides q/k/v's: ±inf for full/empty masks)."""
    model = tiny_model(arch, seed=seed)
    if arch == "qwen2":  # q/k/v biases that matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    inputs, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
            def grab(_m, args, key=(i, name)):
                inputs[key] = args[0].reshape(-1, args[0].shape[-1]).detach()
            hooks.append(layer.get_submodule(name).register_forward_pre_hook(grab))
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed)))
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = inputs[i, "self_attn.q_proj"]
        for j, (name, mode) in enumerate(zip(("q_proj", "k_proj", "v_proj"), qkv)):
            lin = getattr(attn, name)
            W, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            if mode == "abs":
                t = _quantile_threshold(x.abs(), 0.4 + 0.1 * j)
                setattr(attn, name, InputSparseLinear(W, b, t))
            else:
                t = _quantile_threshold(x.abs() * W.float().norm(dim=0), 0.4 + 0.1 * j)
                setattr(attn, name, NeuronThresholdLinear(W, b, t))
            if thresholds is not None:
                getattr(attn, name).threshold.fill_(thresholds[j])
        x = inputs[i, "mlp.gate_proj"]
        for j, name in enumerate(("gate_proj", "up_proj")):
            W = getattr(mlp, name).weight.detach()
            if mlp_in == "square":
                rank = 40 - 8 * j  # different ranks: different K in one launch
                U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
                A, B = (U[:, :rank] * S[:rank]).float(), Vh[:rank].float()
                module = RankAdapterLinear(A, B, None, _quantile_threshold((x @ B.T).pow(2), 0.5))
                module.set_active_fraction(0.5)
            else:
                module = InputSparseLinear(W, None, _quantile_threshold(x.abs(), 0.5))
                module.set_active_fraction(0.3)
            setattr(mlp, name, module)
        o = inputs[i, "self_attn.o_proj"]
        attn.o_proj = InputSparseLinear(attn.o_proj.weight.detach(), None, _quantile_threshold(o.abs()))
        h = inputs[i, "mlp.down_proj"]
        mlp.down_proj = InputSparseLinear(mlp.down_proj.weight.detach(), None, _quantile_threshold(h.abs()))
    return model.eval()


@pytest.fixture
def grouped_calls(monkeypatch):
    """How often a group ran its grouped call (eagerly: per call; compiled: per trace)."""
    calls = []
    real = groups.decode_masked_grouped

    def counting(ws, *args):
        calls.append(len(ws))
        return real(ws, *args)

    monkeypatch.setattr(groups, "decode_masked_grouped", counting)
    # eagerly on CPU the groups step aside by default (a grouped call is a loop there): exercise the grouping
    monkeypatch.setattr(groups, "GROUP_EAGER_CPU", True)
    return calls


def _unlink_all(model):
    for m in model.modules():
        groups.unlink(m)


def _decode_logits(model):
    """Greedy single-token decoding under a StaticCache (eager): the logits of every step."""
    return greedy_static(model, decode_step)[0]


# ------------------------------------------------------------------------------------- linking
def test_link_groups_by_mode():
    model = adapted(qkv=("abs", "abs_scaled", "abs"), mlp_in="square")
    assert link_decode_groups(model, get_arch(model.config)) == 2 * 2
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    g = attn.q_proj._decode_group
    assert g is not None and g is attn.v_proj._decode_group and g.mode == "abs"
    assert g.members() == [attn.q_proj, attn.v_proj] and attn.k_proj._decode_group is None  # other mode: alone
    assert mlp.gate_proj._decode_group.members() == [mlp.gate_proj, mlp.up_proj]
    assert mlp.gate_proj._decode_group.mode == "square"
    assert mlp.gate_proj._decode_group.decode_bin == 2 and mlp.down_proj._decode_group is None
    # relinking replaces the groups (no member stays in two)
    assert link_decode_groups(model, get_arch(model.config)) == 4
    assert attn.q_proj._decode_group is attn.v_proj._decode_group is not g


def test_fused_architectures_have_nothing_to_group():
    model = tiny_model("phi3")
    assert groups.shared_input_paths(get_arch(model.config)) == []


# --------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("qkv,mlp_in,thresholds", [
    (("abs", "abs", "abs"), "square", None),  # TEAL q/k/v (GQA, biases), rank gate/up
    (("abs_scaled",) * 3, "abs", None),  # neuron-thresholded q/k/v, input-sparse gate/up
    (("abs", "abs_scaled", "abs"), "square", None),  # mixed kinds: q/v grouped, k alone
    (("abs", "abs", "abs"), "abs", (float("inf"), -float("inf"), 0.2)),  # empty q mask, full k mask
])
def test_grouped_decode_equals_per_projection(qkv, mlp_in, thresholds, grouped_calls):
    model = adapted(qkv=qkv, mlp_in=mlp_in, thresholds=thresholds)
    made = link_decode_groups(model, get_arch(model.config))
    grouped = _decode_logits(model)
    assert len(grouped_calls) == made * STEPS  # every group, every decoded token
    del grouped_calls[:]
    _unlink_all(model)
    separate = _decode_logits(model)
    assert grouped_calls == []
    torch.testing.assert_close(grouped, separate, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_module_outputs_every_dtype(dtype, grouped_calls):
    model = adapted(qkv=("abs", "abs", "abs_scaled"), mlp_in="square").to(dtype)
    link_decode_groups(model, get_arch(model.config))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]
        assert grouped_calls == [2, 2]  # q/k (abs) and gate/up; v (abs_scaled) alone
        _unlink_all(model)
        refs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]
        # the torch reference of each projection (the masked product), in float64
        xd = x.double()
        exp_q = torch.nn.functional.linear(xd * (xd.abs() >= attn.q_proj.threshold.double()),
                                           attn.q_proj.linear.weight.double(), attn.q_proj.linear.bias.double())
    for y, r in zip(outs, refs):
        assert y.dtype == dtype and y.shape == r.shape
        torch.testing.assert_close(y, r, atol=0, rtol=0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float16: 0.01}[dtype]
    torch.testing.assert_close(outs[0].double(), exp_q, atol=tol * float(exp_q.abs().max()), rtol=tol)


def test_group_steps_aside(grouped_calls):
    """Several tokens, training, metering, gradients: each member takes its own path; a call with another
    tensor starts a new grouped call (the cache is keyed by the input's identity)."""
    model = adapted(mlp_in="abs")
    link_decode_groups(model, get_arch(model.config))
    attn = model.model.layers[0].self_attn
    x, other = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    with torch.no_grad():
        attn.q_proj(torch.randn(1, 3, 64))  # prefill
        assert grouped_calls == []
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        assert grouped_calls == [3] and not attn.q_proj._decode_group._outputs  # dropped after the last
        q2 = attn.q_proj(x)
        k_other = attn.k_proj(other)  # another tensor starts a new round: its own grouped call
        k2 = attn.k_proj(x)  # x's round was replaced: computed again, never mixed up
        assert grouped_calls == [3, 3, 3, 3]
        _unlink_all(model)
        torch.testing.assert_close(torch.cat([q, k, v, q2, k_other, k2], -1), torch.cat(
            [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.q_proj(x), attn.k_proj(other), attn.k_proj(x)], -1))
    link_decode_groups(model, get_arch(model.config))
    attn.k_proj.meter_on = True
    with torch.no_grad():
        attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    attn.k_proj.meter_on = False
    attn.train()
    with torch.no_grad():
        attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    attn.eval()
    x.requires_grad_(True)
    attn.q_proj(x).sum().backward()  # gradients wanted: the torch path (the ops have no backward)
    assert grouped_calls == [3] * 4 and x.grad is not None  # nothing grouped since


def test_peft_wrapped_members_keep_lora(grouped_calls):
    """A LoRA-wrapped child: the group must not read the base weight (LoRA would be skipped)."""
    from peft import LoraConfig, get_peft_model

    model = adapted(mlp_in="abs")
    link_decode_groups(model, get_arch(model.config))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["linear"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.eval()
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        q = attn.q_proj(x)
        exp = attn.q_proj.linear(x * (x.abs() >= attn.q_proj.threshold))  # with LoRA
        assert grouped_calls[:1] != [3]
        merged = peft_model.merge_and_unload()
        assert merged.model.layers[0].self_attn.q_proj._decode_group is not None  # links survive the merge
        q_merged = attn.q_proj(x)
    torch.testing.assert_close(q, exp)
    torch.testing.assert_close(q_merged, exp, atol=1e-5, rtol=1e-5)
    assert grouped_calls[-1] == 3  # merged: plain nn.Linear children again, the grouped path


# ------------------------------------------------------------------------------------ compile
def test_compiled_decode_runs_the_groups():
    """torch.compile(fullgraph=True) of the decode step: no graph break, the eager logits and greedy tokens,
    one grouped op per q/k/v and per gate/up group of every layer."""
    model = adapted(qkv=("abs", "abs", "abs"), mlp_in="square")
    made = link_decode_groups(model, get_arch(model.config))
    ref_logits, ref_tokens = greedy_static(model, decode_step)
    counts: list[dict] = []

    def recording(gm, example_inputs):
        targets = [str(n.target).removesuffix(".default") for n in gm.graph.nodes if "rana" in str(n.target)]
        counts.append({t: targets.count(t) for t in set(targets)})
        return gm.forward

    torch._dynamo.reset()
    try:
        step = torch.compile(decode_step, fullgraph=True, backend=recording)
        logits, tokens = greedy_static(model, step)
    finally:
        torch._dynamo.reset()
    assert counts and all(c == counts[0] for c in counts)
    # 2 layers × (q/k/v + gate/up) grouped; o and down on their own
    assert counts[0] == {"rana.decode_masked_grouped": made, "rana.decode_masked": 2 * 2} and made == 4
    torch.testing.assert_close(logits, ref_logits, atol=1e-5 * float(ref_logits.abs().max()), rtol=0)
    assert torch.equal(tokens, ref_tokens)


# ---------------------------------------------------------------------------------- deepcopy
def test_deepcopy_and_relink(grouped_calls):
    model = adapted(qkv=("abs", "abs", "abs"), mlp_in="square")
    link_decode_groups(model, get_arch(model.config))
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    # the copied group still points at the originals: the copy decodes per projection, correctly
    assert attn.q_proj._decode_group.members()[0] is model.model.layers[0].self_attn.q_proj
    ref = _decode_logits(model)
    del grouped_calls[:]
    torch.testing.assert_close(_decode_logits(twin), ref)
    assert grouped_calls == []
    assert relink(twin) == 4
    assert attn.q_proj._decode_group.members() == [attn.q_proj, attn.k_proj, attn.v_proj]
    torch.testing.assert_close(_decode_logits(twin), ref)
    assert len(grouped_calls) == 4 * STEPS
    # the original's links are untouched
    orig = model.model.layers[0].self_attn
    assert orig.q_proj._decode_group.members() == [orig.q_proj, orig.k_proj, orig.v_proj]


# ------------------------------------------------------------------------------ install paths
def test_compress_links_and_records_the_sparsity_bin(tmp_path):
    """rana compress (TEAL: every projection input-sparse) links q/k/v and gate/up, each adapter knows its
    expected active fraction; the folder keeps it, rana.load relinks; an older folder (no key) loads
    with the default bin."""
    from helpers import tiny_calibration, tiny_compress_config
    from rana import io as rio
    from rana.compress import compress_model

    model = tiny_model("llama")
    result = compress_model(model, None, tiny_compress_config(method="teal", flops=0.6), tiny_calibration())
    model = result.model.eval()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj._decode_group.members() == [attn.q_proj, attn.k_proj, attn.v_proj]
    assert mlp.gate_proj._decode_group.members() == [mlp.gate_proj, mlp.up_proj]
    plan_q = next(e for e in result.plan["layers"][0]["attention"]["components"].values() if e.get("path") == "self_attn.q_proj")
    assert attn.q_proj.active_fraction == pytest.approx(plan_q["expected_active"] / 64)
    assert attn.q_proj.decode_bin == route.sparsity_bin(attn.q_proj.active_fraction)

    rio.save(model, None, tmp_path / "r")
    specs = json.loads((tmp_path / "r" / "rana_config.json").read_text())["adapters"]
    assert all("active_fraction" in s for s in specs)
    loaded, _ = rio.load(tmp_path / "r")
    la = loaded.model.layers[0].self_attn
    assert la.q_proj.active_fraction == attn.q_proj.active_fraction and la.q_proj.decode_bin == attn.q_proj.decode_bin
    assert la.q_proj._decode_group.members() == [la.q_proj, la.k_proj, la.v_proj]
    assert la.q_proj._decode_group.decode_bin == attn.q_proj._decode_group.decode_bin
    torch.testing.assert_close(_decode_logits(loaded), _decode_logits(model))

    cfg = tmp_path / "r" / "rana_config.json"
    meta = json.loads(cfg.read_text())
    bad = json.loads(cfg.read_text())
    bad["adapters"][0]["active_fraction"] = 1.5
    cfg.write_text(json.dumps(bad))
    with pytest.raises(rio.ModelLoadError, match="'active_fraction' must be a number in \\[0, 1\\], got 1.5"):
        rio.load(tmp_path / "r")
    for s in meta["adapters"]:
        s.pop("active_fraction")
    cfg.write_text(json.dumps(meta))
    old, _ = rio.load(tmp_path / "r")
    oa = old.model.layers[0].self_attn
    assert oa.q_proj.active_fraction is None and oa.q_proj.decode_bin == route.DEFAULT_SPARSITY_BIN
    assert oa.q_proj._decode_group is not None
    torch.testing.assert_close(_decode_logits(old), _decode_logits(model))


# ------------------------------------------------------ the Triton grouped kernel, interpreted
INTERPRETED = textwrap.dedent(r'''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["RANA_TRITON_ON_CPU"] = "1"  # the modules' eager CPU path takes the Triton kernel
    import torch
    sys.path.insert(0, sys.argv[1])
    from rana.archs import get_arch
    from rana.kernels import ops, weights
    from rana.modules import groups, link_decode_groups
    from test_decode_groups import adapted
    assert ops.HAS_TRITON and weights.TRITON_ON_CPU
    launches, code_launches = [], []
    real = groups.decode_masked_grouped
    groups.decode_masked_grouped = lambda ws, *a: launches.append(len(ws)) or real(ws, *a)
    real_codes = groups.decode_dense_grouped
    groups.decode_dense_grouped = lambda ws, vs: code_launches.append(len(ws)) or real_codes(ws, vs)
    for dtype, qkv, mlp_in, ts in ((torch.float32, ("abs",) * 3, "square", None),
                                   (torch.bfloat16, ("abs_scaled",) * 3, "abs", None),
                                   (torch.float16, ("abs",) * 3, "square", (float("inf"), -float("inf"), 0.3))):
        model = adapted(qkv=qkv, mlp_in=mlp_in, thresholds=ts).to(dtype)
        link_decode_groups(model, get_arch(model.config))
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
        mods = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        with torch.no_grad():
            fused = [m(x) for m in mods]  # two grouped launches
            for m in mods:
                groups.unlink(m)
            single = [m(x) for m in mods]  # five single-projection launches of the same kernel
            for m in mods:
                m.meter_on = True  # the torch masked product
            refs = [m(x) for m in mods]
        for i, (y, s, r) in enumerate(zip(fused, single, refs)):
            assert y.dtype == dtype and y.shape == r.shape, (y.dtype, y.shape, r.shape)
            if mlp_in == "square" and i >= 3:  # gate/up codes B x from the grouped dense kernel, not F.linear
                torch.testing.assert_close(y, s, atol=1e-6 * max(1.0, float(s.abs().max())), rtol=1e-6)
            else:
                torch.testing.assert_close(y, s, atol=0, rtol=0)
            if dtype == torch.float32:  # (in 16 bits a score at the threshold may round across it)
                torch.testing.assert_close(y, r, atol=1e-5 * max(1.0, float(r.abs().max())), rtol=1e-5)
    assert launches == [3, 2] * 3, launches
    assert code_launches == [2, 2], code_launches  # gate's and up's B in one launch, in both "square" models
    print("OK", len(launches))
''')


@pytest.mark.skipif(not ops.HAS_TRITON, reason="triton is not installed")
def test_grouped_modules_through_triton_interpreter(tmp_path):
    script = tmp_path / "interp_groups.py"
    script.write_text(INTERPRETED)
    env = {**os.environ, "TRITON_INTERPRET": "1", "RANA_TRITON_ON_CPU": "1"}
    out = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert out.stdout.strip().splitlines()[-1] == "OK 6"
