/* Codes in AMX tiles (Sapphire Rapids and later) for cpu_gemm.c's gemm_codes, included there after
 * code_tile_pairs, whose arithmetic it keeps: a decode's 4-bit codes against 16 bfloat16 rows of x at a time (its
 * last 2 to 15 rows padded with zero rows: a tile's products cost no more than a few rows' dot products), and a
 * prompt's rows against each panel's values once unpacked (panel_rows_amx, below).
 *
 * code_pairs turns a word of codes into 16 columns' bfloat16 pairs (128 + c, 128 + c') of inputs k + 2j and
 * k + 2j + 1: one row of tdpbf16ps's second operand as it stands. So 32 inputs of a half panel (16 columns) are
 * 16 such rows, unpacked into a buffer and loaded as a tile, and the first operand is x's rows as they lie. Each
 * group's tile of sums of (128 + c) x is then scaled and corrected through the group's sums of x (add_group,
 * as code_tile_pairs does); only the order of the sums within a group differs. The unpacking, once per panel for
 * 16 rows instead of once per 6, and the tiles' multiply rate make it several times the vector dot product's. */
#if BF16_DOT == 1 && defined(__x86_64__) && defined(__linux__)
#define CODES_AMX 1
#include "amx.h"

#define AMX_CODE_ROWS 16 /* rows of x a tile takes */
#define AMX_PARTIAL_ROWS 2 /* a decode's rows past its last whole 16, from this many, take a tile padded with zeros */
#define AMX_ROWS_AFTER_WORDS 6 /* the same where int16 words take a few rows (codes_words.h): fewer cost less there */
#define AMX_CODE_CHUNK 128 /* inputs of a group unpacked at a time: four tiles of 32 a half panel */
static int codes_amx_on; /* set once Linux lets this process use the tiles and the caller asked */

/* Whether products over codes (4-bit ones from 2 rows, for a decode's rows; any from 64) take the tiles from now on:
 * `on` where the CPU has them (the caller knows its flags), and only once Linux lets this process use their state
 * (ARCH_REQ_XCOMP_PERM for XTILEDATA); the answer, unchanged where `on` is negative. */
int64_t gemm_codes_use_amx(int64_t on)
{
    if (on >= 0)
        codes_amx_on = on && amx_permitted();
    return codes_amx_on;
}

/* code_tile_pairs for 16 rows in tiles (group a multiple of 32), of which the first `rows` are x's (the rest, zeros
 * where rows < 16, give sums no one reads). */
__attribute__((target("amx-tile,amx-bf16"))) static void code_tile_amx(
    const char *x, int64_t x_stride, const uint32_t *w, const float *scales, const float *offsets,
    const float *x_sums, int64_t groups, int64_t group, const float *bias, float *y, int64_t y_stride, int64_t cols,
    int64_t later, int rows)
{
    const char *ahead = later ? (const char *)(w + later * (groups * group / 8) * NR) : 0;
    uint32_t pairs[2][AMX_CODE_CHUNK / 32][16 * 16] __attribute__((aligned(64))); /* [half][tile][pair row][column] */
    float parts[2][16 * 16] __attribute__((aligned(64)));
    float sums[AMX_CODE_ROWS * NR];
    memset(sums, 0, sizeof sums);
    for (int64_t g = 0; g < groups; g++) {
        if (ahead) {
            const int64_t there = later * groups * NR + g * NR;
            prefetch_step((const char *)(scales + there), 0, 128);
            prefetch_step((const char *)(offsets + there), 0, 128);
        }
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k0 = 0; k0 < group; k0 += AMX_CODE_CHUNK) {
            const int64_t chunk = group - k0 < AMX_CODE_CHUNK ? group - k0 : AMX_CODE_CHUNK;
            const int64_t first_word = (g * group + k0) / 8;
            for (int64_t q = 0; q < chunk / 8; q++) {
                prefetch_step(ahead, first_word + q, NR * 4);
                const vu w0 = load_words(w + (first_word + q) * NR), w1 = load_words(w + (first_word + q) * NR + GEMM_VEC);
                for (int j = 0; j < 4; j++) {
                    const int64_t row = 4 * q + j; /* pair row of the chunk: inputs 2 row, 2 row + 1 */
                    *(vu *)(pairs[0][row / 16] + row % 16 * 16) = code_pairs(w0, j);
                    *(vu *)(pairs[1][row / 16] + row % 16 * 16) = code_pairs(w1, j);
                }
            }
            AMX_MEMORY_IN_ORDER(); /* the pairs just unpacked */
            for (int64_t t = 0; t < chunk / 32; t++) {
                _tile_loadd(2, x + (g * group + k0 + 32 * t) * 2, x_stride * 2);
                _tile_loadd(3, pairs[0][t], 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_loadd(4, pairs[1][t], 64);
                _tile_dpbf16ps(1, 2, 4);
            }
        }
        _tile_stored(0, parts[0], 64);
        _tile_stored(1, parts[1], 64);
        AMX_MEMORY_IN_ORDER();
        for (int r = 0; r < rows; r++)
            add_group(sums + r * NR, load_floats(parts[0] + r * 16), load_floats(parts[1] + r * 16), scales, offsets,
                      g, x_sums[r * groups + g], 128.0f);
    }
    for (int r = 0; r < rows; r++)
        store_row(load_floats(sums + r * NR), load_floats(sums + r * NR + GEMM_VEC), bias, y + r * y_stride, cols);
}
/* A prompt's bfloat16 rows against one panel's values as dequantize_panel lays them out for bfloat16 rows
 * ([K / 2][NR] pairs: a half panel's 32 inputs are tdpbf16ps's second operand as they stand), K a multiple of
 * 32: blocks of 16 rows, two accumulator tiles (one a half panel). Returns the rows done, a multiple of 16: the
 * vector kernel takes the rest. (Blocks of 32 rows in four accumulators, each tile loaded serving two products,
 * were slower: docs/kernel-measurements.md.) */
__attribute__((target("amx-tile,amx-bf16"))) static int64_t panel_rows_amx(const char *x, int64_t x_stride,
                                                                          const uint32_t *values, int64_t K,
                                                                          const float *bias, float *y,
                                                                          int64_t y_stride, int64_t rows,
                                                                          int64_t cols)
{
    float parts[2][16 * 16] __attribute__((aligned(64)));
    const int64_t row_bytes = x_stride * 2;
    int64_t m = 0;
    AMX_MEMORY_IN_ORDER(); /* the panel's values, just unpacked */
    for (; m + 16 <= rows; m += 16) {
        const char *top = x + m * row_bytes;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += 32) {
            const uint32_t *pairs = values + k / 2 * NR;
            _tile_loadd(2, top + k * 2, row_bytes);
            _tile_loadd(3, pairs, NR * 4);
            _tile_dpbf16ps(0, 2, 3);
            _tile_loadd(4, pairs + 16, NR * 4);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, parts[0], 64);
        _tile_stored(1, parts[1], 64);
        AMX_MEMORY_IN_ORDER();
        for (int r = 0; r < 16; r++)
            store_row(load_floats(parts[0] + r * 16), load_floats(parts[1] + r * 16), bias, y + (m + r) * y_stride,
                      cols);
    }
    return m;
}
#else
#define CODES_AMX 0
int64_t gemm_codes_use_amx(int64_t on)
{
    (void)on;
    return 0;
}
#endif
const char *gemm_codes_use_amx_signature(void) { return "i:i"; }
