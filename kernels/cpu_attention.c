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

/* How a cached row holds its values (kernels/kv_quant.py): float32, or head_dim one-byte values
 * (int8, or OCP E4M3 floats) followed by their float32 scale. */
enum row_kind { ROW_F32, ROW_I8, ROW_F8 };

/* One KV head's keys (or values) at `row`: returns the row's scale (1 for float32). */
static inline float head_scale(const char *row, int64_t head_dim, int kind)
{
    float scale = 1.f;
    if (kind != ROW_F32)
        memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

/* An E4M3 byte as a float, in operations that vectorize and without float32 subnormals (which
 * -ffast-math may flush): exponent and mantissa move into float32's fields, rebiased (7 -> 127);
 * an exponent of 0 is E4M3's subnormal range, mantissa x 2^-9. 0x7f and 0xff (NaN) are never written. */
static inline float fp8_e4m3_value(uint8_t byte)
{
    const uint32_t magnitude = byte & 0x7fu;
    union { uint32_t bits; float value; } normal = { .bits = (magnitude << 20) + (120u << 23) }, result;
    const float subnormal = (float)(int32_t)(magnitude & 7u) * 0x1p-9f;
    result.value = magnitude >= 8u ? normal.value : subnormal;
    result.bits |= (uint32_t)(byte & 0x80u) << 24;
    return result.value;
}

#define MAX_DECODED 8192 /* floats of one cached token's E4M3 row decoded at once (kernels/cpu_attention.py checks) */

/* Every KV head's E4M3 values of one cached token, as floats: decoded once for all the query heads
 * and query rows that read them. */
static inline void decode_fp8_token(const char *restrict row, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t head_bytes, float *restrict decoded)
{
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const uint8_t *bytes = (const uint8_t *)(row + h * head_bytes);
        for (int64_t d = 0; d < head_dim; d++)
            decoded[h * head_dim + d] = fp8_e4m3_value(bytes[d]);
    }
}

static inline __attribute__((always_inline)) void attend_range(
    const float *restrict query, int64_t query_stride, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict block_tables, int64_t table_stride, const int32_t *restrict query_start,
    const int32_t *restrict context_lens, int64_t first_seq, int64_t last_seq, int64_t num_heads,
    int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float *restrict scores, float *restrict out, const int kind)
{
    const int64_t group = num_heads / num_kv_heads;
    /* bytes of one KV head's row, and of a cached token: every KV head's row */
    const int64_t head_bytes = kind != ROW_F32 ? head_dim + (int64_t)sizeof(float) : head_dim * (int64_t)sizeof(float);
    const int64_t token_bytes = num_kv_heads * head_bytes;
    int64_t low[QUERY_BLOCK], high[QUERY_BLOCK];          /* each query's visible positions, inclusive */
    float decoded[kind == ROW_F8 ? MAX_DECODED : 1];
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
                    if (kind == ROW_F8)
                        decode_fp8_token(row, num_kv_heads, head_dim, head_bytes, decoded);
                    for (int64_t b = 0; b < block; b++) {
                        if (p < low[b] || p > high[b])
                            continue;
                        const float *q = query + (first + i0 + b) * query_stride;
                        for (int64_t head = 0; head < num_heads; head++) {
                            const char *k = row + (head / group) * head_bytes;
                            const float *qh = q + head * head_dim;
                            float dot = 0.f;
                            if (kind == ROW_I8) {
                                const int8_t *kq = (const int8_t *)k;
                                for (int64_t d = 0; d < head_dim; d++)
                                    dot += qh[d] * (float)kq[d];
                            } else if (kind == ROW_F8) {
                                const float *kf = decoded + (head / group) * head_dim;
                                for (int64_t d = 0; d < head_dim; d++)
                                    dot += qh[d] * kf[d];
                            } else {
                                const float *kf = (const float *)k;
                                for (int64_t d = 0; d < head_dim; d++)
                                    dot += qh[d] * kf[d];
                            }
                            scores[(b * num_heads + head) * n + t] = dot * head_scale(k, head_dim, kind) * scale;
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
                    if (kind == ROW_F8)
                        decode_fp8_token(row, num_kv_heads, head_dim, head_bytes, decoded);
                    for (int64_t b = 0; b < block; b++) {
                        if (p < low[b] || p > high[b])
                            continue;
                        float *o = out + (first + i0 + b) * num_heads * head_dim;
                        for (int64_t head = 0; head < num_heads; head++) {
                            const char *v = row + (head / group) * head_bytes;
                            const float weight = scores[(b * num_heads + head) * n + t] * head_scale(v, head_dim, kind);
                            float *oh = o + head * head_dim;
                            if (kind == ROW_I8) {
                                const int8_t *vq = (const int8_t *)v;
                                for (int64_t d = 0; d < head_dim; d++)
                                    oh[d] += weight * (float)vq[d];
                            } else if (kind == ROW_F8) {
                                const float *vf = decoded + (head / group) * head_dim;
                                for (int64_t d = 0; d < head_dim; d++)
                                    oh[d] += weight * vf[d];
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
 * compiler unroll the inner loops into whole vectors; a constant row kind drops the other kinds'. */
#define ATTEND_SPECIALIZED(KIND)                                                                        \
    switch (head_dim) {                                                                                 \
    case 64: ATTEND(64, KIND); break;                                                                   \
    case 128: ATTEND(128, KIND); break;                                                                 \
    default: ATTEND(head_dim, KIND);                                                                    \
    }
#define ATTEND(DIM, KIND)                                                                               \
    attend_range(query, query_stride, (const char *)key_cache, (const char *)value_cache, block_tables,  \
                 table_stride, query_start, context_lens, first_seq, last_seq, num_heads, num_kv_heads,  \
                 DIM, block_size, scale, window, scores, out, KIND)

void paged_attention_f32(
    const float *query, int64_t query_stride, const float *key_cache, const float *value_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *query_start, const int32_t *context_lens, int64_t first_seq,
    int64_t last_seq, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_F32)
}

/* The same over an int8 cache: each KV head's row is head_dim int8 values and their float32 scale. */
void paged_attention_i8(
    const float *query, int64_t query_stride, const int8_t *key_cache, const int8_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    int64_t first_seq, int64_t last_seq, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_I8)
}

/* And over an E4M3 cache: each KV head's row is head_dim E4M3 bytes and their float32 scale. */
void paged_attention_f8(
    const float *query, int64_t query_stride, const uint8_t *key_cache, const uint8_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    int64_t first_seq, int64_t last_seq, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_F8)
}
#undef ATTEND
#undef ATTEND_SPECIALIZED

/* The argument types of paged_attention_f32, _i8 and _f8, as kernels/native.py checks them before
 * any call: p a pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *paged_attention_f32_signature(void) { return "pipppippiiiiiifipp:v"; }
const char *paged_attention_i8_signature(void) { return "pipppippiiiiiifipp:v"; }
const char *paged_attention_f8_signature(void) { return "pipppippiiiiiifipp:v"; }
