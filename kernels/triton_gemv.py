"""Triton masked GEMV for batch-1 decoding: one launch for up to three projections.

    out_g = (m_g ⊙ v_g) @ w_t_g (+ bias_g),   m_g from v_g and the 0-dim fp32 threshold t_g,
    for g < G ≤ 3, returned concatenated along the last dim (q | k | v, gate | up, or one projection).

``w_t_g`` is (K_g, N_g) row-major (column k of the nn.Linear weight is the contiguous row k), so an
inactive input skips one contiguous row; the mask is applied on the load, so an inactive row costs
no memory traffic. Modes: "square" (v² ≥ t, RaNA's rank code), "abs_scaled" (|v|·scale ≥ t, neuron
thresholding), "abs" (|v| ≥ t, TEAL), "none" (everything active: the rank adapters' dense `B x`).
Scores, comparisons and accumulation are fp32; the output has v's dtype. Nothing here reads a
tensor value on the host.

Why the kernel looks like this (a batch-1 GEMV only has to stream the kept rows at full bandwidth):

* **Per-thread accumulation.** Each program keeps a [BLOCK_K, BLOCK_N] fp32 accumulator in
  registers and reduces it across K once, after the loop. A reduction inside the loop costs a
  cross-warp barrier round trip per step, which makes the loop latency-bound whatever the sparsity.
* **Loads pipelined in registers.** While step i's weights are multiplied, step i+1's kept rows
  (their mask already computed) and step i+2's inputs are loading. Triton's own ``tl.range``
  pipelining would stage the tiles through shared memory with ``cp.async``, which costs two
  barriers per step; register double-buffering needs none, and a predicated-off load reads
  nothing, so the bytes in flight are the kept rows only.
* **A grid that fills the GPU.** Output blocks of all G projections × SPLIT slices of the inputs,
  sized for several programs per SM (:func:`heuristic_config`). Wide outputs (gate/up, the LM head)
  fill the GPU by themselves: SPLIT = 1, one launch, final values and bias written directly. Tall or
  square shapes split K; each program then writes fp32 partial sums to a workspace slot that only it
  owns (no zero-fill, no atomics, deterministic) and a tiny second launch sums the slots.

Configs (BLOCK_N, BLOCK_K, SPLIT, num_warps) come from the tuning table shipped next to
this file (``gemv_configs.json``, keyed by GPU name, dtype, sparsity bin and bucketed shapes, filled
by ``python -m rana.kernels.gemv_tune`` on that GPU), else from a shape heuristic. The choice is a
pure function of shapes, so eager, traced and captured calls take the same config and nothing is
timed behind the user's back. Under TRITON_INTERPRET=1 small blocks are used.

int8 weights (``rana_masked_gemv_int8``, :func:`grouped_masked_gemv_triton` with ``qscales``): the same kernel body with
``INT8`` set: ``w_t_g`` int8 (K_g, N_g), loaded only for kept rows (a quarter of an fp32 row's bytes),
converted to fp32 and accumulated in fp32; each program multiplies its sum by the fp32 per-output-channel
scale once, before the bias and before a split's partials are stored (qscale · Σ_s p_s = Σ_s qscale · p_s:
the reduce launch is shared). Its configs have their own table keys (``bfloat16.w-int8|...``) and
heuristic (more rows per step: :data:`INT8_BLOCK_K`). Mode "none" is the dense int8 GEMV.

The kernels are module-level functions: inductor regenerates user Triton kernels from source and
keeps only the helpers it finds among the kernel's global names, so no kernel may reach a helper
through a closure. Self-contained (torch + stdlib, triton optional) so it can be copied next to an
exported model and imported on machines without triton.
"""
from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

# one table of mask modes for every kernel (modes.py): the ids are the C kernel's and the Triton kernel's ABI
from .modes import MODE_IDS, mode_id

__all__ = ["triton_available", "kernels_available", "interpreting", "grouped_masked_gemv_triton",
           "grouped_dense_gemv_triton",
           "int8_kernel", "expert_masked_gemv_triton", "expert_kernel",
           "choose_config", "heuristic_config",
           "MODE_IDS", "GemvConfig", "TABLE_FILE", "table_key", "sparsity_bin", "KERNEL_NAMES", "config_table",
           "set_config_table", "read_table"]

