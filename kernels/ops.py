"""The masked GEMV as torch.library ops: what a traced decode step calls (route.py picks them under
torch.compile), each with a fake implementation, so ``torch.compile(fullgraph=True)`` traces a decode step
without reading a tensor value on the host. Every op takes either weight format: float ``w_t`` (K, N), or
int8 codes ``w_t`` with their per-output-channel scales ``qscale`` (N,) (None for float weights):
``y = [qscale ⊙] ((m ⊙ v) @ w_t) (+ bias)``.

    rana::decode_masked(Tensor w_t, Tensor? qscale, Tensor v, Tensor threshold, str mode, Tensor? scale,
                        Tensor? bias) -> Tensor
        one projection, v of any leading dims, output v.shape[:-1] + (N,) in v's dtype. CPU: one token through
        the native kernel (its call bound once and kept, op_native.py; float weights fp32 only), else the torch
        gather; several tokens and any other device: the dense masked product (sync-free).
    rana::decode_masked_grouped(Tensor[] vs, Tensor[] w_ts, Tensor?[] qscales, Tensor[] thresholds, str mode,
                                Tensor?[] scales, Tensor?[] biases) -> Tensor
        one token through each of up to three projections (q/k/v, gate/up), outputs concatenated (1-D); on CPU
        one native call for all of them (op_native.py).
    rana::decode_w8a8(Tensor w_t, Tensor? qscale, Tensor v, Tensor threshold, str mode, Tensor? scale,
                      Tensor? bias, int block) -> Tensor
    rana::decode_w8a8_grouped(...)  (decode_masked_grouped's schema, then int block)
        int8 weights with int8 activations (W8A8): each token's kept inputs quantized per block of `block` input
        positions (torch_gemv.quantize_activations) and multiplied int8 × int8; CPU: one token through the native
        W8A8 kernel, else the quantized input through the int8 torch paths. (Exports made before the block was a
        setting register rana::decode_masked_a8 / decode_masked_grouped_a8 with blocks of 64: other names.)
    rana::decode_masked_triton(Tensor[] vs, Tensor[] w_ts, Tensor?[] qscales, Tensor[] thresholds, str mode,
                               Tensor?[] scales, Tensor?[] biases, SymInt sparsity_bin) -> Tensor
        triton_op (registered when the Triton kernels can run): the grouped kernel of triton_gemv.py
        (rana_masked_gemv, or rana_masked_gemv_int8 for int8 weights), visible to torch.compile / inductor
        through wrap_triton, captured by CUDA graphs.
    rana::dense_gemv_triton(Tensor[] vs, Tensor[] ws) -> Tensor
        triton_op: up to three dense row-major GEMVs in one launch (the rank adapters' codes B x).
    rana::expert_masked_gemv(Tensor w_t, Tensor v, Tensor idx, Tensor thresholds) -> Tensor
        a mixture of experts' one token: S selected experts (idx) of the stacked w_t (E, K, N),
        each input row v[s] masked by |v| >= thresholds[idx[s]]; CPU: the native kernel (fp32: one C call over
        the selected experts' kept rows), else one embedding_bag over their active rows; elsewhere the
        gathered dense batched product.
    rana::expert_masked_gemv_triton(Tensor w_t, Tensor v, Tensor idx, Tensor thresholds) -> Tensor
        triton_op: the same through rana_expert_masked_gemv (CUDA): one launch over the selected experts'
        kept rows, the expert index read on the device.

The masked ops are named after the route's entry points: exports made before the weight formats shared one
route register ``rana::masked_gemv*`` ops with other schemas, and an op is defined once per process (the first
definition serves all), so an older export and this rana must not share a name (tests/test_decode_ops.py).

``threshold`` is a 0-dim fp32 tensor (a module buffer) and ``mode`` a name of modes.py. State the kernels
keep (the CPU kernel's dense-branch prediction, the Triton tuning decisions) is only touched inside the op
implementations, which run outside the traced graph; the Triton kernels are built when this module is
imported. `docs/gpu.md` lists these ops (tests/test_kernel_modes.py checks it against OP_NAMES).

Self-contained (torch + stdlib + its sibling kernel files; triton optional) so it ships with exports.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .cpu_gemv import check_a8_block, expert_masked_gemv_native
from .modes import mode_id
from .op_native import grouped_native, masked_native
from .torch_gemv import (expert_masked_gemv_dense, expert_masked_gemv_gather, masked_gemv_int8_torch,
                         masked_gemv_torch)
from .triton_gemv import (expert_masked_gemv_triton, grouped_dense_gemv_triton, grouped_masked_gemv_triton,
                          interpreting, kernels_available)

__all__ = ["decode_masked_impl", "decode_w8a8_impl", "expert_masked_gemv_impl", "HAS_TRITON", "OP_NAMES", "ALL_OP_NAMES"]

HAS_TRITON = kernels_available()


# --------------------------------------------------------------------------------------------
# implementations (run eagerly, outside any traced graph)
# --------------------------------------------------------------------------------------------
def decode_masked_impl(w_t: torch.Tensor, qscale: Optional[torch.Tensor], v: torch.Tensor, threshold: torch.Tensor,
                     mode: str, scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """rana::decode_masked's implementation (no Triton): one CPU token through the native kernel (its binding kept by
    op_native) or the torch gather; several tokens and other devices the dense masked product."""
    mode_id(mode)  # ValueError for an unknown mode
    y = masked_native(w_t, qscale, v, threshold, mode, scale, bias)  # one CPU token, its call bound once
    if y is not None:
        return y
    if qscale is None:
        y = masked_gemv_torch(w_t, v, threshold, mode=mode, scale=scale, bias=bias)
    else:
        y = masked_gemv_int8_torch(w_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias)
    return y.contiguous()


def decode_w8a8_impl(w_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, threshold: torch.Tensor,
                     mode: str, scale: Optional[torch.Tensor], bias: Optional[torch.Tensor], block: int) -> torch.Tensor:
    """rana::decode_w8a8's implementation: int8 weights with int8 activations in blocks of `block` (one CPU token
    through the native W8A8 kernel, else torch_gemv's int8 paths on the quantized inputs)."""
    mode_id(mode)
    check_a8_block(block)
    y = masked_native(w_t, qscale, v, threshold, mode, scale, bias, activations="int8", block=block)
    if y is not None:
        return y
    return masked_gemv_int8_torch(w_t, qscale, v, threshold, mode=mode, scale=scale, bias=bias,
                                  activations="int8", block=block).contiguous()


