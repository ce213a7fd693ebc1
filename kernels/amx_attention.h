/* A prompt block's attention over a bfloat16 cache in AMX tiles (Sapphire Rapids and later), for
 * cpu_attention.c's block_attention: included there, after the layouts and the softmax it shares.
 *
 * The arithmetic is the bfloat16 dot product's (bf16 operands, float32 sums), so the rows come out as the
 * vector path's up to the order of the sums: the query and the softmax's weights are rounded to bfloat16 as
 * they are there. A block's 16 rows (QUERY_BLOCK queries x BLOCK_HEADS heads of one KV head) are one tile:
 * - scores: the rows' queries (16 x 32 dimensions a tile) against the keys as lay_out_keys leaves them, whose
 *   tile t is already tdpbf16ps's second operand (16 words of two dimensions, 16 positions each);
 * - weighted values: the weights (rounded in place, 32 positions a tile) against the values as
 *   lay_out_values_bf16 leaves them (16 pairs of positions a tile, 16 of its interleaved dimensions each), the
 *   sums then put in order as store_dims does.
 * Positions go 32 at a time, from a multiple of 32; those past the context weigh nothing and hold zeros. */
#if defined(BF16_DOT) && defined(__x86_64__) && defined(__linux__)
#define AMX_PROMPT 1
#include "amx.h"

#define AMX_POSITIONS 32 /* positions of one step of the weighted values: two bfloat16 a word, 16 words a tile row */
#define AMX_DIMS 64      /* dimensions of the weighted values held at once: four 16 x 16 tiles of sums */
static int amx_prompt_on; /* set once Linux lets this process use the tiles and the caller asked */

/* Whether prompt blocks over a bfloat16 cache take the tiles from now on: `on` where the CPU has them (the
 * caller knows its flags), and only once Linux lets this process use their state (ARCH_REQ_XCOMP_PERM for
 * XTILEDATA); the answer. */
int64_t attention_use_amx(int64_t on)
{
    amx_prompt_on = on && amx_permitted();
    return amx_prompt_on;
}

static inline int amx_block_path(int kind, int64_t head_dim)
{
    return amx_prompt_on && kind == ROW_BF16 && head_dim % 32 == 0 && head_dim <= 256;
}

/* Scores of the 16 rows of `query` (bfloat16, head_dim apart) against key tiles base / TILE .. last / TILE:
 * scores[r * stride + p - base], unscaled. Two key tiles share each load of the query. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_scores(const uint16_t *query, int64_t head_dim,
                                                                  const uint32_t *keys, int64_t base, int64_t last,
                                                                  float *scores, int64_t stride)
{
    const int64_t tile_words = head_dim / 2 * TILE;
    AMX_MEMORY_IN_ORDER(); /* the query may be this call's */
    for (int64_t t = base / TILE; t <= last / TILE; t += 2) {
        const int two = t + 1 <= last / TILE;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < head_dim / 32; c++) {
            _tile_loadd(2, query + c * 32, head_dim * 2);
            _tile_loadd(3, keys + t * tile_words + c * 16 * TILE, 64);
            _tile_dpbf16ps(0, 2, 3);
            if (two) {
                _tile_loadd(4, keys + (t + 1) * tile_words + c * 16 * TILE, 64);
                _tile_dpbf16ps(1, 2, 4);
            }
        }
        _tile_stored(0, scores + t * TILE - base, stride * 4);
        if (two)
            _tile_stored(1, scores + (t + 1) * TILE - base, stride * 4);
    }
    AMX_MEMORY_IN_ORDER();
}

/* Dimensions d0 .. d0 + AMX_DIMS - 1 of the 16 rows' weighted values, from base to last: the rows' weights are
 * bfloat16 at (uint16_t *)(scores + r * stride) + p - base; sums[r * AMX_DIMS + n] for tile n / 16's column. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_values(const char *weights, int64_t stride,
                                                                  const char *values, int64_t head_dim,
                                                                  int64_t d0, int64_t base, int64_t last,
                                                                  float *sums)
{
    const int64_t pair_bytes = head_dim * 4, first = d0 / 16 * 64; /* a pair of positions' row; d0's tile in it */
    const int tiles = (int)min64(4, (head_dim - d0) / 16);
    AMX_MEMORY_IN_ORDER(); /* the weights, just written */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = base; p <= last; p += AMX_POSITIONS) {
        const char *pairs = values + p / 2 * pair_bytes + first;
        _tile_loadd(4, weights + (p - base) * 2, stride * 4);
        _tile_loadd(5, pairs, pair_bytes);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, pairs + 64, pair_bytes);
        _tile_dpbf16ps(1, 4, 5);
        if (tiles > 2) {
            _tile_loadd(5, pairs + 128, pair_bytes);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, pairs + 192, pair_bytes);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, sums, AMX_DIMS * 4);
    _tile_stored(1, sums + 16, AMX_DIMS * 4);
    if (tiles > 2) {
        _tile_stored(2, sums + 32, AMX_DIMS * 4);
        _tile_stored(3, sums + 48, AMX_DIMS * 4);
    }
    AMX_MEMORY_IN_ORDER();
}

