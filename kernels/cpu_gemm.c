/* y = x W^T (+ b) for a batch of rows, W packed once when the model loads: the linear layers of
 * every step on a CPU, from one row (a decode at concurrency 1) to a prompt's thousands.
 *
 * W is packed into panels of NR output columns (two vectors of the build's width: 16 columns with
 * AVX2, 32 with AVX-512). A panel holds its columns for every k, in one of three formats:
 *   float32:  [K][NR] floats;
 *   float16:  [K][NR] halves, widened to floats in registers as they are read;
 *   bfloat16: [ceil(K / 2)][NR] pairs, each 32 bits holding W[n][k] (low half) and W[n][k + 1] (high
 *             half): the layout of the AVX512-BF16 dot product, which multiplies such pairs by pairs
 *             of x and adds both products into a float32 lane. Without it a pair becomes two float
 *             vectors with one shift and one mask, and x stays float32.
 * A tile is up to MR rows of x against one panel, in 2 x MR vector accumulators, so the multiply-
 * add units and not the loads set the pace. A panel streams from memory in one run and stays in the
 * second-level cache while every tile of rows passes over it, and the first PREFETCH_TILES tiles
 * over a panel each prefetch their share of a later one into that cache, every line of it at an
 * even pace: the reads from memory overlap the arithmetic of several passes rather than stalling the
 * first (docs/kernel-measurements.md). A decode's few rows (3 to STREAM_ROWS) go over a panel in blocks of k that the
 * first-level cache holds, every tile over a block before the next, the tiles sharing the prefetch of the
 * block after: a panel then streams from memory at one steady pace (panel_sums). Up to MR rows (one tile)
 * are bound by the reads alone, and there the hardware's own prefetch streams the panels faster without
 * ours (docs/kernel-measurements.md). For a prompt's many rows, blocking as BLIS does, rows packed into
 * micro-panels and K cut so that a panel's block stays in the first-level cache, was faster on one
 * thread at 2,048 rows but not on two sharing a call (docs/kernel-measurements.md), so it is not done. A prompt's
 * many rows are cut into blocks of ROW_BLOCK_BYTES of x (half the smallest second-level cache seen),
 * which the threads take in turn, each block's panels shared.
 *
 * x: [M, K] floats with rows x_stride apart (bfloat16 rows of even length where
 * gemm_bf16_reads_bf16_rows() says so); y: [M, N] with rows y_stride apart; bias: [N] or NULL.
 * A gated MLP's gate and up projections (halves > 0: N = 2 x halves) are packed in pairs of panels, a gate
 * panel and the up panel of the same columns (kernels/cpu_linear.py), so that a tile of rows has both
 * sums at hand: with an activation (act), y gets SiLU(gate) x up, [M, halves], as it is stored, rather
 * than both halves in float32 for another pass to read back; without, each half's columns as unpaired.
 * Threads share a call by claiming its chunks (claims.h): units_per_chunk panels, or pairs of them, of one
 * block of rows; the caller, wait != 0, returns once every chunk is done. Sums run in float32.
 *
 * Written with GCC's vector extensions, so one source serves every instruction set the package
 * builds (kernels/native.py): GEMM_VEC floats a vector (16 where AVX-512 is built in, else 8; a
 * build may set it, and a width the machine lacks is carried out in halves, which the tests use
 * to run the AVX-512 layout on an AVX2 machine), and GEMM_BF16_DOT_EMULATED has the bfloat16
 * format take bfloat16 rows as the dot product does, computed without it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "claims.h"
#include "silu.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef GEMM_VEC
#ifdef __AVX512F__
#define GEMM_VEC 16
#else
#define GEMM_VEC 8
#endif
#endif

#if defined(__AVX512BF16__) && GEMM_VEC == 16
#define BF16_DOT 1 /* the instruction */
#elif defined(GEMM_BF16_DOT_EMULATED)
#define BF16_DOT 2 /* its arithmetic, in plain multiply-adds */
#else
#define BF16_DOT 0
#endif
#if BF16_DOT == 2
#define BF16_NOTE ", bfloat16 rows as by the dot product"
#else
#define BF16_NOTE ""
#endif

/* Without a vector unit as wide as these vectors, GCC's note that passing one changes the ABI says
 * nothing: none crosses a call (every such function is inlined). */
#pragma GCC diagnostic ignored "-Wpsabi"

#define MR 6
#define NR (2 * GEMM_VEC)
#define MC 48 /* rows per block: their x stays in the second-level cache while the block passes a panel */
#ifndef ROW_BLOCK_BYTES
#define ROW_BLOCK_BYTES (256 << 10) /* x of a call's block of rows, held in the second-level cache (gemm) */
#endif
#define PREFETCH_MIN_ROWS 3
#define STREAM_ROWS 32 /* up to this many rows, a panel goes in blocks of k, each block's tiles in turn (panel_sums) */
#define AMX_STREAM_ROWS 63 /* the same for 4-bit codes in AMX tiles (amx_codes.h): up to a prompt's product's rows */
#define STREAM_BLOCK_BYTES 8192 /* such a block of a panel */
#define PREFETCH_TILES 4 /* tiles over a panel that share the prefetch of a later one: more add nothing once the rows are many */
#define PREFETCH_PANELS 2 /* how far ahead that panel is: a slow read has a whole panel's passes to arrive (even: paired
                           * panels prefetch the pair as far ahead) */

enum weight_kind { W_F32, W_F16, W_BF16 };
enum activation { ACT_NONE, ACT_SILU_F32, ACT_SILU_BF16 }; /* what y holds for paired panels */

typedef float vf __attribute__((vector_size(4 * GEMM_VEC)));
typedef uint32_t vu __attribute__((vector_size(4 * GEMM_VEC)));
typedef float vf_unaligned __attribute__((vector_size(4 * GEMM_VEC), aligned(4)));
typedef uint32_t vu_unaligned __attribute__((vector_size(4 * GEMM_VEC), aligned(4)));

static inline __attribute__((always_inline)) vf load_floats(const float *p) { return *(const vf_unaligned *)p; }
static inline __attribute__((always_inline)) vu load_words(const void *p) { return *(const vu_unaligned *)p; }
static inline __attribute__((always_inline)) vf splat(float s) { return (vf){0} + s; }
static inline __attribute__((always_inline)) vf as_floats(vu bits) { return (vf)bits; }

/* GEMM_VEC float16 values as floats: F16C's conversion where the build has it, else the bits moved
 * into float32's fields (normal numbers rebiased 15 -> 127, subnormals as mantissa x 2^-24). */
static inline __attribute__((always_inline)) vf halves_to_floats(const uint16_t *p)
{
#if GEMM_VEC == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    vf out;
    for (int part = 0; part < GEMM_VEC / 8; part++) {
        const __m256 eight = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8 * part)));
        memcpy((float *)&out + 8 * part, &eight, sizeof eight);
    }
    return out;
#else
    vu h;
    for (int i = 0; i < GEMM_VEC; i++)
        h[i] = p[i];
    const vu exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, sign = (h & 0x8000) << 16;
    const vu normal = ((exponent + 112) << 23) | (mantissa << 13);
    const vu special = 0x7f800000u | (mantissa << 13); /* infinities and NaNs */
    const vf subnormal = __builtin_convertvector(mantissa, vf) * 0x1p-24f;
    const vu is_normal = (exponent != 0) & (exponent != 31), is_special = exponent == 31;
    const vu bits = (normal & is_normal) | (special & is_special) | ((vu)subnormal & ~(is_normal | is_special));
    return as_floats(bits | sign);
#endif
}

/* acc + the products of the bfloat16 pairs in `x_pair` (broadcast) and in each lane of `w`. */
static inline __attribute__((always_inline)) vf dot_pairs(vf acc, uint32_t x_pair, vu w)
{
#if BF16_DOT == 1
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)(__m512i)((vu){0} + x_pair), (__m512bh)(__m512i)w);
#else
    const vu x = (vu){0} + x_pair;
    return acc + as_floats(x << 16) * as_floats(w << 16) + as_floats(x & 0xffff0000u) * as_floats(w & 0xffff0000u);
#endif
}

