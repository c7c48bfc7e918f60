"""int8 weights × int8 activations (W8A8, issue 38): the native CPU kernel (each inner loop this machine runs), the
torch paths, the ops, the decode route, an int8 model's modules and folders, and the compiled decode step.

    y = qscale ⊙ Σ_b s_b · (Σ_{k kept in block b} q_k · q_t[k, :])  (+ bias)

with each token's kept nonzero inputs quantized per block of B input positions (B a setting of the int8 folder, 1 to
64; 64 where a folder records none): s_b = max|x| / 127, q_k = round_half_even(x_k · (127 / max|x|)). The expectation here is written independently of rana's code: the
quantization block by block in fp32 (as the kernels define it), then exact sums in float64.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from rana.kernels import cpu_gemv as cg
from rana.kernels import ops, route
from rana.kernels import torch_gemv as mg
from rana.kernels import weights
from rana.kernels.weights import Int8Weight

from test_kernels import _scores64, _threshold_for

MODES = ["none", "square", "abs_scaled", "abs"]
ISAS = list(range(len(cg.A8_ISAS)))


@pytest.fixture
def native():
    if cg.native_kernel() is None:
        pytest.skip(f"native CPU kernel unavailable here: {cg.native_status()}")


def _problem(K, N, mode, frac, *, seed=0, lead=(1,), dtype=torch.float32, zeros=True, bias=True):
    g = torch.Generator().manual_seed(seed)
    q_t = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
    qscale = torch.rand(N, generator=g) * 0.02 + 1e-3
    v = torch.randn(*lead, K, generator=g) * (torch.rand(K, generator=g) * 4)  # blocks of unequal magnitude
    if zeros:
        v[..., ::11] = 0.0  # exact zeros: kept in mode "none", adding nothing
    v = v.to(dtype)
    scale = (torch.rand(K, generator=g) + 0.25) if mode == "abs_scaled" else None
    b = torch.randn(N, generator=g) if bias else None
    t = -math.inf if mode == "none" else _threshold_for(_scores64(v, mode, scale), round(frac * v.numel()))
    return q_t, qscale, v, t, scale, b


def _quantized(x: torch.Tensor, size: int = 64) -> list[tuple[list[int], list[int], float]]:
    """One token's kept nonzero inputs (fp32 values, 0 where not kept) as (positions, codes, scale) per block of
    `size` positions."""
    out = []
    for start in range(0, x.numel(), size):
        block = x[start:start + size]
        ks = [start + i for i in range(block.numel()) if float(block[i]) != 0.0]
        if not ks:
            continue
        amax = x[ks].abs().max().reshape(1)  # fp32
        inv = torch.tensor([127.0]) / amax  # fp32, as the kernels compute it
        codes = [int(c) for c in torch.round(x[ks] * inv).clamp(-127, 127)]
        out.append((ks, codes, float(amax / 127.0)))
    return out


def _expected(q_t, qscale, v, t, mode, scale=None, bias=None, block=64):
    """float64 W8A8 product, token by token, and the magnitude of Σ|terms| (what fp32 rounding scales with)."""
    K, N = q_t.shape
    rows = v.reshape(-1, K).float()
    q = q_t.double()
    out = torch.zeros(rows.shape[0], N, dtype=torch.float64)
    mag = torch.zeros(rows.shape[0], N, dtype=torch.float64)
    for r, vr in enumerate(rows):
        kept = torch.ones(K, dtype=torch.bool) if mode == "none" else _scores64(vr, mode, scale) >= t
        x = torch.where(kept, vr, torch.zeros(()))
        for ks, codes, s in _quantized(x, block):
            part = torch.tensor(codes, dtype=torch.float64) @ q[ks]
            out[r] += s * part
            mag[r] += s * (torch.tensor(codes, dtype=torch.float64).abs() @ q[ks].abs())
        out[r] *= qscale.double()
        mag[r] *= qscale.double()
        if bias is not None:
            out[r] += bias.double()
    return out.reshape(*v.shape[:-1], N), float(mag.max()) if mag.numel() else 0.0


def _assert_close(y, expected, dtype=torch.float32):
    exp, mag = expected
    assert y.dtype == dtype and y.shape == exp.shape, (y.dtype, y.shape, exp.shape)
    atol = 2e-6 * max(mag, 1.0)  # the int sums are exact: only the fp32 block and scale products round
    if dtype != torch.float32:
        atol += torch.finfo(dtype).eps * max(float(exp.abs().max()), 1.0)
    torch.testing.assert_close(y.double(), exp, atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------
# the quantization itself
# --------------------------------------------------------------------------------------------
BLOCKS = [64, 32, 7, 1]


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_activations_per_block(block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 150, generator=g) * torch.linspace(0.01, 50, 150)
    x[1, 64:128] = 0.0  # empty blocks stay zero
    y = mg.quantize_activations(x, block=block)
    for r in range(3):
        expect = torch.zeros(150)
        for ks, codes, s in _quantized(x[r], block):
            expect[ks] = torch.tensor(codes, dtype=torch.float32) * torch.tensor(s, dtype=torch.float32)
        torch.testing.assert_close(y[r], expect, atol=1e-6 * float(x.abs().max()), rtol=1e-6)
    assert torch.equal(y[1, 64:128], torch.zeros(64))
    assert (mg.quantize_activations(x, block=block) == y).all()  # deterministic
    for start in range(0, 150, block):  # no code beyond ±127: the block maximum maps to code 127 (to fp32 rounding)
        amax = x[:, start:start + block].abs().amax(-1, keepdim=True)
        torch.testing.assert_close(y[:, start:start + block].abs().amax(-1, keepdim=True), amax, atol=0, rtol=2.4e-7)


def test_smaller_blocks_quantize_closer():
    """Each scale follows fewer inputs: on inputs of uneven magnitude the error shrinks with the block."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g) * torch.rand(256, generator=g).pow(4) * 30
    errors = [float((mg.quantize_activations(x, block=b) - x).norm()) for b in (64, 32, 16, 1)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-6 * float(x.norm()), errors


@pytest.mark.parametrize("block", [0, 65, 2.0, True])
def test_a_block_outside_1_to_64_is_refused(block):
    with pytest.raises(ValueError, match="1 to 64"):
        mg.quantize_activations(torch.ones(8), block=block)
    with pytest.raises(ValueError, match="1 to 64"):
        Int8Weight(torch.zeros(8, 8, dtype=torch.int8), torch.ones(8), activations="int8", block=block)


def test_quantize_activations_rounds_half_to_even_and_keeps_the_block_maximum():
    x = torch.zeros(64)
    x[0], x[1], x[2] = 127.0, 0.5, 1.5  # inv = 1: 0.5 -> 0, 1.5 -> 2 (half to even)
    y = mg.quantize_activations(x, block=64)
    assert y[0] == 127.0 and y[1] == 0.0 and y[2] == 2.0
    x[3] = float("nan")
    assert torch.isnan(mg.quantize_activations(x, block=64)[:64]).any()


# --------------------------------------------------------------------------------------------
# the native kernel: every loop, mode, mask, shape and thread count
# --------------------------------------------------------------------------------------------
SHAPES = [(5, 3), (63, 64), (64, 65), (130, 97), (200, 129), (577, 300)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode,frac", [("none", 1.0)] + [(m, f) for m in MODES[1:] for f in (0.0, 0.35, 1.0)])
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("block", [64, 32])
def test_native_w8a8_matches_float64(native, isa, mode, frac, nthreads, block):
    if isa > cg.native_kernel().a8_best:
        pytest.skip(f"this CPU cannot run the {cg.A8_ISAS[isa]} loop")
    old = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        for i, (K, N) in enumerate(SHAPES):
            q_t, qs, v, t, scale, b = _problem(K, N, mode, frac, seed=i, bias=i % 2 == 0)
            call = cg.NativeCall.bind(q_t, qs, mode, scale, b, activations="int8", isa=isa, block=block)
            assert call.usable and call.activations == "int8" and call.block == block
            _assert_close(call(v, t), _expected(q_t, qs, v, t, mode, scale, b, block))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block", [1, 3, 7, 33])
def test_native_w8a8_odd_blocks_match_float64(native, isa, block):
    """Blocks that are not a multiple of the 4-row groups (each block's last group padded), down to one input per
    scale; the per-thread scratch grows when a smaller block needs more groups for the same K."""
    if isa > cg.native_kernel().a8_best:
        pytest.skip(f"this CPU cannot run the {cg.A8_ISAS[isa]} loop")
    for i, (K, N) in enumerate(SHAPES):
        for mode, frac in (("none", 1.0), ("abs", 0.35), ("abs_scaled", 0.6)):
            q_t, qs, v, t, scale, b = _problem(K, N, mode, frac, seed=10 + i)
            call = cg.NativeCall.bind(q_t, qs, mode, scale, b, activations="int8", isa=isa, block=block)
            _assert_close(call(v, t), _expected(q_t, qs, v, t, mode, scale, b, block))


def test_wide_outputs_split_over_threads_agree(native):
    """N large enough for the OpenMP split (whole 64-column chunks per thread, a tail chunk)."""
    q_t, qs, v, t, scale, b = _problem(300, 1000, "abs", 0.5, seed=3)
    outs = []
    for n in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            outs.append(cg.NativeCall.bind(q_t, qs, "abs", None, b, activations="int8")(v, t))
        finally:
            torch.set_num_threads(old)
    _assert_close(outs[0], _expected(q_t, qs, v, t, "abs", None, b))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_every_loop_agrees_with_the_widest(native):
    """Forcing the narrower loops (RANA_CPU_ISA, or `isa=`) computes the same products (the int sums are exact)."""
    q_t, qs, v, t, scale, b = _problem(257, 333, "square", 0.4, seed=4)
    ys = [cg.NativeCall.bind(q_t, qs, "square", None, b, activations="int8", isa=i)(v, t)
          for i in range(cg.native_kernel().a8_best + 1)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], atol=1e-5 * float(ys[0].abs().max()), rtol=0)


def test_rana_cpu_isa_forces_a_narrower_loop(native, monkeypatch):
    q_t, qs, *_ = _problem(8, 8, "abs", 0.5)
    monkeypatch.setenv("RANA_CPU_ISA", "scalar")
    assert cg.a8_isa() == 0
    assert cg.NativeCall.bind(q_t, qs, "abs", activations="int8")._operands.isa == 0
    monkeypatch.setenv("RANA_CPU_ISA", "avx512_vnni")  # never wider than the CPU runs
    assert cg.a8_isa() == cg.native_kernel().a8_best
    monkeypatch.delenv("RANA_CPU_ISA")
    assert cg.a8_isa() == cg.native_kernel().a8_best


def test_a_nonfinite_kept_input_gives_nan(native):
    q_t, qs, v, t, scale, b = _problem(100, 70, "none", 1.0)
    v[0, 5] = float("inf")
    assert torch.isnan(cg.NativeCall.bind(q_t, qs, "none", None, b, activations="int8")(v, t)).all()


def test_w8a8_declines_float_weights():
    w = torch.randn(8, 8)
    assert not cg.NativeCall.bind(w, None, "abs", activations="int8").usable
    assert not cg.NativeCall.bind(torch.zeros(8, 8, dtype=torch.int8), torch.ones(8), "abs",
                                  activations="int4").usable


# --------------------------------------------------------------------------------------------
# torch paths, ops, the route
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [64, 32])
def test_torch_paths_match_float64(mode, block, monkeypatch):
    q_t, qs, v, t, scale, b = _problem(150, 90, mode, 0.4, seed=5, lead=(3,))
    thr = torch.tensor(0.0 if mode == "none" else t)
    _assert_close(mg.masked_gemv_int8_torch(q_t, qs, v, thr, mode=mode, scale=scale, bias=b, activations="int8",
                                           block=block),
                  _expected(q_t, qs, v, t, mode, scale, b, block))  # several tokens: the dense product
    monkeypatch.setattr(cg, "native_masked", lambda *a, **k: None)
    monkeypatch.setattr(mg, "native_masked", lambda *a, **k: None)  # one token: the torch gather
    one = v[:1]
    _assert_close(mg.masked_gemv_int8_torch(q_t, qs, one, thr, mode=mode, scale=scale, bias=b,
                                           activations="int8", block=block),
                  _expected(q_t, qs, one, t, mode, scale, b, block))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [64, 32])
