"""The masked GEMV in torch ops: the reference, the sync-free dense product, and the CPU paths without the
native kernel. The torch backend of the decode route (route.py) and the registered ops' implementations.

    y = W[:, active] @ v[active]  (+ bias),      W: N x K (out x in)

The weight is passed *transposed*: ``w_t`` is (K, N) with unit stride along N, so column k of W is the
contiguous row ``w_t[k]`` and an inactive input skips one contiguous row entirely (the CATS / TEAL kernel
layout). The mask (modes.py) is computed next to the product from a threshold that may live on the device
(a 0-dim tensor), so no path here syncs with the host, but the CPU gathers (which read it to index rows):

    mode="none"        every input active (the threshold is not read)
    mode="square"      active_k = v_k**2            >= t   (RaNA B-masker on the rank code)
    mode="abs_scaled"  active_k = |v_k| * scale_k   >= t   (neuron thresholding, scale = ||W[:, k]||)
    mode="abs"         active_k = |v_k|             >= t   (TEAL input sparsity)

Scores and comparisons are done in fp32, products are accumulated in fp32 and the result is
returned in v's dtype. ``threshold=None`` (or the float -inf) means "everything active".

    masked_gemv_reference  plain fp32 reference.
    masked_gemv_dense      ``(v * mask) @ w_t`` over any leading dims, sync-free on every device.
    masked_gemv_torch      one CPU token: the native kernel of cpu_gemv.py (fp32), else gathered rows
                           through embedding_bag; several tokens or another device: the dense product.
    masked_gemv_int8_*     the same for int8 weights (see "int8 weights" below).
    expert_masked_gemv_*   a mixture of experts' one token through its selected experts.

int8 weights: ``q_t`` int8 (K, N) row-major with per-output-channel fp32 scales ``qscale`` (N,):

    y = qscale ⊙ ((m ⊙ v) @ q_t)  (+ bias)

with the same masks, fp32 accumulation and the scale applied once to the accumulated sums. A kept int8 row
is a quarter of an fp32 row's bytes, and a batch-1 decode is memory bound: the one-token paths read only the
kept int8 rows.

This file and its siblings are self-contained (torch + stdlib) so they can be copied next to an exported
model and imported on machines without triton.
"""
from __future__ import annotations

import functools
import math

import torch

from .cpu_gemv import A8_BLOCK_UNRECORDED, check_a8_block, native_masked
from .modes import mode_id

__all__ = [
    "check_args",
    "check_int8_args",
    "expert_masked_gemv_dense",
    "expert_masked_gemv_gather",
    "expert_masked_gemv_reference",
    "masked_gemv_dense",
    "masked_gemv_gather",
    "masked_gemv_reference",
    "masked_gemv_torch",
    "masked_gemv_int8_dense",
    "masked_gemv_int8_gather",
    "masked_gemv_int8_reference",
    "masked_gemv_int8_torch",
    "masked_gemv_a8_reference",
    "quantize_activations",
    "a8_masked_input",
    "KEEP_NONZERO",
]

# Torch fast path on CPU: gather the active rows (embedding_bag with per-sample weights, no
# copy of the rows) while the active fraction is below this value, else the dense masked
# product. Measured on a 2-core x86 VM (benchmarks/results/kernels_cpu.md): the fp32 crossover
# is near 0.5-0.75; for fp16/bf16 embedding_bag beat the dense CPU GEMV even fully active.
CPU_GATHER_MAX_FRACTION = {torch.float32: 0.5, torch.float16: 1.0, torch.bfloat16: 1.0}
_BAG_OFFSETS = torch.zeros(1, dtype=torch.long)  # embedding_bag: a single bag starting at 0


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------
def check_args(w_t: torch.Tensor, v: torch.Tensor, mode: str, threshold, scale) -> None:
    """ValueError unless (w_t, v, mode, threshold, scale) is a float masked GEMV this file can run."""
    mode_id(mode)  # ValueError for an unknown mode
    if w_t.dim() != 2:
        raise ValueError(f"w_t must be 2-D (K, N), got shape {tuple(w_t.shape)}")
    if v.dim() == 0 or v.shape[-1] != w_t.shape[0]:
        raise ValueError(f"v's last dim must equal K={w_t.shape[0]}, got shape {tuple(v.shape)}")
    if mode == "abs_scaled" and scale is None and not _all_active(threshold):
        raise ValueError("mode='abs_scaled' needs scale (the column norms of W)")


