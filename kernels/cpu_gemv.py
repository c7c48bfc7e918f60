"""Native CPU masked GEMV for batch-1 decoding: one C call per projection.

Why native: a masked product written as torch ops costs several ops per projection (score,
compare, nonzero, gather, product), microseconds each, and ``embedding_bag`` streams scattered
rows from memory at about 60 % of the dense GEMV's bandwidth (benchmarks/results/kernels_cpu.md).
At batch 1 a decoder is memory bound, so the masked product only pays off if it reads the
active rows as fast as BLAS reads the whole matrix. The kernel scores the inputs, compares them
with the threshold and accumulates the active rows of ``w_t`` four at a time, prefetching
the rows ahead (short scattered rows are latency bound), in one call.

One calling convention: a projection's operands (its weights in either format, their scales, the column
norms, the bias, the mask mode) are bound once into a C struct (:class:`NativeCall`), kept by the weight
operand its module holds (rana.kernels.weights), and a token passes only itself, its threshold, the output
and the thread count. Unbound callers (the registered ops, tests) bind for one call (:func:`native_masked`).

The C source is ``cpu_gemv.c`` beside this file (with ``rana_modes.h``, the mask-mode ids of modes.py,
inlined: :func:`source`), compiled once per machine with the system C compiler (``$CC``, else
``cc``; ``-O3 -march=native -fopenmp``, without OpenMP if that fails; a fraction of a second;
the OpenMP runtime is torch's own libgomp when torch is loaded first) into a private per-user cache
(``$RANA_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/rana/kernels``, else ``~/.cache/rana/kernels``;
created 0700) and loaded with ctypes. A library is loaded only from a folder no one else can write
(owned by this user, not group/world writable, in parents others cannot change) and only when its
sha256 matches the one recorded beside it at build time (``NAME.so.sha256``); otherwise it is
rebuilt, and an unsafe cache folder is not used at all. An unwritable cache: the library is built
in a private temporary folder for this process. No compiler, a failed build, an unsafe cache or
``RANA_NATIVE_CPU=0``: :func:`native_kernel` returns None (:func:`native_status` says why) and
callers use their torch path.

Semantics are those of torch_gemv.py: fp32 scores ``v*v``, ``|v|*scale`` or ``|v|`` compared ``>= t``
exactly as torch does, fp32 accumulation.

float weights: when more than ``limit`` inputs are active the kernel does not multiply: it writes the masked
input to ``xm`` and the caller runs the dense GEMV on it (BLAS wins when nearly everything is active).

int8 weights: the same scan, then the active int8 rows (a quarter of an fp32 row's bytes) converted to fp32
in the inner loop (AVX-512 / AVX2 intrinsics where the build targets them, plain C elsewhere;
:func:`native_status` says which) and accumulated in fp32, the per-output-channel scale applied once per
column at the end: ``y = qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)``. There is no int8 BLAS to fall back to, so it
always multiplies; with everything active it is the dense int8 GEMV.

int8 weights with int8 activations (W8A8, ``activations="int8"``): the kept inputs quantized per token in blocks
of ``block`` input positions (1 to A8_BLOCK_MAX, a setting of the int8 folder; one fp32 scale each, symmetric,
round half to even: :func:`torch_gemv.quantize_activations` is the same in torch) and multiplied int8 × int8 with
int32 sums: AVX-512 VNNI, AVX2 or portable C, the widest this CPU runs (:func:`a8_isa`; ``RANA_CPU_ISA=avx2|scalar``
forces a narrower one).

This file is self-contained (torch + stdlib + modes.py) so it can be copied next to an exported model,
where the C source is inlined (`SHIPPED_SOURCE`: remote code ships .py files only).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from .modes import HEADER_NAME, MODE_IDS, c_header

__all__ = ["NativeCall", "NativeGroup", "native_masked", "a8_isa", "A8_ISAS", "ACTIVATIONS", "A8_BLOCK_MAX",
           "A8_BLOCK_UNRECORDED", "check_a8_block", "expert_masked_gemv_native",
           "native_kernel", "native_status", "native_limit", "dense_streak", "reset_dense_streaks", "source", "library_name", "build_variant",
           "Library", "BUILD_FLAGS", "BUILD_ATTEMPTS", "DENSE_STREAK"]

_ABS_SCALED = MODE_IDS["abs_scaled"]

# Dense BLAS beats the native kernel once more than this fraction of the inputs is active. Set
# from timings inside real decoding (SmolLM2, fp32, benchmarks/results/decode_cpu*.md), where
# the gather compares better than in isolated kernel timings: at one thread a 576x192 projection
# 77 % active took 39 us gathered vs 52 us on the dense branch (41 us for the dense model).
# The kernel splits the columns over torch's thread count as the BLAS GEMV does, but its fixed
# costs weigh more against the faster multi-threaded GEMV, so the crossover comes earlier there.
NATIVE_MAX_FRACTION = 0.9
NATIVE_MAX_FRACTION_THREADED = 0.75

C_FILE = Path(__file__).with_name("cpu_gemv.c")
# An export inlines the C source here (what `source()` returns): transformers copies only the .py files of
# remote code.
SHIPPED_SOURCE: str | None = None  # rana:shipped-c-source


@functools.lru_cache(maxsize=1)
def source() -> str:
    """The C unit that is compiled: cpu_gemv.c with its `#include "rana_modes.h"` replaced by the header that
    modes.py makes (so the ids compiled are always the table's), or the source an export inlined."""
    if SHIPPED_SOURCE is not None:
        return SHIPPED_SOURCE
    text = C_FILE.read_text(encoding="utf-8")
    include = f'#include "{HEADER_NAME}"\n'
    if text.count(include) != 1:
        raise RuntimeError(f"{C_FILE.name} must include {HEADER_NAME} exactly once")
    return text.replace(include, c_header())


# --------------------------------------------------------------------------------------------
# the library's entry points
# --------------------------------------------------------------------------------------------
class Library(NamedTuple):
    """The compiled library's entry points (ctypes functions)."""
    masked_f32: object  # rana_masked_gemv_f32(operands, x, t, y, limit, xm, threads) -> kept count, -1: no scratch
    masked_i8: object  # rana_masked_gemv_i8(operands, x, t, y, threads) -> kept count, -1: no scratch
    expert: object  # rana_expert_masked_gemv(w, x, experts, t, S, K, N, lde, ldw, ldx, y, threads) -> 0 / -1
    lanes: int  # the int8 inner loop's vector width (rana_i8_lanes)
    masked_a8: object = None  # rana_masked_gemv_a8(operands, x, t, y, threads): int8 activations; as masked_i8
    a8_best: int = 0  # the widest W8A8 loop this CPU runs (rana_a8_isa_best: an index of A8_ISAS)
    masked_group: object = None  # rana_masked_gemv_group(group, x, y, threads): sibling projections, one call


# The W8A8 inner loops, by the C source's RANA_ISA_* id; the activation formats an int8 weight decodes with.
A8_ISAS = ("scalar", "avx2", "avx512_vnni")
ACTIVATIONS = ("float", "int8")
# int8 activations are quantized per block of this many input positions at most (cpu_gemv.c RANA_A8_BLOCK_MAX; the
# issue's format: llama.cpp's Q8_0 takes 32); an int8 folder written before the block was a setting used 64
A8_BLOCK_MAX = 64
A8_BLOCK_UNRECORDED = 64


def check_a8_block(block) -> int:
    """`block` as an int8-activation block size (1..A8_BLOCK_MAX), else ValueError."""
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= A8_BLOCK_MAX:
        raise ValueError(f"an int8 activation block holds 1 to {A8_BLOCK_MAX} inputs, got {block!r}")
    return block


def a8_isa(library: "Library | None" = None) -> int:
    """The W8A8 loop to bind (an index of A8_ISAS): the widest the CPU runs, or the narrower one ``RANA_CPU_ISA``
    names (read on each bind: tests force each loop)."""
    lib = library if library is not None else _load()[0]
    best = lib.a8_best if lib is not None else 0
    wanted = os.environ.get("RANA_CPU_ISA", "").strip().lower()
    return min(best, A8_ISAS.index(wanted)) if wanted in A8_ISAS else best


def _bind_entries(lib: ctypes.CDLL) -> Library:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    f = lib.rana_masked_gemv_f32
    f.argtypes, f.restype = [p, p, f32, p, i64, p, i32], i64
    i8 = lib.rana_masked_gemv_i8
    i8.argtypes, i8.restype = [p, p, f32, p, i32], i64
    expert = lib.rana_expert_masked_gemv
    expert.argtypes, expert.restype = [p, p, p, p, i64, i64, i64, i64, i64, i64, p, i32], i64
    a8 = lib.rana_masked_gemv_a8
    a8.argtypes, a8.restype = [p, p, f32, p, i32], i64
    group = lib.rana_masked_gemv_group
    group.argtypes, group.restype = [p, p, p, i32], i64
    return Library(f, i8, expert, int(lib.rana_i8_lanes()), a8, int(lib.rana_a8_isa_best()), group)


class _Operands(ctypes.Structure):  # rana_operands in cpu_gemv.c
    _fields_ = [("w", ctypes.c_void_p), ("qscale", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("ldw", ctypes.c_int64),
                ("mode", ctypes.c_int64), ("isa", ctypes.c_int64), ("block", ctypes.c_int64)]


# --------------------------------------------------------------------------------------------
# one projection's call
# --------------------------------------------------------------------------------------------
def _unpickled_none():
    return None


class NativeCall:
    """One projection's native decode call with its operands bound once: the weights (float ``w_t`` or int8
    ``q_t``, both (K, N) with unit stride along N), the int8 scales, the column norms, the bias, the mask mode.
    A token then pays only for its own checks.

    :meth:`bind` always gives one; where the operands do not suit the kernel (no native library, other
    dtypes or layouts) calling it returns None, so an unsuitable weight is not re-examined every token.
    :meth:`binds` says whether it still describes a weight's tensors, by identity (a replaced tensor is a new
    binding); `ptr` is the weights' address it bound, which its owner (weights.Weight.native) compares with the
    weights' current storage (an in-place ``.data`` swap moves it; an in-place copy keeps it). It holds its
    tensors, so a bound address is never stale. Deepcopy and pickle give None: a copy binds its own tensors.
    """

    __slots__ = ("tensors", "mode", "K", "N", "int8", "ptr", "activations", "block", "_fn", "_operands", "_address",
                 "_weight")

    def __init__(self, tensors: tuple, mode: str, K: int = 0, N: int = 0, fn=None, operands=None,
                 activations: str = "float", block: int = A8_BLOCK_UNRECORDED):
        self.tensors, self.mode, self.K, self.N, self.activations = tensors, mode, K, N, activations
        self.block = block
        self.int8 = tensors[1] is not None
        self.ptr = tensors[0].data_ptr() if tensors[0].device.type != "meta" else 0
        self._fn, self._operands = fn, operands
        self._address = ctypes.addressof(operands) if operands is not None else 0
        # float weights: the nn.Linear-layout view (N, K) the dense branch multiplies with
        self._weight = tensors[0].t() if operands is not None and not self.int8 else None

    @classmethod
    def bind(cls, w_t: torch.Tensor, qscale: torch.Tensor | None, mode: str, scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, library: Library | None = None, activations: str = "float",
             isa: int | None = None, block: int = A8_BLOCK_UNRECORDED) -> "NativeCall":
        """`w_t` (K, N): float32 weights, or int8 codes with their fp32 per-output-channel `qscale` (N,).
        `library`: the entry points to call (a variant build, :func:`build_variant`); default the loaded one.
        `activations` "int8" (int8 weights only): the W8A8 kernel, with the inner loop `isa` (an index of A8_ISAS;
        default :func:`a8_isa`) and the tokens quantized per `block` inputs (1..A8_BLOCK_MAX, else ValueError)."""
        tensors = (w_t, qscale, scale, bias)
        if activations == "int8":
            check_a8_block(block)
        unusable = cls(tensors, mode, activations=activations, block=block)
        lib = library if library is not None else _load()[0]
        if activations not in ACTIVATIONS or (activations == "int8" and qscale is None):
            return unusable
        mode_id = MODE_IDS.get(mode)
        if lib is None or mode_id is None or w_t.dim() != 2 or not w_t.is_cpu:
            return unusable
        K, N = w_t.shape
        int8 = qscale is not None
        if w_t.dtype is not (torch.int8 if int8 else torch.float32) or K == 0 or N == 0 or w_t.stride(1) != 1:
            return unusable
        if (int8 and qscale.numel() != N) or (bias is not None and bias.numel() != N):
            return unusable
        if mode_id == _ABS_SCALED and (scale is None or scale.numel() != K):
            return unusable
        used = (qscale, scale if mode_id == _ABS_SCALED else None, bias)
        if any(t is not None and (t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous()) for t in used):
            return unusable  # a bf16 / fp16 bias or scale: native_masked converts it for one call
        operands = _Operands(w_t.data_ptr(), None if qscale is None else qscale.data_ptr(),
                             None if used[1] is None else used[1].data_ptr(),
                             None if bias is None else bias.data_ptr(), K, N, w_t.stride(0) if K > 1 else N,
                             mode_id, 0, block)
        if activations == "int8":
            operands.isa = min(a8_isa(lib) if isa is None else isa, lib.a8_best)
            return cls(tensors, mode, K, N, lib.masked_a8, operands, activations, block)
        return cls(tensors, mode, K, N, lib.masked_i8 if int8 else lib.masked_f32, operands)

    def binds(self, w_t, qscale, mode: str, scale=None, bias=None) -> bool:
        t = self.tensors
        return t[0] is w_t and t[1] is qscale and t[2] is scale and t[3] is bias and self.mode == mode

    @property
    def usable(self) -> bool:
        return self._fn is not None

    @property
    def operands_address(self) -> int:
        """The address of the bound rana_operands struct (0 when unusable): what a C entry point takes."""
        return self._address

    def __call__(self, v: torch.Tensor, threshold: float, limit: int | None = None) -> torch.Tensor | None:
        """The masked GEMV of one fp32 CPU token at `threshold` (a Python float), shape
        ``(1,) * (v.dim() - 1) + (N,)``, or None (unusable operands, another dtype or layout, gradients wanted
        for v: the caller's other path). The caller checks torch.compile and the weights' gradients first.
        float weights: above `limit` kept inputs (default :func:`native_limit` for torch's thread count) the
        dense BLAS GEMV on the masked input runs instead."""
        if self._fn is None or v.dtype is not torch.float32 or v.numel() != self.K or not v.is_contiguous() \
                or not v.is_cpu or (v.requires_grad and torch.is_grad_enabled()):
            return None
        if self.int8:
            y = torch.empty(_out_shape(v.dim(), self.N), dtype=torch.float32)
            if self._fn(self._address, v.data_ptr(), threshold, y.data_ptr(), torch.get_num_threads()) < 0:
                return None  # the index scratch could not be grown
            return y
        return self._float(v, threshold, limit)

    def _float(self, v: torch.Tensor, threshold: float, limit: int | None) -> torch.Tensor | None:
        weight, bias = self._weight, self.tensors[3]
        key = (self.ptr, threshold)  # the threshold too: a sweep moves it in place
        if self.mode == "abs" and limit is None:
            if threshold <= 0:  # |v| >= t holds for every input: the plain dense product
                return torch.nn.functional.linear(v, weight, bias)
            streak = _DENSE_STREAKS.get(key, 0)
            if streak > 0:
                # |v| >= t masking and this weight's last scan found it mostly active: take the dense branch
                # without scanning, masking with one fused op (|v| > the float below t  <=>  |v| >= t in
                # fp32). Plain differentiable torch ops.
                _DENSE_STREAKS[key] = streak - 1
                return torch.nn.functional.linear(torch.nn.functional.hardshrink(v, _float_below(threshold)),
                                                  weight, bias)
        threads = torch.get_num_threads()
        if limit is None:
            limit = native_limit(self.K, threads)
        y = torch.empty(_out_shape(v.dim(), self.N), dtype=torch.float32)
        xm = _scratch_input(v.shape)
        n = self._fn(self._address, v.data_ptr(), threshold, y.data_ptr(), limit, xm.data_ptr(), threads)
        if n < 0:
            return None  # the index scratch could not be grown
        if len(_DENSE_STREAKS) > _STREAK_ENTRIES:  # bounded: thresholds may be swept in one process
            _DENSE_STREAKS.clear()
        if n > limit:  # mostly active: the dense BLAS GEMV on the masked input is faster
            _DENSE_STREAKS[key] = DENSE_STREAK
            return torch.nn.functional.linear(xm, weight, bias)
        _DENSE_STREAKS[key] = 0
        return y

    def __reduce__(self):  # ctypes operands point into this process's tensors: a copy rebinds
        return _unpickled_none, ()


class _Group(ctypes.Structure):  # rana_group in cpu_gemv.c
    _fields_ = [("ops", ctypes.c_void_p), ("t", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("format", ctypes.c_void_p), ("P", ctypes.c_int64)]


_GROUP_FORMATS = {("float", False): 0, ("float", True): 1, ("int8", True): 2}  # (activations, int8) -> RANA_GROUP_*


class NativeGroup:
    """Sibling projections that read one fp32 CPU token (q/k/v, gate/up, a serving engine's fused layer), bound
    once with their thresholds: one native call writes each projection's masked GEMV into its columns of one
    output row. Float weights always take the kernel (no dense-BLAS branch, so a token's result does not depend
    on earlier tokens). The thresholds are read once, here: bind again when they change."""

    __slots__ = ("calls", "width", "K", "_fn", "_arrays", "_group", "_address")

    def __init__(self, calls, width: int, K: int, fn, arrays, group):
        self.calls, self.width, self.K, self._fn, self._arrays, self._group = calls, width, K, fn, arrays, group
        self._address = ctypes.addressof(group)

    @classmethod
    def bind(cls, calls, thresholds, offsets, width: int, library: Library | None = None,
             keep_calls: bool = True) -> "NativeGroup | None":
        """`calls`: usable NativeCalls over one input width K; `thresholds`: a float each (-inf: mode "none");
        `offsets`: where each one's N outputs start in a row of `width`. None where the library or a call cannot
        serve the group (the caller keeps its per-projection path). `keep_calls=False`: the group does not hold
        the calls (nor so their tensors): its owner drops it before any of those tensors is freed (op_native)."""
        lib = library if library is not None else _load()[0]
        if lib is None or lib.masked_group is None or not calls or not all(c.usable for c in calls):
            return None
        if len({c.K for c in calls}) != 1 or any(o < 0 or o + c.N > width for c, o in zip(calls, offsets)):
            return None
        spans = sorted((int(o), int(o) + c.N) for c, o in zip(calls, offsets))
        if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
            return None  # overlapping columns
        P = len(calls)
        ops = (_Operands * P)()
        for i, c in enumerate(calls):
            ops[i] = c._operands  # copied by value: the group reads its own array
        t = (ctypes.c_float * P)(*[float(x) for x in thresholds])
        off = (ctypes.c_int64 * P)(*[int(o) for o in offsets])
        fmt = (ctypes.c_int64 * P)(*[_GROUP_FORMATS[(c.activations, c.int8)] for c in calls])
        group = _Group(ctypes.addressof(ops), ctypes.addressof(t), ctypes.addressof(off), ctypes.addressof(fmt), P)
        return cls(tuple(calls) if keep_calls else (), width, calls[0].K, lib.masked_group, (ops, t, off, fmt), group)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Write the group's outputs for the fp32 contiguous CPU token `x` (K values) into `y` (fp32 contiguous,
        `width` values); False (y not to be used) where a scratch buffer could not be grown."""
        return self.run(x.data_ptr(), y.data_ptr(), torch.get_num_threads())

    def run(self, x: int, y: int, threads: int) -> bool:
        """`__call__` on raw addresses, for a caller that has checked the tensors and reads the thread count
        once per layer (a serving engine's op, ~120 calls per decode step)."""
        return self._fn(self._address, x, y, threads) >= 0

    def __reduce__(self):  # bound to this process's addresses: a copy rebinds
        return _unpickled_none, ()


def native_masked(w_t: torch.Tensor, qscale: torch.Tensor | None, v: torch.Tensor, threshold: float, mode: str,
                  scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  limit: int | None = None, activations: str = "float",
                  block: int = A8_BLOCK_UNRECORDED) -> torch.Tensor | None:
    """One CPU token through the native kernel, its operands bound for this call only (the registered ops,
    tests): ``(m ⊙ v) @ w_t (+ bias)`` for float32 ``w_t``, ``qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)`` for int8
    codes (``activations="int8"``: the W8A8 kernel, tokens quantized per `block` inputs). int8 weights take any float token and scales (converted to
    fp32; the output in v's dtype); float
    weights take fp32 only. ``threshold`` a Python float. None where the kernel is unavailable or the
    operands do not suit it (see :class:`NativeCall`; also gradients wanted, under torch.compile): the
    caller's torch path."""
    if torch.compiler.is_compiling():
        return None  # torch.compile cannot trace through the C call
    if torch.is_grad_enabled() and (v.requires_grad or w_t.requires_grad):
        return None  # invisible to autograd: differentiable callers take the torch path
    if qscale is None:
        return NativeCall.bind(w_t, None, mode, scale, bias)(v, threshold, limit)
    if w_t.dim() != 2 or v.numel() != w_t.shape[0] or not v.is_floating_point():
        return None
    # int8 weights: the token, scales and bias in fp32 for this call (the output back in v's dtype)
    K, N = w_t.shape
    x = v if v.dtype is torch.float32 and v.is_contiguous() else v.float().contiguous()
    y = NativeCall.bind(w_t, _fp32(qscale, N), mode, _fp32(scale, K), _fp32(bias, N),
                        activations=activations, block=block)(x, threshold)
    return y if y is None or v.dtype is torch.float32 else y.to(v.dtype)


def _fp32(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """`t` as n contiguous fp32 values (t itself when it is; t unchanged when it does not hold n: bind declines)."""
    if t is None or (t.dtype is torch.float32 and t.is_contiguous()) or t.numel() != n:
        return t
    return t.reshape(n).float().contiguous()


# (weight address, threshold) -> tokens left on the dense branch before the next scan (float weights, mode
# "abs"). A prediction only: a wrong or stale entry costs time for at most DENSE_STREAK tokens, never
# correctness, since both branches compute the same masked product.
_DENSE_STREAKS: dict[tuple[int, float], int] = {}
DENSE_STREAK = 8
_STREAK_ENTRIES = 1 << 16


def dense_streak(weight: torch.Tensor, threshold: float) -> int:
    """Tokens `weight` (its storage: the nn.Linear weight or its w_t view) at `threshold` will still take the
    dense branch before its next scan (0: the next call scans)."""
    return _DENSE_STREAKS.get((weight.data_ptr(), threshold), 0)


def reset_dense_streaks() -> None:
    """Forget every prediction: the next call for each weight scans its input."""
    _DENSE_STREAKS.clear()


@functools.lru_cache(maxsize=4096)
def _float_below(t: float) -> float:
    """The largest float32 below the (positive, float32) t: hardshrink keeps |v| > it, i.e. |v| >= t."""
    bits = struct.unpack("<I", struct.pack("<f", t))[0]
    return struct.unpack("<f", struct.pack("<I", bits - 1))[0]


@functools.lru_cache(maxsize=64)
def _out_shape(dim: int, N: int) -> tuple[int, ...]:
    return (1,) * (dim - 1) + (N,)


def native_limit(K: int, threads: int = 1) -> int:
    """Most active inputs (of K) for which the native kernel beats the dense GEMV (float weights)."""
    return int((NATIVE_MAX_FRACTION if threads <= 1 else NATIVE_MAX_FRACTION_THREADED) * K)


_scratch = threading.local()  # per thread: buffers the masked input is written to


def _scratch_input(shape: torch.Size) -> torch.Tensor:
    """A per-thread fp32 buffer of v's shape: the masked input for the dense branch. Shaped like v so the
    dense GEMV returns the output shape directly."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(shape)
    if buf is None:
        buf = buffers[shape] = torch.empty(shape, dtype=torch.float32)
    return buf


# --------------------------------------------------------------------------------------------
# a mixture of experts' one token
# --------------------------------------------------------------------------------------------
def expert_masked_gemv_native(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                              thresholds: torch.Tensor) -> torch.Tensor | None:
    """A mixture of experts' one token on CPU, fp32, as one native call: ``y[s] = (m_s ⊙ v[s]) @
    w_t[idx[s]]`` with ``m_s = |v[s]| >= thresholds[idx[s]]``, reading only the selected experts' kept
    rows. ``w_t`` the stacked (E, K, N) weights with unit stride along N, ``v`` (S, K) with unit stride
    along K (an expanded token, stride 0 between slots, is fine), ``idx`` (S,) expert indices,
    ``thresholds`` (E,) fp32. Returns (S, N) fp32, or None where the kernel is unavailable or the inputs
    do not suit it (other dtypes or layouts, gradients wanted, under torch.compile): the caller's torch path."""
    lib = _load()[0]
    if lib is None:
        return None
    if (w_t.dtype is not torch.float32 or v.dtype is not torch.float32 or w_t.dim() != 3 or v.dim() != 2
            or not (w_t.is_cpu and v.is_cpu) or w_t.stride(2) != 1 or v.stride(1) != 1
            or v.shape[1] != w_t.shape[1] or idx.dim() != 1 or idx.shape[0] != v.shape[0]):
        return None
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (w_t.requires_grad or v.requires_grad)):
        return None
    E, K, N = w_t.shape
    experts = idx.to(torch.int64).contiguous()
    t = thresholds.to(torch.float32).contiguous()
    y = torch.empty((v.shape[0], N), dtype=torch.float32)
    if lib.expert(w_t.data_ptr(), v.data_ptr(), experts.data_ptr(), t.data_ptr(), v.shape[0], K, N, w_t.stride(0),
                  w_t.stride(1), v.stride(0), y.data_ptr(), torch.get_num_threads()) < 0:
        return None
    return y


# --------------------------------------------------------------------------------------------
# build, cache, load
# --------------------------------------------------------------------------------------------
BUILD_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
OPENMP_FLAG = "-fopenmp"
# tried in order: with OpenMP, then without it when the compiler cannot link OpenMP (single-threaded kernel)
BUILD_ATTEMPTS = ((*BUILD_FLAGS, OPENMP_FLAG), BUILD_FLAGS)


# the int8 inner loop the build picked (rana_i8_lanes): intrinsics where the target has them
_I8_LOOPS = {16: "AVX-512", 8: "AVX2", 1: "scalar"}


class _UnsafeCache(Exception):
    """The cache folder could be written by someone else: nothing in it may be loaded."""


def _cache_dir() -> Path:
    env = os.environ.get("RANA_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rana" / "kernels"


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _check_private(folder: Path) -> None:
    """Raise _UnsafeCache unless `folder` is a real folder of this user that no one else can write,
    below folders no one else can swap (others may write a parent only if it is sticky, like /tmp)."""
    uid = _uid()
    if uid is None:
        return  # no POSIX ownership to check (the native build is POSIX-only anyway)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise _UnsafeCache(f"kernel cache '{folder}' is not a folder")
    if st.st_uid != uid:
        raise _UnsafeCache(f"kernel cache '{folder}' is owned by uid {st.st_uid}, not you (uid {uid})")
    if st.st_mode & 0o022:
        raise _UnsafeCache(f"kernel cache '{folder}' is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                           "chmod 700 it")
    for parent in folder.parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid) or (pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX):
            raise _UnsafeCache(f"kernel cache '{folder}' lies in '{parent}', which others can change "
                               f"(owner uid {pst.st_uid}, mode {stat.S_IMODE(pst.st_mode):o})")


def _private_cache() -> Path:
    """The per-user cache folder, created 0700; _UnsafeCache if others could plant a library there,
    OSError if it cannot be created."""
    folder = Path(os.path.abspath(_cache_dir()))
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = Path(os.path.realpath(folder))  # check (and use) the folder a symlinked cache really is
    _check_private(folder)
    return folder


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(lib: Path) -> bool:
    """The cached library is a plain file of this user whose sha256 is the one recorded when it was built."""
    record = lib.with_name(lib.name + ".sha256")
    try:
        for p in (lib, record):
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or (_uid() is not None and st.st_uid != _uid()) or st.st_mode & 0o022:
                return False
        return record.read_text().strip() == _sha256(lib)
    except OSError:
        return False


def _build(compiler: str, flags: tuple[str, ...], folder: Path, name: str) -> Path:
    """Compile into a fresh private temp folder inside `folder`; return the library's path there,
    with its sha256 recorded beside it (`NAME.sha256`)."""
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
    try:
        src = tmp / "rana_cpu_gemv.c"
        src.write_text(source())
        subprocess.run([compiler, *flags, "-o", str(tmp / name), str(src)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        (tmp / (name + ".sha256")).write_text(_sha256(tmp / name) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp / name


def build_variant(compiler: str, flags: tuple[str, ...], folder: Path) -> Library:
    """Compile the C source with `flags` into `folder` (never the cache) and load it: for checking the source's
    alternative inner loops (e.g. a build without AVX-512) on this machine (`NativeCall.bind(..., library=)`)."""
    return _bind_entries(ctypes.CDLL(str(_build(compiler, flags, Path(folder), "rana_cpu_gemv_variant.so"))))


def library_name(compiler: str, flags: tuple[str, ...]) -> str:
    """The cached library's file name: a hash of everything the build depends on."""
    key = hashlib.sha256("\0".join([source(), compiler, *flags, platform.machine(), platform.node()]).encode())
    return f"rana_cpu_gemv_{key.hexdigest()[:16]}.so"


def _compile(compiler: str, flags: tuple[str, ...]) -> tuple[ctypes.CDLL, str]:
    """(the loaded library, a note) built with `flags`: from the private cache when its recorded hash
    matches, else compiled there (atomically: temp folder + rename of the library and its hash).

    Compiler errors propagate (the caller reports them). An unusable cache raises _UnsafeCache;
    an unwritable one falls back to a private temporary folder, removed once the library is loaded."""
    name = library_name(compiler, flags)
    try:
        folder = _private_cache()
    except OSError:
        folder = None
    if folder is None:  # read-only home etc.: a private folder for this process only
        scratch = Path(tempfile.mkdtemp(prefix="rana-kernel-"))
        try:
            return ctypes.CDLL(str(_build(compiler, flags, scratch, name))), " (built in a private temp folder)"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    target = folder / name
    note = ""
    if target.exists() or target.is_symlink():
        if _verified(target):
            return ctypes.CDLL(str(target)), ""
        note = " (rebuilt: the cached library failed its hash check)"  # never loaded: replaced below
    built = _build(compiler, flags, folder, name)
    try:
        lib = ctypes.CDLL(str(built))  # what this process just compiled, before anyone can swap it
        os.replace(built, target)
        os.replace(built.with_name(name + ".sha256"), target.with_name(name + ".sha256"))
    finally:
        shutil.rmtree(built.parent, ignore_errors=True)
    return lib, note


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Library | None, str]:
    """(the library's entry points or None, a one-line status)."""
    if os.environ.get("RANA_NATIVE_CPU", "1") == "0":
        return None, "torch fallback (native kernel disabled: RANA_NATIVE_CPU=0)"
    requested = os.environ.get("CC")
    compiler = shutil.which(requested) if requested else (shutil.which("cc") or shutil.which("gcc")
                                                          or shutil.which("clang"))
    if not compiler:
        return None, (f"torch fallback (native kernel build failed: C compiler {requested!r} not found)" if requested
                      else "torch fallback (no C compiler found; set CC)")
    error = ""
    for flags in BUILD_ATTEMPTS:
        try:
            lib, note = _compile(compiler, flags)
        except _UnsafeCache as exc:
            return None, f"torch fallback (not loading the native kernel: {exc}; or set RANA_KERNEL_CACHE)"
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
            error = f"{type(exc).__name__}: {detail[0] if detail else exc}"
            continue
        entries = _bind_entries(lib)
        threading_note = "OpenMP" if OPENMP_FLAG in flags else "single-threaded"
        int8_note = _I8_LOOPS.get(entries.lanes, "scalar")
        return entries, (f"native ({os.path.basename(compiler)} {' '.join(flags[:2])}, {threading_note}, "
                         f"int8 rows {int8_note}, int8 x int8 {A8_ISAS[entries.a8_best]}){note}")
    return None, f"torch fallback (native kernel build failed: {error[:200]})"


def native_kernel() -> Library | None:
    """The compiled library's entry points, or None when it cannot be built here."""
    return _load()[0]


def native_status() -> str:
    """How the CPU masked GEMV runs on this machine, in words (for benchmarks and logs)."""
    return _load()[1]


