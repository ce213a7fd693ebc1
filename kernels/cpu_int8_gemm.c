/* W8A8 products on a CPU: y = (x_q W_q^T) * x_scale * w_scale (+ b), x quantized to int8 per row (each token
 * its own scale) and W int8 per output channel, the sums in int32 and so exact: every build below gives the
 * same y, bit for bit.
 *
 * W is packed once when the model loads into panels of I8_NR output columns, [ceil(K / 4)][I8_NR] 32-bit
 * words, each word holding four consecutive k of one column (k in its low byte): the operand layout of
 * AVX512-VNNI's vpdpbusd, which multiplies four unsigned bytes by four signed bytes and adds the four products
 * into an int32 lane. Its first operand is unsigned, so x goes in as x + 128 and each column's sums lose
 * 128 x (the column's sum of weights), which the packing computes (`colsums`). Without VNNI (AVX2, AVX-512
 * without it) the bytes are widened to int16 and multiplied in pairs (vpmaddwd), which, unlike the byte
 * product vpmaddubsw, cannot saturate: a checkpoint's weights and x's codes both reach -128. The portable
 * build is plain C in int32.
 *
 * int8_linear takes x as float32 rows ([M][K], rows x_stride apart) and quantizes each block of rows it works
 * on into a buffer of its thread (as x + 128 for VNNI's unsigned bytes, K padded to a multiple of 4 with
 * zeros): one call per product, and no pass of its own over x. w_scales [N]; bias [N] or NULL; y: [M][N]
 * float32 with rows y_stride apart. Threads share a call by claiming chunks of units_per_chunk panels of one
 * block of rows (claims.h), as cpu_gemm.c's do; each quantizes the blocks of rows it meets. int8_linear_codes
 * takes rows the kernel before it quantized (the norm's, the activation's), so no thread quantizes them again.
 *
 * From 16 rows, where the CPU has AMX tiles for int8, blocks of 16 rows are multiplied in them (below).
 *
 * A row's quantization is int8_rows.h's (quantize_rows gives it on its own, for the tests).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "claims.h"
#include "int8_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define I8_KIND 2 /* vpdpbusd */
#define I8_NR 32
#define I8_MR 8
#elif defined(__AVX2__)
#include <immintrin.h>
#define I8_KIND 1 /* widened to int16, vpmaddwd */
#define I8_NR 16
#define I8_MR 3
#else
#define I8_KIND 0 /* plain C */
#define I8_NR 16
#define I8_MR 4
#endif
#define I8_MC 48 /* rows of a block whose codes stay in the second-level cache while a chunk's panels pass */
#define I8_ROW_BLOCK_BYTES (256 << 10)
#define PREFETCH_PANELS 2
#define I8_MAX_WIDENING 8 /* how many times wider a call of several blocks of rows makes the caller's chunks */

#pragma GCC diagnostic ignored "-Wpsabi"

/* Column c's int32 sum of a tile's row r over `words` words of k, in sums[r][c] (rows I8_NR apart), added to
 * what sums holds with `accumulate`: the tile's loop is the build's. With `ahead` (VNNI), every `every`-th step
 * of k asks for the next two lines from ahead on: its share of a later panel, asked for evenly over the tile. */
