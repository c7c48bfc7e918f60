"""The compile-safe decode path: torch.library ops (opcheck), the grouped Triton kernel under the
interpreter (parity, fused q/k/v and gate/up launches), and `torch.compile(fullgraph=True)` of a tiny
compressed model's single-token decode step under transformers' StaticCache: no graph break, the
eager logits and greedy tokens, the rana ops in the graph — for every adapter kind and for an exported
model loaded in a fresh process without rana or triton."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from decode_harness import compiled_matches
from helpers import tiny_model
from rana.kernels import ops
from rana.modules import CatsActivation, InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear, SharedRankCode

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- opcheck
def _case(K, N, dtype, mode, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w_t = torch.randn(K, N, generator=g).to(dtype)
    v = torch.randn(1, 1, K, generator=g).to(dtype)
    scale = torch.rand(K, generator=g) + 0.5 if mode == "abs_scaled" else None
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    t = torch.tensor({"square": 0.5, "abs": 0.7, "abs_scaled": 0.6, "none": 0.0}[mode])
    return w_t, v, t, scale, b


def _reference(w_t, v, t, mode, scale, b):
    vf = v.double().reshape(-1)
    score = {"square": vf * vf, "abs": vf.abs(), "none": torch.full_like(vf, float("inf")),
             "abs_scaled": vf.abs() * (scale.double() if scale is not None else 1)}[mode]
    y = (vf * (score >= float(t))) @ w_t.double()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["square", "abs_scaled", "abs", "none"])
def test_opcheck_cpu_ops(dtype, mode):
    w_t, v, t, scale, b = _case(40, 24, dtype, mode)
    torch.library.opcheck(torch.ops.rana.decode_masked.default, (w_t, None, v, t, mode, scale, b))
    y = torch.ops.rana.decode_masked(w_t, None, v, t, mode, scale, b)
    assert y.shape == (1, 1, 24) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(y.double().reshape(-1), _reference(w_t, v, t, mode, scale, b), atol=tol, rtol=0.02)
    w2, _, t2, s2, _ = _case(40, 8, dtype, mode, seed=1, bias=False)
    args = ([v, v], [w_t, w2], [None, None], [t, t2], mode, [scale, s2], [b, None])
    torch.library.opcheck(torch.ops.rana.decode_masked_grouped.default, args)
    flat = torch.ops.rana.decode_masked_grouped(*args)
    assert flat.shape == (32,)
    torch.testing.assert_close(flat[24:].double(), _reference(w2, v, t2, mode, s2, None), atol=tol, rtol=0.02)


def test_ops_are_registered():
    assert set(ops.OP_NAMES) >= {"rana::decode_masked", "rana::decode_masked_grouped"}
    if ops.HAS_TRITON:
        assert "rana::decode_masked_triton" in ops.OP_NAMES


# --------------------------------------------------------------------- Triton under the interpreter
INTERPRETED = textwrap.dedent(r'''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_decode_ops import _case, _reference
    from rana.kernels import ops, triton_gemv as tg
    assert ops.HAS_TRITON and "rana::decode_masked_triton" in ops.OP_NAMES
    op = torch.ops.rana.decode_masked_triton
    TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 1e-2), torch.bfloat16: (0.15, 2e-2)}
    checked = 0

    def check(groups, mode, dtype, cfg=None):
        global checked
        vs, ws, ts, ss, bs = zip(*groups)
        if cfg is None:
            flat = op(list(vs), list(ws), [None] * len(ws), list(ts), mode, list(ss), list(bs), 2)
        else:
            flat = tg._launch(list(vs), list(ws), list(ts), mode, list(ss), list(bs), cfg)
        assert flat.dtype == dtype and flat.shape == (sum(w.shape[1] for w in ws),), (flat.dtype, flat.shape)
        exp = torch.cat([_reference(w, v, t, mode, s, b) for v, w, t, s, b in groups])
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(flat.double(), exp, atol=atol * max(1.0, float(exp.abs().max())), rtol=rtol)
        checked += 1

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mode in ("square", "abs_scaled", "abs", "none"):
            # one projection, odd shapes, bias
            w, v, t, sc, b = _case(37, 29, dtype, mode, seed=3)
            check([(v, w, t, sc, b)], mode, dtype)
        # fused q/k/v: one input, three thresholds, GQA widths (q 48, k/v 16), biases on q and v only
        w_q, v, _, _, b_q = _case(40, 48, dtype, "abs", seed=4)
        w_k, _, _, _, _ = _case(40, 16, dtype, "abs", seed=5)
        w_v, _, _, _, b_v = _case(40, 16, dtype, "abs", seed=6)
        ts = [torch.tensor(0.3), torch.tensor(0.9), torch.tensor(1.5)]
        qkv = [(v, w_q, ts[0], None, b_q), (v, w_k, ts[1], None, None), (v, w_v, ts[2], None, b_v)]
        check(qkv, "abs", dtype)
        # gate/up of rank adapters: different inputs (rank codes), different K, one launch
        w_g, z_g, t_g, _, _ = _case(24, 40, dtype, "square", seed=7, bias=False)
        w_u, z_u, t_u, _, _ = _case(20, 40, dtype, "square", seed=8, bias=False)
        check([(z_g, w_g, t_g, None, None), (z_u, w_u, t_u, None, None)], "square", dtype)
    # the LM head's shape (--lm-head sparse): a narrow input, a vocabulary-wide output (many output blocks)
    for dtype in (torch.float32, torch.bfloat16):
        w, v, t, _, _ = _case(64, 1000, dtype, "abs", seed=13, bias=False)
        check([(v, w, t, None, None)], "abs", dtype)
    # both store paths: SPLIT == 1 writes the output directly, SPLIT > 1 goes through the reduce launch
    for cfg in (tg.GemvConfig(16, 8, 1, 4), tg.GemvConfig(32, 8, 3, 4), tg.GemvConfig(64, 16, 8, 4)):
        check(qkv, "abs", torch.bfloat16, cfg)
    # empty and full masks
    w, v, _, _, b = _case(33, 20, torch.float16, "abs", seed=9)
    empty = op([v], [w], [None], [torch.tensor(1e30)], "abs", [None], [b], 2)
    torch.testing.assert_close(empty, b)
    full = op([v], [w], [None], [torch.tensor(-float("inf"))], "abs", [None], [b], 2)
    torch.testing.assert_close(full.double(), _reference(w, v, torch.tensor(0.0), "none", None, b), atol=2e-2, rtol=1e-2)
    # inactive rows are never read (NaN there would poison the sum)
    w, v, t, _, _ = _case(48, 16, torch.float32, "abs", seed=10, bias=False)
    poisoned = w.clone()
    poisoned[(v.reshape(-1).abs() < t)] = float("nan")
    y = op([v], [poisoned], [None], [t], "abs", [None], [None], 2)
    torch.testing.assert_close(y.double(), _reference(w, v, t, "abs", None, None), atol=1e-4, rtol=1e-5)
    # opcheck the triton_op on a fused call: schema, autograd registration, fake. (aot_dispatch traces the
    # launches with functional tensors, which the interpreter cannot read; on CUDA it runs in full below.)
    ws, vs, ts2, ss, bs = (list(x) for x in zip(*[_case(24, 16, torch.float32, "abs_scaled", seed=s) for s in (11, 12)]))
    torch.library.opcheck(op.default, (vs, ws, [None, None], ts2, "abs_scaled", ss, bs, 2),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    # the rank adapters' codes: up to three dense row-major GEMVs in one launch (odd shapes, K not a
    # multiple of the block, several blocks of rows), as a function and as the registered op
    dense_op = torch.ops.rana.dense_gemv_triton
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(21)
        ws = [torch.randn(n, k, generator=g).to(dtype) for n, k in ((13, 70), (9, 70), (5, 33))]
        vs = [torch.randn(w.shape[1], generator=g).to(dtype) for w in ws]
        for count in (1, 2, 3):
            exp = torch.cat([w.double() @ v.double() for w, v in zip(ws[:count], vs[:count])])
            for y in (tg.grouped_dense_gemv_triton(vs[:count], ws[:count]), dense_op(vs[:count], ws[:count])):
                assert y.dtype == dtype and y.shape == exp.shape
                atol, rtol = TOL[dtype]
                torch.testing.assert_close(y.double(), exp, atol=atol * max(1.0, float(exp.abs().max())), rtol=rtol)
                checked += 1
    print("OK", checked)
''')


@pytest.mark.skipif(not ops.HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_under_interpreter(tmp_path):
    script = tmp_path / "interp.py"
    script.write_text(INTERPRETED)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert out.stdout.strip().splitlines()[-1] == "OK 41"


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1: the kernels would be interpreted; run with TRITON_INTERPRET=0")
@pytest.mark.skipif(not (ops.HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_opcheck_triton_op_cuda(dtype):
    groups = [_case(64, n, dtype, "abs", seed=s) for s, n in ((1, 96), (2, 32), (3, 32))]
    ws, vs, ts, ss, bs = (list(x) for x in zip(*groups))
    args = ([v.cuda() for v in vs], [w.cuda() for w in ws], [None] * len(ws), [t.cuda() for t in ts], "abs", ss,
            [b.cuda() for b in bs], 2)
    torch.library.opcheck(torch.ops.rana.decode_masked_triton.default, args)
    flat = torch.ops.rana.decode_masked_triton(*args)
    exp = torch.cat([_reference(w, v, t, "abs", None, b) for w, v, t, _, b in groups])
    torch.testing.assert_close(flat.double().cpu(), exp, atol=0.1, rtol=0.02)


# ------------------------------------------------------------------------ compiled decode on CPU
def rana_adapted():
    """Every adapter kind in one tiny llama: shared rank code + q/k/v slices, rank adapters (gate/up),
    neuron thresholding (down), TEAL input sparsity (o), and CATS on the last layer's activation."""
    from test_export import adapt_like_rana

    model = tiny_model("llama")
    calib = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapt_like_rana(model, calib)
    mlp = model.model.layers[-1].mlp
    mlp.act_fn = CatsActivation(mlp.act_fn, 0.05, model.config.hidden_size, model.config.intermediate_size)
    return model.eval()