/* The softmax of a row's scaled scores from .. to - 1, rounded to bfloat16 in place ((uint16_t *)row + t), zero
 * elsewhere up to `width` (a multiple of 16). */
static inline __attribute__((always_inline)) void bf16_weights(float *row, int64_t from, int64_t to, int64_t width,
                                                               float scale)
{
    float top = row[from];
    for (int64_t t = from + 1; t < to; t++)
        top = row[t] > top ? row[t] : top;
    float total = 0.f;
    for (int64_t t = from; t < to; t++) {
        row[t] = expf((row[t] - top) * scale);
        total += row[t];
    }
    const __m512 inverse = _mm512_set1_ps(1.f / total);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t = 0; t < width; t += 16) { /* each store lands on floats already read */
        const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)t));
        const __mmask16 kept = _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32((int)from)) &
                               _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32((int)to));
        const __m512 weights = _mm512_maskz_mul_ps(kept, _mm512_loadu_ps(row + t), inverse);
        _mm256_storeu_si256((__m256i *)((uint16_t *)row + t), (__m256i)_mm512_cvtneps_pbh(weights));
    }
}

/* One query block's rows of heads h0 .. h0 + heads - 1 (block_attention's loop body, tiles configured): rows
 * (b, hh) at r = b * BLOCK_HEADS + hh, those past `heads` zero; `values` as lay_out_values_bf16 leaves them,
 * zero up to the next multiple of AMX_POSITIONS past the context. */
static inline __attribute__((always_inline)) void amx_block_rows(
    const float *const *rows, int64_t block, const int64_t head_dim, int64_t h0, int64_t heads,
    const uint32_t *keys, const char *values, const int64_t *low, const int64_t *high, int64_t base, int64_t last,
    float scale, float *scores, int64_t stride, float *const *outs)
{
    uint16_t query[QUERY_BLOCK * BLOCK_HEADS * 256];
    for (int64_t b = 0; b < QUERY_BLOCK; b++)
        for (int64_t hh = 0; hh < BLOCK_HEADS; hh++) {
            uint16_t *row = query + (b * BLOCK_HEADS + hh) * head_dim;
            for (int64_t c = 0; c < head_dim / 32; c++) {
                const __m512bh dims = hh < heads ? query_dims(rows[b] + (h0 + hh) * head_dim, c, head_dim)
                                                 : (__m512bh)_mm512_setzero_si512();
                _mm512_storeu_si512(row + c * 32, (__m512i)dims);
            }
        }
    amx_scores(query, head_dim, keys, base, last, scores, stride);
    const int64_t width = (last / AMX_POSITIONS + 1) * AMX_POSITIONS - base;
    for (int64_t r = 0; r < QUERY_BLOCK * BLOCK_HEADS; r++) {
        const int64_t b = r / BLOCK_HEADS;
        if (b < block && r % BLOCK_HEADS < heads)
            bf16_weights(scores + r * stride, low[b] - base, high[b] - base + 1, width, scale);
        else /* a row no output keeps: zero weights, so that nothing it held can make a tile's sums NaN */
            memset(scores + r * stride, 0, width * 2);
    }
    float sums[QUERY_BLOCK * BLOCK_HEADS * AMX_DIMS];
    for (int64_t d0 = 0; d0 < head_dim; d0 += AMX_DIMS) {
        amx_values((const char *)scores, stride, values, head_dim, d0, base, last, sums);
        for (int64_t b = 0; b < block; b++)
            for (int64_t hh = 0; hh < heads; hh++) {
                const float *row = sums + (b * BLOCK_HEADS + hh) * AMX_DIMS;
                for (int64_t c = d0 / 32; c < min64(head_dim, d0 + AMX_DIMS) / 32; c++)
                    store_dims(outs[b] + (h0 + hh) * head_dim, _mm512_loadu_ps(row + (c - d0 / 32) * 32),
                               _mm512_loadu_ps(row + (c - d0 / 32) * 32 + 16), c, head_dim);
            }
    }
}
#else
#define AMX_PROMPT 0
int64_t attention_use_amx(int64_t on)
{
    (void)on;
    return 0;
}
#endif
const char *attention_use_amx_signature(void) { return "i:i"; }
