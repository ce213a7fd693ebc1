/* y = x W^T (+ b) for a few rows of x: a decode batch at low concurrency, or one sequence and the
 * proposals it verifies. A BLAS tuned for large batches runs a few rows at a fraction of the core's
 * speed; here every row of x (up to MAX_ROWS) meets each weight in the same pass, in a tile of
 * vector accumulators held in registers, so the weights stream from memory once and a few rows cost
 * little more than one.
 *
 * x: [M, K] with rows x_stride floats apart; w: [N, K] contiguous; y: [M, N] with rows y_stride
 * apart; bias: [N] or NULL. Returns -1, with nothing done, where it does not apply (no AVX2 and FMA,
 * or M outside 1..MAX_ROWS): the caller then uses torch. Sums run in float32, in their own order.
 */
#include <stdint.h>

#define MAX_ROWS 6

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float sum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* ROWS rows of x against the COLS weight rows at w_rows[0..COLS-1], in ROWS x COLS vector
 * accumulators: each weight vector is loaded once for all ROWS rows. Results go to y[r][c] for the
 * first `cols` weight rows (the rest alias the first and are dropped). */
#define TILE(ROWS, COLS)                                                                                \
    static inline __attribute__((always_inline)) void tile_##ROWS##x##COLS(                             \
        const float *x, int64_t x_stride, const float *const *w_rows, int64_t cols, const float *bias,  \
        float *y, int64_t y_stride, int64_t K, int prefetch)                                             \
    {                                                                                                   \
        const int64_t vectorized = K & ~(int64_t)7;                                                     \
        __m256 acc[ROWS][COLS];                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                  \
            for (int c = 0; c < COLS; c++)                                                              \
                acc[r][c] = _mm256_setzero_ps();                                                        \
        for (int64_t k = 0; k < vectorized; k += 8) {                                                   \
            if (prefetch && !(k & 15))  /* the next tile's weight rows, one cache line each */           \
                for (int c = 0; c < COLS; c++)                                                          \
                    _mm_prefetch((const char *)(w_rows[c] + COLS * K + k), _MM_HINT_T0);                \
            __m256 weights[COLS];                                                                       \
            for (int c = 0; c < COLS; c++)                                                              \
                weights[c] = _mm256_loadu_ps(w_rows[c] + k);                                            \
            for (int r = 0; r < ROWS; r++) {                                                            \
                const __m256 v = _mm256_loadu_ps(x + r * x_stride + k);                                 \
                for (int c = 0; c < COLS; c++)                                                          \
                    acc[r][c] = _mm256_fmadd_ps(v, weights[c], acc[r][c]);                              \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < ROWS; r++)                                                                  \
            for (int c = 0; c < cols; c++) {                                                            \
                float s = sum8(acc[r][c]);                                                              \
                for (int64_t k = vectorized; k < K; k++)                                                \
                    s += x[r * x_stride + k] * w_rows[c][k];                                            \
                y[r * y_stride + c] = s + (bias ? bias[c] : 0.0f);                                      \
            }                                                                                           \
    }

/* Tiles of 8 to 12 accumulators: enough independent chains to hide the multiply-add's latency,
 * few enough to stay in the sixteen vector registers with the loads. */
TILE(1, 8)
TILE(2, 4)
TILE(3, 4)

int64_t linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                   int64_t y_stride, int64_t M, int64_t N, int64_t K)
{
    if (M < 1 || M > MAX_ROWS)
        return -1;
    const int64_t step = M == 1 ? 8 : 4;
    for (int64_t n = 0; n < N; n += step) {
        const float *w_rows[8];
        const int64_t cols = N - n < step ? N - n : step;
        for (int64_t c = 0; c < step; c++)
            w_rows[c] = w + (n + (c < cols ? c : 0)) * K;
        const float *b = bias ? bias + n : 0;
        float *out = y + n;
        if (M == 1) {
            tile_1x8(x, x_stride, w_rows, cols, b, out, y_stride, K, 0);
            continue;
        }
        /* Three rows at a time; the later ones find these weight rows in the first-level cache. */
        int64_t m = 0;
        for (; M - m >= 3; m += 3)
            tile_3x4(x + m * x_stride, x_stride, w_rows, cols, b, out + m * y_stride, y_stride, K, m == 0 && n + 2 * step <= N);
        if (M - m == 2)
            tile_2x4(x + m * x_stride, x_stride, w_rows, cols, b, out + m * y_stride, y_stride, K, m == 0 && n + 2 * step <= N);
        else if (M - m == 1)
            tile_2x4(x + (m - 1) * x_stride, x_stride, w_rows, cols, b, out + (m - 1) * y_stride, y_stride, K, 0);
    }
    return 0;
}

#else

int64_t linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                   int64_t y_stride, int64_t M, int64_t N, int64_t K)
{
    return -1; /* no vector unit to beat the BLAS with: the caller uses torch */
}

#endif

/* The argument types of linear_f32, as kernels/native.py checks them before any call: p a pointer,
 * i an int64_t, f a float; after the colon the result (v: none). */
const char *linear_f32_signature(void) { return "pipppiiii:i"; }
