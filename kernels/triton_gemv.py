"""Triton masked GEMV for batch-1 decoding: one launch for up to three projections.

    out_g = (m_g ⊙ v_g) @ w_t_g (+ bias_g),   m_g from v_g and the 0-dim fp32 threshold t_g,
    for g < G ≤ 3, returned concatenated along the last dim (q | k | v, gate | up, or one projection).

``w_t_g`` is (K_g, N_g) row-major (column k of the nn.Linear weight is the contiguous row k), so an
inactive input skips one contiguous row; the mask is applied on the load, so an inactive row costs
no memory traffic. Modes: "square" (v² ≥ t, RaNA's rank code), "abs_scaled" (|v|·scale ≥ t, neuron
thresholding), "abs" (|v| ≥ t, TEAL), "none" (everything active). Scores, comparisons and
accumulation are fp32; the output has v's dtype. Nothing here reads a tensor value on the host.

Design (why not the atomic split-K of TEAL): an fp32 atomic-add split-K needs a zeroed fp32 buffer
(a fill launch) and a cast launch per projection, three launches where a decode step is already
launch bound, and its atomics serialise on tall shapes. Here the grid is (output blocks of all G
projections, SPLIT slices of the inputs):

* SPLIT == 1 (wide outputs fill the GPU by themselves, and always under the interpreter's small
  shapes when chosen): each program owns BLOCK_N outputs, walks all K inputs and writes the final
  value in the output dtype, bias included — one launch, no workspace.
* SPLIT > 1 (tall or square shapes, where the output blocks alone would leave SMs idle): every
  program writes its fp32 partial sums to a workspace slot that exactly one program owns, so the
  workspace needs no zero-fill (``torch.empty``); a second, tiny launch sums the SPLIT partials,
  casts and writes the output. Two launches for up to three projections, deterministic (no
  atomics), and the extra traffic is SPLIT·N·8 bytes against K·N·2·f bytes of weights.

Configs: BLOCK_N / BLOCK_K / SPLIT / num_warps are chosen per (G, shapes, dtype, sparsity bin,
device) by timing candidates on the first eager CUDA call outside a CUDA-graph capture and outside
torch.compile tracing; the decision is cached in a dict and reused by traced and captured calls
(which never tune: they take the cached decision, else a shape heuristic). Under
TRITON_INTERPRET=1 one fixed config is used. Weights are loaded with ``evict_first`` (streamed
once per token), inputs with ``evict_last``.

Self-contained (torch + stdlib, triton imported lazily and optionally) so it can be copied next to
an exported model and imported on machines without triton.
"""
from __future__ import annotations

import functools
import os

import torch

# one table of mask modes for every kernel: the ids are the C kernel's and the Triton kernel's ABI
from .cpu_gemv import MODE_IDS

__all__ = ["triton_available", "interpreting", "grouped_masked_gemv_triton", "choose_config", "tune",
           "MODE_IDS", "GemvConfig"]

