/* Paged attention for the CPU in float32, reading keys and values straight from the paged cache.
 *
 * The contract is paged_attention_reference's (kernels/paged_attention.py): query row i of
 * sequence s sits at position context_lens[s] - num_queries + i and sees that sequence's keys up
 * to its own position (within the sliding window when window > 0), found through its row of the
 * block table. Nothing is gathered into a workspace first; each cached token (its keys or values
 * for every KV head, one row) is read once for up to QUERY_BLOCK queries of a sequence (a prompt's
 * chunk, or a decode with the proposals it verifies) and for all the query heads.
 * Built with -O3 -ffast-math so the head_dim loops become SIMD and expf the vector library's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QUERY_BLOCK 8 /* queries of one sequence served together: each key and value is read once for all */

/* The cached row of position p (every KV head's keys or values), and in *stop the end of the run of
 * positions up to `end` that share p's block: a caller walks the table block by block, with one
 * division per block rather than one per position. token_bytes: the bytes of one position's row. */
static inline const char *block_run(const char *cache, const int32_t *table, int64_t p, int64_t end,
                                    int64_t block_size, int64_t token_bytes, int64_t *stop)
{
    const int64_t offset = p % block_size;
    *stop = p - offset + block_size < end ? p - offset + block_size : end;
    return cache + ((int64_t)table[p / block_size] * block_size + offset) * token_bytes;
}

/* One KV head's keys (or values) at `row`: a float32 row, or with `quantized` head_dim int8 values
 * followed by their float32 scale (kernels/kv_quant.py). Returns the scale (1 for float32). */
