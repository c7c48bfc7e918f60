"""The decode route: how one token goes from an adapter module to a kernel.

    module forward ── rana.modules.common (the gate: eval, meter off, one token, no gradients; the operand)
      └─ decode_masked / decode_masked_grouped / decode_expert_masked / decode_dense_grouped   (here)
           ├─ under torch.compile: the registered ops (ops.py), which the traced graph records
           └─ eagerly: the row of EAGER for the operand's backend (weights.py: chosen once per operand)
                ├─ "native"  cpu_gemv.c through the operand's bound call (cpu_gemv.NativeCall)
                ├─ "triton"  triton_gemv.py's kernels (one launch for a sibling group)
                └─ "torch"   torch_gemv.py (the gather on CPU, the dense masked product elsewhere)

Every entry point takes a weight operand of any format (weights.py: FloatWeight, Int8Weight), so a new format
needs no new entry point: its operand type plus its kernels. The rows below are the one place where an
(op, backend) pair is mapped to its implementation; no entry point tests the device or the format itself.

Outputs: ``decode_masked`` v.shape[:-1] + (N,) in v's dtype (several tokens take the dense masked product);
the grouped forms one 1-D tensor per projection. ``threshold`` is a 0-dim fp32 tensor (a module buffer; None
with mode "none"), ``sparsity_bin`` a Python int (the Triton tuning key, constant under compile).

Self-contained (torch + its sibling kernel files; triton optional) so it ships with exported models.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .ops import OP_NAMES  # noqa: F401  importing ops registers the rana:: ops the traced rows call
from .torch_gemv import (KEEP_NONZERO, a8_masked_input, expert_masked_gemv_dense, expert_masked_gemv_gather,
                         masked_gemv_dense, masked_gemv_gather, masked_gemv_int8_dense, masked_gemv_int8_gather,
                         masked_gemv_int8_torch)
from .cpu_gemv import expert_masked_gemv_native
from .triton_gemv import expert_masked_gemv_triton, grouped_dense_gemv_triton, grouped_masked_gemv_triton, sparsity_bin
from .weights import FloatWeight, Weight, eager_cpu

__all__ = ["decode_masked", "decode_masked_grouped", "decode_expert_masked", "decode_dense_grouped", "eager_cpu",
           "EAGER", "TRACED", "Backend", "DEFAULT_SPARSITY_BIN", "sparsity_bin"]

DEFAULT_SPARSITY_BIN = 2  # active fraction ≈ 0.5: the Triton tuning key when a module gives no hint


class Backend(NamedTuple):
    """One backend's implementation of each entry point (None: it has none; the caller keeps its own path)."""
    masked: Callable  # (w, v, threshold, mode, scale, sbin) -> Tensor
    grouped: Callable  # (ws, vs, thresholds, mode, scales, sbin) -> list of 1-D Tensors
    expert: Callable  # (w, v, idx, thresholds) -> Tensor (S, N)
    dense_grouped: Optional[Callable]  # (ws, vs) -> list of 1-D Tensors


