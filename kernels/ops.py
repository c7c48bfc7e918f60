"""The masked GEMV as torch.library ops: what the adapter modules call for a batch-1 decode token.

Ops (one token: ``v`` holds K values, any leading dims of size 1):

    rana::masked_gemv(Tensor w_t, Tensor v, Tensor threshold, str mode, Tensor? scale, Tensor? bias) -> Tensor
        custom_op; CPU: the native kernel of cpu_gemv.py (fp32), else the torch gather / dense masked
        product; any other device: the dense masked product (sync-free). Output v.shape[:-1] + (N,).
    rana::masked_gemv_grouped(Tensor[] vs, Tensor[] w_ts, Tensor[] thresholds, str mode, Tensor?[] scales,
                              Tensor?[] biases) -> Tensor
        custom_op; the same for up to three projections (q/k/v, gate/up), outputs concatenated (1-D).
    rana::masked_gemv_triton(Tensor[] vs, Tensor[] w_ts, Tensor[] thresholds, str mode, Tensor?[] scales,
                             Tensor?[] biases, SymInt sparsity_bin) -> Tensor
        triton_op (registered when triton imports): the grouped Triton kernel of triton_gemv.py, visible
        to torch.compile / inductor through wrap_triton, captured by CUDA graphs.
    rana::dense_gemv_triton(Tensor[] vs, Tensor[] ws) -> Tensor
        triton_op: up to three dense row-major GEMVs in one launch (the rank adapters' codes B x).
    rana::expert_masked_gemv_triton(Tensor w_t, Tensor v, Tensor idx, Tensor thresholds) -> Tensor
        triton_op: the same through rana_expert_masked_gemv (CUDA): one launch over the selected experts'
        kept rows, the expert index read on the device.
    rana::expert_masked_gemv(Tensor w_t, Tensor v, Tensor idx, Tensor thresholds) -> Tensor
        custom_op; a mixture of experts' one token: S selected experts (idx) of the stacked w_t
        (E, K, N), each input row v[s] masked by |v| >= thresholds[idx[s]]; CPU: the native kernel
        (fp32: one C call over the selected experts' kept rows), else one embedding_bag over the active
        rows of all selected experts; elsewhere the gathered dense batched product.

    rana::masked_gemv_int8(Tensor q_t, Tensor qscale, Tensor v, Tensor threshold, str mode, Tensor? scale,
                           Tensor? bias) -> Tensor
        custom_op; int8 weights q_t (K, N) with per-output-channel fp32 scales qscale (N,):
        ``qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)``. CPU: the native int8 kernel of cpu_gemv.py (any float v),
        else a torch gather of the kept int8 rows / the dense dequantized product; any other device: the
        dense dequantized product (sync-free). Output v.shape[:-1] + (N,) in v's dtype.
    rana::masked_gemv_int8_grouped(Tensor[] vs, Tensor[] q_ts, Tensor[] qscales, Tensor[] thresholds, str mode,
                                   Tensor?[] scales, Tensor?[] biases) -> Tensor
        custom_op; the same for up to three projections, outputs concatenated (1-D).
    rana::masked_gemv_int8_triton(Tensor[] vs, Tensor[] q_ts, Tensor[] qscales, Tensor[] thresholds, str mode,
                                  Tensor?[] scales, Tensor?[] biases, SymInt sparsity_bin) -> Tensor
        triton_op (when triton imports): the int8 kernel of triton_gemv.py (rana_masked_gemv_int8), up to
        three projections in one launch.

``threshold`` is a 0-dim fp32 tensor (a module buffer) and ``mode`` one of "none", "square",
"abs_scaled", "abs" (see masked_gemv.py). Every op has a fake implementation, so
``torch.compile(fullgraph=True)`` traces a decode step without reading a tensor value on the host.
State the kernels keep (the CPU kernel's dense-branch prediction, the Triton tuning decisions) is
only touched inside the op implementations, which run outside the traced graph; the Triton kernels
are built when this module is imported.

:func:`decode_masked` / :func:`decode_masked_grouped` (and :func:`decode_masked_int8` /
:func:`decode_masked_int8_grouped` for int8 weights; mode "none" there is the dense int8 GEMV) are the
module-facing entry points: eagerly they call the implementations directly (a Python op dispatch costs more than a small CPU GEMV); under
torch.compile they go through the ops.

Self-contained (torch + stdlib + its sibling kernel files; triton optional) so it ships with exports.
"""
from __future__ import annotations

