/* rana's native CPU masked GEMV: one token, one projection, one call (see cpu_gemv.py for why and how it is
   built and loaded). Compiled as one unit with rana_modes.h inlined: the build writes what it compiles, so the
   mask-mode ids are always those of kernels/modes.py.

   One calling convention: a projection's operands are bound once by Python (rana_operands: the weights in
   either format, their scales, the column norms, the bias, the mask mode), and a decode token passes itself,
   its threshold, the output and the thread count to its format's entry point (rana_masked_gemv_f32 / _i8):
   ctypes converts every argument on every call (~0.1-0.2 us each).

   y = sum over kept k of x[k] * w[k, :]  (+ bias),  w: K rows of N weights, row stride ldw.
   kept: RANA_MODE_NONE all; SQUARE x*x >= t; ABS_SCALED |x|*scale >= t; ABS |x| >= t (fp32, as torch
   computes them). The columns are split over `threads` OpenMP threads (torch's own libgomp when torch is
   loaded first). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "rana_modes.h"

#define PREFETCH_ROWS 8   /* start loading rows this far ahead ...                           */
#define PREFETCH_LINES 4  /* ... their first cache lines: enough to wake the HW prefetcher    */

static inline int rana_active(float v, float t, int mode, const float* scale, int64_t k) {
    if (mode == RANA_MODE_NONE) return 1;
    float a = v < 0.0f ? -v : v;
    if (mode == RANA_MODE_SQUARE) return v * v >= t;
    if (mode == RANA_MODE_ABS_SCALED) return a * scale[k] >= t;
    return a >= t;  /* RANA_MODE_ABS */
}

/* Scratch for a call's list of kept rows: K int32 per thread, grown on demand, never freed (one per thread
   that ever decoded, the size of the widest input it saw). */
static __thread int32_t* rana_idx_buf = 0;
static __thread int64_t rana_idx_cap = 0;

static int32_t* rana_index_scratch(int64_t K) {
    if (K > rana_idx_cap) {
        int32_t* grown = (int32_t*)malloc((size_t)(K > 0 ? K : 1) * sizeof(int32_t));
        if (!grown) return 0;
        free(rana_idx_buf);
        rana_idx_buf = grown;
        rana_idx_cap = K;
    }
    return rana_idx_buf;
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

/* The two compute functions below stay out of line (noinline), as they were while they were the library's
   entry points: inlined into their small entry points, the int8 one measured ~1 us slower per call on
   DRAM-resident weights (576 x 576, 1 thread) and 4 % slower per SmolLM2 decode step. */

/* fp32 weights. Returns the kept count n. If n > limit nothing is multiplied: xm gets the masked x instead
   (the caller's dense BLAS GEMV on it beats gathering rows once nearly everything is kept). */
__attribute__((noinline))
static int64_t rana_masked_f32(const float* __restrict w, const float* __restrict x, int64_t K, int64_t N,
                               int64_t ldw, float t, int mode, const float* __restrict scale,
                               const float* __restrict bias, float* __restrict y, int64_t limit,
                               float* __restrict xm, int32_t* __restrict idx, int threads) {
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
   mostly active input to, so every call multiplies (RANA_MODE_NONE, everything active, is the dense int8
   GEMV). idx: scratch for K int32 active indices. Returns the active count. */
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

__attribute__((noinline))
static int64_t rana_masked_i8(const int8_t* __restrict w, const float* __restrict qscale, const float* __restrict x,
                              int64_t K, int64_t N, int64_t ldw, float t, int mode, const float* __restrict scale,
                              const float* __restrict bias, float* __restrict y, int32_t* __restrict idx,
                              int threads) {
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

/* One projection's operands, bound once by Python (cpu_gemv.NativeCall; its _Operands mirrors this struct). */
typedef struct {
    const void* w;        /* K rows of N weights, row stride ldw: float, or int8 codes */
    const float* qscale;  /* int8: the N per-output-channel scales; unused for float weights */
    const float* scale;   /* RANA_MODE_ABS_SCALED: the K column norms */
    const float* bias;    /* N values, or 0 */
    int64_t K, N, ldw;
    int64_t mode;
} rana_operands;

/* The entry points: y = op's masked GEMV of the token x at threshold t; the kept count, or -1 when no index
   scratch could be allocated (the caller takes its other path). One per weight format, both on the bound
   operands: float weights also take `limit` and `xm` (a count above limit means y was not written and xm
   holds the masked x, see rana_masked_f32); int8 weights always multiply, and a token passes five arguments
   (ctypes converts each on every call). */
int64_t rana_masked_gemv_f32(const rana_operands* __restrict op, const float* __restrict x, float t,
                             float* __restrict y, int64_t limit, float* __restrict xm, int threads) {
    int32_t* idx = rana_index_scratch(op->K);
    if (!idx) return -1;
    return rana_masked_f32((const float*)op->w, x, op->K, op->N, op->ldw, t, (int)op->mode, op->scale, op->bias, y,
                           limit, xm, idx, threads);
}

int64_t rana_masked_gemv_i8(const rana_operands* __restrict op, const float* __restrict x, float t,
                            float* __restrict y, int threads) {
    int32_t* idx = rana_index_scratch(op->K);
    if (!idx) return -1;
    return rana_masked_i8((const int8_t*)op->w, op->qscale, x, op->K, op->N, op->ldw, t, (int)op->mode, op->scale,
                          op->bias, y, idx, threads);
}

/* A mixture of experts' one token: S selected experts of the stacked w (E blocks of K rows of N floats,
   block stride lde, row stride ldw). Slot s reads its input x + s*ldx (ldx 0: one token for every slot),
   keeps |x_k| >= t[experts[s]] and writes y + s*N; only the kept rows of the selected experts are read,
   with the loop over slots here rather than in Python. Returns 0, or -1 when no index scratch could be
   allocated (nothing written). */
int64_t rana_expert_masked_gemv(const float* __restrict w, const float* __restrict x,
                                const int64_t* __restrict experts, const float* __restrict t, int64_t S,
                                int64_t K, int64_t N, int64_t lde, int64_t ldw, int64_t ldx,
                                float* __restrict y, int threads) {
    int32_t* idx = rana_index_scratch(K);
    if (!idx) return -1;
    for (int64_t s = 0; s < S; ++s) {
        const float* ws = w + experts[s] * lde;
        const float* xs = x + s * ldx;
        float* ys = y + s * N;
        const float ts = t[experts[s]];
        int64_t n = 0;
        for (int64_t k = 0; k < K; ++k)
            if (rana_active(xs[k], ts, RANA_MODE_ABS, 0, k)) idx[n++] = (int32_t)k;
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
    return 0;
}