static inline __attribute__((always_inline)) void tile_sums(const int rows, const int8_t *x, int64_t x_stride,
                                                              const int32_t *w, int64_t words, int32_t *sums,
                                                              const int accumulate, const char *ahead,
                                                              int64_t every)
{
#if I8_KIND == 2
    __m512i acc0[I8_MR], acc1[I8_MR];
    for (int r = 0; r < rows; r++) {
        acc0[r] = accumulate ? _mm512_loadu_si512(sums + r * I8_NR) : _mm512_setzero_si512();
        acc1[r] = accumulate ? _mm512_loadu_si512(sums + r * I8_NR + 16) : _mm512_setzero_si512();
    }
    for (int64_t q = 0, due = 0; q < words; q++) {
        if (ahead && q == due) {
            __builtin_prefetch(ahead, 0, 2);
            __builtin_prefetch(ahead + 64, 0, 2);
            ahead += 128;
            due += every;
        }
        const __m512i w0 = _mm512_loadu_si512(w + q * I8_NR), w1 = _mm512_loadu_si512(w + q * I8_NR + 16);
        for (int r = 0; r < rows; r++) {
            int32_t quad; /* x + 128, unsigned */
            memcpy(&quad, x + r * x_stride + 4 * q, 4);
            const __m512i xb = _mm512_set1_epi32(quad);
            acc0[r] = _mm512_dpbusd_epi32(acc0[r], xb, w0);
            acc1[r] = _mm512_dpbusd_epi32(acc1[r], xb, w1);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_si512(sums + r * I8_NR, acc0[r]);
        _mm512_storeu_si512(sums + r * I8_NR + 16, acc1[r]);
    }
#elif I8_KIND == 1
    /* Four columns a vector: lanes 2c and 2c + 1 hold column c's sums of k, k + 1 and of k + 2, k + 3. */
    __m256i acc[I8_MR][4];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 4; v++)
            acc[r][v] = _mm256_setzero_si256();
    (void)accumulate, (void)ahead, (void)every; /* whole panels only (int8_linear) */
    for (int64_t q = 0; q < words; q++) {
        const __m128i *wq = (const __m128i *)(w + q * I8_NR);
        __m256i wv[4];
        for (int v = 0; v < 4; v++)
            wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(wq + v));
        for (int r = 0; r < rows; r++) {
            int32_t quad;
            memcpy(&quad, x + r * x_stride + 4 * q, 4);
            const __m128i wide = _mm_cvtepi8_epi16(_mm_cvtsi32_si128(quad));
            const __m256i xb = _mm256_broadcastq_epi64(wide);
            for (int v = 0; v < 4; v++)
                acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(wv[v], xb));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 4; v++) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, acc[r][v]);
            for (int c = 0; c < 4; c++)
                sums[r * I8_NR + 4 * v + c] = lanes[2 * c] + lanes[2 * c + 1];
        }
#else
    int32_t acc[I8_MR][I8_NR];
    memset(acc, 0, sizeof acc);
    (void)accumulate, (void)ahead, (void)every; /* whole panels only (int8_linear) */
    for (int64_t q = 0; q < words; q++) {
        const int8_t *wq = (const int8_t *)(w + q * I8_NR);
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = x + r * x_stride + 4 * q;
            for (int c = 0; c < I8_NR; c++)
                acc[r][c] += xq[0] * wq[4 * c] + xq[1] * wq[4 * c + 1] + xq[2] * wq[4 * c + 2] + xq[3] * wq[4 * c + 3];
        }
    }
    for (int r = 0; r < rows; r++)
        memcpy(sums + r * I8_NR, acc[r], sizeof acc[r]);
#endif
}

/* Row r's sums as floats: (sum - the x + 128 correction) x (x_scale x w_scale), then plus the bias, in that
 * order in every build: the bias is added in a pass of its own, so no build fuses it into a multiply-add that
 * others do not have. */
__attribute__((optimize("no-fast-math"))) static void store_rows(const int rows, const int32_t *sums, const int32_t *colsums, const float *x_scales,
                       const float *w_scales, const float *bias, float *y, int64_t y_stride, int64_t cols)
{
    for (int r = 0; r < rows; r++) {
        const float xs = x_scales[r];
        float *yr = y + r * y_stride;
        for (int64_t c = 0; c < cols; c++) {
            const int32_t sum = I8_KIND == 2 ? sums[r * I8_NR + c] - 128 * colsums[c] : sums[r * I8_NR + c];
            yr[c] = (float)sum * (xs * w_scales[c]);
        }
        if (bias)
            for (int64_t c = 0; c < cols; c++)
                yr[c] += bias[c];
    }
}

#define BY_ROWS(FN, ...)                                                                                \
    switch (rows) {                                                                                     \
    case 8: FN(8 <= I8_MR ? 8 : 1, __VA_ARGS__); break;                                                 \
    case 7: FN(7 <= I8_MR ? 7 : 1, __VA_ARGS__); break;                                                 \
    case 6: FN(6 <= I8_MR ? 6 : 1, __VA_ARGS__); break;                                                 \
    case 5: FN(5 <= I8_MR ? 5 : 1, __VA_ARGS__); break;                                                 \
    case 4: FN(4 <= I8_MR ? 4 : 1, __VA_ARGS__); break;                                                 \
    case 3: FN(3, __VA_ARGS__); break;                                                                  \
    case 2: FN(2, __VA_ARGS__); break;                                                                  \
    default: FN(1, __VA_ARGS__);                                                                        \
    }

