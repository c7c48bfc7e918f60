"""The int8-weight and expert-indexed Triton kernels compiled for CUDA, against an independent float64 product of
the same operands, with inputs in fp32, bf16 and fp16 and every mask mode each kernel has (int8: "none",
"square", "abs_scaled", "abs"; experts: |v| >= the expert's threshold, with experts that keep every input and
none). On CPU the interpreter covers them (tests/test_int8_kernels.py, tests/test_moe.py); these run where the
GPU suite runs `pytest -m cuda` with TRITON_INTERPRET=0, and skip elsewhere. A kernel that fails to compile
or to run fails its tests.

Shapes: odd ones (K and N multiples of no block), and Llama-sized ones whose config on the GPU splits K (fp32
partials in a workspace, each scaled once, summed by the reduce launch) or fills the GPU without a split
(direct store). Thresholds lie midway between two sorted scores (test_kernels._threshold_for), so the kernel
and the reference keep the same rows. Few specializations on purpose: each costs a compile on the GPU machine,
whose 15 minutes are shared by every check.
"""
from __future__ import annotations

import math

import pytest
import torch

import gemv_dispatch as dispatch
from rana.kernels import route
from rana.kernels import triton_gemv as tg
from rana.kernels.weights import FloatWeight, Int8Weight

from test_int8_kernels import MODES as INT8_MODES
from test_int8_kernels import _assert_close, _expected, _problem

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not tg.triton_available(), reason="triton is not installed"),
    pytest.mark.skipif(tg.interpreting(), reason="TRITON_INTERPRET=1: the kernels would be interpreted; run with "
                                                 "TRITON_INTERPRET=0"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


def _cuda(*xs):
    return [x.cuda() if isinstance(x, torch.Tensor) else x for x in xs]


def _threshold(t: float, mode: str):
    """The kernel's threshold argument: None (everything kept) for mode "none", else a device tensor."""
    return None if mode == "none" else torch.tensor(t, device="cuda")


# --------------------------------------------------------------------------------------------
# int8 weights
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", INT8_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_int8_kernel_matches_float64(dtype, mode):
    """Odd shapes (one program per column block, direct store), empty, partial and full masks, with a bias;
    without one in mode "abs"."""
    for frac in ((1.0,) if mode == "none" else (0.0, 0.4, 1.0)):
        q_t, qs, v, t, scale, b = _problem(37, 29, dtype, mode, frac, seed=8)
        for bias in ((b, None) if mode == "abs" else (b,)):
            y = dispatch.masked_gemv_int8_triton(*_cuda(q_t, qs, v), _threshold(t, mode), mode=mode,
                                                 scale=None if scale is None else scale.cuda(),
                                                 bias=None if bias is None else bias.cuda())
            _assert_close(y.cpu(), _expected(q_t, qs, v, t, mode, scale, bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_int8_kernel_at_llama_sizes_splits_and_fills(dtype):
    """A down projection's (K 4096 over a narrow N: the heuristic splits K, workspace + reduce launch) and an LM
    head's shape (N wide enough to fill 132 SMs without a split): the configs the GPU really takes."""
    for K, N, mode in ((4096, 1024, "abs_scaled"), (512, 20000, "abs")):
        q_t, qs, v, t, scale, b = _problem(K, N, dtype, mode, 0.45, seed=K)
        y = dispatch.masked_gemv_int8_triton(*_cuda(q_t, qs, v), _threshold(t, mode), mode=mode,
                                             scale=None if scale is None else scale.cuda(), bias=b.cuda())
        _assert_close(y.cpu(), _expected(q_t, qs, v, t, mode, scale, b), dtype)


def test_int8_grouped_launch_both_store_paths_and_the_decode_route():
    """q/k/v as one launch (GQA widths, biases on q and v only) with the default config and with configs that
    store directly (SPLIT 1) and through the workspace (SPLIT > 1); then the same operands as the decode route
    sees them on CUDA (Int8Weight: the "triton" backend), alone and grouped."""
    dtype = torch.bfloat16
    groups = [_problem(320, n, dtype, "abs", frac, seed=s, bias=bias)
              for n, frac, s, bias in ((192, 0.5, 9, True), (64, 0.3, 10, False), (64, 0.8, 11, True))]
    v = groups[0][2]
    q_ts, qss, ts, bs = [g[0] for g in groups], [g[1] for g in groups], [g[3] for g in groups], [g[5] for g in groups]
    expected = [_expected(q, qs, v, t, "abs", None, b) for q, qs, t, b in zip(q_ts, qss, ts, bs)]
    flat = (torch.cat([e[0].reshape(-1) for e in expected]), max(e[1] for e in expected))
    dq, dqs, dbs = [q.cuda() for q in q_ts], [q.cuda() for q in qss], [None if b is None else b.cuda() for b in bs]
    dv, dts = v.cuda(), [torch.tensor(t, device="cuda") for t in ts]
    for cfg in (None, tg.GemvConfig(64, 128, 1, 8), tg.GemvConfig(64, 64, 3, 4)):
        y = tg.grouped_masked_gemv_triton([dv] * 3, dq, dts, "abs", [None] * 3, dbs, qscales=dqs, config=cfg)
        _assert_close(y.cpu(), flat, dtype)
    operands = [Int8Weight(q, qs, b) for q, qs, b in zip(dq, dqs, dbs)]
    assert {w.backend for w in operands} == {"triton"}
    grouped = route.decode_masked_grouped(operands, [dv] * 3, dts, "abs", [None] * 3)
    _assert_close(torch.cat([y.reshape(-1) for y in grouped]).cpu(), flat, dtype)
    alone = route.decode_masked(operands[0], dv, dts[0], "abs", None)
    _assert_close(alone.cpu(), expected[0], dtype)


def test_int8_triton_op_passes_opcheck():
    """The registered op with int8 weights: schema, fake, autograd registration and aot_dispatch (the trace
    inductor takes), on the kernel compiled for the GPU."""
    groups = [_problem(64, n, torch.bfloat16, "abs_scaled", 0.5, seed=s) for s, n in ((1, 96), (2, 32))]
    q_ts, qss, vs, ts, scales, bs = (list(x) for x in zip(*groups))
    args = ([v.cuda() for v in vs], [q.cuda() for q in q_ts], [q.cuda() for q in qss],
            [torch.tensor(t, device="cuda") for t in ts], "abs_scaled", [s.cuda() for s in scales],
            [b.cuda() for b in bs], 2)
    torch.library.opcheck(torch.ops.rana.decode_masked_triton.default, args)
    flat = torch.ops.rana.decode_masked_triton(*args)
    expected = [_expected(q, qs, v, t, "abs_scaled", s, b) for q, qs, v, t, s, b in groups]
    _assert_close(flat.cpu(), (torch.cat([e[0].reshape(-1) for e in expected]), max(e[1] for e in expected)),
                  torch.bfloat16)


# --------------------------------------------------------------------------------------------
# a mixture of experts' one token: the expert-indexed kernel
# --------------------------------------------------------------------------------------------
def _experts(E, K, N, dtype, seed):
    """Stacked (E, K, N) weights, thresholds midway between scores (expert 1 keeps every input, expert 2 none)."""
    g = torch.Generator().manual_seed(seed)
    w_t = torch.randn(E, K, N, generator=g).to(dtype)
    token = torch.randn(1, K, generator=g).to(dtype)
    rows = torch.randn(3, K, generator=g).to(dtype)
    thresholds = torch.tensor([_threshold_midway(token, frac) for frac in torch.linspace(0.1, 0.9, E).tolist()])
    thresholds[1], thresholds[2] = -math.inf, math.inf
    return w_t, token, rows, thresholds


def _threshold_midway(v: torch.Tensor, frac: float) -> float:
    from test_kernels import _threshold_for

    return _threshold_for(v.double().abs(), round(frac * v.numel()))


def _expert_expected(w_t, v, idx, thresholds):
    """float64 (S, N), and the largest sum of |terms| (what fp32 accumulation error scales with)."""
    keep = v.float().abs() >= thresholds.float()[idx].unsqueeze(1)  # the kernel's fp32 comparison
    x = torch.where(keep, v.double(), 0.0)
    w = w_t.double()[idx]
    return torch.einsum("sk,skn->sn", x, w), float(torch.einsum("sk,skn->sn", x.abs(), w.abs()).max())


def _expert_close(y, expected, dtype):
    exp, mag = expected
    assert y.dtype == dtype and y.shape == exp.shape, (y.dtype, y.shape, exp.shape)
    atol = 1e-5 * max(mag, 1.0) + (0 if dtype == torch.float32 else torch.finfo(dtype).eps * float(exp.abs().max()))
    torch.testing.assert_close(y.double(), exp, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_expert_kernel_matches_float64(dtype):
    """Odd shapes and a Mixtral-sized down projection (K 14336: many BLOCK_K steps), an expert picked twice, one
    keeping every input and one none; the token expanded to every slot (stride 0, as the MoE block passes it) and
    slots with inputs of their own; the kernel directly and through the decode route (FloatWeight on CUDA)."""
    idx = torch.tensor([3, 1, 3, 2])
    for E, K, N in ((6, 40, 24), (4, 14336, 512)):
        w_t, token, rows, thresholds = _experts(E, K, N, dtype, seed=K)
        for v in (token.expand(len(idx), -1), torch.cat([rows, rows[:1]])):
            expected = _expert_expected(w_t, v, idx, thresholds)
            dw, dv, didx, dthr = _cuda(w_t, v, idx, thresholds)
            y = tg.expert_masked_gemv_triton(dw, dv, didx, dthr).cpu()
            _expert_close(y, expected, dtype)
            assert not y[3].any()  # expert 2 keeps no input: zeros
            operand = FloatWeight(dw.transpose(1, 2))
            assert operand.backend == "triton"
            _expert_close(route.decode_expert_masked(operand, dv, didx, dthr).cpu(), expected, dtype)