# --------------------------------------------------------------------------------------------
# the entry points
# --------------------------------------------------------------------------------------------
def decode_masked(w: Weight, v: torch.Tensor, threshold: Optional[torch.Tensor], mode: str,
                  scale: Optional[torch.Tensor] = None, sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor:
    """``[qscale ⊙] ((m ⊙ v) @ w_t) (+ bias)`` of one token through operand `w`."""
    if torch.compiler.is_compiling():
        return _traced(w).masked(w, v, threshold, mode, scale, sparsity_bin)
    return EAGER[w.backend].masked(w, v, threshold, mode, scale, sparsity_bin)


def decode_masked_grouped(ws: Sequence[Weight], vs: Sequence[torch.Tensor], thresholds, mode: str, scales,
                          sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> list[torch.Tensor]:
    """Up to three projections' one-token masked GEMVs (one launch where the backend has one: Triton, the traced
    op); the operands share a format and a backend. Their outputs as 1-D tensors."""
    if torch.compiler.is_compiling():
        return _traced(ws[0]).grouped(ws, vs, thresholds, mode, scales, sparsity_bin)
    return EAGER[ws[0].backend].grouped(ws, vs, thresholds, mode, scales, sparsity_bin)


def decode_expert_masked(w: FloatWeight, v: torch.Tensor, idx: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """``(m_s ⊙ v[s]) @ w_t[idx[s]]`` for the S experts one token was routed to, `w` the stacked (E, N, K)
    experts; (S, N). Triton: one launch reading only the selected experts' kept rows (the expert index read
    on the device); CPU: one native call, else the active-row gather; under torch.compile the registered ops
    (their data-dependent gathers stay inside them: no graph break)."""
    if torch.compiler.is_compiling():
        return _traced(w).expert(w, v, idx, thresholds)
    return EAGER[w.backend].expert(w, v, idx, thresholds)


def decode_dense_grouped(ws: Sequence[FloatWeight], vs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """``W_g @ v_g`` of up to three row-major float weights in one launch where the backend has one (the rank
    adapters' codes `B x` of gate and up on Triton); None elsewhere: the callers' own F.linear is best there."""
    row = _traced(ws[0]) if torch.compiler.is_compiling() else EAGER[ws[0].backend]
    if row.dense_grouped is None or any(w.format != "float" or w.weight.stride(-1) != 1 for w in ws):
        return None
    return row.dense_grouped(ws, vs)


# --------------------------------------------------------------------------------------------
# eager implementations
# --------------------------------------------------------------------------------------------
def _one_token(v: torch.Tensor) -> bool:
    return v.numel() == v.shape[-1]


_NO_THRESHOLD = float("-inf")  # mode "none" reads no threshold


def _torch_masked(w: Weight, v, threshold, mode, scale, sbin):
    """One CPU token: the active rows gathered (embedding_bag / index_select); several tokens or another
    device: the dense masked product (sync-free)."""
    w_t, qscale, bias = w.op_tensors()
    if w.activations == "int8":  # W8A8: its own torch path (the quantized kept inputs)
        return masked_gemv_int8_torch(w_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias,
                                      activations="int8", block=w.block)
    gather = v.is_cpu and w_t.is_cpu and _one_token(v)
    if qscale is None:
        if gather:
            return masked_gemv_gather(w_t, v, threshold, mode, scale, bias)
        return masked_gemv_dense(w_t, v, threshold, mode=mode, scale=scale, bias=bias)
    if gather:
        return masked_gemv_int8_gather(w_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias)
    return masked_gemv_int8_dense(w_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias)


def _native_masked(w: Weight, v, threshold, mode, scale, sbin):
    """One CPU token through the operand's bound native call; what that declines, through the kernel with operands
    converted for one call where the format has that (Weight.native_once: int8 with a bf16 / fp16 token), else
    the torch path, as several tokens are. (Runs per projection per token: no helper calls before the kernel.)"""
    if v.numel() == v.shape[-1]:
        call = w.bound  # Weight.native's check of a kept call, spelled out
        stored = w.stored
        if call is None or call.mode != mode or call.tensors[2] is not scale or (
                stored is not None and call.ptr != stored.data_ptr()):
            call = w.native(mode, scale)
        t = _NO_THRESHOLD if threshold is None else float(threshold)
        y = call(v, t)
        if y is not None:
            return y
        y = w.native_once(v, t, mode, scale)  # what the format converts for one call (int8: bf16 / fp16 tokens)
        if y is not None:
            return y
    return _torch_masked(w, v, threshold, mode, scale, sbin)


def _device_threshold(threshold, v: torch.Tensor) -> torch.Tensor:
    """The kernels read a threshold tensor in every mode (mode "none" does not compare with it)."""
    if threshold is None:
        return torch.full((), float("-inf"), dtype=torch.float32, device=v.device)
    return threshold


def _group_args(ws, vs, thresholds) -> tuple[list, list, list, list]:
    """(w_ts, qscales, biases, device thresholds) of a grouped call's operands, as the kernels and ops take them."""
    w_ts, qscales, biases = (list(c) for c in zip(*(w.op_tensors() for w in ws)))
    return w_ts, qscales, biases, [_device_threshold(t, vs[0]) for t in thresholds]


def _split(flat: torch.Tensor, w_ts) -> list[torch.Tensor]:
    return list(flat.split([w.shape[1] for w in w_ts]))


def _a8_inputs(ws, vs, thresholds, mode, scales):
    """A W8A8 group as the float-activation kernels take it: each token's kept inputs quantized (torch ops,
    sync-free), kept again exactly where nonzero (mode "abs" at KEEP_NONZERO); other groups unchanged."""
    if ws[0].activations != "int8":
        return vs, thresholds, mode, scales
    vs = [a8_masked_input(v, t, mode, s, block=w.block) for w, v, t, s in zip(ws, vs, thresholds, scales)]
    keep = torch.full((), KEEP_NONZERO, dtype=torch.float32, device=vs[0].device)
    return vs, [keep] * len(vs), "abs", [None] * len(vs)


def _triton_grouped(ws, vs, thresholds, mode, scales, sbin):
    dtype = vs[0].dtype
    vs, thresholds, mode, scales = _a8_inputs(ws, vs, thresholds, mode, scales)
    w_ts, qscales, biases, ts = _group_args(ws, vs, thresholds)
    ys = grouped_masked_gemv_triton(list(vs), w_ts, ts, mode, list(scales), biases, sbin, qscales=qscales)
    return _split(ys.to(dtype), w_ts)


def _group_of_one(grouped: Callable, several: Callable) -> Callable:
    """A backend's masked entry made from its grouped launch: one token is a group of one; several tokens
    take `several` (the dense masked product)."""
    def masked(w, v, threshold, mode, scale, sbin):
        if not _one_token(v):
            return several(w, v, threshold, mode, scale, sbin)
        (y,) = grouped((w,), (v,), (threshold,), mode, (scale,), sbin)
        return y.view(*v.shape[:-1], y.shape[0])
    return masked


def _each_grouped(masked: Callable) -> Callable:
    """A backend without a grouped launch: one call per projection (eagerly on CPU a grouped call is a loop)."""
    def grouped(ws, vs, thresholds, mode, scales, sbin):
        return [masked(w, v, t, mode, s, sbin).reshape(-1) for w, v, t, s in zip(ws, vs, thresholds, scales)]
    return grouped


def _torch_expert(w: FloatWeight, v, idx, thresholds):
    w_t = w.w_t
    if v.is_cpu and w_t.is_cpu and w_t.is_contiguous():
        return expert_masked_gemv_gather(w_t, v, idx, thresholds).contiguous()
    return expert_masked_gemv_dense(w_t, v, idx, thresholds).contiguous()


def _native_expert(w: FloatWeight, v, idx, thresholds):
    y = expert_masked_gemv_native(w.w_t, v, idx, thresholds)
    return y if y is not None else _torch_expert(w, v, idx, thresholds)


def _triton_expert(w: FloatWeight, v, idx, thresholds):
    w_t = w.w_t
    if w_t.stride(-1) != 1 or v.stride(-1) != 1:
        return _torch_expert(w, v, idx, thresholds)
    return expert_masked_gemv_triton(w_t, v, idx, thresholds)


def _triton_dense_grouped(ws, vs):
    weights = [w.weight for w in ws]
    return list(grouped_dense_gemv_triton(list(vs), weights).split([m.shape[0] for m in weights]))


# --------------------------------------------------------------------------------------------
# traced implementations: only registered ops (fake implementations, no host reads, no Python state)
# --------------------------------------------------------------------------------------------
def _op_masked(w: Weight, v, threshold, mode, scale, sbin):
    w_t, qscale, bias = w.op_tensors()
    if w.activations == "int8":
        return torch.ops.rana.decode_w8a8(w_t, qscale, v, _device_threshold(threshold, v), mode, scale, bias, w.block)
    return torch.ops.rana.decode_masked(w_t, qscale, v, _device_threshold(threshold, v), mode, scale, bias)


def _op_grouped(ws, vs, thresholds, mode, scales, sbin):
    w_ts, qscales, biases, ts = _group_args(ws, vs, thresholds)
    if ws[0].activations == "int8":  # a group shares one format (DecodeGroup)
        y = torch.ops.rana.decode_w8a8_grouped(list(vs), w_ts, qscales, ts, mode, list(scales), biases, ws[0].block)
    else:
        y = torch.ops.rana.decode_masked_grouped(list(vs), w_ts, qscales, ts, mode, list(scales), biases)
    return _split(y, w_ts)


def _op_expert(w: FloatWeight, v, idx, thresholds):
    return torch.ops.rana.expert_masked_gemv(w.w_t, v, idx, thresholds)


def _triton_op_grouped(ws, vs, thresholds, mode, scales, sbin):
    dtype = vs[0].dtype
    vs, thresholds, mode, scales = _a8_inputs(ws, vs, thresholds, mode, scales)
    w_ts, qscales, biases, ts = _group_args(ws, vs, thresholds)
    ys = torch.ops.rana.decode_masked_triton(list(vs), w_ts, qscales, ts, mode, list(scales), biases, sbin)
    return _split(ys.to(dtype), w_ts)


def _triton_op_expert(w: FloatWeight, v, idx, thresholds):
    w_t = w.w_t
    if w_t.stride(-1) != 1 or v.stride(-1) != 1:
        return _op_expert(w, v, idx, thresholds)
    return torch.ops.rana.expert_masked_gemv_triton(w_t, v, idx, thresholds)


def _triton_op_dense_grouped(ws, vs):
    weights = [w.weight for w in ws]
    return list(torch.ops.rana.dense_gemv_triton(list(vs), weights).split([m.shape[0] for m in weights]))


# --------------------------------------------------------------------------------------------
# the table: (entry point, backend) -> implementation
# --------------------------------------------------------------------------------------------
#                     masked              grouped                         expert            dense_grouped
EAGER = {
    "native": Backend(_native_masked, _each_grouped(_native_masked), _native_expert, None),
    "triton": Backend(_group_of_one(_triton_grouped, _torch_masked), _triton_grouped, _triton_expert,
                      _triton_dense_grouped),
    "torch": Backend(_torch_masked, _each_grouped(_torch_masked), _torch_expert, None),
}
TRACED = {
    "ops": Backend(_op_masked, _op_grouped, _op_expert, None),
    "triton ops": Backend(_group_of_one(_triton_op_grouped, _op_masked), _triton_op_grouped, _triton_op_expert,
                          _triton_op_dense_grouped),
}


def _traced(w: Weight) -> Backend:
    """Under torch.compile: the Triton ops for CUDA weights, the custom ops (CPU, no Triton) otherwise (the
    interpreter's eager Triton path on CPU is not traced)."""
    return TRACED["triton ops" if w.backend == "triton" and w.device.type == "cuda" else "ops"]