import os

from typing import Optional, Sequence

import torch

from .cpu_gemv import (MODE_IDS, NativeInt8Call, expert_masked_gemv_native, masked_linear_native,
                       masked_linear_native_int8)
from .masked_gemv import (expert_masked_gemv_dense, expert_masked_gemv_gather, masked_gemv_dense,
                          masked_gemv_int8_dense, masked_gemv_int8_torch, masked_gemv_torch)
from .triton_gemv import (expert_masked_gemv_triton, grouped_dense_gemv_triton, grouped_masked_gemv_int8_triton,
                          grouped_masked_gemv_triton, int8_kernel, interpreting, kernels, sparsity_bin,
                          triton_available)

__all__ = ["uses_triton", "eager_cpu", "decode_masked", "decode_masked_linear", "decode_expert_masked", "decode_masked_grouped", "decode_dense_grouped",
           "decode_masked_int8", "decode_masked_int8_grouped", "masked_gemv_impl", "masked_gemv_int8_impl",
           "sparsity_bin", "DEFAULT_SPARSITY_BIN", "HAS_TRITON", "OP_NAMES", "MODES"]

MODES = ("none", "square", "abs_scaled", "abs")
DEFAULT_SPARSITY_BIN = 2  # active fraction ≈ 0.5: the Triton tuning key when a module gives no hint


def _build_triton() -> bool:
    if not triton_available():
        return False
    try:
        kernels()  # build now: no kernel builder may run inside a traced forward
        int8_kernel()
    except Exception:  # a triton that cannot build kernels here: the torch paths only
        return False
    return True


HAS_TRITON = _build_triton()


