/* Rotary position embedding of this step's queries and keys, fused with storing the keys and
 * values into their cache slots: one pass where torch takes some twenty operations per layer.
 *
 * The rotation is HF's "rotate half": for i < d/2, x'[i] = x[i] cos[i] - x[i + d/2] sin[i] and
 * x'[i + d/2] = x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2]. Each product and the sum are rounded
 * as torch rounds them (no fused multiply-add), so the result is bit for bit the reference's.
 * Queries are rotated in place; rotated keys go straight to the cache (converted to its type as
 * torch converts them, rounding to nearest even). A slot < 0 is skipped. Threads share a call by
 * claiming its chunks of tokens_per_chunk tokens (claims.h); the caller, wait != 0, returns once every
 * chunk is done.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "claims.h"

#pragma GCC optimize("fp-contract=off")

/* x and out may be one row (queries rotate in place), so neither is restrict: the rotation goes
 * through a local buffer, and out is written only after x is read whole. */
static inline void rotate(const float *x, const float *restrict cos, const float *restrict sin, float *out,
                          int64_t head_dim)
{
    const int64_t half = head_dim / 2;
    float rotated[512];
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i] * cos[i], b = x[i + half] * sin[i];
        rotated[i] = a - b;
    }
    for (int64_t i = half; i < head_dim; i++) {
        const float a = x[i] * cos[i], b = x[i - half] * sin[i];
        rotated[i] = a + b;
    }
    for (int64_t i = 0; i < head_dim; i++)
        out[i] = rotated[i];
}

/* A quantized row's scale: x's largest magnitude over `limit` (the format's largest value), never
 * below FLT_MIN so that a row of zeros divides cleanly. */
static inline float row_scale(const float *x, int64_t head_dim, float limit)
{
    float top = 0.f;
    for (int64_t i = 0; i < head_dim; i++)
        top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    return top / limit > FLT_MIN ? top / limit : FLT_MIN;
}

/* An int8 cache row (kernels/kv_quant.py): head_dim values rounded from x over its largest
 * magnitude / 127, then that scale as a float32. */
static inline void quantize_row(const float *x, int8_t *out, int64_t head_dim)
{
    const float scale = row_scale(x, head_dim, 127.f);
    for (int64_t i = 0; i < head_dim; i++) {
        const float q = nearbyintf(x[i] / scale);
        out[i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
    }
    memcpy(out + head_dim, &scale, sizeof scale);
}

/* A value within [-448, 448] as an OCP E4M3 byte, rounded to nearest even as torch converts it:
 * below 2^-6 a multiple of 2^-9 (the subnormals; 8 x 2^-9 is the smallest normal, 0x08), above it
 * float32's exponent rebiased (127 -> 7) and its mantissa rounded to 3 bits. */
static inline uint8_t fp8_e4m3_byte(float y)
{
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    const float magnitude = fabsf(y);
    if (magnitude < 0x1p-6f)
        return sign | (uint8_t)nearbyintf(magnitude * 0x1p9f);
    memcpy(&bits, &magnitude, sizeof bits);
    bits += 0x7ffffu + ((bits >> 20) & 1u);
    const uint32_t code = (bits >> 20) - (120u << 3);
    return sign | (uint8_t)(code > 0x7eu ? 0x7eu : code); /* 0x7e: 448; 0x7f is NaN */
}

/* An E4M3 cache row (kernels/kv_quant.py): head_dim values of x over its largest magnitude / 448,
 * then that scale as a float32. */
static inline void quantize_row_fp8(const float *x, uint8_t *out, int64_t head_dim)
{
    const float scale = row_scale(x, head_dim, 448.f);
    for (int64_t i = 0; i < head_dim; i++) {
        const float y = x[i] / scale;
        out[i] = fp8_e4m3_byte(y > 448.f ? 448.f : y < -448.f ? -448.f : y);
    }
    memcpy(out + head_dim, &scale, sizeof scale);
}

/* How a cache row holds its values: float32; bfloat16 or float16; or one byte each (int8, E4M3)
 * and their scale. */
enum row_kind { ROW_F32, ROW_BF16, ROW_F16, ROW_I8, ROW_F8 };

/* x's head_dim values into a cache row of `kind` (not float32). */
static inline void store_as(int kind, const float *x, char *out, int64_t head_dim)
{
    if (kind == ROW_BF16)
        for (int64_t i = 0; i < head_dim; i++)
            ((uint16_t *)out)[i] = bfloat16_of(x[i]);
    else if (kind == ROW_F16)
        for (int64_t i = 0; i < head_dim; i++)
            ((_Float16 *)out)[i] = (_Float16)x[i];
    else if (kind == ROW_I8)
        quantize_row(x, (int8_t *)out, head_dim);
    else
        quantize_row_fp8(x, (uint8_t *)out, head_dim);
}

/* Tokens first .. end - 1 of the call below. */
static inline __attribute__((always_inline)) void rotate_tokens(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t first, int64_t end,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, char *key_cache, char *value_cache, const int kind)
{
    const int64_t head_bytes = kind == ROW_I8 || kind == ROW_F8 ? head_dim + (int64_t)sizeof(float)
                             : head_dim * (kind == ROW_F32 ? 4 : 2);
    const int64_t row = num_kv_heads * head_bytes;
    float rotated[512];
    for (int64_t t = first; t < end; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *q = query + t * query_stride + h * head_dim;
            rotate(q, c, s, q, head_dim);
        }
        if (slots[t] < 0)
            continue;
        char *k_out = key_cache + slots[t] * row, *v_out = value_cache + slots[t] * row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *v = value + t * value_stride + h * head_dim;
            if (kind != ROW_F32) {
                rotate(key + t * key_stride + h * head_dim, c, s, rotated, head_dim);
                store_as(kind, rotated, k_out + h * head_bytes, head_dim);
                store_as(kind, v, v_out + h * head_bytes, head_dim);
            } else {
                rotate(key + t * key_stride + h * head_dim, c, s, (float *)(k_out + h * head_bytes), head_dim);
                memcpy(v_out + h * head_bytes, v, head_dim * sizeof(float));
            }
        }
    }
}