/* Row r's sums, plus the bias, into y: whole vectors for a full panel, through a row buffer for the
 * last, partial one. */
static inline __attribute__((always_inline)) void store_row(vf a, vf b, const float *bias, float *y, int64_t cols)
{
    if (cols == NR) {
        if (bias) {
            a += load_floats(bias);
            b += load_floats(bias + GEMM_VEC);
        }
        *(vf_unaligned *)y = a;
        *(vf_unaligned *)(y + GEMM_VEC) = b;
        return;
    }
    float row[NR];
    memcpy(row, &a, sizeof a);
    memcpy(row + GEMM_VEC, &b, sizeof b);
    for (int64_t c = 0; c < cols; c++)
        y[c] = row[c] + (bias ? bias[c] : 0.0f);
}

/* Step `step` of a tile's share of a later panel: the line at ahead + step * pf_stride, and the next for a stride
 * past one line (none where ahead is NULL). */
static inline __attribute__((always_inline)) void prefetch_step(const char *ahead, int64_t step, int64_t pf_stride)
{
    if (!ahead)
        return;
    __builtin_prefetch(ahead + step * pf_stride, 0, 2);
    if (pf_stride > 64)
        __builtin_prefetch(ahead + step * pf_stride + 64, 0, 2);
}

/* `rows` rows of x against kc values of k of one panel, added into the accumulators: inlined into its callers, whose
 * locals nothing takes the address of, so they stay in registers for the whole run. Where `ahead` is given, each step
 * of k prefetches its part of what comes later (prefetch_step). */
static inline __attribute__((always_inline)) void tile_steps(
    const int rows, const int kind, const char *x, int64_t x_stride, const char *w, int64_t kc, vf *acc0, vf *acc1,
    const char *ahead, int64_t pf_stride)
{
    if (kind == W_BF16 && BF16_DOT) {
        const uint32_t *xw = (const uint32_t *)x; /* bfloat16 rows: x_stride counts bfloat16 values */
        for (int64_t p = 0; p < kc / 2; p++) {
            prefetch_step(ahead, p, pf_stride);
            const vu w0 = load_words(w + p * NR * 4), w1 = load_words(w + p * NR * 4 + 4 * GEMM_VEC);
            for (int r = 0; r < rows; r++) {
                const uint32_t pair = xw[r * x_stride / 2 + p];
                acc0[r] = dot_pairs(acc0[r], pair, w0);
                acc1[r] = dot_pairs(acc1[r], pair, w1);
            }
        }
    } else if (kind == W_BF16) {
        const float *xf = (const float *)x;
        for (int64_t p = 0; 2 * p < kc; p++) {
            prefetch_step(ahead, p, pf_stride);
            const vu w0 = load_words(w + p * NR * 4), w1 = load_words(w + p * NR * 4 + 4 * GEMM_VEC);
            const vf low0 = as_floats(w0 << 16), low1 = as_floats(w1 << 16);
            for (int r = 0; r < rows; r++) {
                const vf v = splat(xf[r * x_stride + 2 * p]);
                acc0[r] += v * low0;
                acc1[r] += v * low1;
            }
            if (2 * p + 1 == kc)
                break; /* an odd K's last pair holds one weight and a zero */
            /* The pairs read again rather than held (six rows leave sixteen registers no room): an
             * address the compiler cannot see through keeps it from reusing the first reads. */
            const char *again = w + p * NR * 4;
            __asm__("" : "+r"(again));
            const vf high0 = as_floats(load_words(again) & 0xffff0000u);
            const vf high1 = as_floats(load_words(again + 4 * GEMM_VEC) & 0xffff0000u);
            for (int r = 0; r < rows; r++) {
                const vf v = splat(xf[r * x_stride + 2 * p + 1]);
                acc0[r] += v * high0;
                acc1[r] += v * high1;
            }
        }
    } else {
        const float *xf = (const float *)x;
        const int64_t row_bytes = NR * (kind == W_F16 ? 2 : 4);
        for (int64_t k = 0; k < kc; k++) {
            prefetch_step(ahead, k, pf_stride);
            vf w0, w1;
            if (kind == W_F16) {
                w0 = halves_to_floats((const uint16_t *)(w + k * row_bytes));
                w1 = halves_to_floats((const uint16_t *)(w + k * row_bytes) + GEMM_VEC);
            } else {
                w0 = load_floats((const float *)(w + k * row_bytes));
                w1 = load_floats((const float *)(w + k * row_bytes) + GEMM_VEC);
            }
            for (int r = 0; r < rows; r++) {
                const vf v = splat(xf[r * x_stride + k]);
                acc0[r] += v * w0;
                acc1[r] += v * w1;
            }
        }
    }
}

/* A tile: `rows` rows of x against one panel over all of k, stored into y with the bias. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const int kind, const char *x, int64_t x_stride, const char *w, int64_t K,
    const float *bias, float *y, int64_t y_stride, int64_t cols, const char *ahead, int64_t pf_stride)
{
    vf acc0[MR], acc1[MR];
    for (int r = 0; r < rows; r++)
        acc0[r] = acc1[r] = (vf){0};
    tile_steps(rows, kind, x, x_stride, w, K, acc0, acc1, ahead, pf_stride);
    for (int r = 0; r < rows; r++)
        store_row(acc0[r], acc1[r], bias, y + r * y_stride, cols);
}

/* A tile over one block of k: its rows' sums so far, rows of `sums` NR floats apart, taken into registers, the block
 * added, and put back. */
static inline __attribute__((always_inline)) void tile_block(
    const int rows, const int kind, const char *x, int64_t x_stride, const char *w, int64_t kc, float *sums,
    const char *ahead, int64_t pf_stride)
{
    vf acc0[MR], acc1[MR];
    for (int r = 0; r < rows; r++) {
        acc0[r] = load_floats(sums + r * NR);
        acc1[r] = load_floats(sums + r * NR + GEMM_VEC);
    }
    tile_steps(rows, kind, x, x_stride, w, kc, acc0, acc1, ahead, pf_stride);
    for (int r = 0; r < rows; r++) {
        *(vf_unaligned *)(sums + r * NR) = acc0[r];
        *(vf_unaligned *)(sums + r * NR + GEMM_VEC) = acc1[r];
    }
}

/* FN(rows, kind, ...) with the row count and the weight kind as constants, so that each of its inlined bodies keeps
 * its accumulators in registers: the one dispatch both tile_of and block_of go through. */
#define BY_ROWS(FN, KIND, ...)                                                                          \
    switch (rows) {                                                                                     \
    case 6: FN(6, KIND, __VA_ARGS__); break;                                                            \
    case 5: FN(5, KIND, __VA_ARGS__); break;                                                            \
    case 4: FN(4, KIND, __VA_ARGS__); break;                                                            \
    case 3: FN(3, KIND, __VA_ARGS__); break;                                                            \
    case 2: FN(2, KIND, __VA_ARGS__); break;                                                            \
    default: FN(1, KIND, __VA_ARGS__);                                                                  \
    }
#define BY_ROWS_AND_KIND(FN, ...)                                                                       \
    switch (kind) {                                                                                     \
    case W_F32: BY_ROWS(FN, W_F32, __VA_ARGS__) break;                                                  \
    case W_F16: BY_ROWS(FN, W_F16, __VA_ARGS__) break;                                                  \
    default: BY_ROWS(FN, W_BF16, __VA_ARGS__)                                                           \
    }

static void tile_of(const int kind, int rows, const char *xm, int64_t x_stride, const char *w, int64_t kc,
                    const float *bias, float *ym, int64_t y_stride, int64_t cols, const char *ahead,
                    int64_t pf_stride)
{
    BY_ROWS_AND_KIND(tile, xm, x_stride, w, kc, bias, ym, y_stride, cols, ahead, pf_stride)
}

static void block_of(const int kind, int rows, const char *xm, int64_t x_stride, const char *w, int64_t kc,
                     float *sums, const char *ahead, int64_t pf_stride)
{
    BY_ROWS_AND_KIND(tile_block, xm, x_stride, w, kc, sums, ahead, pf_stride)
}
#undef BY_ROWS_AND_KIND
#undef BY_ROWS