def _all_active(threshold) -> bool:
    """None or a python -inf; a tensor threshold is never inspected (that would sync)."""
    return threshold is None or (not isinstance(threshold, torch.Tensor) and float(threshold) == -math.inf)


def _threshold_like(threshold, v: torch.Tensor):
    """The threshold as an fp32 tensor on v's device, or a python float.

    A host tensor next to accelerator inputs is read on the host: copying it to the device
    from pageable memory would synchronise the stream, reading it does not.
    """
    if isinstance(threshold, torch.Tensor):
        if threshold.device != v.device and threshold.device.type == "cpu":
            return float(threshold)
        if threshold.dim() == 0 and threshold.dtype == torch.float32 and threshold.device == v.device:
            return threshold
        return threshold.reshape(()).to(device=v.device, dtype=torch.float32)
    return float(threshold)


def _active_mask(v: torch.Tensor, threshold, mode: str, scale) -> torch.Tensor | None:
    """Boolean mask with v's shape, or None for "everything active"."""
    if mode == "none" or _all_active(threshold):
        return None
    t = _threshold_like(threshold, v)
    vf = v if v.dtype == torch.float32 else v.float()
    if mode == "square":
        score = vf * vf
    elif mode == "abs":
        score = vf.abs()
    else:
        score = vf.abs() * scale.to(device=v.device, dtype=torch.float32)
    return score >= t