MAX_GROUPS = 3


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _triton():
    """(triton, tl) or None when triton is not importable. Resolved once, outside any traced forward
    (ops.py calls it at import time)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or a broken install: neither may break importing a model
        return None
    return triton, tl


def triton_available() -> bool:
    return _triton() is not None


# --------------------------------------------------------------------------------------------
# kernels (built once, at import of ops.py, so no builder cache is reached inside a forward)
# --------------------------------------------------------------------------------------------
_KERNELS: dict = {}  # interpreting? -> kernels (triton.jit reads TRITON_INTERPRET when it decorates)


def kernels():
    """(partial kernel, reduce kernel); built on first use (import time of ops.py)."""
    mode = interpreting()
    if mode not in _KERNELS:
        _KERNELS[mode] = _build()
    built = _KERNELS[mode]
    return built["partial"], built["reduce"]


def _build() -> dict:
    triton, tl = _triton()

    @triton.jit
    def _project(w_ptr, v_ptr, t_ptr, scale_ptr, bias_ptr, out_ptr, K, N, stride_w, block_n, pid_k,
                 k_chunk, ws_stride, out_off,
                 MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        t = tl.load(t_ptr).to(tl.float32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_hi
            v = tl.load(v_ptr + offs_k, mask=k_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if MODE == 1:
                active = k_ok & (v * v >= t)
            elif MODE == 2:
                s = tl.load(scale_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                active = k_ok & (tl.abs(v) * s >= t)
            elif MODE == 3:
                active = k_ok & (tl.abs(v) >= t)
            else:
                active = k_ok
            w = tl.load(w_ptr + offs_k[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                        mask=active[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
            # a broadcast multiply and a row sum: tl.dot has no use for one row (and is wrong on bf16
            # under the interpreter)
            acc += tl.sum(w.to(tl.float32) * tl.where(active, v, 0.0)[:, None], axis=0)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if SPLIT == 1:
            tl.store(out_ptr + out_off + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:  # this program's own workspace slot: no zero-fill, no atomics
            tl.store(out_ptr + pid_k * ws_stride + out_off + offs_n, acc, mask=n_ok)

    # jitted functions resolve the functions they call among their module's globals
    globals()["_project"] = _project

    @triton.jit
    def partial(w0, v0, t0, s0, b0, w1, v1, t1, s1, b1, w2, v2, t2, s2, b2, out_ptr,
                K0, K1, K2, N0, N1, N2, SW0, SW1, SW2, NB0, NB1, k_chunk, ws_stride,
                G: tl.constexpr, MODE: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # grid axis 0: the output blocks of projection 0, then 1, then 2; axis 1: the input slices
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if pid_n < NB0:
            _project(w0, v0, t0, s0, b0, out_ptr, K0, N0, SW0, pid_n, pid_k, k_chunk, ws_stride, 0,
                     MODE, B0, SPLIT, BLOCK_N, BLOCK_K)
        else:
            if G == 2:
                _project(w1, v1, t1, s1, b1, out_ptr, K1, N1, SW1, pid_n - NB0, pid_k, k_chunk, ws_stride, N0,
                         MODE, B1, SPLIT, BLOCK_N, BLOCK_K)
            elif G == 3:
                if pid_n < NB0 + NB1:
                    _project(w1, v1, t1, s1, b1, out_ptr, K1, N1, SW1, pid_n - NB0, pid_k, k_chunk, ws_stride,
                             N0, MODE, B1, SPLIT, BLOCK_N, BLOCK_K)
                else:
                    _project(w2, v2, t2, s2, b2, out_ptr, K2, N2, SW2, pid_n - NB0 - NB1, pid_k, k_chunk,
                             ws_stride, N0 + N1, MODE, B2, SPLIT, BLOCK_N, BLOCK_K)

    @triton.jit
    def reduce(ws_ptr, y_ptr, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + s * N + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)

    return {"partial": partial, "reduce": reduce}


# --------------------------------------------------------------------------------------------
# configs: heuristic, tuned decisions, tuning
# --------------------------------------------------------------------------------------------
class GemvConfig(tuple):
    """(BLOCK_N, BLOCK_K, SPLIT, num_warps)."""

    __slots__ = ()

    def __new__(cls, block_n: int, block_k: int, split: int, num_warps: int):
        return super().__new__(cls, (block_n, block_k, split, num_warps))

    block_n = property(lambda s: s[0])
    block_k = property(lambda s: s[1])
    split = property(lambda s: s[2])
    num_warps = property(lambda s: s[3])


INTERPRETER_CONFIG = GemvConfig(32, 16, 2, 4)  # small blocks, SPLIT > 1: both store paths exercised
_REDUCE_BLOCK = 1024
_SM_COUNT: dict[int, int] = {}
_TUNED: dict[tuple, GemvConfig] = {}  # decisions taken by tune() on eager calls


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _split_for(ks, ns, block_n: int, block_k: int, sms: int, waves: float = 2.0) -> int:
    """Input slices so that (output blocks × slices) covers `waves` programs per SM, each slice at least
    four BLOCK_K steps long (shorter ones spend more on the workspace than they save)."""
    blocks = sum(-(-n // block_n) for n in ns)
    want = max(1, -(-int(waves * sms) // blocks))
    most = max(1, max(ks) // (4 * block_k))
    return int(min(want, most, 32))


def heuristic_config(ks, ns, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    if interpreting():
        return INTERPRETER_CONFIG
    block_n = 256 if dtype in (torch.float16, torch.bfloat16) else 128  # 512 B of each row per step
    block_k = 16
    return GemvConfig(block_n, block_k, _split_for(ks, ns, block_n, block_k, _sm_count(device)), 8)


def sparsity_bin(density: float) -> int:
    """The expected active fraction as one of 5 bins (it changes the best split and block sizes)."""
    return int(min(4, max(0, round(float(density) * 4))))


def _key(ks, ns, dtype, mode: str, sbin: int, device: torch.device) -> tuple:
    return (tuple(ks), tuple(ns), str(dtype), mode, sbin, str(device))


def choose_config(ks, ns, dtype, mode: str, sbin: int, device) -> GemvConfig:
    """The tuned decision for these shapes, else the heuristic. Never tunes (safe in traced/captured code)."""
    if interpreting():
        return INTERPRETER_CONFIG
    return _TUNED.get(_key(ks, ns, dtype, mode, sbin, device)) or heuristic_config(ks, ns, dtype, device)


def _candidates(ks, ns, dtype, device) -> list[GemvConfig]:
    sms = _sm_count(device)
    out = []
    wide = (128, 256) if dtype in (torch.float16, torch.bfloat16) else (64, 128)
    for block_n in wide + (512,):
        for block_k in (8, 16, 32):
            for waves in (1.0, 2.0, 4.0):
                for warps in (4, 8):
                    cfg = GemvConfig(block_n, block_k, _split_for(ks, ns, block_n, block_k, sms, waves), warps)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _tuning_allowed(tensor: torch.Tensor) -> bool:
    if interpreting() or not tensor.is_cuda or torch.compiler.is_compiling():
        return False
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return False  # fake / functional tensors (tracing)
    return not torch.cuda.is_current_stream_capturing()


def tune(vs, w_ts, thresholds, mode: str, scales, biases, sbin: int, repeats: int = 20) -> GemvConfig:
    """Time every candidate on these very tensors (CUDA, eager, not capturing) and cache the fastest."""
    ks, ns = [w.shape[0] for w in w_ts], [w.shape[1] for w in w_ts]
    dtype, device = vs[0].dtype, vs[0].device
    key = _key(ks, ns, dtype, mode, sbin, device)
    if key in _TUNED:
        return _TUNED[key]
    best, best_ms = None, float("inf")
    for cfg in _candidates(ks, ns, dtype, device):
        try:
            _launch(vs, w_ts, thresholds, mode, scales, biases, cfg)  # compile + warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                _launch(vs, w_ts, thresholds, mode, scales, biases, cfg)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / repeats
        except Exception:  # a config that does not fit this GPU (shared memory, registers)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _TUNED[key] = best or heuristic_config(ks, ns, dtype, device)
    return _TUNED[key]


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
    if mode not in MODE_IDS:
        raise ValueError(f"mode must be one of {tuple(MODE_IDS)}, got {mode!r}")
    for v, w in zip(vs, w_ts):
        if w.dim() != 2 or v.numel() != w.shape[0]:
            raise ValueError(f"one token per projection: v of {v.numel()} values for w_t of shape {tuple(w.shape)}")


def _launch(vs, w_ts, thresholds, mode: str, scales, biases, cfg: GemvConfig, wrap=None) -> torch.Tensor:
    """Launch the kernels with `cfg`; returns the concatenated output (sum of N_g,) in v's dtype.

    `wrap` is torch.library.wrap_triton inside the triton_op (so torch.compile sees the kernels)."""
    partial, reduce = kernels()
    if wrap is not None:
        partial, reduce = wrap(partial), wrap(reduce)
    g = len(w_ts)
    device, dtype = vs[0].device, vs[0].dtype
    ks = [w.shape[0] for w in w_ts]
    ns = [w.shape[1] for w in w_ts]
    n_total = sum(ns)
    block_n, block_k, split, warps = cfg
    k_chunk = -(-(-(-max(ks) // split)) // block_k) * block_k  # ceil(K / split) rounded up to BLOCK_K
    split = -(-max(ks) // k_chunk)  # no empty trailing slice
    nbs = [-(-n // block_n) for n in ns]
    pad = lambda seq, fill: list(seq) + [fill] * (MAX_GROUPS - g)
    w_p = pad([w if w.stride(1) == 1 else w.contiguous() for w in w_ts], w_ts[0])
    v_p = pad([v.reshape(-1) for v in vs], vs[0].reshape(-1))
    t_p = pad(thresholds, thresholds[0])
    s_p = pad([s if s is not None else v.reshape(-1) for s, v in zip(scales, vs)], vs[0].reshape(-1))
    b_p = pad([b if b is not None else v.reshape(-1) for b, v in zip(biases, vs)], vs[0].reshape(-1))
    has_b = pad([b is not None for b in biases], False)
    k_p, n_p = pad(ks, 0), pad(ns, 0)
    out = torch.empty(n_total, dtype=dtype, device=device)
    target = out if split == 1 else torch.empty(split, n_total, dtype=torch.float32, device=device)
    if wrap is not None and interpreting() and _is_fake(out):
        return out  # fake tracing under the interpreter: it would run the kernel on meta storage
    grid = (sum(nbs), split)
    partial[grid](w_p[0], v_p[0], t_p[0], s_p[0], b_p[0], w_p[1], v_p[1], t_p[1], s_p[1], b_p[1],
                  w_p[2], v_p[2], t_p[2], s_p[2], b_p[2], target,
                  k_p[0], k_p[1], k_p[2], n_p[0], n_p[1], n_p[2],
                  w_p[0].stride(0), w_p[1].stride(0), w_p[2].stride(0), nbs[0], nbs[1] if g > 1 else 0,
                  k_chunk, n_total,
                  G=g, MODE=MODE_IDS[mode], B0=has_b[0], B1=has_b[1], B2=has_b[2], SPLIT=split,
                  BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    if split > 1:
        reduce[(-(-n_total // _REDUCE_BLOCK),)](target, out, n_total, SPLIT=split, BLOCK=_REDUCE_BLOCK,
                                                num_warps=4)
    return out


def grouped_masked_gemv_triton(vs, w_ts, thresholds, mode: str, scales, biases, sbin: int = 2,
                               wrap=None) -> torch.Tensor:
    """Concatenated masked GEMVs of up to three projections in one launch (plus a reduce launch when the
    inputs are split). Tunes on the first eager CUDA call for these shapes; traced and captured calls
    take the cached decision. Returns a 1-D tensor of sum(N_g) values in vs[0]'s dtype."""
    _check_group(vs, w_ts, thresholds, scales, biases, mode)
    ks, ns = [w.shape[0] for w in w_ts], [w.shape[1] for w in w_ts]
    if _tuning_allowed(vs[0]):
        cfg = tune(vs, w_ts, thresholds, mode, scales, biases, sbin)
    else:
        cfg = choose_config(ks, ns, vs[0].dtype, mode, sbin, vs[0].device)
    return _launch(vs, w_ts, thresholds, mode, scales, biases, cfg, wrap=wrap)