/* Rows r < M of a panel's sums (rows NR apart) into `cols` columns of y's rows, y_stride apart. */
static void store_sums(const float *sums, int64_t M, float *y, int64_t y_stride, int64_t cols)
{
    for (int64_t r = 0; r < M; r++)
        store_row(load_floats(sums + r * NR), load_floats(sums + r * NR + GEMM_VEC), 0, y + r * y_stride, cols);
}

/* The sums of a few rows (M <= STREAM_ROWS) over one panel, plus the bias, into sums [M][NR]. The panel goes in blocks
 * of k that the first-level cache holds while every tile of rows passes, and the tiles share the prefetch of the next
 * block: the panel streams from memory at one steady pace, overlapping the arithmetic, where passing whole panels
 * asked for the first pass's reads in bursts. */
static void panel_sums(const int kind, const char *x, int64_t x_stride, const char *w, int64_t M, int64_t K,
                       const float *bias, int64_t cols, float *sums)
{
    const int64_t x_element = kind == W_BF16 && BF16_DOT ? 2 : 4, k_per_step = kind == W_BF16 ? 2 : 1;
    const int64_t step_bytes = NR * (kind == W_F16 ? 2 : 4); /* a value of k, or a pair of them */
    const int64_t block = STREAM_BLOCK_BYTES / step_bytes * k_per_step, tiles = (M + MR - 1) / MR;
    memset(sums, 0, (size_t)M * NR * sizeof *sums);
    for (int64_t k0 = 0; k0 < K; k0 += block) {
        const int64_t kc = K - k0 < block ? K - k0 : block, steps = (kc + k_per_step - 1) / k_per_step;
        const int64_t share = (steps * step_bytes + tiles - 1) / tiles, pf_stride = (share + steps - 1) / steps;
        const char *w_block = w + k0 / k_per_step * step_bytes, *next = w_block + steps * step_bytes;
        for (int64_t m = 0, t = 0; m < M; m += MR, t++) {
            const int rows = M - m < MR ? (int)(M - m) : MR;
            /* One tile reads each block once, a plain stream the hardware's prefetch follows faster than ours. */
            block_of(kind, rows, x + (m * x_stride + k0) * x_element, x_stride, w_block, kc, sums + m * NR,
                     tiles > 1 ? next + t * share : 0, pf_stride);
        }
    }
    if (bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < cols; c++)
                sums[r * NR + c] += bias[c];
}

/* The bytes of one panel of K values of k. */
static inline int64_t panel_bytes(int kind, int64_t K)
{
    return kind == W_BF16 ? (K + 1) / 2 * NR * 4 : K * NR * (kind == W_F16 ? 2 : 4);
}

/* The tiles over a panel that prefetch a later one (none for a row or two), the bytes each asks for, and the
 * stride of its asks per step of k. */
struct prefetch_plan { int64_t sharing, share, stride; };

static struct prefetch_plan plan_prefetch(const int kind, int64_t M, int64_t K)
{
    const int64_t tiles = M >= PREFETCH_MIN_ROWS ? (M + MR - 1) / MR : 0, steps = kind == W_BF16 ? (K + 1) / 2 : K;
    const int64_t sharing = tiles < PREFETCH_TILES ? tiles : PREFETCH_TILES;
    const int64_t share = sharing ? (panel_bytes(kind, K) + sharing - 1) / sharing : 0;
    return (struct prefetch_plan){sharing, share, (share + steps - 1) / steps};
}

/* With `later` panels after these in memory, which the first tiles prefetch; without (a panel in a buffer), none. */
static void gemm_panels(const int kind, const char *x, int64_t x_stride, const char *panels, const float *bias,
                        float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t first_panel,
                        int64_t last_panel, const int later)
{
    const int64_t whole_panel = panel_bytes(kind, K);
    if (M >= PREFETCH_MIN_ROWS && M <= STREAM_ROWS) {
        float sums[STREAM_ROWS * NR];
        for (int64_t p = first_panel; p < last_panel; p++) {
            const int64_t n = p * NR, cols = N - n < NR ? N - n : NR;
            panel_sums(kind, x, x_stride, panels + p * whole_panel, M, K, bias ? bias + n : 0, cols, sums);
            store_sums(sums, M, y + n, y_stride, cols);
        }
        return;
    }
    const int64_t x_element = kind == W_BF16 && BF16_DOT ? 2 : 4;
    const struct prefetch_plan plan = plan_prefetch(kind, M, K);
    for (int64_t p = first_panel; p < last_panel; p++) {
        const int64_t n = p * NR, cols = N - n < NR ? N - n : NR;
        const char *w = panels + p * whole_panel;
        int64_t t = 0;
        /* Rows in blocks whose x stays in the second-level cache while the block passes. */
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m_end = m0 + MC < M ? m0 + MC : M;
            for (int64_t m = m0; m < m_end; m += MR, t++) {
                const int rows = m_end - m < MR ? (int)(m_end - m) : MR;
                const char *ahead = later && t < plan.sharing ? w + PREFETCH_PANELS * whole_panel + t * plan.share : 0;
                tile_of(kind, rows, x + m * x_stride * x_element, x_stride, w, K, bias ? bias + n : 0,
                        y + m * y_stride + n, y_stride, cols, ahead, plan.stride);
            }
        }
    }
}

/* Rows r < rows of a tile's gate and up sums (rows NR apart), as SiLU(gate) x up, into `cols` columns of
 * y's rows: the expression and vector expf of cpu_activation.c, so the values are the ones it gives. */
static void store_gated(const float *gate, const float *up, int rows, int64_t cols, void *y, int64_t y_stride,
                        const int act)
{
    for (int r = 0; r < rows; r++) {
        const float *g = gate + r * NR, *u = up + r * NR;
        if (act == ACT_SILU_BF16) {
            uint16_t *o = (uint16_t *)y + r * y_stride;
#pragma omp simd
            for (int64_t i = 0; i < cols; i++)
                o[i] = bfloat16_of(silu(g[i]) * u[i]);
        } else {
            float *o = (float *)y + r * y_stride;
#pragma omp simd
            for (int64_t i = 0; i < cols; i++)
                o[i] = silu(g[i]) * u[i];
        }
    }
}

/* Pairs of panels first .. last - 1 (pair j: columns j NR .. of the gate half, then of the up half, `halves`
 * columns each): each tile of rows over the gate panel, then over the up panel, stored as gemm_panels stores
 * unpaired columns (act == ACT_NONE) or through first-level-cache rows as the activation (store_gated). */
static void gemm_pairs(const int kind, const char *x, int64_t x_stride, const char *panels, const float *bias,
                       void *y, int64_t y_stride, int64_t M, int64_t halves, int64_t K, int64_t first, int64_t last,
                       const int act)
{
    const int64_t whole_panel = panel_bytes(kind, K), y_element = act == ACT_SILU_BF16 ? 2 : 4;
    if (M >= PREFETCH_MIN_ROWS && M <= STREAM_ROWS) {
        float gate[STREAM_ROWS * NR], up[STREAM_ROWS * NR];
        for (int64_t j = first; j < last; j++) {
            const int64_t n = j * NR, cols = halves - n < NR ? halves - n : NR;
            const char *wg = panels + 2 * j * whole_panel;
            panel_sums(kind, x, x_stride, wg, M, K, bias ? bias + n : 0, cols, gate);
            panel_sums(kind, x, x_stride, wg + whole_panel, M, K, bias ? bias + halves + n : 0, cols, up);
            if (act != ACT_NONE) {
                store_gated(gate, up, (int)M, cols, (char *)y + n * y_element, y_stride, act);
                continue;
            }
            store_sums(gate, M, (float *)y + n, y_stride, cols);
            store_sums(up, M, (float *)y + halves + n, y_stride, cols);
        }
        return;
    }
    const int64_t x_element = kind == W_BF16 && BF16_DOT ? 2 : 4;
    const struct prefetch_plan plan = plan_prefetch(kind, M, K);
    float gate[MR * NR], up[MR * NR];
    for (int64_t j = first; j < last; j++) {
        const int64_t n = j * NR, cols = halves - n < NR ? halves - n : NR;
        const char *wg = panels + 2 * j * whole_panel, *wu = wg + whole_panel;
        const float *bias_g = bias ? bias + n : 0, *bias_u = bias ? bias + halves + n : 0;
        int64_t t = 0;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m_end = m0 + MC < M ? m0 + MC : M;
            for (int64_t m = m0; m < m_end; m += MR, t++) {
                const int rows = m_end - m < MR ? (int)(m_end - m) : MR;
                const char *xm = x + m * x_stride * x_element;
                /* a later pair's panels */
                const char *ahead_g = t < plan.sharing ? wg + PREFETCH_PANELS * whole_panel + t * plan.share : 0;
                const char *ahead_u = ahead_g ? ahead_g + whole_panel : 0;
                char *ym = (char *)y + m * y_stride * y_element;
                if (act == ACT_NONE) {
                    tile_of(kind, rows, xm, x_stride, wg, K, bias_g, (float *)ym + n, y_stride, cols, ahead_g,
                            plan.stride);
                    tile_of(kind, rows, xm, x_stride, wu, K, bias_u, (float *)ym + halves + n, y_stride, cols, ahead_u,
                            plan.stride);
                    continue;
                }
                tile_of(kind, rows, xm, x_stride, wg, K, bias_g, gate, NR, cols, ahead_g, plan.stride);
                tile_of(kind, rows, xm, x_stride, wu, K, bias_u, up, NR, cols, ahead_u, plan.stride);
                store_gated(gate, up, rows, cols, ym + n * y_element, y_stride, act);
            }
        }
    }
}

