"""Native CPU masked GEMV for batch-1 decoding: one C call per projection.

Why native: a masked product written as torch ops costs several ops per projection (score,
compare, nonzero, gather, product), microseconds each, and ``embedding_bag`` streams scattered
rows from memory at about 60 % of the dense GEMV's bandwidth (benchmarks/results/kernels_cpu.md).
At batch 1 a decoder is memory bound, so the masked product only pays off if it reads the
active rows as fast as BLAS reads the whole matrix. This kernel scores the inputs, compares them
with the threshold and accumulates the active rows of ``w_t`` four at a time, prefetching
the rows ahead (short scattered rows are latency bound), in one call.

The C source below is compiled once per machine with the system C compiler (``$CC``, else
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

Semantics are those of ``masked_gemv`` (see masked_gemv.py): fp32 scores ``v*v``,
``|v|*scale`` or ``|v|`` compared ``>= t`` exactly as torch does, fp32 accumulation. When more
than ``limit`` inputs are active the kernel does not multiply: it writes the masked input to
``xm`` and the caller runs the dense GEMV on it (BLAS wins when nearly everything is active).

int8 weights (:func:`masked_linear_native_int8`): the same scan, then the active int8 rows (a quarter of
an fp32 row's bytes) converted to fp32 in the inner loop (AVX-512 / AVX2 intrinsics where the build targets
them, plain C elsewhere; :func:`native_status` says which) and accumulated in fp32, the per-output-channel
scale applied once per column at the end: ``y = qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)``. There is no int8
BLAS to fall back to, so it always multiplies; with everything active it is the dense int8 GEMV.

This file is self-contained (torch + stdlib) so it can be copied next to an exported model.
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

import torch

__all__ = ["expert_masked_gemv_native", "native_kernel", "native_status", "masked_gemv_native", "masked_linear_native", "native_limit", "MODE_IDS",
           "native_kernel_int8", "NativeInt8Call", "masked_linear_native_int8", "masked_gemv_native_int8", "dense_streak",
           "reset_dense_streaks", "library_name", "build_variant", "BUILD_ATTEMPTS", "DENSE_STREAK"]

MODE_IDS = {"none": 0, "square": 1, "abs_scaled": 2, "abs": 3}
_ABS_SCALED, _ABS = MODE_IDS["abs_scaled"], MODE_IDS["abs"]

# Dense BLAS beats the native kernel once more than this fraction of the inputs is active. Set
# from timings inside real decoding (SmolLM2, fp32, benchmarks/results/decode_cpu*.md), where
# the gather compares better than in isolated kernel timings: at one thread a 576x192 projection
# 77 % active took 39 us gathered vs 52 us on the dense branch (41 us for the dense model).
# The kernel splits the columns over torch's thread count as the BLAS GEMV does, but its fixed
# costs weigh more against the faster multi-threaded GEMV, so the crossover comes earlier there.
NATIVE_MAX_FRACTION = 0.9
NATIVE_MAX_FRACTION_THREADED = 0.75

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* y = sum over active k of x[k] * w[k, :]  (+ bias),  w: K rows of N floats, row stride ldw.
   active: mode 0 all; 1 x*x >= t; 2 |x|*scale >= t; 3 |x| >= t  (fp32, as torch computes them).
   Returns the active count n. If n > limit nothing is multiplied: xm gets the masked x instead.
   Otherwise xm is scratch for the active indices (K int32 fit in K floats). The columns are
   split over `threads` OpenMP threads (torch's own libgomp when torch is loaded first). */
#define PREFETCH_ROWS 8   /* start loading rows this far ahead ...                           */
#define PREFETCH_LINES 4  /* ... their first cache lines: enough to wake the HW prefetcher    */

static inline int rana_active(float v, float t, int mode, const float* scale, int64_t k) {
    if (mode == 0) return 1;
    float a = v < 0.0f ? -v : v;
    if (mode == 1) return v * v >= t;
    if (mode == 2) return a * scale[k] >= t;
    return a >= t;
}

/* Weight rows are read once per token and the kept rows of a model outgrow the last-level cache: fetch
   them non-temporally (locality 0), so they do not evict what the rest of the step reuses (the KV cache,
   activations, the interpreter's own data). Measured in SmolLM2 decode steps, the same run alternating:
   1-2 % faster for fp32 rows, 2-4 % (1 thread) and 4-6 % (2 threads) for int8 rows, than locality 3. */
#define RANA_PREFETCH_LOCALITY 0
static inline void rana_prefetch(const float* r, int64_t width) {
    int64_t lines = (width + 15) / 16;
    if (lines > PREFETCH_LINES) lines = PREFETCH_LINES;
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(r + l * 16, 0, RANA_PREFETCH_LOCALITY);
}

/* y[j0:j1] += sum_i x[idx[i]] * w[idx[i], j0:j1]. Scattered short rows are latency bound:
   prefetch PREFETCH_ROWS ahead. Four rows per sweep over y: a quarter of the y traffic. */
static void rana_accumulate(const float* __restrict w, const float* __restrict x, const int32_t* __restrict idx,
                            int64_t n, int64_t ldw, int64_t j0, int64_t j1, float* __restrict y) {
    const int64_t width = j1 - j0;
    const float* wj = w + j0;
    float* yj = y + j0;
    for (int64_t p = 0; p < PREFETCH_ROWS && p < n; ++p) rana_prefetch(wj + idx[p] * ldw, width);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int64_t p = i + PREFETCH_ROWS; p < i + PREFETCH_ROWS + 4 && p < n; ++p)
            rana_prefetch(wj + idx[p] * ldw, width);
        const float *r0 = wj + idx[i] * ldw, *r1 = wj + idx[i + 1] * ldw;
        const float *r2 = wj + idx[i + 2] * ldw, *r3 = wj + idx[i + 3] * ldw;
        const float a0 = x[idx[i]], a1 = x[idx[i + 1]], a2 = x[idx[i + 2]], a3 = x[idx[i + 3]];
        for (int64_t j = 0; j < width; ++j) yj[j] += a0 * r0[j] + a1 * r1[j] + a2 * r2[j] + a3 * r3[j];
    }
    for (; i < n; ++i) {
        const float* r = wj + idx[i] * ldw;
        const float a = x[idx[i]];
        for (int64_t j = 0; j < width; ++j) yj[j] += a * r[j];
    }
}

int64_t rana_masked_gemv_f32(const float* __restrict w, const float* __restrict x, int64_t K, int64_t N,
                             int64_t ldw, float t, int mode, const float* __restrict scale,
                             const float* __restrict bias, float* __restrict y, int64_t limit,
                             float* __restrict xm, int threads) {
    int32_t* idx = (int32_t*)xm;
    int64_t n = 0;
    for (int64_t k = 0; k < K; ++k)
        if (rana_active(x[k], t, mode, scale, k)) idx[n++] = (int32_t)k;
    if (n > limit) {
        for (int64_t k = 0; k < K; ++k) xm[k] = rana_active(x[k], t, mode, scale, k) ? x[k] : 0.0f;
        return n;
    }
    if (bias) memcpy(y, bias, (size_t)N * sizeof(float)); else memset(y, 0, (size_t)N * sizeof(float));
#ifdef _OPENMP
    if (threads > 1 && N >= 64 * threads) {
        #pragma omp parallel num_threads(threads)
        {
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t chunk = ((N + nt - 1) / nt + 15) / 16 * 16;  /* whole cache lines */
            const int64_t j0 = tid * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
            if (j0 < j1) rana_accumulate(w, x, idx, n, ldw, j0, j1, y);
        }
        return n;
    }
#endif
    rana_accumulate(w, x, idx, n, ldw, 0, N, y);
    return n;
}

/* The int8-weight variant: w holds K rows of N int8 (row stride ldw), qscale N per-column fp32 scales:
   y = qscale * sum over active k of x[k] * w[k, :]  (+ bias), fp32 accumulation, the scale applied once
   per column at the end. An int8 row is a quarter of an fp32 row's bytes. There is no BLAS to hand a
   mostly active input to, so every call multiplies (mode 0, everything active, is the dense int8 GEMV).
   idx: scratch for K int32 active indices. Returns the active count. */
/* int8 rows are short (a 576-wide row is 9 cache lines): fetch them whole and further ahead than fp32
   rows, but cap the lines so a very wide row (an LM head's) is left to the hardware streamer. (24 rows ahead
   was 4 % faster in isolated timings of a step's shapes but no faster inside real decode steps.) */
#define PREFETCH_ROWS_I8 16
#define PREFETCH_LINES_I8 16
static inline void rana_prefetch_i8(const int8_t* r, int64_t width) {
    int64_t lines = (width + 63) / 64;
    if (lines > PREFETCH_LINES_I8) lines = PREFETCH_LINES_I8;
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(r + l * 64, 0, RANA_PREFETCH_LOCALITY);
}

/* The int8 rows' inner loop is written with intrinsics where the compiler targets AVX-512 or AVX2:
   compilers auto-vectorise `x * (float)r[j]` into two-step sign extensions with lane shuffles, which
   made the int8 kernel compute bound at about a third of the fp32 kernel's bytes per second. Here one
   sign-extending load per 16 (8) columns, one convert, one FMA per row: int8 rows stream at about the
   fp32 kernel's rate, so the quarter-size rows are time saved. Same fp32 accumulation either way. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RANA_I8_LANES 16
static inline __m512 rana_i8_ps(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512 rana_i8_ps_tail(const int8_t* p, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
/* y[0:width] += a0 r0 + a1 r1 + a2 r2 + a3 r3 (rows r1..r3 may be r0 with a zero weight for the tail) */
static inline void rana_axpy4_i8(float* __restrict y, int64_t width, const int8_t* r0, const int8_t* r1,
                                 const int8_t* r2, const int8_t* r3, float a0, float a1, float a2, float a3) {
    const __m512 v0 = _mm512_set1_ps(a0), v1 = _mm512_set1_ps(a1), v2 = _mm512_set1_ps(a2), v3 = _mm512_set1_ps(a3);
    int64_t j = 0;
    for (; j + 16 <= width; j += 16) {
        __m512 acc = _mm512_fmadd_ps(v0, rana_i8_ps(r0 + j), _mm512_loadu_ps(y + j));
        acc = _mm512_fmadd_ps(v1, rana_i8_ps(r1 + j), acc);
        acc = _mm512_fmadd_ps(v2, rana_i8_ps(r2 + j), acc);
        _mm512_storeu_ps(y + j, _mm512_fmadd_ps(v3, rana_i8_ps(r3 + j), acc));
    }
    if (j < width) {
        const __mmask16 m = (__mmask16)((1u << (width - j)) - 1u);
        __m512 acc = _mm512_fmadd_ps(v0, rana_i8_ps_tail(r0 + j, m), _mm512_maskz_loadu_ps(m, y + j));
        acc = _mm512_fmadd_ps(v1, rana_i8_ps_tail(r1 + j, m), acc);
        acc = _mm512_fmadd_ps(v2, rana_i8_ps_tail(r2 + j, m), acc);
        _mm512_mask_storeu_ps(y + j, m, _mm512_fmadd_ps(v3, rana_i8_ps_tail(r3 + j, m), acc));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RANA_I8_LANES 8
static inline __m256 rana_i8_ps(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline void rana_axpy4_i8(float* __restrict y, int64_t width, const int8_t* r0, const int8_t* r1,
                                 const int8_t* r2, const int8_t* r3, float a0, float a1, float a2, float a3) {
    const __m256 v0 = _mm256_set1_ps(a0), v1 = _mm256_set1_ps(a1), v2 = _mm256_set1_ps(a2), v3 = _mm256_set1_ps(a3);
    int64_t j = 0;
    for (; j + 8 <= width; j += 8) {
        __m256 acc = _mm256_fmadd_ps(v0, rana_i8_ps(r0 + j), _mm256_loadu_ps(y + j));
        acc = _mm256_fmadd_ps(v1, rana_i8_ps(r1 + j), acc);
        acc = _mm256_fmadd_ps(v2, rana_i8_ps(r2 + j), acc);
        _mm256_storeu_ps(y + j, _mm256_fmadd_ps(v3, rana_i8_ps(r3 + j), acc));
    }
    for (; j < width; ++j) y[j] += a0 * (float)r0[j] + a1 * (float)r1[j] + a2 * (float)r2[j] + a3 * (float)r3[j];
}
#else
#define RANA_I8_LANES 1
static inline void rana_axpy4_i8(float* __restrict y, int64_t width, const int8_t* r0, const int8_t* r1,
                                 const int8_t* r2, const int8_t* r3, float a0, float a1, float a2, float a3) {
    for (int64_t j = 0; j < width; ++j)
        y[j] += a0 * (float)r0[j] + a1 * (float)r1[j] + a2 * (float)r2[j] + a3 * (float)r3[j];
}
#endif

static void rana_accumulate_i8(const int8_t* __restrict w, const float* __restrict qscale,
                               const float* __restrict x, const int32_t* __restrict idx, int64_t n, int64_t ldw,
                               int64_t j0, int64_t j1, const float* __restrict bias, float* __restrict y) {
    const int64_t width = j1 - j0;
    const int8_t* wj = w + j0;
    float* yj = y + j0;
    for (int64_t j = 0; j < width; ++j) yj[j] = 0.0f;
    for (int64_t p = 0; p < PREFETCH_ROWS_I8 && p < n; ++p) rana_prefetch_i8(wj + idx[p] * ldw, width);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int64_t p = i + PREFETCH_ROWS_I8; p < i + PREFETCH_ROWS_I8 + 4 && p < n; ++p)
            rana_prefetch_i8(wj + idx[p] * ldw, width);
        rana_axpy4_i8(yj, width, wj + idx[i] * ldw, wj + idx[i + 1] * ldw, wj + idx[i + 2] * ldw,
                      wj + idx[i + 3] * ldw, x[idx[i]], x[idx[i + 1]], x[idx[i + 2]], x[idx[i + 3]]);
    }
    for (; i < n; ++i) {  /* the last rows: the same row four times, three of them weighted 0 (exact) */
        const int8_t* r = wj + idx[i] * ldw;
        rana_axpy4_i8(yj, width, r, r, r, r, x[idx[i]], 0.0f, 0.0f, 0.0f);
    }
    const float* sj = qscale + j0;
    if (bias) {
        const float* bj = bias + j0;
        for (int64_t j = 0; j < width; ++j) yj[j] = yj[j] * sj[j] + bj[j];
    } else {
        for (int64_t j = 0; j < width; ++j) yj[j] *= sj[j];
    }
}

/* Which inner loop this build has (Python reads it for the kernel's status line). */
int rana_i8_lanes(void) { return RANA_I8_LANES; }

int64_t rana_masked_gemv_i8(const int8_t* __restrict w, const float* __restrict qscale, const float* __restrict x,
                            int64_t K, int64_t N, int64_t ldw, float t, int mode, const float* __restrict scale,
                            const float* __restrict bias, float* __restrict y, int32_t* __restrict idx, int threads) {
    int64_t n = 0;
    for (int64_t k = 0; k < K; ++k)
        if (rana_active(x[k], t, mode, scale, k)) idx[n++] = (int32_t)k;
#ifdef _OPENMP
    if (threads > 1 && N >= 128 * threads) {
        #pragma omp parallel num_threads(threads)
        {
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t chunk = ((N + nt - 1) / nt + 63) / 64 * 64;  /* whole cache lines of int8 */
            const int64_t j0 = tid * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
            if (j0 < j1) rana_accumulate_i8(w, qscale, x, idx, n, ldw, j0, j1, bias, y);
        }
        return n;
    }
#endif
    rana_accumulate_i8(w, qscale, x, idx, n, ldw, 0, N, bias, y);
    return n;
}

/* One int8 projection's operands, bound once per module by Python (NativeInt8Call): a decode step then
   passes five arguments per projection instead of thirteen, and no index scratch (a per-thread buffer
   here, grown on demand; ctypes converts every argument on every call, ~0.1-0.2 us each). */
typedef struct {
    const int8_t* w; const float* qscale; const float* scale; const float* bias;
    int64_t K, N, ldw; int64_t mode;
} rana_i8_operands;

static __thread int32_t* rana_idx_buf = 0;
static __thread int64_t rana_idx_cap = 0;

int64_t rana_i8_bound(const rana_i8_operands* __restrict op, const float* __restrict x, float t,
                      float* __restrict y, int threads) {
    if (op->K > rana_idx_cap) {
        int32_t* grown = (int32_t*)malloc((size_t)op->K * sizeof(int32_t));
        if (!grown) return -1;  /* the caller takes its other path */
        free(rana_idx_buf);
        rana_idx_buf = grown;
        rana_idx_cap = op->K;
    }
    return rana_masked_gemv_i8(op->w, op->qscale, x, op->K, op->N, op->ldw, t, (int)op->mode, op->scale, op->bias,
                               y, rana_idx_buf, threads);
}

/* A mixture of experts' one token: S selected experts of the stacked w (E blocks of K rows of N floats,
   block stride lde, row stride ldw). Slot s reads its input x + s*ldx (ldx 0: one token for every slot),
   keeps |x_k| >= t[experts[s]] and writes y + s*N; only the kept rows of the selected experts are read,
   with the loop over slots here rather than in Python. idx: scratch for K int32 active indices. */
void rana_expert_masked_gemv_f32(const float* __restrict w, const float* __restrict x,
                                 const int64_t* __restrict experts, const float* __restrict t, int64_t S,
                                 int64_t K, int64_t N, int64_t lde, int64_t ldw, int64_t ldx,
                                 float* __restrict y, int32_t* __restrict idx, int threads) {
    for (int64_t s = 0; s < S; ++s) {
        const float* ws = w + experts[s] * lde;
        const float* xs = x + s * ldx;
        float* ys = y + s * N;
        const float ts = t[experts[s]];
        int64_t n = 0;
        for (int64_t k = 0; k < K; ++k)
            if (rana_active(xs[k], ts, 3, 0, k)) idx[n++] = (int32_t)k;
        memset(ys, 0, (size_t)N * sizeof(float));
#ifdef _OPENMP
        if (threads > 1 && N >= 64 * threads) {
            #pragma omp parallel num_threads(threads)
            {
                const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
                const int64_t chunk = ((N + nt - 1) / nt + 15) / 16 * 16;
                const int64_t j0 = tid * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
                if (j0 < j1) rana_accumulate(ws, xs, idx, n, ldw, j0, j1, ys);
            }
            continue;
        }
#endif
        rana_accumulate(ws, xs, idx, n, ldw, 0, N, ys);
    }
}
"""
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
        src.write_text(_SOURCE)
        subprocess.run([compiler, *flags, "-o", str(tmp / name), str(src)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        (tmp / (name + ".sha256")).write_text(_sha256(tmp / name) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp / name


def build_variant(compiler: str, flags: tuple[str, ...], folder: Path) -> Path:
    """Compile this file's C source with `flags` into `folder` (never the cache) and return the library's path:
    for checking the source's alternative inner loops (e.g. a build without AVX-512) on this machine."""
    return _build(compiler, flags, Path(folder), "rana_cpu_gemv_variant.so")


def library_name(compiler: str, flags: tuple[str, ...]) -> str:
    """The cached library's file name: a hash of everything the build depends on."""
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags, platform.machine(), platform.node()]).encode())
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
def _load() -> tuple[object | None, str]:
    """(the ctypes function or None, a one-line status)."""
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
        fn = lib.rana_masked_gemv_f32
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, p, i64, i64, i64, ctypes.c_float, ctypes.c_int, p, p, p, i64, p, ctypes.c_int]
        fn.restype = i64
        fn_i8 = lib.rana_masked_gemv_i8
        fn_i8.argtypes = [p, p, p, i64, i64, i64, ctypes.c_float, ctypes.c_int, p, p, p, p, ctypes.c_int]
        fn_i8.restype = i64
        fn_b = lib.rana_i8_bound
        fn_b.argtypes = [p, p, ctypes.c_float, p, ctypes.c_int]
        fn_b.restype = i64
        _INT8_KERNEL[id(fn)] = (fn, fn_i8, fn_b)  # the same library's int8 entry points (see native_kernel_int8)
        fn_e = lib.rana_expert_masked_gemv_f32
        fn_e.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, p, p, ctypes.c_int]
        fn_e.restype = None
        _EXPERT_KERNEL[id(fn)] = (fn, fn_e)
        threading_note = "OpenMP" if OPENMP_FLAG in flags else "single-threaded"
        int8_note = _I8_LOOPS.get(lib.rana_i8_lanes(), "scalar")
        return fn, (f"native ({os.path.basename(compiler)} {' '.join(flags[:2])}, {threading_note}, "
                    f"int8 rows {int8_note}){note}")
    return None, f"torch fallback (native kernel build failed: {error[:200]})"


