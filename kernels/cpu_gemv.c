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

/* Per-thread scratch, grown on demand and never freed (one per thread that ever decoded, the size of the widest
   call it saw): *buf holds at least `bytes`, or 0 is returned when it cannot be grown (*buf kept). */
static void* rana_grow(void** buf, int64_t* cap, int64_t bytes) {
    if (bytes > *cap) {
        void* grown = malloc((size_t)(bytes > 0 ? bytes : 1));
        if (!grown) return 0;
        free(*buf);
        *buf = grown;
        *cap = bytes;
    }
    return *buf;
}

/* A call's list of kept rows: K int32. */
static __thread void* rana_idx_buf = 0;
static __thread int64_t rana_idx_cap = 0;
static int32_t* rana_index_scratch(int64_t K) {
    return (int32_t*)rana_grow(&rana_idx_buf, &rana_idx_cap, K * (int64_t)sizeof(int32_t));
}

/* A thread's own accumulator for a sibling group's outputs (rana_masked_gemv_group): N floats. */
static __thread void* rana_row_buf = 0;
static __thread int64_t rana_row_cap = 0;
static float* rana_row_scratch(int64_t N) {
    return (float*)rana_grow(&rana_row_buf, &rana_row_cap, N * (int64_t)sizeof(float));
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

/* ---------------------------------------------------------------------------------------------------------------
   int8 weights x int8 activations (W8A8). A token's kept inputs are quantized per block of B input positions, B
   the operands' `block` (1..RANA_A8_BLOCK_MAX; block b holds inputs [Bb, Bb + B), the last one fewer), a setting
   of the int8 folder: smaller blocks follow the activations' range more closely and flush their int32 sums
   into fp32 more often. s_b = max |x_k| over the block's kept nonzero inputs / 127, q_k = rint(x_k * (127 / max)) (fp32, round half to even, within +-127), symmetric, one
   fp32 scale per block, as llama.cpp's Q8_0 activations. Then, per output n,

       y[n] = qscale[n] * sum_b s_b * (sum over the block's kept k of q_k * w[k, n])   (+ bias)

   with the inner sums exact in int32. An input that is zero (or not kept) adds nothing and is skipped.
   Torch computes the same quantization (torch_gemv.quantize_activations); tests compare with float64.

   The kept rows of a block go in groups of 4 (the last group of a block padded with a row weighted 0): the 4
   rows are loaded side by side, interleaved byte-wise so each 32-bit lane holds one output's 4 weights, and one
   4-way int8 dot product per lane adds them into int32 sums (AVX-512 VNNI: vpdpbusd, which takes unsigned x
   signed bytes, so the weights are offset by 128 with one xor and the block subtracts 128 * sum q once; AVX2:
   vpmaddubsw on |q| and the weights signed by q, then vpmaddwd). The interleave works inside 128-bit lanes, so
   the sums of a 64 (32) column chunk sit in a fixed permuted order; they stay so until the end, where one 4 x 4
   (2 x 2) lane transpose puts them in order. The vector loops go block by block and, inside a block, one chunk
   of columns at a time: the block's int32 sums of the chunk stay in registers and are flushed into the fp32
   sums (times s_b) once, and the block's rows are read side by side while the next block's are prefetched. The
   order before (rows outer, every group's int32 sums loaded and stored, flushed per block) paid 2-12 % more at
   blocks of 32 than of 64; this one runs blocks of 32 at that order's speed of 64 or faster, from memory
   (benchmarks/results/kernels_w8a8_cpu.md). Which loop runs is the operands' `isa`: Python asks rana_a8_isa_best() (what this CPU and build
   can run) and may choose a narrower one (RANA_CPU_ISA, tests).
   --------------------------------------------------------------------------------------------------------------- */
#define RANA_A8_BLOCK_MAX 64  /* the widest block (llama.cpp's Q8_0 takes 32) */
#ifndef RANA_A8_AHEAD
#define RANA_A8_AHEAD 32  /* the rows after a block's, prefetched while it is summed */
#endif
#ifndef RANA_A8_LINES
#define RANA_A8_LINES 32  /* the lines of each such row prefetched (a row's first 2 KB; the rest the hardware's) */
#endif
#define RANA_ISA_SCALAR 0
#define RANA_ISA_AVX2 1
#define RANA_ISA_AVX512_VNNI 2

#if defined(__x86_64__) || defined(__i386__)
#define RANA_X86 1
#include <immintrin.h>
#endif

/* A token's quantized kept inputs, shared read-only by the threads of a call. */
typedef struct {
    int32_t* rows;    /* 4 per group: the kept rows (a padded slot repeats the group's first row) */
    int32_t* words;   /* 1 per group: its 4 codes, byte i for rows[4g + i] */
    int64_t* start;   /* per block b: its groups are [start[b], start[b + 1]) */
    float* bscale;    /* per block: s_b */
    int32_t* bcorr;   /* per block: 128 * the sum of its codes (the VNNI loop's offset) */
    int64_t groups_cap, blocks_cap;  /* what it was sized for */
} rana_a8_tokens;

static __thread rana_a8_tokens rana_a8_buf = {0, 0, 0, 0, 0, 0, 0};

/* The calling thread's scratch for a token of K inputs in blocks of `block`, grown (never shrunk) as needed. */
static rana_a8_tokens* rana_a8_scratch(int64_t K, int64_t block) {
    rana_a8_tokens* s = &rana_a8_buf;
    int64_t blocks = (K + block - 1) / block, groups = K / 4 + blocks + 1;  /* a block of n: ceil(n / 4) groups */
    if (groups > s->groups_cap || blocks > s->blocks_cap) {
        if (groups < s->groups_cap) groups = s->groups_cap;
        if (blocks < s->blocks_cap) blocks = s->blocks_cap;
        int32_t* rows = (int32_t*)malloc((size_t)(4 * groups) * sizeof(int32_t));
        int32_t* words = (int32_t*)malloc((size_t)groups * sizeof(int32_t));
        int64_t* start = (int64_t*)malloc((size_t)(blocks + 1) * sizeof(int64_t));
        float* bscale = (float*)malloc((size_t)blocks * sizeof(float));
        int32_t* bcorr = (int32_t*)malloc((size_t)blocks * sizeof(int32_t));
        if (!rows || !words || !start || !bscale || !bcorr) {
            free(rows); free(words); free(start); free(bscale); free(bcorr);
            return 0;
        }
        free(s->rows); free(s->words); free(s->start); free(s->bscale); free(s->bcorr);
        s->rows = rows; s->words = words; s->start = start; s->bscale = bscale; s->bcorr = bcorr;
        s->groups_cap = groups;
        s->blocks_cap = blocks;
    }
    return s;
}

/* Scan, mask and quantize one token into s. Returns the kept count; *finite 0 when a kept input is inf / NaN. */
static int64_t rana_a8_quantize(const float* __restrict x, int64_t K, int64_t block, float t, int mode,
                                const float* __restrict scale, rana_a8_tokens* __restrict s, int* finite) {
    const int64_t blocks = (K + block - 1) / block;
    int64_t g = 0, kept = 0;
    float vals[RANA_A8_BLOCK_MAX];
    int32_t ks[RANA_A8_BLOCK_MAX];
    *finite = 1;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = b * block, k1 = k0 + block < K ? k0 + block : K;
        int n = 0;
        float amax = 0.0f;
        for (int64_t k = k0; k < k1; ++k) {
            const float v = x[k];
            if (v != 0.0f && rana_active(v, t, mode, scale, k)) {
                const float a = v < 0.0f ? -v : v;
                if (!(a <= 3.4028234663852886e38f)) *finite = 0;  /* inf or NaN */
                if (a > amax) amax = a;
                vals[n] = v;
                ks[n++] = (int32_t)k;
            }
        }
        s->start[b] = g;
        if (n == 0) { s->bscale[b] = 0.0f; s->bcorr[b] = 0; continue; }
        const float inv = 127.0f / amax;
        int32_t sum = 0;
        for (int i = 0; i < n; i += 4) {
            uint32_t word = 0;
            for (int j = 0; j < 4; ++j) {
                int32_t code = 0, row = ks[i];
                if (i + j < n) {
                    float r = __builtin_rintf(vals[i + j] * inv);
                    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                    code = (int32_t)r;
                    row = ks[i + j];
                }
                sum += code;
                s->rows[4 * g + j] = row;
                word |= ((uint32_t)(uint8_t)(int8_t)code) << (8 * j);
            }
            s->words[g++] = (int32_t)word;
        }
        s->bscale[b] = amax / 127.0f;
        s->bcorr[b] = 128 * sum;
        kept += n;
    }
    s->start[blocks] = g;
    return kept;
}

