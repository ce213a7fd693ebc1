/* Rotary position embedding of this step's queries and keys, fused with storing the keys and
 * values into their cache slots: one pass where torch takes some twenty operations per layer.
 *
 * The rotation is HF's "rotate half": for i < d/2, x'[i] = x[i] cos[i] - x[i + d/2] sin[i] and
 * x'[i + d/2] = x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2]. Each product and the sum are rounded
 * as torch rounds them (no fused multiply-add), so the result is bit for bit the reference's.
 * Queries are rotated in place; rotated keys go straight to the cache. A slot < 0 is skipped.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* cos, sin: [num_tokens, head_dim]; query rows are num_heads * head_dim apart (query_stride
 * floats between tokens), keys and values num_kv_heads * head_dim (key_stride, value_stride). */
int64_t rotate_and_write_f32(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float *key_cache, float *value_cache)
{
    if (head_dim > 512 || head_dim % 2)
        return -1;
    const int64_t row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *q = query + t * query_stride + h * head_dim;
            rotate(q, c, s, q, head_dim);
        }
        if (slots[t] < 0)
            continue;
        float *k_out = key_cache + slots[t] * row, *v_out = value_cache + slots[t] * row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate(key + t * key_stride + h * head_dim, c, s, k_out + h * head_dim, head_dim);
            const float *v = value + t * value_stride + h * head_dim;
            for (int64_t i = 0; i < head_dim; i++)
                v_out[h * head_dim + i] = v[i];
        }
    }
    return 0;
}

/* An int8 cache row (kernels/kv_quant.py): head_dim values rounded from x over its largest
 * magnitude / 127, then that scale as a float32. */
static inline void quantize_row(const float *x, int8_t *out, int64_t head_dim)
{
    float top = 0.f;
    for (int64_t i = 0; i < head_dim; i++)
        top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const float scale = top / 127.f > FLT_MIN ? top / 127.f : FLT_MIN;
    for (int64_t i = 0; i < head_dim; i++) {
        const float q = nearbyintf(x[i] / scale);
        out[i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
    }
    memcpy(out + head_dim, &scale, sizeof scale);
}

/* The same into an int8 cache: rows of head_dim + 4 bytes, keys rotated and then quantized. */
int64_t rotate_and_write_i8(
    float *query, int64_t query_stride, const float *key, int64_t key_stride, const float *value,
    int64_t value_stride, const float *cos, const float *sin, const int64_t *slots, int64_t num_tokens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int8_t *key_cache, int8_t *value_cache)
{
    if (head_dim > 512 || head_dim % 2)
        return -1;
    const int64_t width = head_dim + (int64_t)sizeof(float), row = num_kv_heads * width;
    float rotated[512];
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *q = query + t * query_stride + h * head_dim;
            rotate(q, c, s, q, head_dim);
        }
        if (slots[t] < 0)
            continue;
        int8_t *k_out = key_cache + slots[t] * row, *v_out = value_cache + slots[t] * row;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate(key + t * key_stride + h * head_dim, c, s, rotated, head_dim);
            quantize_row(rotated, k_out + h * width, head_dim);
            quantize_row(value + t * value_stride + h * head_dim, v_out + h * width, head_dim);
        }
    }
    return 0;
}

/* The argument types of rotate_and_write_f32 and rotate_and_write_i8, as kernels/native.py checks them
 * before any call: p a pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *rotate_and_write_f32_signature(void) { return "pipipipppiiiipp:i"; }
const char *rotate_and_write_i8_signature(void) { return "pipipipppiiiipp:i"; }