/* cos, sin: [num_tokens, head_dim]; query rows are num_heads * head_dim apart (query_stride
 * floats between tokens), keys and values num_kv_heads * head_dim (key_stride, value_stride). A
 * float32 cache takes the rotated keys and the values as they are; an int8 or E4M3 cache (rows of
 * head_dim one-byte values and their float32 scale) takes them quantized. */
static inline __attribute__((always_inline)) int64_t rotate_and_write(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, char *key_cache, char *value_cache, const int kind,
    int64_t tokens_per_chunk, int64_t *counters, int64_t wait)
{
    if (head_dim > 512 || head_dim % 2)
        return -1;
    const int64_t chunks = (num_tokens + tokens_per_chunk - 1) / tokens_per_chunk;
    for (int64_t chunk; (chunk = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t first = chunk * tokens_per_chunk, end = first + tokens_per_chunk < num_tokens
                                                                    ? first + tokens_per_chunk : num_tokens;
        rotate_tokens(query, query_stride, key, key_stride, value, value_stride, cos, sin, slots, first, end,
                      num_heads, num_kv_heads, head_dim, key_cache, value_cache, kind);
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}


int64_t rotate_and_write_f32(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float *key_cache, float *value_cache,
    int64_t tokens_per_chunk, int64_t *counters, int64_t wait)
{
    return rotate_and_write(query, query_stride, key, key_stride, value, value_stride, cos, sin, slots, num_tokens,
                            num_heads, num_kv_heads, head_dim, (char *)key_cache, (char *)value_cache, ROW_F32,
                            tokens_per_chunk, counters, wait);
}

int64_t rotate_and_write_bf16(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uint16_t *key_cache, uint16_t *value_cache,
    int64_t tokens_per_chunk, int64_t *counters, int64_t wait)
{
    return rotate_and_write(query, query_stride, key, key_stride, value, value_stride, cos, sin, slots, num_tokens,
                            num_heads, num_kv_heads, head_dim, (char *)key_cache, (char *)value_cache, ROW_BF16,
                            tokens_per_chunk, counters, wait);
}

int64_t rotate_and_write_f16(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uint16_t *key_cache, uint16_t *value_cache,
    int64_t tokens_per_chunk, int64_t *counters, int64_t wait)
{
    return rotate_and_write(query, query_stride, key, key_stride, value, value_stride, cos, sin, slots, num_tokens,
                            num_heads, num_kv_heads, head_dim, (char *)key_cache, (char *)value_cache, ROW_F16,
                            tokens_per_chunk, counters, wait);
}

int64_t rotate_and_write_i8(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int8_t *key_cache, int8_t *value_cache,
    int64_t tokens_per_chunk, int64_t *counters, int64_t wait)
{
    return rotate_and_write(query, query_stride, key, key_stride, value, value_stride, cos, sin, slots, num_tokens,
                            num_heads, num_kv_heads, head_dim, (char *)key_cache, (char *)value_cache, ROW_I8,
                            tokens_per_chunk, counters, wait);
}

int64_t rotate_and_write_f8(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uint8_t *key_cache, uint8_t *value_cache,
    int64_t tokens_per_chunk, int64_t *counters, int64_t wait)
{
    return rotate_and_write(query, query_stride, key, key_stride, value, value_stride, cos, sin, slots, num_tokens,
                            num_heads, num_kv_heads, head_dim, (char *)key_cache, (char *)value_cache, ROW_F8,
                            tokens_per_chunk, counters, wait);
}

/* The same calls as tasks of helper_pool.c: the arguments before the counters as words, in order. */
#define ROTATE_TASK(NAME, KIND)                                                                         \
    int64_t NAME##_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)               \
    {                                                                                                   \
        (void)thread;                                                                                   \
        return rotate_and_write((float *)w[0], w[1], (const float *)w[2], w[3], (const float *)w[4], w[5],   \
                                (const float *)w[6], (const float *)w[7], (const int64_t *)w[8], w[9], w[10], \
                                w[11], w[12], (char *)w[13], (char *)w[14], KIND, w[15], counters, wait); \
    }                                                                                                   \
    int64_t NAME##_task_words(void) { return 16; }                                                      \
    const char *NAME##_task_words_signature(void) { return ":i"; }
ROTATE_TASK(rotate_and_write_f32, ROW_F32)
ROTATE_TASK(rotate_and_write_bf16, ROW_BF16)
ROTATE_TASK(rotate_and_write_f16, ROW_F16)
ROTATE_TASK(rotate_and_write_i8, ROW_I8)
ROTATE_TASK(rotate_and_write_f8, ROW_F8)
#undef ROTATE_TASK

/* The argument types of rotate_and_write_f32, _bf16, _f16, _i8 and _f8, as kernels/native.py checks them
 * before any call: p a pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *rotate_and_write_f32_signature(void) { return "pipipipppiiiippipi:i"; }
const char *rotate_and_write_bf16_signature(void) { return "pipipipppiiiippipi:i"; }
const char *rotate_and_write_f16_signature(void) { return "pipipipppiiiippipi:i"; }
const char *rotate_and_write_i8_signature(void) { return "pipipipppiiiippipi:i"; }
const char *rotate_and_write_f8_signature(void) { return "pipipipppiiiippipi:i"; }