/* Per-thread sums of a call's columns: int32 for the open block, fp32 for the finished ones. */
static __thread int32_t* rana_a8_acc = 0;
static __thread float* rana_a8_sum = 0;
static __thread int64_t rana_a8_cols = 0;

static int rana_a8_columns(int64_t width) {
    const int64_t need = (width + 63) / 64 * 64;
    if (need > rana_a8_cols) {
        int32_t* acc = (int32_t*)aligned_alloc(64, (size_t)need * sizeof(int32_t));
        float* sum = (float*)aligned_alloc(64, (size_t)need * sizeof(float));
        if (!acc || !sum) { free(acc); free(sum); return 0; }
        free(rana_a8_acc); free(rana_a8_sum);
        rana_a8_acc = acc; rana_a8_sum = sum; rana_a8_cols = need;
    }
    return 1;
}

/* The portable loop for columns [c0, c1) of the sums (natural order), rows read at w + c0. */
static void rana_a8_cols_c(const int8_t* __restrict w, int64_t ldw, const rana_a8_tokens* __restrict s,
                           int64_t blocks, int64_t c0, int64_t c1, int32_t* __restrict acc, float* __restrict sum) {
    const int64_t width = c1 - c0;
    for (int64_t j = 0; j < width; ++j) { acc[j] = 0; sum[j] = 0.0f; }
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g0 = s->start[b], g1 = s->start[b + 1];
        if (g0 == g1) continue;
        for (int64_t g = g0; g < g1; ++g) {
            const int8_t *r0 = w + s->rows[4 * g] * ldw + c0, *r1 = w + s->rows[4 * g + 1] * ldw + c0;
            const int8_t *r2 = w + s->rows[4 * g + 2] * ldw + c0, *r3 = w + s->rows[4 * g + 3] * ldw + c0;
            const uint32_t word = (uint32_t)s->words[g];
            const int32_t q0 = (int8_t)(word & 255u), q1 = (int8_t)((word >> 8) & 255u);
            const int32_t q2 = (int8_t)((word >> 16) & 255u), q3 = (int8_t)(word >> 24);
            for (int64_t j = 0; j < width; ++j) acc[j] += q0 * r0[j] + q1 * r1[j] + q2 * r2[j] + q3 * r3[j];
        }
        const float sb = s->bscale[b];
        for (int64_t j = 0; j < width; ++j) { sum[j] += sb * (float)acc[j]; acc[j] = 0; }
    }
}