static int64_t gemm(const int kind, const void *x, int64_t x_stride, const void *panels, const float *bias, void *y,
                    int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t halves, int64_t act,
                    int64_t units_per_chunk, int64_t *counters, int64_t wait)
{
    /* The units claimed: panels, or pairs of them; and the rows in blocks whose x the second-level cache holds while
     * the threads pass their panels over it (rather than every panel's pass reading all of x from the third level),
     * each panel read once a block: block after block, each block's chunks of units in turn. */
    const int64_t x_element = kind == W_BF16 && BF16_DOT ? 2 : 4, y_element = act == ACT_SILU_BF16 ? 2 : 4;
    const int64_t fit = K > 0 ? ROW_BLOCK_BYTES / (K * x_element) / MC * MC : 0;
    const int64_t row_block = M > fit && fit ? fit : (M > 0 ? M : 1);
    const int64_t count = halves ? (halves + NR - 1) / NR : (N + NR - 1) / NR;
    const int64_t unit_chunks = (count + units_per_chunk - 1) / units_per_chunk;
    const int64_t chunks = unit_chunks * ((M + row_block - 1) / row_block);
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t first = c % unit_chunks * units_per_chunk, m0 = c / unit_chunks * row_block;
        const int64_t last = first + units_per_chunk < count ? first + units_per_chunk : count;
        const int64_t rows = M - m0 < row_block ? M - m0 : row_block;
        const char *xm = (const char *)x + m0 * x_stride * x_element;
        char *ym = (char *)y + m0 * y_stride * y_element;
        if (halves)
            gemm_pairs(kind, xm, x_stride, (const char *)panels, bias, ym, y_stride, rows, halves, K, first, last,
                       (int)act);
        else
            gemm_panels(kind, xm, x_stride, (const char *)panels, bias, (float *)ym, y_stride, rows, N, K, first, last,
                        1);
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

int64_t gemm_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, void *y, int64_t y_stride,
                 int64_t M, int64_t N, int64_t K, int64_t halves, int64_t act, int64_t units_per_chunk,
                 int64_t *counters, int64_t wait)
{
    return gemm(W_F32, x, x_stride, panels, bias, y, y_stride, M, N, K, halves, act, units_per_chunk, counters, wait);
}

int64_t gemm_f16(const float *x, int64_t x_stride, const uint16_t *panels, const float *bias, void *y, int64_t y_stride,
                 int64_t M, int64_t N, int64_t K, int64_t halves, int64_t act, int64_t units_per_chunk,
                 int64_t *counters, int64_t wait)
{
    return gemm(W_F16, x, x_stride, panels, bias, y, y_stride, M, N, K, halves, act, units_per_chunk, counters, wait);
}

int64_t gemm_bf16(const void *x, int64_t x_stride, const uint32_t *panels, const float *bias, void *y, int64_t y_stride,
                 int64_t M, int64_t N, int64_t K, int64_t halves, int64_t act, int64_t units_per_chunk,
                 int64_t *counters, int64_t wait)
{
    return gemm(W_BF16, x, x_stride, panels, bias, y, y_stride, M, N, K, halves, act, units_per_chunk, counters, wait);
}

/* Weights quantized by groups of k (W4A16, W8A16 and FP8 W8A16 checkpoints): each weight a code in a 32-bit word of
 * consecutive k of one column, panels of [K / codes a word][NR] words; its value is code x scale + offset, with a
 * scale and an offset per column and group of `group` k ([K / group][NR] of each a panel), the offset holding
 * the zero point (-zero x scale). A word holds four bytes (k in the low byte), or eight 4-bit codes: k, k + 2,
 * k + 4, k + 6 in the low half's nibbles and k + 1, k + 3, ... in the high half's, so that one shift and one mask
 * put a pair of them where the bfloat16 dot product takes a pair (code_pairs). FP8 codes (e4m3) are their own
 * value times the scale, the offset zero.
 *
 * x comes as float32 rows, or (x_bf16, in a build with the bfloat16 dot product) as bfloat16 rows.
 * A decode's rows (up to STREAM_ROWS) take each word's values in registers, so only the codes stream from
 * memory: for bfloat16 rows, 4-bit codes c become the bfloat16 numbers 128 + c (exact, and made by
 * bit operations alone), each group's sums of (128 + c) x are scaled once, and the 128 and the offset come back
 * through the group's sum of x; elsewhere each value is code x scale + offset in float32. Where the build has
 * AVX512-VNNI, such rows instead become int16 values by groups whose bytes meet the codes, masked into bytes, in
 * the byte dot product (codes_words.h). Where the CPU has AMX tiles for bfloat16, blocks of 16 such rows take 4-bit codes in
 * them (amx_codes.h), up to AMX_STREAM_ROWS rows, and so do the last few, padded with zero rows.
 * A prompt's many rows take each panel's values once into a buffer in the layout of the float32 or bfloat16
 * panels above (as x's rows are), and the float kernel runs over it, or for bfloat16 rows AMX tiles where
 * the CPU has them. */
enum code_kind { CODE_U4, CODE_U8, CODE_FP8 };

static inline __attribute__((always_inline)) int codes_per_word(const int code) { return code == CODE_U4 ? 8 : 4; }

/* Code j of each lane of `words`, as a float (not yet scaled). */
static inline __attribute__((always_inline)) vf code_value(const int code, vu words, int j)
{
    if (code == CODE_U4)
        return __builtin_convertvector((words >> ((j & 1) * 16 + (j >> 1) * 4)) & 0xfu, vf);
    const vu byte = (words >> (8 * j)) & 0xffu;
    if (code == CODE_U8)
        return __builtin_convertvector(byte, vf);
    /* e4m3: its exponent and mantissa moved into float32's, then 2^120 rebiases 7 -> 127 (subnormals too) */
    const vf magnitude = as_floats((byte & 0x7fu) << 20) * 0x1p120f;
    return as_floats((vu)magnitude | ((byte & 0x80u) << 24));
}

/* A row's k-th value of x: a float, or a bfloat16 (x_bf16). */
static inline __attribute__((always_inline)) float x_value(const int x_bf16, const char *x, int64_t index)
{
    if (x_bf16)
        return float_of_bits((int64_t)((const uint16_t *)x)[index] << 16);
    return ((const float *)x)[index];
}