def test_route_decodes_int8_activations_in_every_dtype(native, dtype, block):
    for mode in MODES:
        q_t, qs, v, t, scale, b = _problem(130, 70, mode, 0.4, seed=6, lead=(1, 1), dtype=dtype)
        thr = torch.tensor(0.0 if mode == "none" else t)
        w = Int8Weight(q_t, qs, b, activations="int8", block=block)
        y = route.decode_masked(w, v, thr, mode, scale)
        exp = _expected(q_t, qs, v.float(), t, mode, scale, b, block)
        _assert_close(y, exp, dtype)
        assert w.bound is not None and w.bound.activations == "int8" and w.bound.block == block
        grouped = route.decode_masked_grouped([w, w], [v, v], [thr, thr], mode, [scale, scale])
        torch.testing.assert_close(grouped[0].view_as(y), y, atol=0, rtol=0)


def test_w8a8_differs_from_w8a16_by_the_activation_rounding_only(native):
    q_t, qs, v, t, scale, b = _problem(512, 256, "abs", 0.5, seed=7)
    thr = torch.tensor(t)
    a8 = route.decode_masked(Int8Weight(q_t, qs, b, activations="int8"), v, thr, "abs")
    a16 = route.decode_masked(Int8Weight(q_t, qs, b), v, thr, "abs")
    rel = float((a8 - a16).norm() / (a16 - b).norm())
    assert 0 < rel < 0.02, rel  # int8 activations: ~0.5 % of the output, never identical, never far


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [64, 32])
def test_opcheck_w8a8_ops(mode, block):
    q_t, qs, v, t, scale, b = _problem(80, 40, mode, 0.5, lead=(1, 1))
    thr = torch.tensor(0.0 if mode == "none" else t)
    torch.library.opcheck(torch.ops.rana.decode_w8a8.default, (q_t, qs, v, thr, mode, scale, b, block))
    _assert_close(torch.ops.rana.decode_w8a8(q_t, qs, v, thr, mode, scale, b, block),
                  _expected(q_t, qs, v, t, mode, scale, b, block))
    args = ([v, v], [q_t, q_t], [qs, qs], [thr, thr], mode, [scale, scale], [b, None], block)
    torch.library.opcheck(torch.ops.rana.decode_w8a8_grouped.default, args)
    grouped = torch.ops.rana.decode_w8a8_grouped(*args)
    _assert_close(grouped[:40].view(1, 1, 40), _expected(q_t, qs, v, t, mode, scale, b, block))
    assert {"rana::decode_w8a8", "rana::decode_w8a8_grouped"} <= set(ops.OP_NAMES)


