"""The registered ops' CPU token: native calls bound once per set of operands, not once per call.

Under torch.compile a decode step calls the ops of ops.py with plain tensors (no module, no weight operand that
could keep a bound call), once per projection or sibling group per token. Binding a native call there on every
call (checks, ctypes structs, the threshold read on the host) cost ~100 µs per op, more than the kernel, and
made a compiled CPU step slower than the eager one. Here an op's operands are bound once into a
cpu_gemv.NativeGroup (a sibling group, q/k/v or gate/up, is one native call) and found again by the tensors'
addresses. A binding stays valid while:

- the memory it reads is alive: it holds weak references to the storages of the weights, scales and bias (never
  the tensors: a cache must not keep a freed model's weights; the tensors an op receives are often new views
  made by the traced graph, so it is the storage that lives as long as the module's parameter or buffer), and
  a binding whose storage was freed is never used again (its addresses may hold another tensor by then);
- the values it read at binding (the thresholds, scales or bias converted to fp32) are unchanged: their
  version counters are compared on every call (an in-place update rebinds).

Bindings of freed models are pruned when the table fills up.

Self-contained (torch + its sibling kernel files) so it ships with exported models.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .cpu_gemv import A8_BLOCK_UNRECORDED, NativeCall, NativeGroup

__all__ = ["Binding", "grouped_native", "masked_native", "bindings", "bound_count", "forget_all", "prune"]

_BOUND: dict[tuple, "Binding"] = {}
_STATS = {"binds": 0}
_MAX_BINDINGS = 1 << 14


class Binding:
    """One set of operands bound into a NativeGroup: weak references to the storages its kernel reads, the
    tensors whose values it read at binding (with their versions) and the fp32 copies it made."""

    __slots__ = ("group", "storages", "read", "versions", "copies")

    def __init__(self, group: NativeGroup, storages: list, read: tuple, copies: tuple):
        self.group, self.storages, self.read, self.copies = group, storages, read, copies
        self.versions = tuple(_stamp(t) for t in read)

    def alive(self) -> bool:
        for ref in self.storages:
            if ref.expired():
                return False
        return True

    def current(self) -> bool:
        """Whether the memory it reads is alive and every value it read at binding unchanged."""
        if not self.alive():
            return False
        for t, stamp in zip(self.read, self.versions):
            if not (t._version == stamp if type(stamp) is int else torch.equal(t, stamp)):
                return False
        return True


def _stamp(t: torch.Tensor):
    """What tells a later call whether `t` changed in place: its version counter, or for an inference tensor (which
    has none: buffers of a model loaded under inference_mode) a copy of its values."""
    return t.clone() if t.is_inference() else t._version


def _fp32(t: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    if t is None or (t.dtype is torch.float32 and t.is_contiguous()) or t.numel() != n:
        return t
    return t.reshape(n).float().contiguous()


def _key(w_ts, qscales, thresholds, scales, biases, mode: str, activations: str, block: int) -> tuple:
    """Every address the binding reads (and the weights' layout): equal keys describe the same memory."""
    key = [mode, activations, block]
    none = mode == "none"  # its threshold is not read (traced steps make a new one per call)
    for w, q, t, s, b in zip(w_ts, qscales, thresholds, scales, biases):
        key += (w.data_ptr(), w.shape, w.stride(0), w.dtype, q.data_ptr() if q is not None else 0,
                s.data_ptr() if s is not None else 0, b.data_ptr() if b is not None else 0,
                0 if none else t.data_ptr())
    return tuple(key)


def _bind(key, w_ts, qscales, thresholds, scales, biases, mode: str, activations: str,
          block: int) -> Optional[Binding]:
    """A binding of the projections into one group row (their outputs side by side), or None where the kernel
    cannot serve them (the caller's torch path)."""
    calls, ts, offsets, copies, read, width = [], [], [], [], [], 0
    for w, q, t, s, b in zip(w_ts, qscales, thresholds, scales, biases):
        if not (w.is_cpu and (mode == "none" or t.is_cpu)):
            return None
        K, N = w.shape if w.dim() == 2 else (0, 0)
        q32, s32, b32 = _fp32(q, N), _fp32(s, K), _fp32(b, N)
        copies += [c for c, o in ((q32, q), (s32, s), (b32, b)) if c is not o]
        read += [o for c, o in ((q32, q), (s32, s), (b32, b)) if o is not None and c is not o]
        threshold = -math.inf if mode == "none" else float(t)
        if mode != "none":
            read.append(t)
        call_mode = "none" if threshold == -math.inf and q is not None else mode
        call = NativeCall.bind(w, q32, call_mode, s32, b32, activations=activations, block=block)
        if not call.usable:
            return None
        calls.append(call)
        ts.append(threshold)
        offsets.append(width)
        width += N
    group = NativeGroup.bind(calls, ts, offsets, width, keep_calls=False)
    if group is None:
        return None
    storages = {}  # by storage: q/k/v slices of one fused weight share one
    for t in (*w_ts, *qscales, *scales, *biases):
        if t is not None:
            ref = StorageWeakRef(t.untyped_storage())
            storages.setdefault(ref.cdata, ref)
    binding = Binding(group, list(storages.values()), tuple(read), tuple(copies))
    _STATS["binds"] += 1
    if len(_BOUND) >= _MAX_BINDINGS:
        prune()
    _BOUND[key] = binding
    return binding


def prune() -> int:
    """Drop the bindings whose memory was freed (a deleted model's); if the table is still full, all of them.
    Returns the bindings left."""
    for key in [k for k, b in _BOUND.items() if not b.alive()]:
        del _BOUND[key]
    if len(_BOUND) >= _MAX_BINDINGS:
        _BOUND.clear()
    return len(_BOUND)


def grouped_native(vs: Sequence[torch.Tensor], w_ts, qscales, thresholds, mode: str, scales, biases,
                   activations: str = "float", block: int = A8_BLOCK_UNRECORDED) -> Optional[torch.Tensor]:
    """Every projection's masked GEMV of one CPU token `vs[0]` (the siblings read one input), concatenated
    (1-D, in the token's dtype), in one native call; None where it cannot run (several tokens, gradients, other
    devices or formats, members with their own inputs): the caller's path. (Runs per op per token: its checks
    are spelled out: ~8 µs in all besides the kernel.)"""
    v = vs[0]
    if v.numel() != v.shape[-1] or not v.is_cpu:
        return None
    for u in vs[1:]:
        if not (u is v or u.data_ptr() == v.data_ptr() or (u.shape == v.shape and torch.equal(u, v))):
            return None  # the members' own inputs (inductor may hand each its own buffer of one token's values)
    if torch.is_grad_enabled() and (v.requires_grad or any(w.requires_grad for w in w_ts)):
        return None
    key = _key(w_ts, qscales, thresholds, scales, biases, mode, activations, block)
    binding = _BOUND.get(key)
    if binding is not None and not binding.current():
        binding = None  # a value read at binding changed in place: bind again
    if binding is None:
        binding = _bind(key, w_ts, qscales, thresholds, scales, biases, mode, activations, block)
        if binding is None:
            return None
    group = binding.group
    if group.K != v.shape[-1]:
        return None
    x = v if v.dtype is torch.float32 and v.is_contiguous() else v.float().contiguous()
    y = torch.empty(group.width, dtype=torch.float32)
    if not group.run(x.data_ptr(), y.data_ptr(), torch.get_num_threads()):
        return None
    return y if v.dtype is torch.float32 else y.to(v.dtype)


def masked_native(w_t, qscale, v, threshold, mode: str, scale, bias, activations: str = "float",
                  block: int = A8_BLOCK_UNRECORDED):
    """One projection's one CPU token through its kept binding: v.shape[:-1] + (N,), or None (the caller's path)."""
    y = grouped_native((v,), (w_t,), (qscale,), (threshold,), mode, (scale,), (bias,), activations, block)
    return None if y is None else y.view(*v.shape[:-1], y.shape[0])


def bindings() -> list[Binding]:
    """The bindings kept now (tests: what a call bound, and whether it is still current)."""
    return list(_BOUND.values())


def bound_count() -> int:
    """Bindings made in this process (tests: a compiled step binds each projection once, not per token)."""
    return _STATS["binds"]


def forget_all() -> None:
    _BOUND.clear()