/* `rows` rows of x against one panel of codes over all of K, stored into y with the bias. */
static inline __attribute__((always_inline)) void code_tile(
    const int rows, const int code, const int x_bf16, const char *x, int64_t x_stride, const uint32_t *w, const float *scales,
    const float *offsets, int64_t group, int64_t K, const float *bias, float *y, int64_t y_stride, int64_t cols)
{
    const int per_word = codes_per_word(code);
    vf acc0[MR], acc1[MR];
    for (int r = 0; r < rows; r++)
        acc0[r] = acc1[r] = (vf){0};
    for (int64_t g = 0, k = 0; k < K; g++) {
        const vf s0 = load_floats(scales + g * NR), s1 = load_floats(scales + g * NR + GEMM_VEC);
        const vf o0 = load_floats(offsets + g * NR), o1 = load_floats(offsets + g * NR + GEMM_VEC);
        for (const int64_t end = k + group; k < end; k += per_word) {
            const uint32_t *word = w + k / per_word * NR;
            const vu w0 = load_words(word), w1 = load_words(word + GEMM_VEC);
            for (int j = 0; j < per_word; j++) {
                const vf v0 = code_value(code, w0, j) * s0 + o0, v1 = code_value(code, w1, j) * s1 + o1;
                for (int r = 0; r < rows; r++) {
                    const vf xv = splat(x_value(x_bf16, x, r * x_stride + k + j));
                    acc0[r] += xv * v0;
                    acc1[r] += xv * v1;
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        store_row(acc0[r], acc1[r], bias, y + r * y_stride, cols);
}

#include "codes_words.h"

#if BF16_DOT
/* Pair j of each lane's eight 4-bit codes (k + 2j in the low half, k + 2j + 1 in the high) as the bfloat16 pair
 * (128 + c, 128 + c'): 128 + c is 2^7 with c in the low bits of the seven-bit mantissa, its unit there 1. */
static inline __attribute__((always_inline)) vu code_pairs(vu words, int j)
{
    return ((words >> (4 * j)) & 0x000f000fu) | 0x43004300u;
}

/* Group g's sums of (base + c) x of one row (total0, total1: a panel's two halves) as sums of the values, added
 * into the row's sums: scale x those + (offset - base x scale) x the group's sum of x. */
static inline __attribute__((always_inline)) void add_group(float *row, vf total0, vf total1, const float *scales,
                                                            const float *offsets, int64_t g, float x_sum, float base)
{
    const vf s0 = load_floats(scales + g * NR), s1 = load_floats(scales + g * NR + GEMM_VEC);
    const vf o0 = load_floats(offsets + g * NR) - base * s0, o1 = load_floats(offsets + g * NR + GEMM_VEC) - base * s1;
    const vf xs = splat(x_sum);
    *(vf_unaligned *)row = load_floats(row) + total0 * s0 + xs * o0;
    *(vf_unaligned *)(row + GEMM_VEC) = load_floats(row + GEMM_VEC) + total1 * s1 + xs * o1;
}

/* code_tile for 4-bit codes by the bfloat16 dot product: each group's sums of (128 + c) x, then
 * sums += scale x those + (offset - 128 scale) x the group's sum of x (x_sums [rows][groups]). Or, `in_words`,
 * by the byte dot product over the bytes of x's int16 values (codes_words.h; x, rows x_stride int16 apart, as
 * those bytes): each group's exact sums of c x_int, as floats times the row's unit of the group (units
 * [rows][groups]), then sums += scale x those + offset x the group's sum of x. Where `later` is not 0 (the first tile over a panel: the
 * others find it in cache), each step asks for the same lines of the panel `later` panels on, and each group for
 * that panel's scales and offsets, so that its reads from memory overlap this thread's arithmetic. */
static inline __attribute__((always_inline)) void code_tile_pairs(
    const int rows, const int in_words, const char *x, int64_t x_stride, const uint32_t *w, const float *scales,
    const float *offsets, const float *units, const float *x_sums, int64_t groups, int64_t group, const float *bias,
    float *y, int64_t y_stride, int64_t cols, int64_t later)
{
    const char *ahead = later ? (const char *)(w + later * (groups * group / 8) * NR) : 0;
    const uint32_t *xw = (const uint32_t *)x; /* pairs of x: bfloat16, or int16 */
    /* Sums in chains of their own for a few rows, so that the dot product's latency, not its rate, does not bound
     * a decode of one or two rows: pair j goes to chain j % chains. In words, the sums of x's low bytes (j < 2) and
     * high bytes (the first and second half of the chains) apart. */
    const int chains = rows == 1 ? 4 : rows == 2 || in_words ? 2 : 1;
    float sums[MR * NR];
    memset(sums, 0, sizeof sums);
    for (int64_t g = 0; g < groups; g++) {
        vf part0[MR][4], part1[MR][4]; /* in words, int32 sums as their bits */
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < chains; c++)
                part0[r][c] = part1[r][c] = (vf){0};
        /* word q of the group: the codes of inputs 8q .. 8q + 7, and pairs 4q .. 4q + 3 of each row of x */
        const uint32_t *words = w + (size_t)(g * group / 8) * NR, *pairs = xw + (size_t)(g * group / 2);
        if (ahead) {
            const int64_t there = later * groups * NR + g * NR;
            prefetch_step((const char *)(scales + there), 0, 128);
            prefetch_step((const char *)(offsets + there), 0, 128);
        }
        for (size_t q = 0; q < (size_t)group / 8; q++) {
            prefetch_step(ahead, (int64_t)(g * group / 8) + (int64_t)q, NR * 4);
            const vu w0 = load_words(words + q * NR), w1 = load_words(words + q * NR + GEMM_VEC);
#pragma GCC unroll 4 /* each j's chain a register */
            for (int j = 0; j < 4; j++) {
                const vu b0 = in_words ? code_words(w0, j) : code_pairs(w0, j);
                const vu b1 = in_words ? code_words(w1, j) : code_pairs(w1, j);
                for (int r = 0; r < rows; r++) {
                    const uint32_t pair = pairs[(size_t)r * (size_t)(x_stride / 2) + 4 * q + (size_t)j];
                    const int chain = in_words && chains == 2 ? j >> 1 : j % chains;
                    vf *a0 = &part0[r][chain], *a1 = &part1[r][chain];
                    *a0 = in_words ? dot_words(*a0, pair, b0, j) : dot_pairs(*a0, pair, b0);
                    *a1 = in_words ? dot_words(*a1, pair, b1, j) : dot_pairs(*a1, pair, b1);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            vf total0 = part0[r][0], total1 = part1[r][0];
            if (in_words) { /* low bytes' sums + 256 x high bytes', exact in int32 */
                vi low0 = (vi)part0[r][0], low1 = (vi)part1[r][0], high0 = (vi)part0[r][chains - 1],
                   high1 = (vi)part1[r][chains - 1];
                if (chains == 4) {
                    low0 += (vi)part0[r][1], low1 += (vi)part1[r][1];
                    high0 += (vi)part0[r][2], high1 += (vi)part1[r][2];
                }
                const vf unit = splat(units[r * groups + g]);
                total0 = __builtin_convertvector(low0 + (high0 << 8), vf) * unit;
                total1 = __builtin_convertvector(low1 + (high1 << 8), vf) * unit;
            } else {
                for (int c = 1; c < chains; c++) {
                    total0 += part0[r][c];
                    total1 += part1[r][c];
                }
            }
            const float base = in_words ? 0.0f : 128.0f;
            add_group(sums + r * NR, total0, total1, scales, offsets, g, x_sums[r * groups + g], base);
        }
    }
    for (int r = 0; r < rows; r++)
        store_row(load_floats(sums + r * NR), load_floats(sums + r * NR + GEMM_VEC), bias, y + r * y_stride, cols);
}

static void code_pairs_tile_of(int rows, int in_words, const char *x, int64_t x_stride, const uint32_t *w,
                               const float *scales, const float *offsets, const float *units, const float *x_sums,
                               int64_t groups, int64_t group, const float *bias, float *y, int64_t y_stride,
                               int64_t cols, int64_t later)
{
#define PAIRS(ROWS, WORDS)                                                                                            \
    code_tile_pairs(ROWS, WORDS, x, x_stride, w, scales, offsets, units, x_sums, groups, group, bias, y, y_stride,    \
                    cols, later)
#define ROWS_OF(ROWS)                                                                                                 \
    if (in_words)                                                                                                     \
        PAIRS(ROWS, CODE_WORDS);                                                                                      \
    else                                                                                                              \
        PAIRS(ROWS, 0);
    switch (rows) {
    case 6: ROWS_OF(6) break;
    case 5: ROWS_OF(5) break;
    case 4: ROWS_OF(4) break;
    case 3: ROWS_OF(3) break;
    case 2: ROWS_OF(2) break;
    default: ROWS_OF(1)
    }
#undef ROWS_OF
#undef PAIRS
}

/* Each row's sum of its bfloat16 x over each group of k, into sums [rows][groups]. */
static void group_sums(const char *x, int64_t x_stride, int64_t rows, int64_t K, int64_t group, float *sums)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = (const uint16_t *)x + r * x_stride;
        for (int64_t g = 0; g < K / group; g++) {
            float total = 0;
#pragma omp simd reduction(+ : total)
            for (int64_t k = g * group; k < (g + 1) * group; k++)
                total += float_of_bits((int64_t)row[k] << 16);
            sums[r * (K / group) + g] = total;
        }
    }
}
#endif

#include "amx_codes.h"

#define CODE_ROWS(CODE, XB)                                                                             \
    switch (rows) {                                                                                     \
    case 6: code_tile(6, CODE, XB, x, x_stride, w, scales, offsets, group, K, bias, y, y_stride, cols); break; \
    case 5: code_tile(5, CODE, XB, x, x_stride, w, scales, offsets, group, K, bias, y, y_stride, cols); break; \
    case 4: code_tile(4, CODE, XB, x, x_stride, w, scales, offsets, group, K, bias, y, y_stride, cols); break; \
    case 3: code_tile(3, CODE, XB, x, x_stride, w, scales, offsets, group, K, bias, y, y_stride, cols); break; \
    case 2: code_tile(2, CODE, XB, x, x_stride, w, scales, offsets, group, K, bias, y, y_stride, cols); break; \
    default: code_tile(1, CODE, XB, x, x_stride, w, scales, offsets, group, K, bias, y, y_stride, cols);   \
    }
#define CODE_ROWS_X(CODE)                                                                               \
    if (x_bf16) {                                                                                       \
        CODE_ROWS(CODE, 1)                                                                              \
    } else {                                                                                            \
        CODE_ROWS(CODE, 0)                                                                              \
    }

static void code_tile_of(const int code, const int x_bf16, int rows, const char *x, int64_t x_stride,
                         const uint32_t *w, const float *scales, const float *offsets, int64_t group, int64_t K,
                         const float *bias, float *y, int64_t y_stride, int64_t cols)
{
    switch (code) {
    case CODE_U4: CODE_ROWS_X(CODE_U4) break;
    case CODE_U8: CODE_ROWS_X(CODE_U8) break;
    default: CODE_ROWS_X(CODE_FP8)
    }
}
#undef CODE_ROWS_X
#undef CODE_ROWS

/* One panel's values into `out`: bfloat16 pairs (rounded to nearest even) for bfloat16 rows of x, else floats,
 * laid out as the float kernel's panels. */
static void dequantize_panel(const int code, const int to_bf16, const uint32_t *w, const float *scales,
                             const float *offsets, int64_t group, int64_t K, void *out)
{
    const int per_word = codes_per_word(code);
    for (int64_t g = 0, k = 0; k < K; g++) {
        const vf s0 = load_floats(scales + g * NR), s1 = load_floats(scales + g * NR + GEMM_VEC);
        const vf o0 = load_floats(offsets + g * NR), o1 = load_floats(offsets + g * NR + GEMM_VEC);
        for (const int64_t end = k + group; k < end; k += per_word) {
            const uint32_t *word = w + k / per_word * NR;
            const vu w0 = load_words(word), w1 = load_words(word + GEMM_VEC);
            for (int j = 0; j < per_word; j += 2) {
                const vf a0 = code_value(code, w0, j) * s0 + o0, a1 = code_value(code, w1, j) * s1 + o1;
                const vf b0 = code_value(code, w0, j + 1) * s0 + o0, b1 = code_value(code, w1, j + 1) * s1 + o1;
                if (to_bf16) {
                    /* pair (k + j, k + j + 1) of each column: low half k + j, rounded as bfloat16_of rounds */
                    const vu ra0 = (vu)a0, ra1 = (vu)a1, rb0 = (vu)b0, rb1 = (vu)b1;
                    const vu low0 = (ra0 + 0x7fffu + ((ra0 >> 16) & 1u)) >> 16;
                    const vu low1 = (ra1 + 0x7fffu + ((ra1 >> 16) & 1u)) >> 16;
                    const vu high0 = (rb0 + 0x7fffu + ((rb0 >> 16) & 1u)) & 0xffff0000u;
                    const vu high1 = (rb1 + 0x7fffu + ((rb1 >> 16) & 1u)) & 0xffff0000u;
                    uint32_t *pair = (uint32_t *)out + (k + j) / 2 * NR;
                    *(vu_unaligned *)pair = low0 | high0;
                    *(vu_unaligned *)(pair + GEMM_VEC) = low1 | high1;
                } else {
                    float *row = (float *)out + (k + j) * NR;
                    *(vf_unaligned *)row = a0;
                    *(vf_unaligned *)(row + GEMM_VEC) = a1;
                    *(vf_unaligned *)(row + NR) = b0;
                    *(vf_unaligned *)(row + NR + GEMM_VEC) = b1;
                }
            }
        }
    }
}

/* This thread's buffer `which` (a dequantized panel, or sums of x), grown as needed (helpers live as long as the
 * process). */
static void *thread_buffer(int which, size_t bytes)
{
    static __thread void *buffers[2];
    static __thread size_t capacities[2];
    if (bytes > capacities[which]) {
        free(buffers[which]);
        capacities[which] = (bytes + 4095) / 4096 * 4096;
        buffers[which] = aligned_alloc(64, capacities[which]);
        if (!buffers[which])
            capacities[which] = 0;
    }
    return buffers[which];
}

#define AMX_PANEL_BYTES (1 << 20) /* unpacked panels a thread holds at once in AMX tiles' prompt path: half the
                                   * second-level cache of each CPU with the tiles */
static inline int64_t panels_at_once(int64_t K)
{
    const int64_t bytes = panel_bytes(W_BF16, K);
    return AMX_PANEL_BYTES / bytes > 1 ? AMX_PANEL_BYTES / bytes : 1;
}

#if CODES_AMX
/* A prompt's bfloat16 rows (all M) against panels first .. last - 1 of codes in AMX tiles. The panels are unpacked
 * a group at a time, each once a call, and every block of 32 rows passes the whole group while its x stays in
 * the first- or second-level cache; rows short of a tile's 16 take the vector kernel. */
static void codes_prompt_amx(int code, const char *x, int64_t x_stride, const uint32_t *panels, const float *scales,
                             const float *offsets, int64_t group, const float *bias, float *y, int64_t y_stride,
                             int64_t M, int64_t N, int64_t K, int64_t first, int64_t last, char *values)
{
    const int64_t bytes = panel_bytes(W_BF16, K), words = K / codes_per_word(code), groups = K / group;
    const int64_t per_group = panels_at_once(K);
    for (int64_t p0 = first; p0 < last; p0 += per_group) {
        const int64_t p1 = p0 + per_group < last ? p0 + per_group : last;
        for (int64_t p = p0; p < p1; p++)
            dequantize_panel(code, 1, panels + p * words * NR, scales + p * groups * NR, offsets + p * groups * NR,
                             group, K, values + (p - p0) * bytes);
        for (int64_t m = 0; m < M; m += 32) {
            const int64_t rows = M - m < 32 ? M - m : 32;
            const char *xm = x + m * x_stride * 2;
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n = p * NR, cols = N - n < NR ? N - n : NR;
                const char *panel = values + (p - p0) * bytes;
                const float *b = bias ? bias + n : 0;
                const int64_t done = panel_rows_amx(xm, x_stride, (const uint32_t *)panel, K, b, y + m * y_stride + n,
                                                    y_stride, rows, cols);
                if (done < rows)
                    gemm_panels(W_BF16, xm + done * x_stride * 2, x_stride, panel, b, y + (m + done) * y_stride + n,
                                y_stride, rows - done, N - n, K, 0, 1, 0);
            }
        }
    }
}
#endif

int64_t gemm_codes(const void *x, int64_t x_stride, int64_t x_bf16, const uint32_t *panels, const float *scales,
                   const float *offsets, int64_t group, int64_t code, const float *bias, float *y, int64_t y_stride,
                   int64_t M, int64_t N, int64_t K, int64_t units_per_chunk, int64_t *counters, int64_t wait)
{
    if (x_bf16 && !BF16_DOT)
        return -1;
#if CODE_WORDS
    /* a decode's 4-bit codes against int16 values of its rows (codes_words.h) */
    const int words_on = codes_words_rows > 0 && x_bf16 && code == CODE_U4 && group <= CODE_WORDS_MAX_GROUP;
#endif
#if CODES_AMX
    /* rows from which tiles take a decode's rows, and the rows past its last whole 16, rather than the vector
     * kernel: a few rows cost a tile what 16 do, and the int16 words' few rows cost less */
#if CODE_WORDS
    const int64_t tiles_from = !words_on ? AMX_PARTIAL_ROWS
                               : codes_words_rows < AMX_ROWS_AFTER_WORDS ? codes_words_rows + 1
                                                                           : AMX_ROWS_AFTER_WORDS;
#else
    const int64_t tiles_from = AMX_PARTIAL_ROWS;
#endif
    /* 4-bit codes against blocks of 16 bfloat16 rows in tiles, up to the rows a prompt's product takes */
    const int amx = codes_amx_on && x_bf16 && code == CODE_U4 && group % 32 == 0 && M >= tiles_from;
    /* and a prompt's rows against any codes' unpacked panels */
    const int amx_prompt = codes_amx_on && x_bf16 && K % 32 == 0;
#else
    const int amx = 0, amx_prompt = 0;
#endif
    const int kind = x_bf16 ? W_BF16 : W_F32, prompt = M > (amx ? AMX_STREAM_ROWS : STREAM_ROWS);
    const int prompt_tiles = amx_prompt && prompt;
    const int64_t x_element = x_bf16 ? 2 : 4, words = K / codes_per_word((int)code), groups = K / group;
    /* a prompt's blocks of rows are larger than the float kernel's: each block dequantizes every panel again (in
     * tiles, one block: each panel is unpacked once) */
    const int64_t fit = K > 0 && !prompt_tiles ? 4 * ROW_BLOCK_BYTES / (K * x_element) / MC * MC : 0;
    const int64_t row_block = M > fit && fit ? fit : (M > 0 ? M : 1);
    const int64_t count = (N + NR - 1) / NR, unit_chunks = (count + units_per_chunk - 1) / units_per_chunk;
    const int64_t chunks = unit_chunks * ((M + row_block - 1) / row_block);
    const int pairs = x_bf16 && code == CODE_U4 && !prompt;
    const int64_t held = prompt_tiles ? panels_at_once(K) : 1; /* panels unpacked at once */
    void *values = prompt ? thread_buffer(0, (size_t)(held * panel_bytes(kind, K))) : 0;
#if CODES_AMX
    /* A decode's rows past its last whole 16 (one block of rows), from tiles_from, in a tile too: this thread's copy
     * of them, followed by zero rows. */
    const int64_t tail = amx && pairs && row_block == M ? M % AMX_CODE_ROWS : 0;
    /* the rows tiles take, the first of those the vector kernel takes */
    const int64_t vector_from = amx && pairs ? (tail >= tiles_from ? M : M - M % AMX_CODE_ROWS) : 0;
#else
    const int64_t vector_from = 0;
#endif
#if CODE_WORDS
    /* the vector kernel's rows in int16 words, where they are few enough (codes_words.h) */
    const int in_words = words_on && pairs && vector_from < M && M - vector_from <= codes_words_rows;
#else
    const int in_words = 0;
#endif
    /* the bfloat16 rows' sums by group, for the tiles' rows and the bfloat16 dot product's */
    const int bf16_sums = pairs && (vector_from > 0 || !in_words);
    const int64_t word_rows = in_words ? M - vector_from : 0;
    const int64_t sums_bytes = bf16_sums ? (M * groups * (int64_t)sizeof(float) + 63) / 64 * 64 : 0;
    const int64_t word_bytes = word_rows * (2 * groups * (int64_t)sizeof(float) + K * 2);
    char *x_sums_bytes = pairs ? thread_buffer(1, (size_t)(sums_bytes + word_bytes)) : 0;
    float *x_sums = (float *)x_sums_bytes;
    if ((prompt && !values) || (pairs && !x_sums))
        return -1;
#if BF16_DOT
    if (bf16_sums)
        group_sums((const char *)x, x_stride, M, K, group, x_sums);
    /* rows from vector_from as int16 values' bytes: [word_rows][2 K], then their units and sums by group */
    uint8_t *xq = in_words ? (uint8_t *)(x_sums_bytes + sums_bytes) : 0;
    float *units = in_words ? (float *)(xq + word_rows * 2 * K) : 0;
    float *word_sums = in_words ? units + word_rows * groups : 0;
#endif
#if CODE_WORDS
    if (in_words)
        quantize_groups((const char *)x + vector_from * x_stride * 2, x_stride, word_rows, K, group, xq, units,
                        word_sums);
#endif
#if CODES_AMX
    const int tiles = (amx && pairs) || prompt_tiles;
    char *padded = tail >= tiles_from ? thread_buffer(0, (size_t)(AMX_CODE_ROWS * K * 2)) : 0;
    if (tail >= tiles_from && !padded)
        return -1;
    for (int64_t r = 0; padded && r < AMX_CODE_ROWS; r++) {
        if (r < tail)
            memcpy(padded + r * K * 2, (const char *)x + (M - tail + r) * x_stride * 2, (size_t)K * 2);
        else
            memset(padded + r * K * 2, 0, (size_t)K * 2);
    }
    if (tiles)
        amx_configure(5);
#endif
    /* A thread claims its next chunk as the last panels of one begin, so that they ask for the first of the next: a
     * thread's chunks are seldom neighbours. */
    for (int64_t c = claim_chunk(counters), next = -1, next_first = count; c < chunks; c = next, next = -1) {
        const int64_t first = c % unit_chunks * units_per_chunk, m0 = c / unit_chunks * row_block;
        const int64_t last = first + units_per_chunk < count ? first + units_per_chunk : count;
        const int64_t rows = M - m0 < row_block ? M - m0 : row_block;
        const char *xm = (const char *)x + m0 * x_stride * x_element;
        float *ym = y + m0 * y_stride;
#if CODES_AMX
        if (prompt_tiles) {
            codes_prompt_amx((int)code, xm, x_stride, panels, scales, offsets, group, bias, ym, y_stride, rows, N, K,
                             first, last, values);
            next = claim_chunk(counters);
            finish_chunk(counters);
            continue;
        }
#endif
        for (int64_t p = first; p < last; p++) {
            const int64_t n = p * NR, cols = N - n < NR ? N - n : NR;
            const uint32_t *w = panels + p * words * NR;
            const float *sc = scales + p * groups * NR, *of = offsets + p * groups * NR, *b = bias ? bias + n : 0;
            if (next < 0 && p + PREFETCH_PANELS >= last)
                next_first = next_chunk_first(counters, &next, chunks, unit_chunks, units_per_chunk, count);
            if (prompt) {
                dequantize_panel((int)code, (int)x_bf16, w, sc, of, group, K, values);
                gemm_panels(kind, xm, x_stride, (const char *)values, b, ym + n, y_stride, rows, N - n, K, 0, 1, 0);
                continue;
            }
#if BF16_DOT
            /* The first tile over a panel asks for a later one (at a chunk's end, the first of the next), even at
             * one row: unpacking the codes keeps the hardware's prefetch from running far enough ahead on its own.
             * How many panels on it is, or 0. */
            const int64_t later_panel = panel_after(p, PREFETCH_PANELS, last, next_first);
            const int64_t later = later_panel < count ? later_panel - p : 0;
#endif
            int64_t m = 0;
#if CODES_AMX
            if (amx && pairs)
                for (; m + AMX_CODE_ROWS <= rows; m += AMX_CODE_ROWS)
                    code_tile_amx(xm + m * x_stride * x_element, x_stride, w, sc, of, x_sums + (m0 + m) * groups,
                                  groups, group, b, ym + m * y_stride + n, y_stride, cols, m == 0 ? later : 0,
                                  AMX_CODE_ROWS);
            if (padded && m < rows) { /* the tail */
                code_tile_amx(padded, K, w, sc, of, x_sums + (m0 + m) * groups, groups, group, b, ym + m * y_stride + n,
                              y_stride, cols, m == 0 ? later : 0, (int)(rows - m));
                m = rows;
            }
#endif
            for (; m < rows; m += MR) {
                const int tile_rows = rows - m < MR ? (int)(rows - m) : MR;
                const char *xt = xm + m * x_stride * x_element;
                float *yt = ym + m * y_stride + n;
#if BF16_DOT
                if (pairs) {
                    /* in int16 words: this thread's values of the rows from vector_from */
                    const int64_t w_row = m0 + m - vector_from;
                    const char *xp = in_words ? (const char *)(xq + w_row * 2 * K) : xt;
                    code_pairs_tile_of(tile_rows, in_words, xp, in_words ? K : x_stride, w, sc, of,
                                       in_words ? units + w_row * groups : 0,
                                       in_words ? word_sums + w_row * groups : x_sums + (m0 + m) * groups, groups,
                                       group, b, yt, y_stride, cols, m == 0 ? later : 0);
                    continue;
                }
#endif
                code_tile_of((int)code, (int)x_bf16, tile_rows, xt, x_stride, w, sc, of, group, K, b, yt, y_stride,
                             cols);
            }
        }
        finish_chunk(counters);
    }
#if CODES_AMX
    if (tiles)
        amx_release();
#endif
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

int64_t gemm_codes_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return gemm_codes((const void *)w[0], w[1], w[2], (const uint32_t *)w[3], (const float *)w[4], (const float *)w[5],
                      w[6], w[7], (const float *)w[8], (float *)w[9], w[10], w[11], w[12], w[13], w[14], counters, wait);
}
int64_t gemm_codes_task_words(void) { return 15; }

#if defined(__AVX512F__) && GEMM_VEC == 16
/* Sixteen columns of sixteen rows of 32-bit words (rows NR words apart) as min(columns, 16) rows of `to`, `stride`
 * words apart: a transpose in registers, in the usual three steps (words, pairs of words, quarters). */
static inline void columns_as_rows(const uint32_t *from, uint32_t *to, int64_t stride, int64_t columns)
{
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_loadu_si512(from + i * NR);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c]: column 4L + c of rows i .. i + 3 in each quarter L */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int c = 0; c < 4; c++) {
            t[i + c] = _mm512_shuffle_i32x4(r[i + c], r[i + 4 + c], 0x88);     /* columns c and 8 + c */
            t[i + 4 + c] = _mm512_shuffle_i32x4(r[i + c], r[i + 4 + c], 0xdd); /* columns 4 + c and 12 + c */
        }
    for (int c = 0; c < 8; c++) { /* t[c] and t[8 + c]: columns c and 8 + c of rows 0 .. 7 and 8 .. 15 */
        if (c < columns)
            _mm512_storeu_si512(to + c * stride, _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88));
        if (c + 8 < columns)
            _mm512_storeu_si512(to + (c + 8) * stride, _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd));
    }
}
#endif