def test_compiled_fullgraph_calls_the_a8_ops(monkeypatch):
    """torch.compile(fullgraph=True) of the route with W8A8 operands: no graph break, the a8 ops in the graph, the
    eager result (aot_eager checks the fakes)."""
    monkeypatch.setattr(weights, "TRITON_ON_CPU", False)
    q_t, qs, v, t, scale, b = _problem(128, 48, "abs", 0.5, seed=8, lead=(1, 1))
    w = Int8Weight(q_t, qs, b, activations="int8", block=32)
    thr = torch.tensor(t)

    def step(x):
        y = route.decode_masked(w, x, thr, "abs")
        g = route.decode_masked_grouped([w, w], [x, x], [thr, thr], "abs", [None, None])
        return torch.relu(y), torch.cat(g)

    from decode_harness import traced_targets

    targets = traced_targets(step, v)
    assert {"rana.decode_w8a8", "rana.decode_w8a8_grouped"} <= targets, targets
    _, grouped = torch.compile(step, backend="aot_eager", fullgraph=True)(v)
    _assert_close(grouped[:48].view(1, 1, 48), _expected(q_t, qs, v, t, "abs", None, b, 32))  # the op's block: 32


# --------------------------------------------------------------------------------------------
# modules, folders, the compiled decode step of a model
# --------------------------------------------------------------------------------------------
def test_int8_linear_one_token_matches_its_torch_path():
    from rana.modules.int8 import Int8Linear

    g = torch.Generator().manual_seed(9)
    lin = nn.Linear(200, 96)
    q = torch.randint(-127, 128, (96, 200), generator=g, dtype=torch.int8)
    m = Int8Linear.from_quantized(q, torch.rand(96) * 0.01, lin.bias, torch.float32).eval()
    m.activations = "int8"
    x = torch.randn(4, 200, generator=g)
    with torch.no_grad():
        many = m(x)  # several tokens: quantized input, dequantized weight
        one = torch.cat([m(x[i:i + 1]) for i in range(4)])  # one token each: the decode route (native on CPU)
    torch.testing.assert_close(one, many, atol=1e-4, rtol=1e-4)
    m.activations = "float"
    with torch.no_grad():
        assert not torch.allclose(m(x[:1]), one[:1], atol=1e-6)  # the operand follows the setting