static void tile_of(int rows, const int8_t *x, int64_t x_stride, const int32_t *w, int64_t words, int32_t *sums,
                    const int accumulate, const char *ahead, int64_t every)
{
    BY_ROWS(tile_sums, x, x_stride, w, words, sums, accumulate, ahead, every)
}
#undef BY_ROWS

#if I8_KIND == 2 && defined(__x86_64__) && defined(__linux__)
#define I8_AMX 1
#include "amx.h"
/* AMX tiles (Sapphire Rapids and later): a block of 16 rows against a panel's 32 columns takes two 16 x 16 tiles
 * of int32 sums, each step of k 16 words (64 k) of x's codes, as VNNI's (x + 128 unsigned, tdpbusd), and two
 * tiles of the panel as it lies: 16 words of k, 16 columns a tile, the rows of the panel 4 x I8_NR bytes apart.
 * So the sums are VNNI's, bit for bit. Words of k past the last whole 16 go through tile_sums, accumulating. */
#define AMX_ROWS 16
#define AMX_WORDS 16
#define AMX_STEP_BYTES (AMX_WORDS * I8_NR * 4) /* of a panel, a step of k */
#define AMX_GROUP_BYTES (1 << 20) /* half the second-level cache of every CPU with AMX */
static int amx_on; /* set once the kernel has let this process use the tiles and the caller asked (int8_use_amx) */

/* Sums of 16 rows of x over `steps` steps of k; each step asks for its share of `ahead` (the next panel, or NULL)
 * on into the second-level cache. (Two blocks of rows sharing the panel's tiles were slower.) */
__attribute__((target("amx-tile,amx-int8"))) static void amx_block(const int8_t *x, int64_t x_stride,
                                                                 const int32_t *w, int64_t steps, int32_t *sums,
                                                                 const char *ahead)
{
    AMX_MEMORY_IN_ORDER(); /* x's codes may be this call's */
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t s = 0; s < steps; s++) {
        if (ahead)
            for (int64_t line = 0; line < AMX_STEP_BYTES; line += 64)
                __builtin_prefetch(ahead + s * AMX_STEP_BYTES + line, 0, 2);
        _tile_loadd(2, x + s * 4 * AMX_WORDS, x_stride);
        _tile_loadd(3, w + s * AMX_WORDS * I8_NR, I8_NR * 4);
        _tile_loadd(4, w + s * AMX_WORDS * I8_NR + 16, I8_NR * 4);
        _tile_dpbusd(0, 2, 3);
        _tile_dpbusd(1, 2, 4);
    }
    _tile_stored(0, sums, I8_NR * 4);
    _tile_stored(1, sums + 16, I8_NR * 4);
    AMX_MEMORY_IN_ORDER();
}

/* Panels first .. last - 1 against the block's rows 0 .. rows / 16 * 16 - 1 (codes rows `padded` bytes apart), in
 * tiles, each block of 16 rows passing a group of panels in turn: an output row is written a run of the group's
 * columns at a time (panel by panel, the blocks of rows wrote 16 rows' short pieces far apart, which cost more than
 * the products on wide layers), and a group is as many panels as stay in the second-level cache while every block
 * of rows passes them (a chunk of a call on one thread is the whole weight). Words of k past amx_words go through
 * tile_sums. The rows left to the VNNI loop. */