def _out_shape(v: torch.Tensor, n: int) -> tuple:
    return (*v.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# reference and torch paths
# --------------------------------------------------------------------------------------------
def masked_gemv_reference(w_t, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """fp32 reference: ``sum_k [active_k] v_k w_t[k, :] (+ bias)``, any leading dims of v."""
    check_args(w_t, v, mode, threshold, scale)
    mask = _active_mask(v, threshold, mode, scale)
    vf = v.float()
    if mask is not None:
        vf = torch.where(mask, vf, torch.zeros((), dtype=vf.dtype, device=vf.device))
    y = vf @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(v.dtype)


def masked_gemv_dense(w_t, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """``(v * mask) @ w_t (+ bias)`` over any leading dims: the batch>1 / prefill path.

    No host sync on any device; the product runs in w_t's dtype (BLAS/cuBLAS accumulate fp32).
    """
    check_args(w_t, v, mode, threshold, scale)
    mask = _active_mask(v, threshold, mode, scale)
    x = v if mask is None else torch.where(mask, v, 0.0)
    return _matmul(x, w_t, bias).to(v.dtype).reshape(_out_shape(v, w_t.shape[1]))


def _matmul(x: torch.Tensor, w_t: torch.Tensor, bias) -> torch.Tensor:
    """x (..., K) @ w_t (K, N) [+ bias] as one GEMM (addmm adds the bias before rounding)."""
    x = x.to(w_t.dtype)
    if bias is None:
        return x @ w_t
    x2 = x.reshape(-1, w_t.shape[0])
    return torch.addmm(bias.to(w_t.dtype).unsqueeze(0), x2, w_t)


def masked_gemv_torch(w_t, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """Fast path for one token on CPU.

    fp32: the native kernel (:mod:`cpu_gemv`: score, compare and active-row accumulation in one
    call, the dense BLAS GEMV on the masked input when nearly everything is active). Without it,
    or for fp16/bf16: the active rows are summed with ``embedding_bag`` (per-sample weights
    ``v[idx]``; reads only the active rows of ``w_t``, no gathered copy, fp32 accumulation) while
    at most ``CPU_GATHER_MAX_FRACTION`` of the rows are active, else the dense masked product.
    On other devices (where ``nonzero`` would sync) and for several tokens it is
    :func:`masked_gemv_dense`.
    """
    check_args(w_t, v, mode, threshold, scale)
    K, N = w_t.shape
    if v.device.type != "cpu" or w_t.device.type != "cpu" or v.numel() != K:
        return masked_gemv_dense(w_t, v, threshold, mode=mode, scale=scale, bias=bias)
    t = -math.inf if mode == "none" or _all_active(threshold) else float(threshold)
    y = native_masked(w_t, None, v, t, mode, scale, bias)
    return y if y is not None else masked_gemv_gather(w_t, v, threshold, mode, scale, bias)


def masked_gemv_gather(w_t, v, threshold, mode: str, scale, bias) -> torch.Tensor:
    """The CPU one-token path in torch ops (embedding_bag gather or dense masked)."""
    K, N = w_t.shape
    # every torch op costs microseconds here, comparable to a small GEMV: keep the op count low
    v1 = v.reshape(K)
    mask = _active_mask(v1, threshold, mode, scale)
    idx = _all_rows(K) if mask is None else mask.nonzero().view(-1)
    if idx.numel() > CPU_GATHER_MAX_FRACTION.get(w_t.dtype, 0.5) * K:
        x = v1 if mask is None else torch.where(mask, v1, 0.0)
        y = _matmul(x, w_t, bias)
    else:
        # one bag holding the active rows, weighted by v: sum_k v_k w_t[k, :] without a copy
        # (the aten op directly: F.embedding_bag's argument handling costs more than the sum)
        weights = v1.index_select(0, idx).to(w_t.dtype)
        y = torch.embedding_bag(w_t, idx, _BAG_OFFSETS, False, 0, False, weights, False, None)[0]
        if bias is not None:
            y = y.float() + bias.float()
    return y.to(v.dtype).reshape(_out_shape(v, N))


@functools.lru_cache(maxsize=8)
def _all_rows(K: int) -> torch.Tensor:
    return torch.arange(K)


# --------------------------------------------------------------------------------------------
# int8 weights: y = qscale * ((m ⊙ v) @ q_t) (+ bias)
# --------------------------------------------------------------------------------------------
def check_int8_args(q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, mode: str, threshold, scale) -> None:
    """ValueError unless the arguments are an int8 masked GEMV this file can run."""
    mode_id(mode)  # ValueError for an unknown mode
    if q_t.dim() != 2 or q_t.dtype != torch.int8:
        raise ValueError(f"q_t must be a 2-D (K, N) int8 tensor, got {q_t.dtype} of shape {tuple(q_t.shape)}")
    if qscale.numel() != q_t.shape[1]:
        raise ValueError(f"qscale must hold N={q_t.shape[1]} scales, got shape {tuple(qscale.shape)}")
    if v.dim() == 0 or v.shape[-1] != q_t.shape[0]:
        raise ValueError(f"v's last dim must equal K={q_t.shape[0]}, got shape {tuple(v.shape)}")
    if mode == "abs_scaled" and scale is None and not _all_active(threshold):
        raise ValueError("mode='abs_scaled' needs scale (the column norms of W)")


def masked_gemv_int8_reference(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """float64 reference over the dequantized weight, any leading dims of v; returns float64 (tests).

    The mask is computed as the kernels compute it (fp32 scores, ``>= t``)."""
    check_int8_args(q_t, qscale, v, mode, threshold, scale)
    mask = _active_mask(v, threshold, mode, scale)
    vd = v.double()
    if mask is not None:
        vd = torch.where(mask, vd, torch.zeros((), dtype=vd.dtype, device=vd.device))
    y = (vd @ q_t.double()) * qscale.reshape(-1).double()
    if bias is not None:
        y = y + bias.reshape(-1).double()
    return y


def masked_gemv_int8_dense(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """``((v * mask) @ q_t) * qscale (+ bias)`` over any leading dims: batch > 1, prefill, and the
    sync-free path on any device without Triton. Dequantizes the whole weight (fp32 on CPU, v's
    half dtype on accelerators, where the GEMM accumulates in fp32); output in v's dtype."""
    check_int8_args(q_t, qscale, v, mode, threshold, scale)
    mask = _active_mask(v, threshold, mode, scale)
    x = v if mask is None else torch.where(mask, v, 0.0)
    dt = v.dtype if (v.device.type != "cpu" and v.dtype in (torch.float16, torch.bfloat16)) else torch.float32
    y = (x.to(dt) @ q_t.to(dt)).float() * qscale.reshape(-1).float()
    if bias is not None:
        y = y + bias.reshape(-1).float()
    return y.to(v.dtype).reshape(_out_shape(v, q_t.shape[1]))


def masked_gemv_int8_gather(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None) -> torch.Tensor:
    """One token on CPU in torch ops: copy out only the kept int8 rows (``index_select``), multiply them
    in fp32; while at most ``CPU_GATHER_MAX_FRACTION[float32]`` of the rows are kept, else the dense path."""
    check_int8_args(q_t, qscale, v, mode, threshold, scale)
    K, N = q_t.shape
    v1 = v.reshape(K)
    mask = _active_mask(v1, threshold, mode, scale)
    if mask is None:
        return masked_gemv_int8_dense(q_t, qscale, v, None, mode="none", bias=bias)
    idx = mask.nonzero().view(-1)
    if idx.numel() > CPU_GATHER_MAX_FRACTION[torch.float32] * K:
        return masked_gemv_int8_dense(q_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias)
    y = (v1.index_select(0, idx).float() @ q_t.index_select(0, idx).float()) * qscale.reshape(N).float()
    if bias is not None:
        y = y + bias.reshape(N).float()
    return y.to(v.dtype).reshape(_out_shape(v, N))


def masked_gemv_int8_torch(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None,
                           activations: str = "float", block: int = A8_BLOCK_UNRECORDED) -> torch.Tensor:
    """One token on CPU: the native int8 kernel of cpu_gemv.py, else :func:`masked_gemv_int8_gather`.
    Other devices and several tokens: :func:`masked_gemv_int8_dense` (no sync). ``activations="int8"`` (W8A8):
    the native W8A8 kernel, else the kept inputs quantized per `block` (:func:`a8_masked_input`) through the same
    torch paths, output in v's dtype."""
    check_int8_args(q_t, qscale, v, mode, threshold, scale)
    K = q_t.shape[0]
    one_cpu_token = v.device.type == "cpu" and q_t.device.type == "cpu" and v.numel() == K
    if one_cpu_token:
        t = -math.inf if (mode == "none" or _all_active(threshold)) else float(threshold)
        y = native_masked(q_t, qscale, v, t, "none" if t == -math.inf else mode, scale, bias, activations=activations,
                          block=block)
        if y is not None:
            return y.reshape(_out_shape(v, q_t.shape[1]))
    run = masked_gemv_int8_gather if one_cpu_token else masked_gemv_int8_dense
    if activations == "int8":
        return run(q_t, qscale, a8_masked_input(v, threshold, mode, scale, block=block), KEEP_NONZERO, mode="abs",
                   bias=bias).to(v.dtype)
    return run(q_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias)


# --------------------------------------------------------------------------------------------
# int8 activations (W8A8): the kept inputs quantized per token, in blocks of `block` input positions
# --------------------------------------------------------------------------------------------
# |x| >= this holds exactly for the nonzero values: a quantized masked input handed to a masked kernel in mode "abs"
# keeps what the quantization kept (a kept input that quantized to 0 adds nothing either way)
KEEP_NONZERO = 2.0 ** -149


def quantize_activations(x: torch.Tensor, *, block: int) -> torch.Tensor:
    """`x` (any leading dims; masked inputs hold 0) with each token's values quantized to int8 and back, in fp32:
    per block of `block` positions along the last dim (the last block shorter), ``s = max|x| / 127``,
    ``q = round_half_even(x * (127 / max|x|))`` within ±127, value ``q * s``. What the native W8A8 kernel computes
    with int8 sums (cpu_gemv.c, rana_a8_quantize), here as float ops (sync-free, any device, traceable). A block
    holding inf / NaN gives NaN."""
    check_a8_block(block)
    xf = x.float()
    K = xf.shape[-1]
    pad = (-K) % block
    blocks = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros((), dtype=torch.float32, device=xf.device))
    q = torch.round(blocks * inv).clamp_(-127.0, 127.0)
    y = (q * (amax / 127.0)).flatten(-2)
    return y[..., :K] if pad else y


def a8_masked_input(v: torch.Tensor, threshold, mode: str, scale, *, block: int) -> torch.Tensor:
    """The masked token(s) with their kept inputs quantized per `block` (:func:`quantize_activations`), fp32:
    multiplied with a float-activation kernel at threshold KEEP_NONZERO in mode "abs", it gives the W8A8 product."""
    mask = _active_mask(v, threshold, mode, scale)
    x = v.float() if mask is None else torch.where(mask, v.float(), 0.0)
    return quantize_activations(x, block=block)


def masked_gemv_a8_reference(q_t, qscale, v, threshold, *, mode: str, scale=None, bias=None,
                             block: int) -> torch.Tensor:
    """float64 reference of the W8A8 product: the kept inputs quantized as the kernels do (fp32 scale arithmetic),
    then exact sums in float64."""
    check_int8_args(q_t, qscale, v, mode, threshold, scale)
    x = a8_masked_input(v, threshold, mode, scale, block=block)
    return masked_gemv_int8_reference(q_t, qscale, x, None, mode="none", bias=bias)


# --------------------------------------------------------------------------------------------
# expert-indexed products (mixture of experts, one decode token): S selected experts of E stacked
# --------------------------------------------------------------------------------------------
def _check_experts(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, thresholds: torch.Tensor) -> None:
    if w_t.dim() != 3 or v.dim() != 2 or idx.dim() != 1 or v.shape != (idx.shape[0], w_t.shape[1]):
        raise ValueError(f"expert GEMV needs w_t (E, K, N), v (S, K), idx (S,); got {tuple(w_t.shape)}, "
                         f"{tuple(v.shape)}, {tuple(idx.shape)}")
    if thresholds.shape != (w_t.shape[0],):
        raise ValueError(f"thresholds must be (E,) = ({w_t.shape[0]},), got {tuple(thresholds.shape)}")


def _expert_mask(v: torch.Tensor, idx: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """|v[s, k]| >= t[idx[s]] in fp32, shape (S, K)."""
    t = thresholds.to(device=v.device, dtype=torch.float32).index_select(0, idx)
    return v.float().abs() >= t.unsqueeze(1)


def expert_masked_gemv_dense(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                             thresholds: torch.Tensor) -> torch.Tensor:
    """``y[s] = (m_s ⊙ v[s]) @ w_t[idx[s]]`` with ``m_s = |v[s]| >= thresholds[idx[s]]``; (S, N) in v's dtype.

    Sync-free on every device (no nonzero): the selected experts' weights are gathered by index and
    multiplied as one batched product, so it costs their dense reads; the accelerator / reference path."""
    _check_experts(w_t, v, idx, thresholds)
    x = torch.where(_expert_mask(v, idx, thresholds), v, 0.0).to(w_t.dtype)
    return torch.bmm(x.unsqueeze(1), w_t.index_select(0, idx)).squeeze(1).to(v.dtype)


def expert_masked_gemv_gather(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                              thresholds: torch.Tensor) -> torch.Tensor:
    """The same product reading only the active rows, for CPU: the stacked ``w_t`` (contiguous E x K x N)
    is one table of E·K rows, each selected expert one bag of its active rows ``idx[s]·K + k`` weighted
    by ``v[s, k]`` — one ``embedding_bag`` over all selected experts (no loop, no gathered copy,
    fp32 accumulation)."""
    _check_experts(w_t, v, idx, thresholds)
    E, K, N = w_t.shape
    mask = _expert_mask(v, idx, thresholds)
    slot, col = mask.nonzero().unbind(1)  # row-major: each slot's active inputs are contiguous
    rows = idx.index_select(0, slot) * K + col
    counts = mask.sum(1)
    offsets = torch.cumsum(counts, 0) - counts
    weights = v[slot, col].to(w_t.dtype)
    y = torch.embedding_bag(w_t.reshape(E * K, N), rows, offsets, False, 0, False, weights, False, None)[0]
    return y.to(v.dtype)


def expert_masked_gemv_reference(w_t, v, idx, thresholds) -> torch.Tensor:
    """fp32 reference, one expert at a time (tests)."""
    _check_experts(w_t, v, idx, thresholds)
    mask = _expert_mask(v, idx, thresholds)
    return torch.stack([(v[s].float() * mask[s]) @ w_t[int(idx[s])].float() for s in range(len(idx))]).to(v.dtype)