def _int8_model(activations: str, **kwargs):
    from helpers import tiny_model
    from rana.quantize import quantize_model

    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    quantize_model(model, ids, activations=activations, **kwargs)
    return model


def test_quantize_records_and_load_honours_the_activations(tmp_path):
    from rana.io import load, save
    from rana.modules.int8 import activation_format_of
    from rana.quantize.config import DEFAULT_ACTIVATION_BLOCK

    model = _int8_model("int8")
    default = {"activations": "int8", "activation_block": DEFAULT_ACTIVATION_BLOCK}
    assert activation_format_of(model) == default
    save(model, None, tmp_path / "a8", plan={"weights": "int8"})
    meta = json.loads((tmp_path / "a8" / "rana_config.json").read_text())
    assert {k: meta["int8"][k] for k in default} == default
    back, _ = load(tmp_path / "a8")
    assert activation_format_of(back) == default
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    # folders written before each setting existed decode as they were written: blocks of 64, float activations
    del meta["int8"]["activation_block"]
    (tmp_path / "a8" / "rana_config.json").write_text(json.dumps(meta))
    old, _ = load(tmp_path / "a8")
    assert activation_format_of(old) == {"activations": "int8", "activation_block": 64}
    del meta["int8"]["activations"]
    (tmp_path / "a8" / "rana_config.json").write_text(json.dumps(meta))
    old, _ = load(tmp_path / "a8")
    assert activation_format_of(old) == {"activations": "float"}