static inline float head_scale(const char *row, int64_t head_dim, int quantized)
{
    float scale = 1.f;
    if (quantized)
        memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

static inline __attribute__((always_inline)) void attend_range(
    const float *restrict query, int64_t query_stride, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict block_tables, int64_t table_stride, const int32_t *restrict query_start,
    const int32_t *restrict context_lens, int64_t first_seq, int64_t last_seq, int64_t num_heads,
    int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float *restrict scores, float *restrict out, const int quantized)
{
    const int64_t group = num_heads / num_kv_heads;
    /* bytes of one KV head's row, and of a cached token: every KV head's row */
    const int64_t head_bytes = quantized ? head_dim + (int64_t)sizeof(float) : head_dim * (int64_t)sizeof(float);
    const int64_t token_bytes = num_kv_heads * head_bytes;
    int64_t low[QUERY_BLOCK], high[QUERY_BLOCK];          /* each query's visible positions, inclusive */
    for (int64_t s = first_seq; s < last_seq; s++) {
        const int32_t *table = block_tables + s * table_stride;
        const int64_t first = query_start[s], num_queries = query_start[s + 1] - first;
        const int64_t context = context_lens[s];
        for (int64_t i0 = 0; i0 < num_queries; i0 += QUERY_BLOCK) {
            const int64_t block = num_queries - i0 < QUERY_BLOCK ? num_queries - i0 : QUERY_BLOCK;
            for (int64_t b = 0; b < block; b++) {
                high[b] = context - num_queries + i0 + b;
                low[b] = (window > 0 && high[b] - window + 1 > 0) ? high[b] - window + 1 : 0;
            }
            const int64_t lowest = low[0], n = high[block - 1] + 1 - lowest; /* span of the block's rows */
            /* Scores of row (b, head) at t = p - lowest live at scores[(b * num_heads + head) * n + t]. Every
             * KV head is served in the same walk over the positions, so each cached token row (all its
             * heads, consecutive) is read once from memory, however long the context. */
            for (int64_t p = lowest, end = lowest + n, stop; p < end;) {
                const char *row = block_run(key_cache, table, p, end, block_size, token_bytes, &stop);
                for (; p < stop; p++, row += token_bytes) {
                    const int64_t t = p - lowest;
                    for (int64_t b = 0; b < block; b++) {
                        if (p < low[b] || p > high[b])
                            continue;
                        const float *q = query + (first + i0 + b) * query_stride;
                        for (int64_t head = 0; head < num_heads; head++) {
                            const char *k = row + (head / group) * head_bytes;
                            const float *qh = q + head * head_dim;
                            float dot = 0.f;
                            if (quantized) {
                                const int8_t *kq = (const int8_t *)k;
                                for (int64_t d = 0; d < head_dim; d++)
                                    dot += qh[d] * (float)kq[d];
                            } else {
                                const float *kf = (const float *)k;
                                for (int64_t d = 0; d < head_dim; d++)
                                    dot += qh[d] * kf[d];
                            }
                            scores[(b * num_heads + head) * n + t] = dot * head_scale(k, head_dim, quantized) * scale;
                        }
                    }
                }
            }
            for (int64_t b = 0; b < block; b++)
                for (int64_t head = 0; head < num_heads; head++) {
                    float *weights = scores + (b * num_heads + head) * n;
                    const int64_t from = low[b] - lowest, to = high[b] - lowest + 1;
                    float top = weights[from];
                    for (int64_t t = from + 1; t < to; t++)
                        top = weights[t] > top ? weights[t] : top;
                    float total = 0.f;
                    for (int64_t t = from; t < to; t++) {
                        weights[t] = expf(weights[t] - top);
                        total += weights[t];
                    }
                    const float inverse = 1.f / total;
                    for (int64_t t = from; t < to; t++)
                        weights[t] *= inverse;
                }
            memset(out + (first + i0) * num_heads * head_dim, 0, block * num_heads * head_dim * sizeof(float));
            for (int64_t p = lowest, end = lowest + n, stop; p < end;) {
                const char *row = block_run(value_cache, table, p, end, block_size, token_bytes, &stop);
                for (; p < stop; p++, row += token_bytes) {
                    const int64_t t = p - lowest;
                    for (int64_t b = 0; b < block; b++) {
                        if (p < low[b] || p > high[b])
                            continue;
                        float *o = out + (first + i0 + b) * num_heads * head_dim;
                        for (int64_t head = 0; head < num_heads; head++) {
                            const char *v = row + (head / group) * head_bytes;
                            const float weight = scores[(b * num_heads + head) * n + t] * head_scale(v, head_dim, quantized);
                            float *oh = o + head * head_dim;
                            if (quantized) {
                                const int8_t *vq = (const int8_t *)v;
                                for (int64_t d = 0; d < head_dim; d++)
                                    oh[d] += weight * (float)vq[d];
                            } else {
                                const float *vf = (const float *)v;
                                for (int64_t d = 0; d < head_dim; d++)
                                    oh[d] += weight * vf[d];
                            }
                        }
                    }
                }
            }
        }
    }
}

/* scores: scratch of QUERY_BLOCK * num_heads * max(context_lens) floats. A constant head_dim lets the
 * compiler unroll the inner loops into whole vectors; a constant `quantized` drops the other type's. */
#define ATTEND_SPECIALIZED(QUANTIZED)                                                                   \
    switch (head_dim) {                                                                                 \
    case 64: ATTEND(64, QUANTIZED); break;                                                              \
    case 128: ATTEND(128, QUANTIZED); break;                                                            \
    default: ATTEND(head_dim, QUANTIZED);                                                               \
    }
#define ATTEND(DIM, QUANTIZED)                                                                          \
    attend_range(query, query_stride, (const char *)key_cache, (const char *)value_cache, block_tables,  \
                 table_stride, query_start, context_lens, first_seq, last_seq, num_heads, num_kv_heads,  \
                 DIM, block_size, scale, window, scores, out, QUANTIZED)

void paged_attention_f32(
    const float *query, int64_t query_stride, const float *key_cache, const float *value_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *query_start, const int32_t *context_lens, int64_t first_seq,
    int64_t last_seq, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float *scores, float *out)
{
    ATTEND_SPECIALIZED(0)
}

/* The same over an int8 cache: each KV head's row is head_dim int8 values and their float32 scale. */
void paged_attention_i8(
    const float *query, int64_t query_stride, const int8_t *key_cache, const int8_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    int64_t first_seq, int64_t last_seq, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, float *scores, float *out)
{
    ATTEND_SPECIALIZED(1)
}
#undef ATTEND
#undef ATTEND_SPECIALIZED

/* The argument types of paged_attention_f32 and paged_attention_i8, as kernels/native.py checks them
 * before any call: p a pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *paged_attention_f32_signature(void) { return "pipppippiiiiiifipp:v"; }
const char *paged_attention_i8_signature(void) { return "pipppippiiiiiifipp:v"; }