static int64_t amx_chunk(const int8_t *codes, int64_t padded, int64_t rows, const int32_t *panels, int64_t words,
                         int64_t amx_words, int64_t first, int64_t last, int64_t N, const int32_t *colsums,
                         const float *scales, const float *w_scales, const float *bias, float *y, int64_t y_stride)
{
    int32_t sums[AMX_ROWS * I8_NR];
    const int64_t whole_rows = rows / AMX_ROWS * AMX_ROWS, panel_bytes = words * I8_NR * 4;
    const int64_t group = AMX_GROUP_BYTES / panel_bytes > 1 ? AMX_GROUP_BYTES / panel_bytes : 1;
    for (int64_t g = first; g < last; g += group) {
        const int64_t end = g + group < last ? g + group : last;
        for (int64_t m = 0; m < whole_rows; m += AMX_ROWS) {
            const int8_t *xm = codes + m * padded;
            for (int64_t p = g; p < end; p++) {
                const int64_t n = p * I8_NR, cols = N - n < I8_NR ? N - n : I8_NR;
                const int32_t *w = panels + p * words * I8_NR;
                /* The first block of rows meets the group's panels in memory, and the tile loads wait on it:
                 * that block asks for the next panel as it goes (two or more panels on were slower). */
                const char *ahead = m == 0 && p + 1 < last ? (const char *)(w + words * I8_NR) : 0;
                amx_block(xm, padded, w, amx_words / AMX_WORDS, sums, ahead);
                if (amx_words < words)
                    for (int64_t r = 0; r < AMX_ROWS; r += I8_MR)
                        tile_of(I8_MR, xm + r * padded + 4 * amx_words, padded, w + amx_words * I8_NR,
                                words - amx_words, sums + r * I8_NR, 1, 0, 1);
                store_rows(AMX_ROWS, sums, colsums + n, scales + m, w_scales + n, bias ? bias + n : 0,
                           y + m * y_stride + n, y_stride, cols);
            }
        }
    }
    return whole_rows;
}

/* Whether products of 16 rows or more use the tiles from now on: `on` where the CPU has them (the caller knows
 * its flags), and only once Linux lets this process use their state (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA); the answer. */
int64_t int8_use_amx(int64_t on)
{
    amx_on = on && amx_permitted();
    return amx_on;
}
#else
#define I8_AMX 0
int64_t int8_use_amx(int64_t on)
{
    (void)on;
    return 0;
}
#endif
const char *int8_use_amx_signature(void) { return "i:i"; }

/* Rows first .. last - 1 of x as codes, rows code_stride bytes apart (int8_rows.h). */
static void quantize_range(const float *x, int64_t x_stride, int64_t K, int64_t padded, int8_t *codes,
                           int64_t code_stride, float *scales, float static_scale, int64_t first, int64_t last,
                           const int unsigned_codes)
{
    for (int64_t r = first; r < last; r++)
        quantize_row(x + r * x_stride, K, padded, codes + r * code_stride, scales + r, static_scale, unsigned_codes);
}

/* The rows of a call's blocks of rows (each block's codes stay in the second-level cache while a chunk's panels
 * pass): the call's chunks are its blocks of rows times its chunks of panels. */
static int64_t int8_row_block(int64_t M, int64_t K)
{
    const int64_t fit = K > 0 ? I8_ROW_BLOCK_BYTES / (4 * ((K + 3) / 4)) / I8_MC * I8_MC : 0;
    return M > fit && fit ? fit : (M > 0 ? M : 1);
}

/* This thread's buffer for a block of rows' codes and scales, grown as needed (helpers live as long as the
 * process). */
static void *codes_buffer(size_t bytes)
{
    static __thread void *buffer;
    static __thread size_t capacity;
    if (bytes > capacity) {
        free(buffer);
        capacity = (bytes + 4095) / 4096 * 4096;
        buffer = aligned_alloc(64, capacity);
        if (!buffer)
            capacity = 0;
    }
    return buffer;
}

/* The product of x's rows, quantized by each thread as it meets them, or of rows already quantized (`given`, its
 * codes rows `padded` bytes apart as this build takes them, and `given_scales`). */