#ifdef RANA_X86
/* The AVX-512 VNNI loop, block by block and, inside a block, 128 columns at a time: the block's groups are summed
   into eight int32 registers (started at -128 * sum q, the offset's correction), which are scaled into the fp32
   sums once, so no int32 sum goes to memory and a block costs one fp32 update per column however few rows it
   keeps. The block's rows are read side by side, 128 bytes of each per step, while the first lines of the next
   block's rows are prefetched (short rows, a down projection's, are over before the hardware prefetcher starts). */
/* Lines [l0, l1) (byte offsets, only those within the first RANA_A8_LINES lines) of `count` rows listed in
   `rows`: the next block's rows, fetched while a block is summed. */
static inline void rana_a8_prefetch_lines(const int8_t* w, int64_t ldw, const int32_t* rows, int64_t count,
                                          int64_t l0, int64_t l1) {
    if (l1 > 64 * RANA_A8_LINES) l1 = 64 * RANA_A8_LINES;
    for (int64_t l = l0; l < l1; l += 64)
        for (int64_t p = 0; p < count; ++p) __builtin_prefetch(w + rows[p] * ldw + l, 0, 1);
}

/* The first block's rows, before the loop reaches them. */
static inline void rana_a8_prefetch_first(const int8_t* w, int64_t ldw, const rana_a8_tokens* s, int64_t blocks,
                                          int64_t width) {
    const int64_t total = 4 * s->start[blocks];
    rana_a8_prefetch_lines(w, ldw, s->rows, total < RANA_A8_AHEAD ? total : RANA_A8_AHEAD, 0, width);
}