MAX_GROUPS = 3
TABLE_FILE = Path(__file__).with_name("gemv_configs.json")
# An export inlines the table here: transformers copies only the .py files of remote code.
SHIPPED_TABLE: dict | None = None  # rana:shipped-gemv-table
# what profilers show
KERNEL_NAMES = ("rana_masked_gemv", "rana_gemv_reduce", "rana_dense_gemv", "rana_masked_gemv_int8",
                "rana_expert_masked_gemv")

try:  # optional: a model exported with these files must import on machines without triton
    import triton
    import triton.language as tl
except Exception:  # not installed, or a broken install
    triton = tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    return triton is not None


def kernels():
    """(masked GEMV kernel, reduce kernel, dense row-major GEMV kernel)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    return rana_masked_gemv, rana_gemv_reduce, rana_dense_gemv


@functools.lru_cache(maxsize=1)
def kernels_available() -> bool:
    """Whether the Triton kernels can be launched here: triton imports and every kernel was defined (a triton
    that cannot build them leaves the torch and native paths)."""
    if triton is None:
        return False
    try:
        kernels()
        int8_kernel()
        expert_kernel()
    except Exception:
        return False
    return True


def int8_kernel():
    """The masked GEMV kernel for int8 weights with per-output-channel scales (its split launches reuse
    the reduce kernel of :func:`kernels`)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    return rana_masked_gemv_int8