/* The weight that codes stand for as a row-major [N][K] bfloat16 matrix (K even), rounded as a prompt's panels
 * are, for a product by someone else's kernel (oneDNN's, in AMX tiles). Each panel is dequantized into this
 * thread's buffer, then its columns are written out as rows, sixteen pairs of k (one cache line) at a time. */
int64_t codes_bf16_weight(const uint32_t *panels, const float *scales, const float *offsets, int64_t group,
                          int64_t code, uint16_t *out, int64_t N, int64_t K, int64_t units_per_chunk, int64_t *counters,
                          int64_t wait)
{
    if (K % 2)
        return -1;
    const int64_t words = K / codes_per_word((int)code), groups = K / group, pairs = K / 2;
    const int64_t count = (N + NR - 1) / NR, chunks = (count + units_per_chunk - 1) / units_per_chunk;
    uint32_t *values = thread_buffer(0, (size_t)panel_bytes(W_BF16, K));
    if (!values)
        return -1;
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t last = (c + 1) * units_per_chunk < count ? (c + 1) * units_per_chunk : count;
        for (int64_t p = c * units_per_chunk; p < last; p++) {
            const int64_t n = p * NR, cols = N - n < NR ? N - n : NR;
            dequantize_panel((int)code, 1, panels + p * words * NR, scales + p * groups * NR,
                             offsets + p * groups * NR, group, K, values);
            uint32_t *rows = (uint32_t *)out + n * pairs;
            int64_t q0 = 0;
#if defined(__AVX512F__) && GEMM_VEC == 16
            for (; q0 + 16 <= pairs; q0 += 16)
                for (int64_t j0 = 0; j0 < cols; j0 += 16)
                    columns_as_rows(values + q0 * NR + j0, rows + j0 * pairs + q0, pairs, cols - j0);
#endif
            for (; q0 < pairs; q0 += 16) {
                const int64_t q1 = q0 + 16 < pairs ? q0 + 16 : pairs;
                for (int64_t j = 0; j < cols; j++)
                    for (int64_t q = q0; q < q1; q++)
                        rows[j * pairs + q] = values[q * NR + j];
            }
        }
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

int64_t codes_bf16_weight_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return codes_bf16_weight((const uint32_t *)w[0], (const float *)w[1], (const float *)w[2], w[3], w[4],
                             (uint16_t *)w[5], w[6], w[7], w[8], counters, wait);
}
int64_t codes_bf16_weight_task_words(void) { return 9; }