/* One group's 4 rows, columns [c, c + 64), into the four int32 sums `acc` (in the interleave's order). */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void rana_vnni_group(const int8_t* const* r, int64_t c, __m512i word, __m512i offset, __m512i* acc) {
    const __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(r[0] + c)), offset);
    const __m512i a1 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(r[1] + c)), offset);
    const __m512i a2 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(r[2] + c)), offset);
    const __m512i a3 = _mm512_xor_si512(_mm512_loadu_si512((const void*)(r[3] + c)), offset);
    const __m512i t0 = _mm512_unpacklo_epi8(a0, a1), t1 = _mm512_unpackhi_epi8(a0, a1);
    const __m512i t2 = _mm512_unpacklo_epi8(a2, a3), t3 = _mm512_unpackhi_epi8(a2, a3);
    acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_unpacklo_epi16(t0, t2), word);
    acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_unpackhi_epi16(t0, t2), word);
    acc[2] = _mm512_dpbusd_epi32(acc[2], _mm512_unpacklo_epi16(t1, t3), word);
    acc[3] = _mm512_dpbusd_epi32(acc[3], _mm512_unpackhi_epi16(t1, t3), word);
}

/* sum[0, 64) += s_b * the four int32 sums. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void rana_vnni_flush(const __m512i* acc, __m512 sb, float* sum) {
    for (int i = 0; i < 4; ++i)
        _mm512_store_ps(sum + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), sb, _mm512_load_ps(sum + 16 * i)));
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void rana_a8_cols_vnni(const int8_t* __restrict w, int64_t ldw, const rana_a8_tokens* __restrict s,
                              int64_t blocks, int64_t width, float* __restrict sum) {
    /* width: a multiple of 64; sums in the interleave's order */
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int64_t j = 0; j < width; j += 16) _mm512_store_ps(sum + j, _mm512_setzero_ps());
    const int8_t* rows[4 * (RANA_A8_BLOCK_MAX / 4 + 1)];  /* a block's rows, its padded last group included */
    rana_a8_prefetch_first(w, ldw, s, blocks, width);
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g0 = s->start[b], n = 4 * (s->start[b + 1] - g0);
        if (n == 0) continue;
        for (int64_t p = 0; p < n; ++p) rows[p] = w + s->rows[4 * g0 + p] * ldw;
        const int64_t ahead = 4 * g0 + n, total = 4 * s->start[blocks];
        const int64_t na = total - ahead < RANA_A8_AHEAD ? total - ahead : RANA_A8_AHEAD;
        const __m512i corr = _mm512_set1_epi32(-s->bcorr[b]);
        const __m512 sb = _mm512_set1_ps(s->bscale[b]);
        const int32_t* words = s->words + g0;
        int64_t c = 0;
        for (; c + 128 <= width; c += 128) {  /* two chunks per step: 128 bytes of each row */
            rana_a8_prefetch_lines(w, ldw, s->rows + ahead, na, c, c + 128);
            __m512i sums[8] = {corr, corr, corr, corr, corr, corr, corr, corr};
            for (int64_t p = 0; p < n; p += 4) {
                const __m512i word = _mm512_set1_epi32(words[p / 4]);
                rana_vnni_group(rows + p, c, word, offset, sums);
                rana_vnni_group(rows + p, c + 64, word, offset, sums + 4);
            }
            rana_vnni_flush(sums, sb, sum + c);
            rana_vnni_flush(sums + 4, sb, sum + c + 64);
        }
        if (c < width) {  /* the last 64 columns */
            rana_a8_prefetch_lines(w, ldw, s->rows + ahead, na, c, c + 64);
            __m512i sums[4] = {corr, corr, corr, corr};
            for (int64_t p = 0; p < n; p += 4)
                rana_vnni_group(rows + p, c, _mm512_set1_epi32(words[p / 4]), offset, sums);
            rana_vnni_flush(sums, sb, sum + c);
        }
    }
    /* back in column order: chunk vectors v0..v3 hold columns {0-3,16-19,32-35,48-51} + 4i */
    for (int64_t c = 0; c < width; c += 64) {
        const __m512 v0 = _mm512_load_ps(sum + c), v1 = _mm512_load_ps(sum + c + 16);
        const __m512 v2 = _mm512_load_ps(sum + c + 32), v3 = _mm512_load_ps(sum + c + 48);
        const __m512 t0 = _mm512_shuffle_f32x4(v0, v1, 0x44), t1 = _mm512_shuffle_f32x4(v0, v1, 0xEE);
        const __m512 t2 = _mm512_shuffle_f32x4(v2, v3, 0x44), t3 = _mm512_shuffle_f32x4(v2, v3, 0xEE);
        _mm512_store_ps(sum + c, _mm512_shuffle_f32x4(t0, t2, 0x88));
        _mm512_store_ps(sum + c + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
        _mm512_store_ps(sum + c + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
        _mm512_store_ps(sum + c + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
    }
}

/* The AVX2 loop, in the VNNI loop's order (block by block, 32 columns at a time, the block's int32 sums in four
   registers, rows read side by side, the next block's rows prefetched meanwhile). */
__attribute__((target("avx2,fma")))
static void rana_a8_cols_avx2(const int8_t* __restrict w, int64_t ldw, const rana_a8_tokens* __restrict s,
                              int64_t blocks, int64_t width, float* __restrict sum) {
    /* width: a multiple of 32; sums in the interleave's order */
    const __m256i ones = _mm256_set1_epi16(1), floor = _mm256_set1_epi8(-127);
    for (int64_t j = 0; j < width; j += 8) _mm256_store_ps(sum + j, _mm256_setzero_ps());
    const int8_t* rows[4 * (RANA_A8_BLOCK_MAX / 4 + 1)];
    rana_a8_prefetch_first(w, ldw, s, blocks, width);
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g0 = s->start[b], n = 4 * (s->start[b + 1] - g0);
        if (n == 0) continue;
        for (int64_t p = 0; p < n; ++p) rows[p] = w + s->rows[4 * g0 + p] * ldw;
        const int64_t ahead = 4 * g0 + n, total = 4 * s->start[blocks];
        const int64_t na = total - ahead < RANA_A8_AHEAD ? total - ahead : RANA_A8_AHEAD;
        const __m256 sb = _mm256_set1_ps(s->bscale[b]);
        const int32_t* words = s->words + g0;
        for (int64_t c = 0; c < width; c += 32) {
            if (c % 64 == 0) rana_a8_prefetch_lines(w, ldw, s->rows + ahead, na, c, c + 64);
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t p = 0; p < n; p += 4) {
                const __m256i word = _mm256_set1_epi32(words[p / 4]);
                const __m256i mag = _mm256_abs_epi8(word);
                /* codes are -127..127; -128 (never written by rana) is read as -127 so that signing it cannot wrap */
                const __m256i a0 = _mm256_max_epi8(_mm256_loadu_si256((const __m256i*)(rows[p] + c)), floor);
                const __m256i a1 = _mm256_max_epi8(_mm256_loadu_si256((const __m256i*)(rows[p + 1] + c)), floor);
                const __m256i a2 = _mm256_max_epi8(_mm256_loadu_si256((const __m256i*)(rows[p + 2] + c)), floor);
                const __m256i a3 = _mm256_max_epi8(_mm256_loadu_si256((const __m256i*)(rows[p + 3] + c)), floor);
                const __m256i t0 = _mm256_unpacklo_epi8(a0, a1), t1 = _mm256_unpackhi_epi8(a0, a1);
                const __m256i t2 = _mm256_unpacklo_epi8(a2, a3), t3 = _mm256_unpackhi_epi8(a2, a3);
                /* |q| x (w signed by q): pairs within +-2 * 127 * 127, no int16 saturation */
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                    mag, _mm256_sign_epi8(_mm256_unpacklo_epi16(t0, t2), word)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                    mag, _mm256_sign_epi8(_mm256_unpackhi_epi16(t0, t2), word)), ones));
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_maddubs_epi16(
                    mag, _mm256_sign_epi8(_mm256_unpacklo_epi16(t1, t3), word)), ones));
                s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_maddubs_epi16(
                    mag, _mm256_sign_epi8(_mm256_unpackhi_epi16(t1, t3), word)), ones));
            }
            float* sc = sum + c;
            _mm256_store_ps(sc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), sb, _mm256_load_ps(sc)));
            _mm256_store_ps(sc + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), sb, _mm256_load_ps(sc + 8)));
            _mm256_store_ps(sc + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), sb, _mm256_load_ps(sc + 16)));
            _mm256_store_ps(sc + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), sb, _mm256_load_ps(sc + 24)));
        }
    }
    /* back in column order: chunk vectors v0..v3 hold columns {0-3,16-19} + 4i */
    for (int64_t c = 0; c < width; c += 32) {
        const __m256 v0 = _mm256_load_ps(sum + c), v1 = _mm256_load_ps(sum + c + 8);
        const __m256 v2 = _mm256_load_ps(sum + c + 16), v3 = _mm256_load_ps(sum + c + 24);
        _mm256_store_ps(sum + c, _mm256_permute2f128_ps(v0, v1, 0x20));
        _mm256_store_ps(sum + c + 8, _mm256_permute2f128_ps(v2, v3, 0x20));
        _mm256_store_ps(sum + c + 16, _mm256_permute2f128_ps(v0, v1, 0x31));
        _mm256_store_ps(sum + c + 24, _mm256_permute2f128_ps(v2, v3, 0x31));
    }
}
#endif

