/* y = x W^T (+ b) for a batch of rows: the matmuls of a decode step, where torch's BLAS runs this
 * AMD CPU at a fraction of its speed (docs/kernels.md).
 *
 * The weights are packed once, when the model loads, into panels of 16 output columns: panel p
 * holds W[16p .. 16p+15][k] for every k, as K rows of 16 floats (zeros past N). A panel streams
 * from memory in one run and stays in the second-level cache while every tile of rows passes over
 * it. A tile is up to 6 rows of x against one panel: 12 vector accumulators (6 rows x 2 vectors of
 * 8), and for each k two loads of the panel, six broadcasts of x and twelve fused multiply-adds,
 * so the multiply-add units, not the loads, set the pace. Each k row of a panel is one cache line,
 * and every tile prefetches the next panel's line k into the second-level cache: the reads from
 * memory spread over all the passes of a panel, not bunched into its first (a decode step of 16
 * rows took 15-20 % less time, docs/kernels.md). One or two rows are bound by the reads alone, and
 * there the hardware's own prefetch streams the panels faster without ours (docs/kernels.md).
 *
 * x: [M, K] with rows x_stride floats apart; panels: [ceil(N / 16), K, 16]; y: [M, N] with rows
 * y_stride apart; bias: [N] or NULL. Threads share a call by claiming its chunks of
 * panels_per_chunk panels (claims.h); the caller, wait != 0, returns once every chunk is done.
 * Returns -1, with nothing done, without AVX2 and FMA. Sums run in float32, over k in order.
 */
#include <stdint.h>

#include "claims.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR 6
#define NR 16
#define PREFETCH_MIN_ROWS 3

/* The tile's sums, plus the bias, into y: whole vectors for a full panel, through a row buffer for
 * the last, partial one. */
static inline __attribute__((always_inline)) void store_row(__m256 a, __m256 b, const float *bias, float *y,
                                                            int64_t cols)
{
    if (cols == NR) {
        if (bias) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(bias));
            b = _mm256_add_ps(b, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(y, a);
        _mm256_storeu_ps(y + 8, b);
        return;
    }
    float row[NR];
    _mm256_storeu_ps(row, a);
    _mm256_storeu_ps(row + 8, b);
    for (int64_t c = 0; c < cols; c++)
        y[c] = row[c] + (bias ? bias[c] : 0.0f);
}

/* The accumulators are locals of the tile, stored by it: nothing takes their address, so they stay
 * in registers for the whole k loop. */
#define TILE(ROWS)                                                                                       \
    static void tile_##ROWS(const float *x, int64_t x_stride, const float *panel, int64_t K,              \
                            const float *bias, float *y, int64_t y_stride, int64_t cols, const float *ahead) \
    {                                                                                                    \
        __m256 acc0[ROWS], acc1[ROWS];                                                                   \
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++)                                           \
            acc0[r] = acc1[r] = _mm256_setzero_ps();                                                     \
        for (int64_t k = 0; k < K; k++) {                                                                \
            if (ahead)                                                                                   \
                _mm_prefetch((const char *)(ahead + k * NR), _MM_HINT_T1);                               \
            const __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8); \
            _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++) {                                     \
                const __m256 v = _mm256_broadcast_ss(x + r * x_stride + k);                              \
                acc0[r] = _mm256_fmadd_ps(v, w0, acc0[r]);                                               \
                acc1[r] = _mm256_fmadd_ps(v, w1, acc1[r]);                                               \
            }                                                                                            \
        }                                                                                                \
        _Pragma("GCC unroll 6") for (int r = 0; r < ROWS; r++)                                           \
            store_row(acc0[r], acc1[r], bias, y + r * y_stride, cols);                                   \
    }

TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)

static void gemm_panels(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                        int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t first_panel, int64_t last_panel)
{
    for (int64_t p = first_panel; p < last_panel; p++) {
        const int64_t n = p * NR, cols = N - n < NR ? N - n : NR;
        const float *b = bias ? bias + n : 0;
        const float *panel = panels + p * K * NR;
        /* The next panel, past the last one too (a prefetch never faults); none for a row or two. */
        const float *next = M >= PREFETCH_MIN_ROWS ? panel + K * NR : 0;
        /* Rows in chunks whose x stays in the second-level cache while the chunk passes. */
        for (int64_t m0 = 0; m0 < M; m0 += 48) {
            const int64_t m_end = m0 + 48 < M ? m0 + 48 : M;
            for (int64_t m = m0; m < m_end; m += MR) {
                const int rows = m_end - m < MR ? (int)(m_end - m) : MR;
                const float *xm = x + m * x_stride;
                float *ym = y + m * y_stride + n;
                switch (rows) {
                case 6: tile_6(xm, x_stride, panel, K, b, ym, y_stride, cols, next); break;
                case 5: tile_5(xm, x_stride, panel, K, b, ym, y_stride, cols, next); break;
                case 4: tile_4(xm, x_stride, panel, K, b, ym, y_stride, cols, next); break;
                case 3: tile_3(xm, x_stride, panel, K, b, ym, y_stride, cols, next); break;
                case 2: tile_2(xm, x_stride, panel, K, b, ym, y_stride, cols, next); break;
                default: tile_1(xm, x_stride, panel, K, b, ym, y_stride, cols, next);
                }
            }
        }
    }
}

int64_t gemm_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                 int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t panels_per_chunk, int64_t *counters,
                 int64_t wait)
{
    const int64_t count = (N + NR - 1) / NR, chunks = (count + panels_per_chunk - 1) / panels_per_chunk;
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t first = c * panels_per_chunk, last = first + panels_per_chunk < count ? first + panels_per_chunk : count;
        gemm_panels(x, x_stride, panels, bias, y, y_stride, M, N, K, first, last);
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

#else

int64_t gemm_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                 int64_t y_stride, int64_t M, int64_t N, int64_t K, int64_t panels_per_chunk, int64_t *counters,
                 int64_t wait)
{
    return -1; /* no vector unit to beat the BLAS with: the caller uses torch */
}

#endif

/* The argument types of gemm_f32, as kernels/native.py checks them before any call: p a pointer,
 * i an int64_t, f a float; after the colon the result (v: none). */
const char *gemm_f32_signature(void) { return "pipppiiiiipi:i"; }
