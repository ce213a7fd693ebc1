/* LoRA adapters applied to the rows of a step, one projection group of one layer at a time, for
 * every adapter of the step at once (as BGMV does): for each unit, a token row under an adapter,
 *
 *   s = A x                        A: the group's stacked A rows (n_a x in), read in place
 *   out[col_p .. col_p + w_p) += s[p r .. (p + 1) r) BT_p     for each of its k projections
 *
 * where BT_p (r x w_p) is the projection's B stored transposed. The weights are float32 or
 * bfloat16 (weight_bf16), read where the adapter's pages are; activations are float32.
 *
 * units: (row, adapter) pairs. adapters: per adapter LORA_FIELDS int64s: the address of A, n_a, r,
 * k, then (address of BT_p, col_p, w_p) for each of up to 3 projections. Threads share a call by
 * claiming chunks of units (claims.h); two units may add to one row only through different
 * adapters, which a step never gives one row, so no two threads write one output value.
 */
#include <stdint.h>
#include <string.h>

#include "claims.h"

#define LORA_FIELDS 13
#define MAX_A_ROWS 256

static inline float bf16_to_f32(uint16_t v)
{
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void shrink_f32(const float *x, const float *a, int64_t n_a, int64_t in, float *s)
{
    for (int64_t j = 0; j < n_a; j++) {
        const float *row = a + j * in;
        float acc = 0.0f;
        for (int64_t i = 0; i < in; i++)
            acc += x[i] * row[i];
        s[j] = acc;
    }
}

static void shrink_bf16(const float *x, const uint16_t *a, int64_t n_a, int64_t in, float *s)
{
    for (int64_t j = 0; j < n_a; j++) {
        const uint16_t *row = a + j * in;
        float acc = 0.0f;
        for (int64_t i = 0; i < in; i++)
            acc += x[i] * bf16_to_f32(row[i]);
        s[j] = acc;
    }
}

static void expand_f32(const float *s, const float *bt, int64_t r, int64_t w, float *o)
{
    for (int64_t j = 0; j < r; j++) {
        const float *row = bt + j * w;
        const float sj = s[j];
        for (int64_t i = 0; i < w; i++)
            o[i] += sj * row[i];
    }
}

static void expand_bf16(const float *s, const uint16_t *bt, int64_t r, int64_t w, float *o)
{
    for (int64_t j = 0; j < r; j++) {
        const uint16_t *row = bt + j * w;
        const float sj = s[j];
        for (int64_t i = 0; i < w; i++)
            o[i] += sj * bf16_to_f32(row[i]);
    }
}

int64_t lora_rows(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t in,
                  const int64_t *units, int64_t n_units, const int64_t *adapters, int64_t weight_bf16,
                  int64_t units_per_chunk, int64_t *counters, int64_t wait)
{
    const int64_t chunks = (n_units + units_per_chunk - 1) / units_per_chunk;
    float s[MAX_A_ROWS];
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t end = (c + 1) * units_per_chunk < n_units ? (c + 1) * units_per_chunk : n_units;
        for (int64_t u = c * units_per_chunk; u < end; u++) {
            const int64_t row = units[2 * u];
            const int64_t *adapter = adapters + LORA_FIELDS * units[2 * u + 1];
            const int64_t n_a = adapter[1] < MAX_A_ROWS ? adapter[1] : MAX_A_ROWS, r = adapter[2], k = adapter[3];
            const float *xr = x + row * x_stride;
            if (weight_bf16)
                shrink_bf16(xr, (const uint16_t *)(intptr_t)adapter[0], n_a, in, s);
            else
                shrink_f32(xr, (const float *)(intptr_t)adapter[0], n_a, in, s);
            for (int64_t p = 0; p < k && p < 3 && (p + 1) * r <= n_a; p++) {
                const int64_t *b = adapter + 4 + 3 * p;
                float *o = out + row * out_stride + b[1];
                if (weight_bf16)
                    expand_bf16(s + p * r, (const uint16_t *)(intptr_t)b[0], r, b[2], o);
                else
                    expand_f32(s + p * r, (const float *)(intptr_t)b[0], r, b[2], o);
            }
        }
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

const char *lora_rows_signature(void) { return "pipiipipiipi:i"; }