/* The widest W8A8 loop this CPU and this build can run (RANA_ISA_*). */
int rana_a8_isa_best(void) {
#ifdef RANA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return RANA_ISA_AVX512_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return RANA_ISA_AVX2;
#endif
    return RANA_ISA_SCALAR;
}

/* Columns [j0, j1) of y: the vector loop on the whole chunks, the portable loop on the rest. */
static void rana_a8_range(const int8_t* __restrict w, const float* __restrict qscale, int64_t ldw,
                          const rana_a8_tokens* __restrict s, int64_t blocks, int isa, int64_t j0, int64_t j1,
                          const float* __restrict bias, float* __restrict y) {
    const int64_t width = j1 - j0;
    int64_t vec = 0;
    if (!rana_a8_columns(width)) {  /* no scratch: the portable loop in fixed-size pieces on the stack */
        int32_t acc[256];
        float sum[256];
        for (int64_t c = j0; c < j1; c += 256) {
            const int64_t e = c + 256 < j1 ? c + 256 : j1;
            rana_a8_cols_c(w, ldw, s, blocks, c, e, acc, sum);
            for (int64_t j = c; j < e; ++j) y[j] = sum[j - c] * qscale[j] + (bias ? bias[j] : 0.0f);
        }
        return;
    }
    int32_t* acc = rana_a8_acc;
    float* sum = rana_a8_sum;
#ifdef RANA_X86
    if (isa >= RANA_ISA_AVX512_VNNI) {
        vec = width / 64 * 64;
        if (vec) rana_a8_cols_vnni(w + j0, ldw, s, blocks, vec, sum);
    } else if (isa == RANA_ISA_AVX2) {
        vec = width / 32 * 32;
        if (vec) rana_a8_cols_avx2(w + j0, ldw, s, blocks, vec, sum);
    }
#endif
    if (vec < width) rana_a8_cols_c(w, ldw, s, blocks, j0 + vec, j1, acc + vec, sum + vec);
    const float* sj = qscale + j0;
    float* yj = y + j0;
    if (bias) {
        const float* bj = bias + j0;
        for (int64_t j = 0; j < width; ++j) yj[j] = sum[j] * sj[j] + bj[j];
    } else {
        for (int64_t j = 0; j < width; ++j) yj[j] = sum[j] * sj[j];
    }
}