def native_kernel():
    """The compiled kernel (a ctypes function), or None when it cannot be built here."""
    return _load()[0]


def native_status() -> str:
    """How the CPU masked GEMV runs on this machine, in words (for benchmarks and logs)."""
    return _load()[1]


def native_limit(K: int, threads: int = 1) -> int:
    """Most active inputs (of K) for which the native kernel beats the dense GEMV."""
    return int((NATIVE_MAX_FRACTION if threads <= 1 else NATIVE_MAX_FRACTION_THREADED) * K)


_scratch = threading.local()  # per thread: buffers the masked input is written to


def _scratch_input(shape: torch.Size) -> torch.Tensor:
    """A per-thread fp32 buffer of v's shape: the masked input for the dense branch (and index
    scratch for the C code). Shaped like v so the dense GEMV returns the output shape directly."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(shape)
    if buf is None:
        buf = buffers[shape] = torch.empty(shape, dtype=torch.float32)
    return buf


def masked_linear_native(weight: torch.Tensor, v: torch.Tensor, threshold: float, mode_id: int,
                         scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         limit: int | None = None) -> torch.Tensor | None:
    """One token, fp32 CPU: ``weight @ (m ⊙ v) (+ bias)`` as one native call.

    ``weight`` is an nn.Linear weight (N × K) stored column-major (``weight.t()`` row-major
    contiguous, see rana.modules.common.column_major_linear). ``mode_id`` is a value of
    ``MODE_IDS``; ``threshold`` a python float (``-inf``: everything active). Returns None when
    the kernel is unavailable or the inputs do not suit it (not one fp32 CPU token, other
    layouts, ``abs_scaled`` without scale, gradients wanted, under torch.compile); the caller
    then takes its torch path. Above ``limit`` active inputs (default :func:`native_limit` for
    torch's thread count) the dense BLAS GEMV on the masked input runs instead. This runs once
    per projection per decoded token, so it avoids every avoidable Python and torch call (each
    costs ~0.1-1 µs).
    """
    fn = _load()[0]
    if fn is None:
        return None
    ptr = weight.data_ptr()
    key = (ptr, threshold)  # the threshold too: a freed weight's address may be reused by another
    if mode_id == _ABS and limit is None and v.dtype is torch.float32:
        if threshold <= 0:  # |v| >= t holds for every input: the plain dense product
            return torch.nn.functional.linear(v, weight, bias)
        streak = _DENSE_STREAKS.get(key, 0)
        if streak > 0:
            # |v| >= t masking and this weight's last scan found it mostly active: take the dense branch
            # without scanning, masking with one fused op (|v| > the float below t  <=>  |v| >= t in
            # fp32). Plain differentiable torch ops, so none of the checks below are needed.
            _DENSE_STREAKS[key] = streak - 1
            return torch.nn.functional.linear(torch.nn.functional.hardshrink(v, _float_below(threshold)),
                                              weight, bias)
    N, K = weight.shape
    if (v.dtype is not torch.float32 or weight.dtype is not torch.float32 or not v.is_cpu
            or v.numel() != K or weight.stride(0) != 1 or not v.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (weight.requires_grad or v.requires_grad):
        return None  # the C call is invisible to autograd: differentiable callers take the torch path
    if torch.compiler.is_compiling():
        return None  # nor can torch.compile trace through it
    if mode_id == _ABS_SCALED:
        if scale is None or scale.dtype is not torch.float32 or not scale.is_contiguous():
            return None
        scale_ptr = scale.data_ptr()
    else:
        scale_ptr = None
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None
    threads = torch.get_num_threads()
    if limit is None:
        limit = native_limit(K, threads)
    y = torch.empty(_out_shape(v.dim(), N), dtype=torch.float32)
    xm = _scratch_input(v.shape)
    n = fn(ptr, v.data_ptr(), K, N, weight.stride(1), threshold, mode_id, scale_ptr,
           None if bias is None else bias.data_ptr(), y.data_ptr(), limit, xm.data_ptr(), threads)
    if len(_DENSE_STREAKS) > _STREAK_ENTRIES:  # bounded: thresholds may be swept in one process
        _DENSE_STREAKS.clear()
    if n > limit:  # mostly active: the dense BLAS GEMV on the masked input is faster
        _DENSE_STREAKS[key] = DENSE_STREAK
        return torch.nn.functional.linear(xm, weight, bias)
    _DENSE_STREAKS[key] = 0
    return y


# (weight address, threshold) -> tokens left on the dense branch before the next scan. A prediction
# only: a wrong or stale entry costs time for at most DENSE_STREAK tokens, never correctness, since
# both branches compute the same masked product.
_DENSE_STREAKS: dict[tuple[int, float], int] = {}
DENSE_STREAK = 8
_STREAK_ENTRIES = 1 << 16


def dense_streak(weight: torch.Tensor, threshold: float) -> int:
    """Tokens `weight` (N × K, as passed to masked_linear_native) at `threshold` will still take the
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


# --------------------------------------------------------------------------------------------
# int8 weights: y = qscale * ((m ⊙ v) @ q_t) (+ bias)
# --------------------------------------------------------------------------------------------
_INT8_KERNEL: dict = {}  # id(fp32 entry point) -> (it, its library's int8 entry point), filled by _load
_EXPERT_KERNEL: dict = {}  # id(fp32 entry point) -> (it, its library's expert-indexed entry point)


def expert_masked_gemv_native(w_t: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                              thresholds: torch.Tensor) -> torch.Tensor | None:
    """A mixture of experts' one token on CPU, fp32, as one native call: ``y[s] = (m_s ⊙ v[s]) @
    w_t[idx[s]]`` with ``m_s = |v[s]| >= thresholds[idx[s]]``, reading only the selected experts' kept
    rows. ``w_t`` the stacked (E, K, N) weights with unit stride along N, ``v`` (S, K) with unit stride
    along K (an expanded token, stride 0 between slots, is fine), ``idx`` (S,) expert indices,
    ``thresholds`` (E,) fp32. Returns (S, N) fp32, or None where the kernel is unavailable or the inputs
    do not suit it (other dtypes or layouts, gradients wanted, under torch.compile): the caller's torch path."""
    fn = _load()[0]
    pair = None if fn is None else _EXPERT_KERNEL.get(id(fn))
    if pair is None or pair[0] is not fn:
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
    pair[1](w_t.data_ptr(), v.data_ptr(), experts.data_ptr(), t.data_ptr(), v.shape[0], K, N, w_t.stride(0),
            w_t.stride(1), v.stride(0), y.data_ptr(), _scratch_index(K).data_ptr(), torch.get_num_threads())
    return y


# the library's int8 entry points, by position in _INT8_KERNEL's entries: operands passed on every call
# (rana_masked_gemv_i8) or bound once (rana_i8_bound, NativeInt8Call)
PER_CALL_ENTRY, BOUND_ENTRY = 1, 2


def native_kernel_int8():
    """The compiled int8-weight kernel (a ctypes function), or None when the native library is unavailable."""
    return _int8_entry(PER_CALL_ENTRY)


def _int8_entry(which: int):
    fn = _load()[0]
    entries = None if fn is None else _INT8_KERNEL.get(id(fn))
    return entries[which] if entries is not None and entries[0] is fn else None


class _Int8Operands(ctypes.Structure):  # rana_i8_operands in the C source
    _fields_ = [("w", ctypes.c_void_p), ("qscale", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("ldw", ctypes.c_int64),
                ("mode", ctypes.c_int64)]


def _unpickled_none():
    return None


class NativeInt8Call:
    """One int8 projection's native decode call with its operands bound once (the weights, scales, bias,
    mask mode): :func:`masked_linear_native_int8` re-checks and re-converts all of them on every token,
    which cost ~3 µs of a 576 × 576 projection's ~10 µs; this checks the token only.

    :meth:`bind` always gives one; where the operands do not suit the kernel (no native library, other
    dtypes or layouts) calling it returns None, so an unsuitable module is not re-examined every token.
    :meth:`binds` says whether it still describes a module's current tensors, by identity: a replaced buffer
    is a new tensor, an in-place copy keeps the address bound here. It holds its tensors (so an address
    is never stale); the owner drops it when it moves (`_apply`). Deepcopy and pickle give None: a copy
    binds its own tensors.
    """

    __slots__ = ("tensors", "mode", "K", "N", "_fn", "_operands", "_address")

    def __init__(self, tensors: tuple, mode: str, K: int = 0, N: int = 0, fn=None, operands=None):
        self.tensors, self.mode, self.K, self.N = tensors, mode, K, N
        self._fn, self._operands = fn, operands
        self._address = ctypes.addressof(operands) if operands is not None else 0

    @classmethod
    def bind(cls, q_t: torch.Tensor, qscale: torch.Tensor, mode: str, scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> "NativeInt8Call":
        tensors = (q_t, qscale, scale, bias)
        unusable = cls(tensors, mode)
        fn = _int8_entry(BOUND_ENTRY)
        mode_id = MODE_IDS.get(mode)
        if fn is None or mode_id is None or q_t.dim() != 2 or q_t.dtype is not torch.int8 or not q_t.is_cpu:
            return unusable
        K, N = q_t.shape
        if q_t.stride(1) != 1 or K == 0 or N == 0 or qscale.numel() != N or (bias is not None and bias.numel() != N):
            return unusable
        if mode_id == _ABS_SCALED and (scale is None or scale.numel() != K):
            return unusable
        used = (qscale, scale if mode_id == _ABS_SCALED else None, bias)
        if any(t is not None and (t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous()) for t in used):
            return unusable  # a bf16 / fp16 bias or scale: the per-call path converts it
        operands = _Int8Operands(q_t.data_ptr(), qscale.data_ptr(), None if used[1] is None else used[1].data_ptr(),
                                 None if bias is None else bias.data_ptr(), K, N, q_t.stride(0) if K > 1 else N,
                                 mode_id)
        return cls(tensors, mode, K, N, fn, operands)

    def binds(self, q_t, qscale, mode: str, scale=None, bias=None) -> bool:
        t = self.tensors
        return t[0] is q_t and t[1] is qscale and t[2] is scale and t[3] is bias and self.mode == mode

    def __call__(self, v: torch.Tensor, threshold: float) -> torch.Tensor | None:
        """``qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)`` for one fp32 CPU token, or None (unusable operands, another
        dtype or layout, gradients wanted for v: the caller's other path). The caller checks torch.compile
        and the bias's gradients first."""
        if self._fn is None or v.dtype is not torch.float32 or v.numel() != self.K or not v.is_contiguous() \
                or not v.is_cpu or (v.requires_grad and torch.is_grad_enabled()):
            return None
        y = torch.empty(_out_shape(v.dim(), self.N), dtype=torch.float32)
        if self._fn(self._address, v.data_ptr(), threshold, y.data_ptr(), torch.get_num_threads()) < 0:
            return None  # the index scratch could not be grown
        return y

    def __reduce__(self):  # ctypes operands point into this process's tensors: a copy rebinds
        return _unpickled_none, ()


def _scratch_index(K: int) -> torch.Tensor:
    """A per-thread int32 buffer of K entries: the C kernel's list of active rows."""
    buffers = getattr(_scratch, "index", None)
    if buffers is None:
        buffers = _scratch.index = {}
    buf = buffers.get(K)
    if buf is None:
        buf = buffers[K] = torch.empty(max(K, 1), dtype=torch.int32)
    return buf


def masked_linear_native_int8(q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, threshold: float,
                              mode_id: int, scale: torch.Tensor | None = None,
                              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """One token on CPU with int8 weights: ``qscale ⊙ ((m ⊙ v) @ q_t) (+ bias)`` as one native call.

    ``q_t`` is the int8 weight (K, N) with unit stride along N (row k holds input k's N weights: a
    skipped input skips one contiguous row of N bytes); ``qscale`` the (N,) fp32 per-output-channel
    scales; ``v`` one token of K values (fp32, bf16 or fp16; scores and accumulation in fp32, the
    output in v's dtype, shape ``(1,) * (v.dim() - 1) + (N,)``). ``mode_id`` is a value of
    ``MODE_IDS`` (0: everything active, the dense int8 GEMV: there is no int8 BLAS to fall back to,
    so the kernel multiplies whatever the active count); ``threshold`` a python float.

    Returns None when the native library is unavailable or the inputs do not suit it (not one CPU
    token, another layout or dtype, ``abs_scaled`` without scale, gradients wanted for v, under
    torch.compile); the caller then takes its torch path (masked_gemv.masked_gemv_int8_torch).
    """
    fn = native_kernel_int8()
    if fn is None:
        return None
    if q_t.dim() != 2 or q_t.dtype is not torch.int8 or not q_t.is_cpu or q_t.stride(1) != 1:
        return None
    K, N = q_t.shape
    if v.numel() != K or not v.is_cpu or not v.is_floating_point() or qscale.numel() != N:
        return None
    if torch.compiler.is_compiling():
        return None  # torch.compile cannot trace through the C call
    if torch.is_grad_enabled() and v.requires_grad:
        return None  # invisible to autograd: differentiable callers take the torch path
    x = v if v.dtype is torch.float32 and v.is_contiguous() else v.reshape(K).float().contiguous()
    if qscale.dtype is not torch.float32 or not qscale.is_contiguous():
        qscale = qscale.reshape(N).float().contiguous()
    if mode_id == _ABS_SCALED:
        if scale is None or scale.numel() != K:
            return None
        if scale.dtype is not torch.float32 or not scale.is_contiguous():
            scale = scale.reshape(K).float().contiguous()
        scale_ptr = scale.data_ptr()
    else:
        scale_ptr = None
    if bias is not None:
        if bias.numel() != N:
            return None
        if bias.dtype is not torch.float32 or not bias.is_contiguous():
            bias = bias.reshape(N).float().contiguous()
    y = torch.empty(_out_shape(v.dim(), N), dtype=torch.float32)
    fn(q_t.data_ptr(), qscale.data_ptr(), x.data_ptr(), K, N, q_t.stride(0) if K > 1 else N, threshold, mode_id,
       scale_ptr, None if bias is None else bias.data_ptr(), y.data_ptr(), _scratch_index(K).data_ptr(),
       torch.get_num_threads())
    return y if v.dtype is torch.float32 else y.to(v.dtype)


def masked_gemv_native_int8(q_t: torch.Tensor, qscale: torch.Tensor, v: torch.Tensor, threshold: float, mode: str,
                            scale: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`masked_linear_native_int8` with masked_gemv's mode names ("none", "square", "abs_scaled", "abs")."""
    mode_id = MODE_IDS.get(mode)
    if mode_id is None:
        return None
    return masked_linear_native_int8(q_t, qscale, v, threshold, mode_id, scale=scale, bias=bias)


def masked_gemv_native(w_t: torch.Tensor, v: torch.Tensor, threshold: float, mode: str,
                       scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                       limit: int | None = None) -> torch.Tensor | None:
    """:func:`masked_linear_native` in masked_gemv's convention: ``w_t`` is (K, N) row-major."""
    mode_id = MODE_IDS.get(mode)
    if mode_id is None or w_t.dim() != 2:
        return None
    return masked_linear_native(w_t.t(), v, threshold, mode_id, scale=scale, bias=bias, limit=limit)