def test_compiled_decode_every_adapter_kind():
    """Inductor (the backend of the static-cache harness; its AOT pass also checks the fake
    implementations against functionalisation) runs the ops inside generated code."""
    model = rana_adapted()
    kinds = {type(m) for m in model.modules()}
    assert {SharedRankCode, RankAdapterLinear, NeuronThresholdLinear, InputSparseLinear, CatsActivation} <= kinds
    seen = compiled_matches(model, backend="inductor")
    assert seen == {"rana.decode_masked", "rana.decode_masked_grouped"}, seen



# ------------------------------------------------------------------ exported model, fresh process
EXPORTED = textwrap.dedent(r'''
    import importlib.abc, json, sys
    folder, out, helpers = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]

    class Block(importlib.abc.MetaPathFinder):  # as on a CPU machine without rana or triton
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("rana", "triton"):
                raise ModuleNotFoundError(name)

    sys.meta_path.insert(0, Block())
    sys.path.insert(0, helpers)
    import torch
    from transformers import AutoModelForCausalLM
    from decode_harness import compiled_matches

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    linked = [n for n, m in model.named_modules() if getattr(m, "_decode_group", None) is not None]
    seen = compiled_matches(model)
    assert not any(m.split(".")[0] in ("rana", "triton") for m in sys.modules), "rana or triton imported"
    json.dump({"seen": sorted(seen), "linked": linked}, open(out, "w"))
''')