/* The same calls as tasks of helper_pool.c: the arguments before the counters as words, in order. */
#define GEMM_TASK(NAME, KIND)                                                                           \
    int64_t NAME##_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)               \
    {                                                                                                   \
        (void)thread;                                                                                   \
        return gemm(KIND, (const void *)w[0], w[1], (const void *)w[2], (const float *)w[3], (void *)w[4], w[5], \
                    w[6], w[7], w[8], w[9], w[10], w[11], counters, wait);                              \
    }                                                                                                   \
    int64_t NAME##_task_words(void) { return 12; }
GEMM_TASK(gemm_f32, W_F32)
GEMM_TASK(gemm_f16, W_F16)
GEMM_TASK(gemm_bf16, W_BF16)
#undef GEMM_TASK

/* What the caller must know of this build: the panels' width in columns, whether gemm_bf16 takes
 * bfloat16 rows of x (of even length, an odd K's last padded with a zero), and how it multiplies. */
int64_t gemm_panel_width(void) { return NR; }
int64_t gemm_bf16_reads_bf16_rows(void) { return BF16_DOT != 0; }
const char *gemm_description(void)
{
#if BF16_DOT == 1
    return "AVX-512, bfloat16 by its dot product";
#elif GEMM_VEC == 16 && defined(__AVX512F__)
    return "AVX-512";
#elif GEMM_VEC == 16
    return "the AVX-512 layout in narrower vectors" BF16_NOTE;
#elif defined(__AVX2__) && defined(__FMA__)
    return "AVX2 and FMA" BF16_NOTE;
#else
    return "portable vectors" BF16_NOTE;
#endif
}

/* The argument types of the gemm_* functions, as kernels/native.py checks them before any call: p a
 * pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *gemm_f32_signature(void) { return "pipppiiiiiiipi:i"; }
const char *gemm_f16_signature(void) { return "pipppiiiiiiipi:i"; }
const char *gemm_bf16_signature(void) { return "pipppiiiiiiipi:i"; }
const char *gemm_codes_signature(void) { return "piipppiippiiiiipi:i"; }
const char *gemm_codes_task_words_signature(void) { return ":i"; }
const char *codes_bf16_weight_signature(void) { return "pppiipiiipi:i"; }
const char *codes_bf16_weight_task_words_signature(void) { return ":i"; }
const char *gemm_f32_task_words_signature(void) { return ":i"; }
const char *gemm_f16_task_words_signature(void) { return ":i"; }
const char *gemm_bf16_task_words_signature(void) { return ":i"; }
const char *gemm_panel_width_signature(void) { return ":i"; }
const char *gemm_bf16_reads_bf16_rows_signature(void) { return ":i"; }
