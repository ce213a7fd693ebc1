/* SiLU(gate) * up over the rows of a fused gate_up projection ([rows, 2 * width]: gate, then up):
 * the input of a gated MLP's down projection, in one pass where torch takes two (SiLU, then the
 * product) and, for a decode step's few rows, most of its time in calling them.
 *
 * gate_up rows are `stride` floats apart, out rows `out_stride` apart; out may be gate_up's own gate
 * half. Threads share a call by claiming its chunks of rows_per_chunk rows (claims.h); the caller,
 * wait != 0, returns once every chunk is done. silu_mul_f32_bf16 writes out as bfloat16 rows, the input
 * of a product that takes them; silu_mul_f32_int8 int8 codes and a scale a row (int8_rows.h), a W8A8
 * product's. Built with -ffast-math, so the loop becomes SIMD and expf the vector library's.
 */
#include <math.h>
#include <stdint.h>

#include "bfloat16.h"
#include "claims.h"
#include "int8_rows.h"
#include "silu.h"

static inline __attribute__((always_inline)) int64_t silu_mul(
    const float *gate_up, int64_t stride, void *out, int64_t out_stride, int64_t rows, int64_t width,
    int64_t rows_per_chunk, int64_t *counters, int64_t wait, const int bf16_out)
{
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t end = (c + 1) * rows_per_chunk < rows ? (c + 1) * rows_per_chunk : rows;
        for (int64_t r = c * rows_per_chunk; r < end; r++) {
            const float *gate = gate_up + r * stride, *up = gate + width;
            if (bf16_out) {
                uint16_t *o = (uint16_t *)out + r * out_stride;
#pragma omp simd
                for (int64_t i = 0; i < width; i++)
                    o[i] = bfloat16_of(silu(gate[i]) * up[i]);
                continue;
            }
            float *o = (float *)out + r * out_stride;
            /* out may be gate_up itself (the gate half, overwritten): each o[i] depends on that i alone. */
#pragma omp simd
            for (int64_t i = 0; i < width; i++)
                o[i] = silu(gate[i]) * up[i];
        }
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

/* SiLU(gate) * up of each row quantized into int8 codes for a W8A8 down projection (int8_rows.h): codes
 * [rows][padded], scales [rows]. Each row is first computed as silu_mul_f32 computes it, into a row on the stack. */
int64_t silu_mul_f32_int8(const float *gate_up, int64_t stride, int8_t *codes, float *scales, float static_scale,
                          int64_t unsigned_codes, int64_t rows, int64_t width, int64_t padded, int64_t rows_per_chunk,
                          int64_t *counters, int64_t wait)
{
    if (width > INT8_ROWS_MAX_WIDTH || width < 1)
        return -1;
    float row[width];
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t end = (c + 1) * rows_per_chunk < rows ? (c + 1) * rows_per_chunk : rows;
        for (int64_t r = c * rows_per_chunk; r < end; r++) {
            const float *gate = gate_up + r * stride, *up = gate + width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++)
                row[i] = silu(gate[i]) * up[i];
            quantize_row(row, width, padded, codes + r * padded, scales + r, static_scale, (int)unsigned_codes);
        }
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

int64_t silu_mul_f32(const float *gate_up, int64_t stride, float *out, int64_t out_stride, int64_t rows,
                     int64_t width, int64_t rows_per_chunk, int64_t *counters, int64_t wait)
{
    return silu_mul(gate_up, stride, out, out_stride, rows, width, rows_per_chunk, counters, wait, 0);
}

int64_t silu_mul_f32_bf16(const float *gate_up, int64_t stride, uint16_t *out, int64_t out_stride, int64_t rows,
                          int64_t width, int64_t rows_per_chunk, int64_t *counters, int64_t wait)
{
    return silu_mul(gate_up, stride, out, out_stride, rows, width, rows_per_chunk, counters, wait, 1);
}

/* The same calls as tasks of helper_pool.c: the arguments before the counters as words, in order. */
#define SILU_TASK(NAME, BF16_OUT)                                                                       \
    int64_t NAME##_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)               \
    {                                                                                                   \
        (void)thread;                                                                                   \
        return silu_mul((const float *)w[0], w[1], (void *)w[2], w[3], w[4], w[5], w[6], counters, wait, BF16_OUT); \
    }                                                                                                   \
    int64_t NAME##_task_words(void) { return 7; }
SILU_TASK(silu_mul_f32, 0)
SILU_TASK(silu_mul_f32_bf16, 1)
#undef SILU_TASK

int64_t silu_mul_f32_int8_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return silu_mul_f32_int8((const float *)w[0], w[1], (int8_t *)w[2], (float *)w[3], float_of_bits(w[4]), w[5], w[6],
                             w[7], w[8], w[9], counters, wait);
}
int64_t silu_mul_f32_int8_task_words(void) { return 10; }

/* The argument types of silu_mul_f32, as kernels/native.py checks them before any call: p a pointer,
 * i an int64_t, f a float; after the colon the result (v: none). */
const char *silu_mul_f32_signature(void) { return "pipiiiipi:i"; }
const char *silu_mul_f32_task_words_signature(void) { return ":i"; }
const char *silu_mul_f32_bf16_signature(void) { return "pipiiiipi:i"; }
const char *silu_mul_f32_bf16_task_words_signature(void) { return ":i"; }
const char *silu_mul_f32_int8_signature(void) { return "pippfiiiiipi:i"; }
const char *silu_mul_f32_int8_task_words_signature(void) { return ":i"; }