# --------------------------------------------------------------------------------------------
# implementations (eager)
# --------------------------------------------------------------------------------------------
def masked_gemv_impl(w_t: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                     scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """One token on any device without Triton: native/gather on CPU, dense masked elsewhere."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t = None if mode == "none" else threshold
    m = "abs" if mode == "none" else mode
    if v.is_cpu and w_t.is_cpu:
        y = masked_gemv_torch(w_t, v, t, mode=m, scale=scale, bias=bias)
    else:
        y = masked_gemv_dense(w_t, v, t, mode=m, scale=scale, bias=bias)
    return y.contiguous()


# --------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------
def _registered(name: str) -> bool:
    """Whether rana::<name> exists already: the rana package and every exported model loaded in this
    process ship a copy of this file, and an op can be defined once per process (the copies are
    the same code, so the first definition serves all)."""
    try:
        getattr(torch.ops.rana, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _masked_gemv_op(w_t: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                    scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    return masked_gemv_impl(w_t, v, threshold, mode, scale, bias)


def _masked_gemv_fake(w_t, v, threshold, mode, scale, bias):
    return v.new_empty((*v.shape[:-1], w_t.shape[1]))


def _masked_gemv_grouped_op(vs: Sequence[torch.Tensor], w_ts: Sequence[torch.Tensor],
                            thresholds: Sequence[torch.Tensor], mode: str,
                            scales: Sequence[Optional[torch.Tensor]],
                            biases: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    return torch.cat([masked_gemv_impl(w, v, t, mode, s, b).reshape(-1)
                      for v, w, t, s, b in zip(vs, w_ts, thresholds, scales, biases)])


def _masked_gemv_grouped_fake(vs, w_ts, thresholds, mode, scales, biases):
    return vs[0].new_empty((sum(w.shape[1] for w in w_ts),))


def _masked_gemv_triton_op(vs: Sequence[torch.Tensor], w_ts: Sequence[torch.Tensor],
                           thresholds: Sequence[torch.Tensor], mode: str,
                           scales: Sequence[Optional[torch.Tensor]], biases: Sequence[Optional[torch.Tensor]],
                           sparsity_bin: int) -> torch.Tensor:
    return grouped_masked_gemv_triton(list(vs), list(w_ts), list(thresholds), mode, list(scales), list(biases),
                                      sparsity_bin, wrap=torch.library.wrap_triton)


if not _registered("masked_gemv"):
    torch.library.custom_op("rana::masked_gemv", _masked_gemv_op, mutates_args=()).register_fake(_masked_gemv_fake)
if not _registered("masked_gemv_grouped"):
    torch.library.custom_op("rana::masked_gemv_grouped", _masked_gemv_grouped_op,
                            mutates_args=()).register_fake(_masked_gemv_grouped_fake)
def _dense_gemv_triton_op(vs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor]) -> torch.Tensor:
    return grouped_dense_gemv_triton(list(vs), list(ws), wrap=torch.library.wrap_triton)


if HAS_TRITON and not _registered("masked_gemv_triton"):
    # triton_op: torch.compile traces into the launches (wrap_triton) and derives the fake itself
    torch.library.triton_op("rana::masked_gemv_triton", _masked_gemv_triton_op, mutates_args=())
if HAS_TRITON and not _registered("dense_gemv_triton"):
    torch.library.triton_op("rana::dense_gemv_triton", _dense_gemv_triton_op, mutates_args=())

def expert_masked_gemv_impl(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                            thresholds: torch.Tensor) -> torch.Tensor:
    """One token through S selected experts: on CPU the native kernel (fp32) else the active-row gather,
    the sync-free product elsewhere."""
    if v.is_cpu and w_t.is_cpu:
        y = expert_masked_gemv_native(w_t, v, idx, thresholds)  # fp32: one native call over the selected experts
        if y is not None:
            return y
    if v.is_cpu and w_t.is_cpu and w_t.is_contiguous():
        return expert_masked_gemv_gather(w_t, v, idx, thresholds).contiguous()
    return expert_masked_gemv_dense(w_t, v, idx, thresholds).contiguous()


def _expert_masked_gemv_fake(w_t, v, idx, thresholds):
    return v.new_empty((v.shape[0], w_t.shape[2]))


if not _registered("expert_masked_gemv"):
    torch.library.custom_op("rana::expert_masked_gemv", expert_masked_gemv_impl,
                            mutates_args=()).register_fake(_expert_masked_gemv_fake)

# --------------------------------------------------------------------------------------------
# int8 weights
# --------------------------------------------------------------------------------------------
def masked_gemv_int8_impl(q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                          scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 weights without Triton: the native kernel / kept-row gather on CPU, the dense dequantized
    product elsewhere (and for several tokens)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t = None if mode == "none" else threshold
    if v.is_cpu and q_t.is_cpu:
        y = masked_gemv_int8_torch(q_t, qscale, v, t, mode=mode, scale=scale, bias=bias)
    else:
        y = masked_gemv_int8_dense(q_t, qscale, v, t, mode=mode, scale=scale, bias=bias)
    return y.contiguous()


def _masked_gemv_int8_op(q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                         scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    return masked_gemv_int8_impl(q_t, qscale, v, threshold, mode, scale, bias)


def _masked_gemv_int8_fake(q_t, qscale, v, threshold, mode, scale, bias):
    return v.new_empty((*v.shape[:-1], q_t.shape[1]))


def _masked_gemv_int8_grouped_op(vs: Sequence[torch.Tensor], q_ts: Sequence[torch.Tensor],
                                 qscales: Sequence[torch.Tensor], thresholds: Sequence[torch.Tensor], mode: str,
                                 scales: Sequence[Optional[torch.Tensor]],
                                 biases: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    return torch.cat([masked_gemv_int8_impl(q, qs, v, t, mode, s, b).reshape(-1)
                      for v, q, qs, t, s, b in zip(vs, q_ts, qscales, thresholds, scales, biases)])


def _masked_gemv_int8_grouped_fake(vs, q_ts, qscales, thresholds, mode, scales, biases):
    return vs[0].new_empty((sum(q.shape[1] for q in q_ts),))


def _masked_gemv_int8_triton_op(vs: Sequence[torch.Tensor], q_ts: Sequence[torch.Tensor],
                                qscales: Sequence[torch.Tensor], thresholds: Sequence[torch.Tensor], mode: str,
                                scales: Sequence[Optional[torch.Tensor]], biases: Sequence[Optional[torch.Tensor]],
                                sparsity_bin: int) -> torch.Tensor:
    return grouped_masked_gemv_int8_triton(list(vs), list(q_ts), list(qscales), list(thresholds), mode, list(scales),
                                           list(biases), sparsity_bin, wrap=torch.library.wrap_triton)


if not _registered("masked_gemv_int8"):
    torch.library.custom_op("rana::masked_gemv_int8", _masked_gemv_int8_op,
                            mutates_args=()).register_fake(_masked_gemv_int8_fake)
if not _registered("masked_gemv_int8_grouped"):
    torch.library.custom_op("rana::masked_gemv_int8_grouped", _masked_gemv_int8_grouped_op,
                            mutates_args=()).register_fake(_masked_gemv_int8_grouped_fake)
if HAS_TRITON and not _registered("masked_gemv_int8_triton"):
    torch.library.triton_op("rana::masked_gemv_int8_triton", _masked_gemv_int8_triton_op, mutates_args=())

def _expert_masked_gemv_triton_op(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                                  thresholds: torch.Tensor) -> torch.Tensor:
    return expert_masked_gemv_triton(w_t, v, idx, thresholds, wrap=torch.library.wrap_triton)


if HAS_TRITON and not _registered("expert_masked_gemv_triton"):
    torch.library.triton_op("rana::expert_masked_gemv_triton", _expert_masked_gemv_triton_op, mutates_args=())

OP_NAMES = ("rana::masked_gemv", "rana::masked_gemv_grouped", "rana::expert_masked_gemv", "rana::masked_gemv_int8",
            "rana::masked_gemv_int8_grouped") + (
    ("rana::masked_gemv_triton", "rana::dense_gemv_triton", "rana::masked_gemv_int8_triton",
     "rana::expert_masked_gemv_triton") if HAS_TRITON else ())


# --------------------------------------------------------------------------------------------
# module-facing entry points
# --------------------------------------------------------------------------------------------
# CPU tensors take the Triton kernel (under the interpreter) only when asked for with
# RANA_TRITON_ON_CPU=1 as well: TRITON_INTERPRET=1 alone is set for whole test sessions, and the
# interpreter is 30-70x slower than the native kernel for every decoded token. Read once: the eager
# CPU path below runs per projection per token.
_INTERPRET = interpreting() and os.environ.get("RANA_TRITON_ON_CPU") == "1"


def _use_triton(v: torch.Tensor) -> bool:
    """CUDA with triton; CPU tensors only under TRITON_INTERPRET=1 in eager (tests of the kernel path)."""
    return HAS_TRITON and (v.is_cuda or (_INTERPRET and not torch.compiler.is_compiling()))


uses_triton = _use_triton  # for callers that skip preparing a launch the CPU path would not make


def decode_masked(w_t: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                  scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor:
    """``(m ⊙ v) @ w_t (+ bias)`` for one token; output v.shape[:-1] + (N,) in v's dtype."""
    out_shape = (*v.shape[:-1], w_t.shape[1])
    if torch.compiler.is_compiling():
        if _use_triton(v):
            return torch.ops.rana.masked_gemv_triton([v], [w_t], [threshold], mode, [scale], [bias],
                                                     sparsity_bin).view(out_shape)
        return torch.ops.rana.masked_gemv(w_t, v, threshold, mode, scale, bias)
    if v.is_cpu and not _INTERPRET:  # the common CPU case first: one native call, nothing else
        if mode != "none":
            y = masked_linear_native(w_t.t(), v, float(threshold), MODE_IDS[mode], scale, bias)
            if y is not None:
                return y
        return masked_gemv_impl(w_t, v, threshold, mode, scale, bias)
    if _use_triton(v):
        return grouped_masked_gemv_triton([v], [w_t], [threshold], mode, [scale], [bias], sparsity_bin).view(out_shape)
    return masked_gemv_impl(w_t, v, threshold, mode, scale, bias)


def eager_cpu(v: torch.Tensor) -> bool:
    """Whether one token on `v` runs the native CPU kernels eagerly (not traced, not the interpreter): there a
    grouped call is a loop of single calls, so callers may skip assembling one."""
    return v.is_cpu and not _INTERPRET and not torch.compiler.is_compiling()


def decode_masked_linear(weight: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                         scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                         sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor:
    """:func:`decode_masked` given the nn.Linear weight (N × K) itself rather than ``w_t``: the eager CPU case
    calls the native kernel without making the two transposed views (~0.5 µs each, per projection per token)."""
    if mode != "none" and v.is_cpu and not _INTERPRET and not torch.compiler.is_compiling():
        y = masked_linear_native(weight, v, float(threshold), MODE_IDS[mode], scale, bias)
        if y is not None:
            return y
    return decode_masked(weight.t(), v, threshold, mode, scale, bias, sparsity_bin)


def decode_masked_grouped(vs, w_ts, thresholds, mode: str, scales, biases,
                          sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> list[torch.Tensor]:
    """Up to three one-token masked GEMVs (one launch on CUDA); their outputs as 1-D tensors."""
    ns = [w.shape[1] for w in w_ts]
    if torch.compiler.is_compiling():
        if _use_triton(vs[0]):
            flat = torch.ops.rana.masked_gemv_triton(vs, w_ts, thresholds, mode, scales, biases, sparsity_bin)
        else:
            flat = torch.ops.rana.masked_gemv_grouped(vs, w_ts, thresholds, mode, scales, biases)
        return list(flat.split(ns))
    if _use_triton(vs[0]):
        flat = grouped_masked_gemv_triton(list(vs), list(w_ts), list(thresholds), mode, list(scales), list(biases),
                                          sparsity_bin)
        return list(flat.split(ns))
    # CPU eagerly: one native call per projection, no concatenation
    return [decode_masked(w, v, t, mode, s, b).reshape(-1) for v, w, t, s, b in zip(vs, w_ts, thresholds, scales, biases)]


def decode_dense_grouped(vs, ws) -> list[torch.Tensor] | None:
    """``W_g @ v_g`` of up to three row-major weights in one launch where the Triton kernels run (the rank
    adapters' codes `B x` of gate and up); None elsewhere: the callers' own F.linear is best there."""
    if not _use_triton(vs[0]) or any(w.stride(-1) != 1 for w in ws):
        return None
    if torch.compiler.is_compiling():
        flat = torch.ops.rana.dense_gemv_triton(vs, ws)
    else:
        flat = grouped_dense_gemv_triton(list(vs), list(ws))
    return list(flat.split([w.shape[0] for w in ws]))


def decode_expert_masked(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """``(m_s ⊙ v[s]) @ w_t[idx[s]]`` for the S experts one token was routed to; (S, N). Where the Triton
    kernels run: one launch reading only the selected experts' kept rows (rana_expert_masked_gemv, the
    expert index read on the device); CPU: the active-row gather. Under torch.compile the registered ops
    (their data-dependent gathers stay inside them: no graph break)."""
    if _use_triton(v) and w_t.stride(-1) == 1 and v.stride(-1) == 1:
        if torch.compiler.is_compiling():
            return torch.ops.rana.expert_masked_gemv_triton(w_t, v, idx, thresholds)
        return expert_masked_gemv_triton(w_t, v, idx, thresholds)
    if torch.compiler.is_compiling():
        return torch.ops.rana.expert_masked_gemv(w_t, v, idx, thresholds)
    return expert_masked_gemv_impl(w_t, v, idx, thresholds)


def decode_masked_int8(q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor, mode: str,
                       scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                       sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor:
    """``qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)`` with int8 ``q_t`` (K, N) (unit stride along N) and fp32
    per-output-channel ``qscale`` (N,); output v.shape[:-1] + (N,) in v's dtype. Mode "none" is the dense
    int8 GEMV (``threshold`` unread). Meant for one token; several tokens take the dense dequantized product."""
    K, N = q_t.shape
    one_token = v.numel() == K
    if torch.compiler.is_compiling():
        if one_token and _use_triton(v):
            return torch.ops.rana.masked_gemv_int8_triton([v], [q_t], [qscale], [threshold], mode, [scale], [bias],
                                                          sparsity_bin).view(*v.shape[:-1], N)
        return torch.ops.rana.masked_gemv_int8(q_t, qscale, v, threshold, mode, scale, bias)
    if v.is_cpu and not _INTERPRET:  # the common CPU case first: one native call, nothing else
        mode_id = MODE_IDS.get(mode)
        if mode_id is not None and one_token:
            y = masked_linear_native_int8(q_t, qscale, v, 0.0 if mode_id == 0 else float(threshold), mode_id,
                                          scale, bias)
            if y is not None:
                return y
        return masked_gemv_int8_impl(q_t, qscale, v, threshold, mode, scale, bias)
    if one_token and _use_triton(v):
        return grouped_masked_gemv_int8_triton([v], [q_t], [qscale], [threshold], mode, [scale], [bias],
                                               sparsity_bin).view(*v.shape[:-1], N)
    return masked_gemv_int8_impl(q_t, qscale, v, threshold, mode, scale, bias)


BOUND_CALL = "_native_int8_call"  # where decode_masked_int8_held keeps a module's bound native call


def decode_masked_int8_held(owner, q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor,
                            threshold: Optional[torch.Tensor], mode: str, scale: Optional[torch.Tensor] = None,
                            bias: Optional[torch.Tensor] = None,
                            sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor:
    """:func:`decode_masked_int8` for int8 weights that a module holds (`owner`: an Int8Linear, the int8 LM
    head). Eagerly on CPU the native call's operands are bound once and kept on the module
    (cpu_gemv.NativeInt8Call, under `BOUND_CALL`; the owner drops it in `_apply`), so a token pays for its own
    checks only. ``threshold`` None: mode "none". Callers check the bias's gradients."""
    if v.is_cpu and not _INTERPRET and not torch.compiler.is_compiling():
        call = owner.__dict__.get(BOUND_CALL)
        if call is None or not call.binds(q_t, qscale, mode, scale, bias):
            call = owner.__dict__[BOUND_CALL] = NativeInt8Call.bind(q_t, qscale, mode, scale, bias)
        y = call(v, 0.0 if threshold is None else float(threshold))
        if y is not None:
            return y
    if threshold is None:  # the other paths take a threshold tensor all the same
        threshold = torch.full((), float("-inf"), dtype=torch.float32, device=v.device)
    return decode_masked_int8(q_t, qscale, v, threshold, mode, scale, bias, sparsity_bin)


def decode_masked_int8_grouped(vs, q_ts, qscales, thresholds, mode: str, scales, biases,
                               sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> list[torch.Tensor]:
    """Up to three one-token int8 masked GEMVs (one launch on CUDA); their outputs as 1-D tensors."""
    ns = [q.shape[1] for q in q_ts]
    if torch.compiler.is_compiling():
        if _use_triton(vs[0]):
            flat = torch.ops.rana.masked_gemv_int8_triton(vs, q_ts, qscales, thresholds, mode, scales, biases,
                                                          sparsity_bin)
        else:
            flat = torch.ops.rana.masked_gemv_int8_grouped(vs, q_ts, qscales, thresholds, mode, scales, biases)
        return list(flat.split(ns))
    if _use_triton(vs[0]):
        flat = grouped_masked_gemv_int8_triton(list(vs), list(q_ts), list(qscales), list(thresholds), mode,
                                               list(scales), list(biases), sparsity_bin)
        return list(flat.split(ns))
    return [decode_masked_int8(q, qs, v, t, mode, s, b).reshape(-1)
            for v, q, qs, t, s, b in zip(vs, q_ts, qscales, thresholds, scales, biases)]