def _decode_w8a8_grouped_impl(vs: Sequence[torch.Tensor], w_ts: Sequence[torch.Tensor],
                              qscales: Sequence[Optional[torch.Tensor]], thresholds: Sequence[torch.Tensor],
                              mode: str, scales: Sequence[Optional[torch.Tensor]],
                              biases: Sequence[Optional[torch.Tensor]], block: int) -> torch.Tensor:
    mode_id(mode)
    check_a8_block(block)
    y = grouped_native(vs, w_ts, qscales, thresholds, mode, scales, biases, activations="int8", block=block)
    if y is not None:
        return y
    return torch.cat([decode_w8a8_impl(w, q, v, t, mode, s, b, block).reshape(-1)
                      for v, w, q, t, s, b in zip(vs, w_ts, qscales, thresholds, scales, biases)])


def expert_masked_gemv_impl(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                            thresholds: torch.Tensor) -> torch.Tensor:
    """One token through S selected experts: on CPU the native kernel (fp32) else the active-row gather,
    the sync-free product elsewhere."""
    if v.is_cpu and w_t.is_cpu:
        y = expert_masked_gemv_native(w_t, v, idx, thresholds)  # fp32: one native call over the selected experts
        if y is not None:
            return y
        if w_t.is_contiguous():
            return expert_masked_gemv_gather(w_t, v, idx, thresholds).contiguous()
    return expert_masked_gemv_dense(w_t, v, idx, thresholds).contiguous()


# --------------------------------------------------------------------------------------------
# registration
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


def _decode_masked_fake(w_t, qscale, v, threshold, mode, scale, bias):
    return v.new_empty((*v.shape[:-1], w_t.shape[1]))


def _decode_w8a8_fake(w_t, qscale, v, threshold, mode, scale, bias, block):
    return v.new_empty((*v.shape[:-1], w_t.shape[1]))