def test_exported_model_compiles_in_fresh_process(tmp_path):
    from test_export import isolated_env, save_rana
    from rana.export import export

    src, out = tmp_path / "src_rana", tmp_path / "exported"
    save_rana(rana_adapted(), src)
    export(src, out)
    script, result = tmp_path / "compile_export.py", tmp_path / "seen.json"
    script.write_text(EXPORTED)
    proc = subprocess.run([sys.executable, "-I", str(script), str(out), str(result), str(Path(__file__).parent)],
                          cwd=tmp_path, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.loads(result.read_text())
    assert result["seen"] == ["rana.decode_masked", "rana.decode_masked_grouped"]
    # gate/up rank adapters decode as one group in the exported model too (linked by its shipped spec), and the
    # q/k/v slices in their shared code's group
    assert result["linked"] == [f"model.layers.{i}.{p}" for i in range(2)
                                for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                          "mlp.up_proj")]


def test_relink_after_deepcopy():
    import copy

    from rana.modules import relink
    from rana.modules.rank_linear import RankSliceLinear

    layer = rana_adapted().model.layers[0]
    twin = copy.deepcopy(layer)
    assert relink(twin) == 1  # the shared code (gate/up are not linked: adapt_like_rana installs them by hand)
    code = twin.self_attn.qkv_code
    slices = [m for m in twin.self_attn.children() if isinstance(m, RankSliceLinear)]
    assert [s._code() for s in slices] == [code] * 3 and [r() for r in code._slices] == slices


# ------------------------------------------------------------------ an older export in the same process
OLDER_EXPORT_FIRST = textwrap.dedent(r'''
    import torch

    # what an export made before the weight formats shared one route registers when it loads first: the
    # masked ops under their old names, with their old schemas (an op is defined once per process)
    def old_masked(w_t: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                   scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        return v.new_zeros((*v.shape[:-1], w_t.shape[1]))

    torch.library.custom_op("rana::masked_gemv", old_masked, mutates_args=()).register_fake(old_masked)

    from rana.kernels import route
    from rana.kernels.weights import FloatWeight, Int8Weight

    g = torch.Generator().manual_seed(0)
    w = FloatWeight(torch.randn(24, 40, generator=g).t().contiguous().t(), torch.randn(24, generator=g))
    q = Int8Weight(torch.randint(-127, 128, (40, 16), dtype=torch.int8, generator=g), torch.rand(16, generator=g))
    t = torch.tensor(0.5)

    def step(x):
        y = route.decode_masked(w, x, t, "abs")
        return y, route.decode_masked_grouped([q, q], [x, x], [t, t], "abs", [None, None])

    x = torch.randn(1, 1, 40, generator=g)
    eager = step(x)
    traced = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(traced[0], eager[0])
    torch.testing.assert_close(torch.cat(traced[1]), torch.cat(eager[1]))
    assert eager[0].abs().sum() > 0  # this rana's op, not the older export's
    print("OK")
''')


def test_an_older_exports_ops_do_not_collide(tmp_path):
    """An export made before the one route (its rana::masked_gemv* ops with their own schemas, registered
    first) and this rana in one process: a traced decode step of this rana calls its own ops."""
    script = tmp_path / "older_first.py"
    script.write_text(OLDER_EXPORT_FIRST)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