__attribute__((noinline))
static int64_t rana_masked_a8(const int8_t* __restrict w, const float* __restrict qscale, const float* __restrict x,
                              int64_t K, int64_t N, int64_t ldw, int64_t block, float t, int mode,
                              const float* __restrict scale, const float* __restrict bias, float* __restrict y,
                              int isa, int threads) {
    if (block < 1 || block > RANA_A8_BLOCK_MAX) return -1;  /* Python binds 1..RANA_A8_BLOCK_MAX only */
    rana_a8_tokens* s = rana_a8_scratch(K, block);
    if (!s) return -1;
    int finite;
    const int64_t kept = rana_a8_quantize(x, K, block, t, mode, scale, s, &finite);
    if (!finite) {  /* an inf / NaN input: no scale quantizes it; the output is NaN, as a float product's */
        for (int64_t j = 0; j < N; ++j) y[j] = __builtin_nanf("");
        return kept;
    }
    const int64_t blocks = (K + block - 1) / block;
#ifdef _OPENMP
    if (threads > 1 && N >= 128 * threads) {
        #pragma omp parallel num_threads(threads)
        {
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            const int64_t chunk = ((N + nt - 1) / nt + 63) / 64 * 64;  /* whole cache lines of int8 */
            const int64_t j0 = tid * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
            if (j0 < j1) rana_a8_range(w, qscale, ldw, s, blocks, isa, j0, j1, bias, y);
        }
        return kept;
    }
#endif
    rana_a8_range(w, qscale, ldw, s, blocks, isa, 0, N, bias, y);
    return kept;
}