def _decode_masked_grouped_impl(vs: Sequence[torch.Tensor], w_ts: Sequence[torch.Tensor],
                            qscales: Sequence[Optional[torch.Tensor]], thresholds: Sequence[torch.Tensor], mode: str,
                            scales: Sequence[Optional[torch.Tensor]],
                            biases: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    mode_id(mode)
    y = grouped_native(vs, w_ts, qscales, thresholds, mode, scales, biases)  # one native call for the siblings
    if y is not None:
        return y
    return torch.cat([decode_masked_impl(w, q, v, t, mode, s, b).reshape(-1)
                      for v, w, q, t, s, b in zip(vs, w_ts, qscales, thresholds, scales, biases)])


def _decode_masked_grouped_fake(vs, w_ts, qscales, thresholds, mode, scales, biases):
    return vs[0].new_empty((sum(w.shape[1] for w in w_ts),))


def _decode_w8a8_grouped_fake(vs, w_ts, qscales, thresholds, mode, scales, biases, block):
    return vs[0].new_empty((sum(w.shape[1] for w in w_ts),))


def _wrap(kernel):
    """wrap_triton for a compiled kernel; an interpreted one (TRITON_INTERPRET=1) is launched as it is:
    nothing traces it, and torch 2.11's wrap_triton refuses it (2.13 hands it back unwrapped)."""
    return kernel if interpreting() else torch.library.wrap_triton(kernel)


def _decode_masked_triton_impl(vs: Sequence[torch.Tensor], w_ts: Sequence[torch.Tensor],
                           qscales: Sequence[Optional[torch.Tensor]], thresholds: Sequence[torch.Tensor], mode: str,
                           scales: Sequence[Optional[torch.Tensor]], biases: Sequence[Optional[torch.Tensor]],
                           sparsity_bin: int) -> torch.Tensor:
    return grouped_masked_gemv_triton(list(vs), list(w_ts), list(thresholds), mode, list(scales), list(biases),
                                      sparsity_bin, wrap=_wrap, qscales=list(qscales))


def _dense_gemv_triton_op(vs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor]) -> torch.Tensor:
    return grouped_dense_gemv_triton(list(vs), list(ws), wrap=_wrap)


def _expert_masked_gemv_fake(w_t, v, idx, thresholds):
    return v.new_empty((v.shape[0], w_t.shape[2]))


def _expert_masked_gemv_triton_impl(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                                  thresholds: torch.Tensor) -> torch.Tensor:
    return expert_masked_gemv_triton(w_t, v, idx, thresholds, wrap=_wrap)


_MASKED = "(Tensor w_t, Tensor? qscale, Tensor v, Tensor threshold, str mode, Tensor? scale, Tensor? bias) -> Tensor"
_GROUPED = ("(Tensor[] vs, Tensor[] w_ts, Tensor?[] qscales, Tensor[] thresholds, str mode, Tensor?[] scales, "
            "Tensor?[] biases) -> Tensor")
# name -> (schema, implementation, fake); the triton_ops derive their fakes from the kernels (wrap_triton)
_CUSTOM = {
    "decode_masked": (_MASKED, decode_masked_impl, _decode_masked_fake),
    "decode_masked_grouped": (_GROUPED, _decode_masked_grouped_impl, _decode_masked_grouped_fake),
    "decode_w8a8": (_MASKED.replace(") ->", ", int block) ->"), decode_w8a8_impl, _decode_w8a8_fake),
    "decode_w8a8_grouped": (_GROUPED.replace(") ->", ", int block) ->"), _decode_w8a8_grouped_impl,
                            _decode_w8a8_grouped_fake),
    "expert_masked_gemv": ("(Tensor w_t, Tensor v, Tensor idx, Tensor thresholds) -> Tensor",
                           expert_masked_gemv_impl, _expert_masked_gemv_fake),
}
_TRITON = {
    "decode_masked_triton": _decode_masked_triton_impl,
    "dense_gemv_triton": _dense_gemv_triton_op,
    "expert_masked_gemv_triton": _expert_masked_gemv_triton_impl,
}

# Defined with torch.library's Library rather than custom_op: a compiled CPU decode step calls these ~120 times
# per token, and custom_op's Python wrappers cost ~6 µs more per call (14.6 against ~8.5 µs for a W8A8 projection
# with nothing kept, inference mode, measured here). One implementation serves every device
# (CompositeExplicitAutograd); nothing differentiates through them (the route calls them without gradients).
_LIBRARY = torch.library.Library("rana", "FRAGMENT")
for _name, (_schema, _impl, _fake) in _CUSTOM.items():
    if not _registered(_name):
        _LIBRARY.define(_name + _schema)
        _LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"rana::{_name}", _fake, lib=_LIBRARY)
if HAS_TRITON:
    for _name, _impl in _TRITON.items():
        if not _registered(_name):
            # triton_op: torch.compile traces into the launches (wrap_triton) and derives the fake itself
            torch.library.triton_op(f"rana::{_name}", _impl, mutates_args=())

ALL_OP_NAMES = tuple(f"rana::{name}" for name in (*_CUSTOM, *_TRITON))  # the triton_ops where triton runs
OP_NAMES = tuple(f"rana::{name}" for name in (*_CUSTOM, *(_TRITON if HAS_TRITON else ())))  # registered here