# --------------------------------------------------------------------------------------------
# kernels (module level: see the docstring; TRITON_INTERPRET is read when the module is imported)
# --------------------------------------------------------------------------------------------
if triton is not None:
    # the mask modes' ids from modes.py, as globals a kernel may read (constexpr: inductor re-emits them)
    MODE_NONE = tl.constexpr(MODE_IDS["none"])
    MODE_SQUARE = tl.constexpr(MODE_IDS["square"])
    MODE_ABS_SCALED = tl.constexpr(MODE_IDS["abs_scaled"])
    MODE_ABS = tl.constexpr(MODE_IDS["abs"])

    @triton.jit
    def _active(v, k_ok, t, scale_ptr, offs_k, MODE: tl.constexpr):
        """The mask of one step's inputs (v in fp32); MODE_NONE keeps them all."""
        if MODE == MODE_SQUARE:
            return k_ok & (v * v >= t)
        elif MODE == MODE_ABS_SCALED:
            s = tl.load(scale_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            return k_ok & (tl.abs(v) * s >= t)
        elif MODE == MODE_ABS:
            return k_ok & (tl.abs(v) >= t)
        else:
            return k_ok

    @triton.jit
    def _kept_rows_dot(w_ptr, v_ptr, t_ptr, scale_ptr, offs_n, n_ok, k_lo, k_hi, stride_w,
                       MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """sum over k in [k_lo, k_hi) with m_k of v_k · w[k, offs_n], fp32, reduced across K once.

        Software-pipelined in registers: while step i's weights are multiplied, step i+1's kept rows
        (whose mask is already known) and step i+2's inputs are in flight, so neither the weight
        stream nor the mask waits on a load, and no shared memory (hence no barrier) is involved."""
        t = tl.load(t_ptr).to(tl.float32)
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        cols = offs_n[None, :]
        offs = k_lo + tl.arange(0, BLOCK_K)
        ok = offs < k_hi
        v_cur = tl.load(v_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        act_cur = _active(v_cur, ok, t, scale_ptr, offs, MODE)
        w_cur = tl.load(w_ptr + offs[:, None].to(tl.int64) * stride_w + cols, mask=act_cur[:, None] & n_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
        offs = offs + BLOCK_K
        v_nxt = tl.load(v_ptr + offs, mask=offs < k_hi, other=0.0, eviction_policy="evict_last").to(tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs1 = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
            ok1 = offs1 < k_hi
            act1 = _active(v_nxt, ok1, t, scale_ptr, offs1, MODE)
            w_nxt = tl.load(w_ptr + offs1[:, None].to(tl.int64) * stride_w + cols,
                            mask=act1[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
            offs2 = offs1 + BLOCK_K
            v_after = tl.load(v_ptr + offs2, mask=offs2 < k_hi, other=0.0, eviction_policy="evict_last").to(tl.float32)
            # a broadcast multiply into the 2-D accumulator: tl.dot has no use for one row (and is
            # wrong on bf16 under the interpreter), and a per-step row sum would need barriers
            acc += w_cur.to(tl.float32) * tl.where(act_cur, v_cur, 0.0)[:, None]
            v_cur, act_cur, w_cur, v_nxt = v_nxt, act1, w_nxt, v_after
        return tl.sum(acc, axis=0)

    @triton.jit
    def _project(w_ptr, v_ptr, t_ptr, scale_ptr, bias_ptr, qs_ptr, out_ptr, ws_ptr, K, N, stride_w, block_n, pid_k,
                 k_chunk, n_total, out_off, MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 WORKSPACE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT8: tl.constexpr):
        offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        acc = _kept_rows_dot(w_ptr, v_ptr, t_ptr, scale_ptr, offs_n, n_ok, k_lo, k_hi, stride_w,
                             MODE, BLOCK_N, BLOCK_K)
        if INT8:
            # int8 weights: this program's fp32 sum times the per-output-channel scale, once, before the bias
            # (and before a split's partials are summed: qscale · Σ_s p_s = Σ_s qscale · p_s, so the reduce
            # launch stays the same)
            acc = acc * tl.load(qs_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if WORKSPACE:  # this program's own slot: no zero-fill, no atomics
            tl.store(ws_ptr + pid_k * n_total + out_off + offs_n, acc, mask=n_ok)
        else:
            tl.store(out_ptr + out_off + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _grouped(w0, v0, t0, s0, b0, q0, w1, v1, t1, s1, b1, q1, w2, v2, t2, s2, b2, q2, out_ptr, ws_ptr,
                 K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1, KC0, KC1, KC2, n_total,
                 G: tl.constexpr, MODE: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                 WORKSPACE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT8: tl.constexpr):
        # grid axis 0: the output blocks of projection 0, then 1, then 2; axis 1: the input slices
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if pid_n < NB0:
            _project(w0, v0, t0, s0, b0, q0, out_ptr, ws_ptr, K0, N0, SW0, pid_n, pid_k, KC0, n_total, 0,
                     MODE, B0, WORKSPACE, BLOCK_N, BLOCK_K, INT8)
        else:
            if G == 2:
                _project(w1, v1, t1, s1, b1, q1, out_ptr, ws_ptr, K1, N1, SW1, pid_n - NB0, pid_k, KC1, n_total,
                         N0, MODE, B1, WORKSPACE, BLOCK_N, BLOCK_K, INT8)
            elif G == 3:
                if pid_n < NB0 + NB1:
                    _project(w1, v1, t1, s1, b1, q1, out_ptr, ws_ptr, K1, N1, SW1, pid_n - NB0, pid_k, KC1,
                             n_total, N0, MODE, B1, WORKSPACE, BLOCK_N, BLOCK_K, INT8)
                else:
                    _project(w2, v2, t2, s2, b2, q2, out_ptr, ws_ptr, K2, N2, SW2, pid_n - NB0 - NB1, pid_k, KC2,
                             n_total, N0 + N1, MODE, B2, WORKSPACE, BLOCK_N, BLOCK_K, INT8)

    @triton.jit
    def rana_masked_gemv(w0, v0, t0, s0, b0, w1, v1, t1, s1, b1, w2, v2, t2, s2, b2, out_ptr, ws_ptr,
                         K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1, KC0, KC1, KC2, n_total,
                         G: tl.constexpr, MODE: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                         B2: tl.constexpr, WORKSPACE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        # float weights: no scales (each projection's weight pointer stands in for its unused scale pointer)
        _grouped(w0, v0, t0, s0, b0, w0, w1, v1, t1, s1, b1, w1, w2, v2, t2, s2, b2, w2, out_ptr, ws_ptr,
                 K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1, KC0, KC1, KC2, n_total,
                 G, MODE, B0, B1, B2, WORKSPACE, BLOCK_N, BLOCK_K, False)

    @triton.jit
    def rana_masked_gemv_int8(w0, v0, t0, s0, b0, q0, w1, v1, t1, s1, b1, q1, w2, v2, t2, s2, b2, q2,
                              out_ptr, ws_ptr, K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1, KC0, KC1, KC2,
                              n_total, G: tl.constexpr, MODE: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                              B2: tl.constexpr, WORKSPACE: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        # int8 weights w_g and their fp32 per-column scales q_g (the same grid and store paths)
        _grouped(w0, v0, t0, s0, b0, q0, w1, v1, t1, s1, b1, q1, w2, v2, t2, s2, b2, q2, out_ptr, ws_ptr,
                 K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1, KC0, KC1, KC2, n_total,
                 G, MODE, B0, B1, B2, WORKSPACE, BLOCK_N, BLOCK_K, True)

    @triton.jit
    def rana_expert_masked_gemv(w_ptr, v_ptr, idx_ptr, t_ptr, out_ptr, K, N, stride_e, stride_w, stride_v,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # a mixture of experts' one token: grid axis 1 is the selected slot s, whose expert idx[s] is read
        # on the device (no host sync, no loop over experts); its w_t (K, N) is the idx[s]-th slice of the
        # stacked weights and its inputs are masked by |v[s]| >= t[idx[s]] (MODE_ABS), kept rows only
        slot = tl.program_id(1)
        e = tl.load(idx_ptr + slot).to(tl.int64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = _kept_rows_dot(w_ptr + e * stride_e, v_ptr + slot * stride_v, t_ptr + e, t_ptr, offs_n, n_ok, 0, K,
                             stride_w, MODE_ABS, BLOCK_N, BLOCK_K)
        tl.store(out_ptr + slot * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def rana_gemv_reduce(ws_ptr, y_ptr, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + s * N + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


    @triton.jit
    def _dense_rows(w_ptr, v_ptr, out_ptr, K, N, stride_w, block, out_off,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[rows] = W[rows, :] @ v for BLOCK_R contiguous rows of a row-major W: each row is read as one
        contiguous stream, the next step's tiles in flight while this one is multiplied."""
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows[:, None] < N
        base = w_ptr + rows[:, None].to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        # v is loaded as a [BLOCK_R, BLOCK_K] tile (every row the same, from L1) so that it gets the weight
        # tile's own layout: a loaded row broadcast afterwards is converted through shared memory, with
        # barriers, every step
        offs = tl.arange(0, BLOCK_K)[None, :]
        v_base = v_ptr + (rows[:, None] * 0)
        w_cur = tl.load(base + offs, mask=r_ok & (offs < K), other=0.0, eviction_policy="evict_first")
        v_cur = tl.load(v_base + offs, mask=offs < K, other=0.0, eviction_policy="evict_last")
        for k0 in range(0, K, BLOCK_K):
            offs1 = k0 + BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            w_nxt = tl.load(base + offs1, mask=r_ok & (offs1 < K), other=0.0, eviction_policy="evict_first")
            v_nxt = tl.load(v_base + offs1, mask=offs1 < K, other=0.0, eviction_policy="evict_last")
            acc += w_cur.to(tl.float32) * v_cur.to(tl.float32)
            w_cur, v_cur = w_nxt, v_nxt
        tl.store(out_ptr + out_off + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def rana_dense_gemv(w0, v0, w1, v1, w2, v2, out_ptr, K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1,
                        G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # the rank adapters' codes B x of up to three projections (gate's and up's), one launch, no split:
        # a row-major W has enough rows to fill the GPU without slicing K
        pid = tl.program_id(0)
        if pid < NB0:
            _dense_rows(w0, v0, out_ptr, K0, N0, SW0, pid, 0, BLOCK_R, BLOCK_K)
        else:
            if G == 2:
                _dense_rows(w1, v1, out_ptr, K1, N1, SW1, pid - NB0, N0, BLOCK_R, BLOCK_K)
            elif G == 3:
                if pid < NB0 + NB1:
                    _dense_rows(w1, v1, out_ptr, K1, N1, SW1, pid - NB0, N0, BLOCK_R, BLOCK_K)
                else:
                    _dense_rows(w2, v2, out_ptr, K2, N2, SW2, pid - NB0 - NB1, N0 + N1, BLOCK_R, BLOCK_K)


# --------------------------------------------------------------------------------------------
# configs: the shipped table, else the heuristic
# --------------------------------------------------------------------------------------------
class GemvConfig(tuple):
    """(BLOCK_N, BLOCK_K, SPLIT, num_warps)."""

    __slots__ = ()

    def __new__(cls, block_n: int, block_k: int, split: int, num_warps: int = 4):
        return super().__new__(cls, (int(block_n), int(block_k), int(split), int(num_warps)))

    block_n = property(lambda s: s[0])
    block_k = property(lambda s: s[1])
    split = property(lambda s: s[2])
    num_warps = property(lambda s: s[3])


INTERPRETER_CONFIG = GemvConfig(32, 16, 2, 4)  # small blocks, SPLIT > 1: both store paths exercised
_REDUCE_BLOCK = 1024
WAVES = 3  # programs per SM the heuristic aims for: enough kept rows in flight at low densities
FILLED = 2  # output blocks per SM from which the outputs alone fill the GPU: no split, no reduce launch
_SM_COUNT: dict[int, int] = {}
_GPU_NAME: dict[int, str] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    index = _device_index(device)
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def gpu_name(device: torch.device) -> str:
    """The table's GPU key: the CUDA device name ("cpu" elsewhere)."""
    if device.type != "cuda":
        return device.type
    index = _device_index(device)
    if index not in _GPU_NAME:
        _GPU_NAME[index] = torch.cuda.get_device_name(index)
    return _GPU_NAME[index]


def split_for(ks, ns, block_n: int, block_k: int, sms: int, waves: float = WAVES) -> int:
    """Input slices so that (output blocks × slices) gives about `waves` programs per SM; 1 when the
    output blocks alone give FILLED per SM (then there is no workspace and no reduce launch). Each slice keeps at least
    two BLOCK_K steps, so the pipeline has a next step to prefetch."""
    blocks = sum(-(-n // block_n) for n in ns)
    if blocks >= FILLED * sms:
        return 1
    want = -(-int(waves * sms) // max(blocks, 1))
    most = max(1, max(ks) // (2 * block_k))
    return int(max(1, min(want, most, 64)))


def heuristic_config(ks, ns, dtype: torch.dtype, device: torch.device, sms: int | None = None,
                     weight_dtype: torch.dtype | None = None) -> GemvConfig:
    """128 bytes of each kept row per program (one cache line), 64 rows per step (8 KB of weights in
    flight per program while the previous step is multiplied), 4 warps (so several programs share an
    SM), split until the grid is ~WAVES programs per SM.

    int8 weights (``weight_dtype=torch.int8``): a kept row is 4× (fp32) or 2× (bf16/fp16) smaller, so a
    step takes more of them: 64 bytes of each kept row per program and 128 rows per step (the same
    8 KB in flight), over 8 warps so the [128, 64] fp32 accumulator stays at 32 registers a thread."""
    if interpreting():
        return INTERPRETER_CONFIG
    sms = sms if sms is not None else _sm_count(device)
    if weight_dtype == torch.int8:
        return GemvConfig(INT8_BLOCK_N, INT8_BLOCK_K, split_for(ks, ns, INT8_BLOCK_N, INT8_BLOCK_K, sms), 8)
    block_n = 32 if dtype == torch.float32 else 64
    block_k = 64
    return GemvConfig(block_n, block_k, split_for(ks, ns, block_n, block_k, sms), 4)


INT8_BLOCK_N, INT8_BLOCK_K = 64, 128


def sparsity_bin(density: float) -> int:
    """The expected active fraction as one of 5 bins (it changes the best split and block sizes)."""
    return int(min(4, max(0, round(float(density) * 4))))


def _bucket(x: int) -> int:
    """Shapes to the nearest half power of two (rank adapters have a different rank in every layer:
    one table entry serves all ranks of a size class)."""
    if x <= 1:
        return 1
    return int(round(2 ** (round(math.log2(x) * 2) / 2)))


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8"}


def table_key(ks, ns, dtype: torch.dtype, sbin: int, weight_dtype: torch.dtype | None = None) -> str:
    """The table's key for a launch: dtype, sparsity bin, bucketed max K and total N, group size. Weights of
    another dtype than the inputs' (int8) are named after it: ``bfloat16.w-int8|s2|...``."""
    name = _DTYPE_NAMES.get(dtype, str(dtype))
    if weight_dtype is not None and weight_dtype != dtype:
        name += ".w-" + _DTYPE_NAMES.get(weight_dtype, str(weight_dtype))
    return f"{name}|s{int(sbin)}|K{_bucket(max(ks))}|N{_bucket(sum(ns))}|G{len(ks)}"


_CONFIG_TABLE: dict = {}  # "table" -> {gpu name: {key: [BLOCK_N, BLOCK_K, SPLIT, warps]}}, once loaded


def config_table() -> dict:
    """{gpu name: {key: [BLOCK_N, BLOCK_K, SPLIT, warps]}}: the table an export inlined, else the shipped
    file; read once per process (at the first launch, eager or traced: never during a CUDA-graph replay).
    A missing or unreadable file is an empty table: the heuristic serves."""
    if "table" not in _CONFIG_TABLE:
        set_config_table(SHIPPED_TABLE if SHIPPED_TABLE is not None else read_table(TABLE_FILE))
    return _CONFIG_TABLE["table"]


def set_config_table(table: dict | None) -> None:
    """Use `table` ({"gpus": {...}} as in the file) from now on; None: read the shipped one again. Configs
    are chosen when a launch is traced, so a compiled step keeps the table it was traced with."""
    if table is None:
        _CONFIG_TABLE.clear()
        return
    gpus = table.get("gpus", {}) if isinstance(table, dict) else {}
    _CONFIG_TABLE["table"] = {gpu: dict(entries) for gpu, entries in gpus.items() if isinstance(entries, dict)}


def read_table(path: Path | str = TABLE_FILE) -> dict:
    """The whole table file ({"format": 1, "gpus": {...}}); an empty table when there is none."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"format": 1, "gpus": {}}
    return data if isinstance(data, dict) and isinstance(data.get("gpus"), dict) else {"format": 1, "gpus": {}}


def choose_config(ks, ns, dtype, mode: str, sbin: int, device, weight_dtype=None) -> GemvConfig:
    """The shipped table's config for these shapes on this GPU, else the heuristic. A pure function of
    its arguments: eager, traced and captured calls agree, and nothing is timed here."""
    if interpreting():
        return INTERPRETER_CONFIG
    entry = config_table().get(gpu_name(device), {}).get(table_key(ks, ns, dtype, sbin, weight_dtype))
    if entry:
        block_n, block_k, _, warps = entry
        # the table's split was tuned for its bucket's shapes: re-derive it for these exact ones from
        # the programs per SM it amounted to
        return GemvConfig(block_n, block_k, _split_like(entry, ks, ns, device), warps)
    return heuristic_config(ks, ns, dtype, device, weight_dtype=weight_dtype)


def _split_like(entry, ks, ns, device) -> int:
    block_n, block_k, split = entry[:3]
    if split <= 1:
        return 1
    waves = split * sum(-(-n // block_n) for n in ns) / _sm_count(device)
    return split_for(ks, ns, block_n, block_k, _sm_count(device), waves)


# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------
def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _check_group(vs, w_ts, thresholds, scales, biases, mode: str) -> None:
    g = len(w_ts)
    if not 1 <= g <= MAX_GROUPS or not (len(vs) == len(thresholds) == len(scales) == len(biases) == g):
        raise ValueError(f"1 to {MAX_GROUPS} projections with one input, threshold, scale and bias slot each")
    mode_id(mode)  # ValueError for an unknown mode
    for v, w in zip(vs, w_ts):
        if w.dim() != 2 or v.numel() != w.shape[0]:
            raise ValueError(f"one token per projection: v of {v.numel()} values for w_t of shape {tuple(w.shape)}")


_WARNED_LAYOUT: list = []


def _streamable(w: torch.Tensor) -> torch.Tensor:
    """w_t with unit stride along N. A row-major nn.Linear weight would need a full copy per token (3×
    the traffic, silently, inside a CUDA graph): refused while tracing, copied with one warning eagerly.
    The adapters keep their masked weights column-major for this kernel."""
    if w.stride(1) == 1:
        return w
    if _is_fake(w) or torch.compiler.is_compiling():
        raise ValueError(f"masked GEMV: w_t of shape {tuple(w.shape)} has strides {tuple(w.stride())}; it must be "
                         "(K, N) with unit stride along N (a column-major nn.Linear weight)")
    if not _WARNED_LAYOUT:
        _WARNED_LAYOUT.append(True)
        import warnings

        warnings.warn("masked GEMV: a row-major weight is copied on every call; store it column-major "
                      "(rana.modules.common.column_major_linear)", RuntimeWarning, stacklevel=3)
    return w.contiguous()


def _launch(vs, w_ts, thresholds, mode: str, scales, biases, cfg: GemvConfig, wrap=None,
            qscales=None) -> torch.Tensor:
    """Launch the kernels with `cfg`; returns the concatenated output (sum of N_g,) in v's dtype.

    `wrap` is torch.library.wrap_triton inside the triton_op (so torch.compile sees the kernels).
    `qscales` (one fp32 (N_g,) tensor per projection): the w_ts are int8 and take the int8 kernel."""
    gemv, reduce, _ = kernels()
    if qscales is not None:
        gemv = int8_kernel()
    if wrap is not None:
        gemv, reduce = wrap(gemv), wrap(reduce)
    g = len(w_ts)
    device, dtype = vs[0].device, vs[0].dtype
    ks = [w.shape[0] for w in w_ts]
    ns = [w.shape[1] for w in w_ts]
    n_total = sum(ns)
    block_n, block_k, split, warps = cfg
    # each projection's inputs in `split` equal slices of whole BLOCK_K steps (a projection in a group is
    # sliced as it would be alone: grouped and single launches sum in the same order)
    chunks = [-(-(-(-max(k, 1) // split)) // block_k) * block_k for k in ks]
    split = max(-(-max(k, 1) // c) for k, c in zip(ks, chunks))  # no slice empty in every projection
    nbs = [-(-n // block_n) for n in ns]
    pad = lambda seq, fill: list(seq) + [fill] * (MAX_GROUPS - g)
    w_ts = [_streamable(w) for w in w_ts]
    flat_vs = [v.reshape(-1) for v in vs]
    w_p = pad(w_ts, w_ts[0])
    v_p = pad(flat_vs, flat_vs[0])
    t_p = pad(thresholds, thresholds[0])
    s_p = pad([s if s is not None else v for s, v in zip(scales, flat_vs)], flat_vs[0])
    b_p = pad([b if b is not None else v for b, v in zip(biases, flat_vs)], flat_vs[0])
    has_b = pad([b is not None for b in biases], False)
    k_p, n_p, c_p = pad(ks, 0), pad(ns, 0), pad(chunks, block_k)
    out = torch.empty(n_total, dtype=dtype, device=device)
    ws = out if split == 1 else torch.empty(split, n_total, dtype=torch.float32, device=device)
    if wrap is not None and interpreting() and _is_fake(out):
        return out  # fake tracing under the interpreter: it would run the kernel on meta storage
    grid = (sum(nbs), split)
    if qscales is not None:
        q_p = pad(qscales, qscales[0])
        head = (w_p[0], v_p[0], t_p[0], s_p[0], b_p[0], q_p[0], w_p[1], v_p[1], t_p[1], s_p[1], b_p[1], q_p[1],
                w_p[2], v_p[2], t_p[2], s_p[2], b_p[2], q_p[2])
    else:
        head = (w_p[0], v_p[0], t_p[0], s_p[0], b_p[0], w_p[1], v_p[1], t_p[1], s_p[1], b_p[1],
                w_p[2], v_p[2], t_p[2], s_p[2], b_p[2])
    gemv[grid](*head, out, ws,
               k_p[0], k_p[1], k_p[2], n_p[0], n_p[1], n_p[2],
               w_p[0].stride(0), w_p[1].stride(0), w_p[2].stride(0), nbs[0], nbs[1] if g > 1 else 0,
               c_p[0], c_p[1], c_p[2], n_total,
               G=g, MODE=MODE_IDS[mode], B0=has_b[0], B1=has_b[1], B2=has_b[2], WORKSPACE=split > 1,
               BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    if split > 1:
        reduce[(-(-n_total // _REDUCE_BLOCK),)](ws, out, n_total, SPLIT=split, BLOCK=_REDUCE_BLOCK, num_warps=4)
    return out


def grouped_masked_gemv_triton(vs, w_ts, thresholds, mode: str, scales, biases, sbin: int = 2, wrap=None,
                               qscales=None, config: GemvConfig | None = None) -> torch.Tensor:
    """Concatenated masked GEMVs of up to three projections in one launch (plus a reduce launch when the
    inputs are split); a 1-D tensor of sum(N_g) values in vs[0]'s dtype.

    Float weights ``w_t_g`` (K_g, N_g), or, with ``qscales`` (one per projection), int8 codes: ``out_g =
    qscale_g ⊙ ((m_g ⊙ v_g) @ q_t_g) (+ bias_g)``, q_t_g int8 with unit stride along N, qscale_g (N_g,) read as
    fp32. The kept int8 rows are converted to fp32 on the load and accumulated in fp32; each program
    multiplies its sum by the scale once, before the bias (a split's partials are each scaled, then summed by
    the reduce launch). Config: ``config`` when given (the tuner, tests of both store paths), else
    :func:`choose_config` (int8 weights: ``weight_dtype=torch.int8``, their own table keys and heuristic)."""
    _check_group(vs, w_ts, thresholds, scales, biases, mode)
    int8 = qscales is not None and any(qs is not None for qs in qscales)
    if int8:
        if len(qscales) != len(w_ts):
            raise ValueError("one qscale per projection")
        for q, qs in zip(w_ts, qscales):
            if q.dtype != torch.int8 or qs is None or qs.numel() != q.shape[1] or not qs.dtype.is_floating_point:
                raise ValueError(f"int8 masked GEMV: an int8 (K, N) weight and N scales, got {q.dtype} "
                                 f"{tuple(q.shape)} and {None if qs is None else (qs.dtype, tuple(qs.shape))}")
    ks, ns = [w.shape[0] for w in w_ts], [w.shape[1] for w in w_ts]
    cfg = config or choose_config(ks, ns, vs[0].dtype, mode, sbin, vs[0].device,
                                  weight_dtype=torch.int8 if int8 else None)
    return _launch(vs, w_ts, thresholds, mode, scales, biases, cfg, wrap=wrap,
                   qscales=[qs.reshape(-1) for qs in qscales] if int8 else None)


# --------------------------------------------------------------------------------------------
# a mixture of experts' one token: the selected experts of the stacked weights, indexed on the device
# --------------------------------------------------------------------------------------------
def expert_kernel():
    if triton is None:
        raise RuntimeError("triton is not installed")
    return rana_expert_masked_gemv


def expert_masked_gemv_triton(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, thresholds: torch.Tensor,
                              wrap=None) -> torch.Tensor:
    """``out[s] = (m_s ⊙ v[s]) @ w_t[idx[s]]``, ``m_s = |v[s]| >= thresholds[idx[s]]``: w_t the stacked
    (E, K, N) weights with unit stride along N, v (S, K) (any stride between slots: an expanded token),
    idx (S,) expert indices read by the kernel, thresholds (E,) fp32. One launch, grid (N blocks, S):
    only the S selected experts' kept rows are read. Returns (S, N) in v's dtype."""
    if w_t.dim() != 3 or w_t.stride(2) != 1 or v.dim() != 2 or v.stride(1) != 1:
        raise ValueError(f"expert masked GEMV: w_t (E, K, N) with unit stride along N and v (S, K), got "
                         f"{tuple(w_t.shape)} / {tuple(v.shape)}")
    E, K, N = w_t.shape
    S = idx.shape[0]
    out = torch.empty((S, N), dtype=v.dtype, device=v.device)
    cfg = heuristic_config([K], [N], v.dtype, v.device)
    kernel = wrap(rana_expert_masked_gemv) if wrap is not None else rana_expert_masked_gemv
    kernel[(-(-N // cfg.block_n), S)](w_t, v, idx.reshape(-1), thresholds, out, K, N, w_t.stride(0), w_t.stride(1),
                                      v.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                      num_warps=cfg.num_warps)
    return out


# --------------------------------------------------------------------------------------------
# the rank adapters' dense codes: several row-major GEMVs in one launch
# --------------------------------------------------------------------------------------------
def dense_rows_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, num_warps): 8 rows × 1 KB of each per step (8 KB in flight per program)."""
    if interpreting():
        return 4, 32, 4
    return 8, (256 if dtype == torch.float32 else 512), 4


def grouped_dense_gemv_triton(vs, ws, wrap=None) -> torch.Tensor:
    """Concatenated ``W_g @ v_g`` of up to three row-major (N_g, K_g) weights (an nn.Linear's own layout:
    the rank adapters' B), one launch; a 1-D tensor of sum(N_g) values in vs[0]'s dtype."""
    g = len(ws)
    if not 1 <= g <= MAX_GROUPS or len(vs) != g:
        raise ValueError(f"1 to {MAX_GROUPS} weights with one input each")
    for v, w in zip(vs, ws):
        if w.dim() != 2 or v.numel() != w.shape[1] or w.stride(1) != 1:
            raise ValueError(f"dense GEMV: a row-major (N, K) weight and K inputs, got {tuple(w.shape)} strides "
                             f"{tuple(w.stride())} for {v.numel()} inputs")
    _, _, kernel = kernels()
    if wrap is not None:
        kernel = wrap(kernel)
    block_r, block_k, warps = dense_rows_config(vs[0].dtype)
    ns, ks = [w.shape[0] for w in ws], [w.shape[1] for w in ws]
    nbs = [-(-n // block_r) for n in ns]
    pad = lambda seq, fill: list(seq) + [fill] * (MAX_GROUPS - g)
    flat = [v.reshape(-1) for v in vs]
    w_p, v_p, k_p, n_p = pad(ws, ws[0]), pad(flat, flat[0]), pad(ks, 0), pad(ns, 0)
    out = torch.empty(sum(ns), dtype=vs[0].dtype, device=vs[0].device)
    if wrap is not None and interpreting() and _is_fake(out):
        return out
    kernel[(sum(nbs),)](w_p[0], v_p[0], w_p[1], v_p[1], w_p[2], v_p[2], out, k_p[0], k_p[1], k_p[2],
                        n_p[0], n_p[1], n_p[2], w_p[0].stride(0), w_p[1].stride(0), w_p[2].stride(0),
                        nbs[0], nbs[1] if g > 1 else 0, G=g, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps)
    return out