/* One projection's operands, bound once by Python (cpu_gemv.NativeCall; its _Operands mirrors this struct). */
typedef struct {
    const void* w;        /* K rows of N weights, row stride ldw: float, or int8 codes */
    const float* qscale;  /* int8: the N per-output-channel scales; unused for float weights */
    const float* scale;   /* RANA_MODE_ABS_SCALED: the K column norms */
    const float* bias;    /* N values, or 0 */
    int64_t K, N, ldw;
    int64_t mode;
    int64_t isa;          /* int8 activations: the inner loop (RANA_ISA_*, at most rana_a8_isa_best()) */
    int64_t block;        /* int8 activations: the inputs quantized per scale (1..RANA_A8_BLOCK_MAX) */
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

/* int8 weights x int8 activations (W8A8): the same five arguments as rana_masked_gemv_i8; the kept inputs are
   quantized per block of the operands' `block` positions (rana_a8_quantize) and multiplied int8 x int8 with int32
   sums by the operands' `isa` loop. Returns the kept count, or -1 when no scratch could be allocated. */
int64_t rana_masked_gemv_a8(const rana_operands* __restrict op, const float* __restrict x, float t,
                            float* __restrict y, int threads) {
    return rana_masked_a8((const int8_t*)op->w, op->qscale, x, op->K, op->N, op->ldw, op->block, t, (int)op->mode,
                          op->scale, op->bias, y, (int)op->isa, threads);
}

/* Sibling projections that read one token (q/k/v, gate/up, a serving engine's fused layer), bound once as a
   group: one call computes each projection's masked GEMV into its own columns of one output row, so a layer
   pays one crossing from Python instead of one per projection, and no per-projection output, threshold read or
   concatenation. `format[p]`: RANA_GROUP_FLOAT (fp32 weights; always multiplied: no dense-BLAS branch, so a
   token's result never depends on what earlier tokens kept), RANA_GROUP_I8 (int8 weights, fp32 tokens) or
   RANA_GROUP_A8 (int8 x int8). */
#define RANA_GROUP_FLOAT 0
#define RANA_GROUP_I8 1
#define RANA_GROUP_A8 2
typedef struct {
    const rana_operands* ops;  /* P bound operands */
    const float* t;            /* P thresholds (-inf for RANA_MODE_NONE) */
    const int64_t* offset;     /* P: the column of y where projection p's N outputs start */
    const int64_t* format;     /* P: RANA_GROUP_* */
    int64_t P;
} rana_group;

#define RANA_GROUP_MAX 16            /* projections in one group's parallel path */
#define RANA_GROUP_MAX_THREADS 64    /* threads whose accumulators the narrow-row path sums */
#define RANA_GROUP_ROWS_WIDTH 8192   /* widest group (outputs) the narrow-row path takes */
static int rana_group_all_float(const rana_group* g) {
    if (g->P > RANA_GROUP_MAX) return 0;
    for (int64_t p = 0; p < g->P; ++p)
        if (g->format[p] != RANA_GROUP_FLOAT || g->ops[p].K != g->ops[0].K) return 0;
    return 1;
}

/* y[offset[p] : offset[p] + N_p] = projection p's masked GEMV of x, for every p (the projections' columns do
   not overlap; the columns between them are not written). Returns the kept count summed over the projections,
   or -1 when a scratch buffer could not be grown (y then partly written: the caller recomputes it by its other
   path). */
int64_t rana_masked_gemv_group(const rana_group* __restrict g, const float* __restrict x, float* __restrict y,
                               int threads) {
    int64_t total = 0;
#ifdef _OPENMP
    if (threads > 1 && rana_group_all_float(g)) {
        /* fp32 weights on several threads: every projection's kept rows listed first, then one parallel
           region for the whole group (one fork and join per layer instead of one per projection) */
        const int64_t K = g->ops[0].K, P = g->P;
        int32_t* idx = rana_index_scratch(K * P);
        if (!idx) return -1;
        int64_t n[RANA_GROUP_MAX];
        for (int64_t p = 0; p < P; ++p) {
            const rana_operands* op = g->ops + p;
            int32_t* ip = idx + p * K;
            int64_t c = 0;
            for (int64_t k = 0; k < K; ++k)
                if (rana_active(x[k], g->t[p], (int)op->mode, op->scale, k)) ip[c++] = (int32_t)k;
            n[p] = c;
            total += c;
            float* yp = y + g->offset[p];
            if (op->bias) memcpy(yp, op->bias, (size_t)op->N * sizeof(float));
            else memset(yp, 0, (size_t)op->N * sizeof(float));
        }
        int64_t lo = g->offset[0], hi = g->offset[0] + g->ops[0].N;  /* the group's columns of y */
        for (int64_t p = 1; p < P; ++p) {
            if (g->offset[p] < lo) lo = g->offset[p];
            if (g->offset[p] + g->ops[p].N > hi) hi = g->offset[p] + g->ops[p].N;
        }
        const int64_t width = hi - lo;
        if (width <= RANA_GROUP_ROWS_WIDTH && threads <= RANA_GROUP_MAX_THREADS) {
            /* narrow rows (a layer's projections): each thread takes a share of every projection's kept rows
               whole, into its own accumulator (thread 0: y), then the accumulators are summed column-wise.
               Whole rows are longer contiguous reads than half rows: 3-5 % faster per SmolLM2 step at 2
               threads than splitting the columns. (The sum order then depends on the thread count.) */
            float* parts[RANA_GROUP_MAX_THREADS];
            int failed = 0;
            #pragma omp parallel num_threads(threads)
            {
                const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
                float* acc = tid ? rana_row_scratch(width) : y + lo;  /* column lo + j at acc[j] */
                if (acc && tid) memset(acc, 0, (size_t)width * sizeof(float));
                parts[tid] = acc;
                if (!acc) {
                    #pragma omp atomic write
                    failed = 1;
                }
                if (acc) {
                    for (int64_t p = 0; p < P; ++p) {
                        const rana_operands* op = g->ops + p;
                        const int64_t i0 = n[p] * tid / nt, i1 = n[p] * (tid + 1) / nt;
                        rana_accumulate((const float*)op->w, x, idx + p * K + i0, i1 - i0, op->ldw, 0, op->N,
                                        acc + (g->offset[p] - lo));
                    }
                }
                #pragma omp barrier
                if (!failed) {
                    for (int64_t p = 0; p < P; ++p) {  /* each projection's own columns only */
                        const int64_t N = g->ops[p].N, at = g->offset[p] - lo;
                        const int64_t chunk = ((N + nt - 1) / nt + 15) / 16 * 16;
                        const int64_t j0 = tid * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
                        for (int64_t q = 1; q < nt; ++q)
                            for (int64_t j = j0; j < j1; ++j) y[lo + at + j] += parts[q][at + j];
                    }
                }
            }
            return failed ? -1 : total;
        }
        /* wide rows (an LM head): the columns split over the threads, one parallel region for the group */
        #pragma omp parallel num_threads(threads)
        {
            const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
            for (int64_t p = 0; p < P; ++p) {
                const rana_operands* op = g->ops + p;
                const int64_t chunk = ((op->N + nt - 1) / nt + 15) / 16 * 16;  /* whole cache lines */
                const int64_t j0 = tid * chunk, j1 = j0 + chunk < op->N ? j0 + chunk : op->N;
                if (j0 < j1)
                    rana_accumulate((const float*)op->w, x, idx + p * K, n[p], op->ldw, j0, j1, y + g->offset[p]);
            }
        }
        return total;
    }
#endif
    for (int64_t p = 0; p < g->P; ++p) {
        const rana_operands* op = g->ops + p;
        float* yp = y + g->offset[p];
        int64_t n;
        if (g->format[p] == RANA_GROUP_A8) {
            n = rana_masked_a8((const int8_t*)op->w, op->qscale, x, op->K, op->N, op->ldw, op->block, g->t[p],
                               (int)op->mode, op->scale, op->bias, yp, (int)op->isa, threads);
        } else {
            int32_t* idx = rana_index_scratch(op->K);
            if (!idx) return -1;
            if (g->format[p] == RANA_GROUP_I8)
                n = rana_masked_i8((const int8_t*)op->w, op->qscale, x, op->K, op->N, op->ldw, g->t[p],
                                   (int)op->mode, op->scale, op->bias, yp, idx, threads);
            else
                n = rana_masked_f32((const float*)op->w, x, op->K, op->N, op->ldw, g->t[p], (int)op->mode,
                                    op->scale, op->bias, yp, op->K, 0, idx, threads);
        }
        if (n < 0) return -1;
        total += n;
    }
    return total;
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