static int64_t product(const float *x, int64_t x_stride, float static_scale, const int8_t *given,
                       const float *given_scales, const int32_t *panels, const int32_t *colsums, const float *w_scales,
                       const float *bias, float *y, int64_t y_stride, int64_t M, int64_t N, int64_t K,
                       int64_t units_per_chunk, int64_t *counters, int64_t wait)
{
    const int64_t words = (K + 3) / 4, padded = 4 * words, count = (N + I8_NR - 1) / I8_NR;
    const int64_t row_block = int8_row_block(M, K), blocks = (M + row_block - 1) / row_block;
    /* The caller sizes chunks of panels for one block of rows (about 8 a thread). A prompt's many blocks already
     * give each thread chunks enough, and a wider chunk takes its panels' first reads fewer times: widen them by
     * the blocks, up to 8 times. */
    units_per_chunk *= blocks < I8_MAX_WIDENING ? blocks : I8_MAX_WIDENING;
    units_per_chunk = units_per_chunk < count ? units_per_chunk : (count > 0 ? count : 1);
    const int64_t unit_chunks = (count + units_per_chunk - 1) / units_per_chunk;
    const int64_t chunks = unit_chunks * blocks;
    int8_t *buffer = given ? 0 : codes_buffer((size_t)(row_block * padded + 4 * row_block + 64));
    if (!given && !buffer)
        return -1;
    int8_t *codes = buffer;
    float *scales = buffer ? (float *)(buffer + (row_block * padded + 63) / 64 * 64) : 0;
    int32_t sums[I8_MR * I8_NR];
    int64_t quantized = -1; /* the first row of the block in this thread's buffer */
#if I8_AMX
    const int amx = amx_on && M >= AMX_ROWS && words >= AMX_WORDS;
    if (amx)
        amx_configure(5);
    const int64_t amx_words = words / AMX_WORDS * AMX_WORDS;
#endif
    /* A thread claims its next chunk as the last panels of one begin, so that they ask for the first of the next: a
     * thread's chunks are seldom neighbours, and a chunk that started cold would wait on its reads. */
    for (int64_t c = claim_chunk(counters), next = -1, next_first = count; c < chunks; c = next, next = -1) {
        const int64_t first = c % unit_chunks * units_per_chunk, m0 = c / unit_chunks * row_block;
        const int64_t last = first + units_per_chunk < count ? first + units_per_chunk : count;
        const int64_t rows = M - m0 < row_block ? M - m0 : row_block;
        if (given) {
            codes = (int8_t *)given + m0 * padded;
            scales = (float *)given_scales + m0;
        } else if (quantized != m0) {
            quantize_range(x + m0 * x_stride, x_stride, K, padded, codes, padded, scales, static_scale, 0, rows,
                           I8_KIND == 2);
            quantized = m0;
        }
        int64_t m0_vnni = 0; /* the block's rows from here on take the VNNI loop */
#if I8_AMX
        if (amx)
            m0_vnni = amx_chunk(codes, padded, rows, panels, words, amx_words, first, last, N, colsums, scales,
                                w_scales, bias, y + m0 * y_stride, y_stride);
#endif
        for (int64_t p = first; p < last; p++) {
            const int64_t n = p * I8_NR, cols = N - n < I8_NR ? N - n : I8_NR;
            const int32_t *w = panels + p * words * I8_NR;
            if (next < 0 && p + PREFETCH_PANELS >= last)
                next_first = next_chunk_first(counters, &next, chunks, unit_chunks, units_per_chunk, count);
            /* From three rows, the tiles ask for the panel PREFETCH_PANELS on, each for its share of it spread over
             * its steps, so that the reads from memory go on while every tile computes, not in the first tile's
             * burst (one or two rows stream faster by the hardware's prefetch alone, as in cpu_gemm.c). */
            const int64_t later = panel_after(p, PREFETCH_PANELS, last, next_first);
            const char *ahead = rows >= 3 && later < count ? (const char *)(panels + later * words * I8_NR) : 0;
            const int64_t tiles = (rows - m0_vnni + I8_MR - 1) / I8_MR, share = tiles ? (words + tiles - 1) / tiles : 0;
            for (int64_t m = m0_vnni, t = 0; m < rows; m += I8_MR, t++) {
                const int tile_rows = rows - m < I8_MR ? (int)(rows - m) : I8_MR;
                const char *mine = ahead && t * share < words ? ahead + t * share * I8_NR * 4 : 0;
                tile_of(tile_rows, codes + m * padded, padded, w, words, sums, 0, mine, tiles);
                store_rows(tile_rows, sums, colsums + n, scales + m, w_scales + n, bias ? bias + n : 0,
                           y + (m0 + m) * y_stride + n, y_stride, cols);
            }
        }
        finish_chunk(counters);
    }
#if I8_AMX
    if (amx)
        amx_release();
#endif
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

int64_t int8_linear(const float *x, int64_t x_stride, float static_scale, const int32_t *panels,
                    const int32_t *colsums, const float *w_scales, const float *bias, float *y, int64_t y_stride,
                    int64_t M, int64_t N, int64_t K, int64_t units_per_chunk, int64_t *counters, int64_t wait)
{
    return product(x, x_stride, static_scale, 0, 0, panels, colsums, w_scales, bias, y, y_stride, M, N, K,
                   units_per_chunk, counters, wait);
}

/* int8_linear of rows quantized before the call (int8_rows.h, unsigned as int8_codes_unsigned says): codes [M][padded
 * K] and scales [M]. */
int64_t int8_linear_codes(const int8_t *codes, const float *scales, const int32_t *panels, const int32_t *colsums,
                          const float *w_scales, const float *bias, float *y, int64_t y_stride, int64_t M, int64_t N,
                          int64_t K, int64_t units_per_chunk, int64_t *counters, int64_t wait)
{
    return product(0, 0, 0, codes, scales, panels, colsums, w_scales, bias, y, y_stride, M, N, K, units_per_chunk,
                   counters, wait);
}

/* Whether this build takes codes as code + 128 (VNNI's unsigned bytes). */
int64_t int8_codes_unsigned(void) { return I8_KIND == 2; }

int64_t quantize_rows(const float *x, int64_t x_stride, int64_t M, int64_t K, int64_t padded, int8_t *codes,
                      int64_t code_stride, float *scales, float static_scale, int64_t units_per_chunk,
                      int64_t *counters, int64_t wait)
{
    const int64_t chunks = (M + units_per_chunk - 1) / units_per_chunk;
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t first = c * units_per_chunk, last = first + units_per_chunk < M ? first + units_per_chunk : M;
        quantize_range(x, x_stride, K, padded, codes, code_stride, scales, static_scale, first, last, 0);
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

/* The calls as tasks of helper_pool.c: the arguments before the counters as words, in order (a float as its
 * bits). */
int64_t int8_linear_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return int8_linear((const float *)w[0], w[1], float_of_bits(w[2]), (const int32_t *)w[3], (const int32_t *)w[4],
                       (const float *)w[5], (const float *)w[6], (float *)w[7], w[8], w[9], w[10], w[11], w[12],
                       counters, wait);
}
int64_t int8_linear_task_words(void) { return 13; }

int64_t int8_linear_codes_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return int8_linear_codes((const int8_t *)w[0], (const float *)w[1], (const int32_t *)w[2], (const int32_t *)w[3],
                             (const float *)w[4], (const float *)w[5], (float *)w[6], w[7], w[8], w[9], w[10], w[11],
                             counters, wait);
}
int64_t int8_linear_codes_task_words(void) { return 12; }

int64_t quantize_rows_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return quantize_rows((const float *)w[0], w[1], w[2], w[3], w[4], (int8_t *)w[5], w[6], (float *)w[7],
                         float_of_bits(w[8]), w[9], counters, wait);
}
int64_t quantize_rows_task_words(void) { return 10; }

int64_t int8_panel_width(void) { return I8_NR; }
const char *int8_description(void)
{
#if I8_KIND == 2
    return "AVX512-VNNI";
#elif I8_KIND == 1
    return "AVX2, int16 pairs";
#else
    return "portable";
#endif
}

const char *int8_linear_signature(void) { return "pifpppppiiiiipi:i"; }
const char *int8_linear_codes_signature(void) { return "pppppppiiiiipi:i"; }
const char *int8_linear_codes_task_words_signature(void) { return ":i"; }
const char *int8_codes_unsigned_signature(void) { return ":i"; }
const char *quantize_rows_signature(void) { return "piiiipipfipi:i"; }
const char *int8_linear_task_words_signature(void) { return ":i"; }
const char *quantize_rows_task_words_signature(void) { return ":i"; }
const char *int8_panel_width_signature(void) { return ":i"; }