def test_the_block_decides_the_decoded_tokens(tmp_path):
    """A folder quantized with blocks of 64 and one with 16 decode differently, each as its own torch path says
    (several tokens) and as its kernels do one token at a time."""
    from rana.io import load, save

    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    logits = {}
    for block in (64, 16):
        save(_int8_model("int8", activation_block=block), None, tmp_path / f"b{block}", plan={"weights": "int8"})
        model, _ = load(tmp_path / f"b{block}")
        with torch.no_grad():
            many = model(ids).logits[0, -1]
            out = model(ids[:, :-1], use_cache=True)
            one = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
        torch.testing.assert_close(one, many, atol=1e-4, rtol=1e-4)
        logits[block] = many
    assert not torch.allclose(logits[64], logits[16], atol=1e-5)


@pytest.mark.parametrize("field,value", [("activations", "int4"), ("activation_block", 0),
                                         ("activation_block", 65), ("activation_block", "32")])
def test_a_bad_activations_record_is_refused(tmp_path, field, value):
    from rana.io import load, save

    save(_int8_model("float"), None, tmp_path / "f", plan={"weights": "int8"})
    meta = json.loads((tmp_path / "f" / "rana_config.json").read_text())
    meta["int8"][field] = value
    (tmp_path / "f" / "rana_config.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match=field):
        load(tmp_path / "f")


def test_compiled_decode_step_of_a_w8a8_model_has_no_graph_break():
    from decode_harness import compiled_matches

    seen = compiled_matches(_int8_model("int8"), backend="aot_eager")
    assert "rana.decode_w8a8" in seen or "rana.decode_w8a8_grouped" in seen, seen
    assert not seen & {"rana.decode_masked", "rana.decode_masked_grouped"}, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_route_quantizes_the_same_inputs_under_the_interpreter(dtype, monkeypatch):
    """Operands on the Triton backend (CUDA; here CPU tensors under the interpreter) quantize the kept inputs in
    torch ops and run the float-activation int8 kernel on them: the W8A8 product, alone and as a q/k/v group."""
    from rana.kernels import triton_gemv as tg

    if not (tg.triton_available() and tg.interpreting()):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    monkeypatch.setattr(weights, "TRITON_ON_CPU", True)
    problems = [_problem(70, n, "abs", frac, seed=s, lead=(1, 1), dtype=dtype)
                for n, frac, s in ((48, 0.5, 20), (16, 0.3, 21), (16, 0.8, 22))]
    v = problems[0][2]
    operands = [Int8Weight(q, qs, b, activations="int8") for q, qs, _, _, _, b in problems]
    assert {w.backend for w in operands} == {"triton"}
    thresholds = [torch.tensor(p[3]) for p in problems]
    ys = route.decode_masked_grouped(operands, [v] * 3, thresholds, "abs", [None] * 3)
    one = route.decode_masked(operands[0], v, thresholds[0], "abs")
    for y, (q, qs, _, t, _, b) in zip(ys, problems):
        exp, mag = _expected(q, qs, v.float(), t, "abs", None, b)
        atol = 2e-6 * max(mag, 1.0) + 2 * torch.finfo(dtype).eps * max(float(exp.abs().max()), 1.0)
        assert y.dtype == dtype
        torch.testing.assert_close(y.double().reshape(exp.shape), exp, atol=atol, rtol=0)
    torch.testing.assert_close(one.reshape(-1), ys[0], atol=0, rtol=0)
