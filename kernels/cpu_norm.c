/* RMSNorm of a few rows at a time, optionally fused with the residual add before it: one pass
 * where torch takes several operations (and, on this CPU, tens of microseconds for one row).
 *
 * With residual != NULL: residual += x, then out = residual / rms(residual) * weight (the residual
 * stream and the normalized input of the next sublayer, as a pre-norm decoder needs both).
 * Without: out = x / rms(x) * weight. Rows are `stride` floats apart in x, residual and out alike.
 * Sums of squares run in float32, as HF's RMSNorm computes them for float32 inputs. rms_norm_f32_bf16
 * writes out as bfloat16 rows (stride values apart), the input of a product that takes them;
 * rms_norm_f32_int8 writes int8 codes and a scale a row (int8_rows.h), the input of a W8A8 product.
 * rms_norm_heads_f32 normalizes each of a row's `heads` runs of `width` values on its own (Qwen3's norm
 * of every head of q and k), rows `stride` floats apart in x and out alike: out may be x, so a view of
 * the heads in the q/k/v projection's output is normalized where it lies.
 */
#include <math.h>
#include <stdint.h>

#include "bfloat16.h"
#include "claims.h"
#include "int8_rows.h"

/* Where a row's output goes: float32 or bfloat16 rows, or int8 codes (int8_rows.h) for a W8A8 product. */
enum { FLOAT_OUT, BF16_OUT, CODES_OUT };

/* How CODES_OUT rows are written: codes rows `padded` bytes apart, a scale a row, the row itself in `row` first. */
struct codes_out {
    int8_t *codes;
    float *scales;
    float static_scale;
    int64_t unsigned_codes, padded;
    float *row;
};

static inline __attribute__((always_inline)) void norm_rows(
    const float *x, float *residual, const float *weight, float eps, void *out, int64_t first, int64_t end,
    int64_t heads, int64_t width, int64_t stride, const int kind, const struct codes_out *codes)
{
    for (int64_t run = first * heads; run < end * heads; run++) {
        const int64_t r = run / heads, at = r * stride + run % heads * width;
        const float *in = x + at;
        float *source = residual ? residual + at : (float *)in;
        if (residual)
            for (int64_t i = 0; i < width; i++)
                source[i] += in[i];
        float squares = 0.0f;
        for (int64_t i = 0; i < width; i++)
            squares += source[i] * source[i];
        const float scale = 1.0f / sqrtf(squares / (float)width + eps);
        if (kind == BF16_OUT) {
            uint16_t *o = (uint16_t *)out + at;
            for (int64_t i = 0; i < width; i++)
                o[i] = bfloat16_of(source[i] * scale * weight[i]);
        } else {
            float *o = kind == CODES_OUT ? codes->row : (float *)out + at;
            for (int64_t i = 0; i < width; i++)
                o[i] = source[i] * scale * weight[i];
            if (kind == CODES_OUT)
                quantize_row(o, width, codes->padded, codes->codes + r * codes->padded, codes->scales + r,
                             codes->static_scale, (int)codes->unsigned_codes);
        }
    }
}

static int64_t norm(const float *x, float *residual, const float *weight, float eps, void *out, int64_t rows,
                    int64_t heads, int64_t width, int64_t stride, int64_t rows_per_chunk, int64_t *counters,
                    int64_t wait, const int kind, const struct codes_out *codes)
{
    const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {
        const int64_t end = (c + 1) * rows_per_chunk < rows ? (c + 1) * rows_per_chunk : rows;
        if (kind == BF16_OUT)
            norm_rows(x, residual, weight, eps, out, c * rows_per_chunk, end, heads, width, stride, BF16_OUT, 0);
        else if (kind == CODES_OUT)
            norm_rows(x, residual, weight, eps, out, c * rows_per_chunk, end, heads, width, stride, CODES_OUT, codes);
        else
            norm_rows(x, residual, weight, eps, out, c * rows_per_chunk, end, heads, width, stride, FLOAT_OUT, 0);
    }
    if (wait)
        wait_for_chunks(counters, chunks);
    return 0;
}

/* Threads share a call by claiming its chunks of rows_per_chunk rows (claims.h); the caller, wait != 0,
 * returns once every chunk is done. */
int64_t rms_norm_f32(const float *x, float *residual, const float *weight, float eps, float *out, int64_t rows,
                     int64_t width, int64_t stride, int64_t rows_per_chunk, int64_t *counters, int64_t wait)
{
    return norm(x, residual, weight, eps, out, rows, 1, width, stride, rows_per_chunk, counters, wait, FLOAT_OUT, 0);
}

int64_t rms_norm_f32_bf16(const float *x, float *residual, const float *weight, float eps, uint16_t *out,
                          int64_t rows, int64_t width, int64_t stride, int64_t rows_per_chunk, int64_t *counters,
                          int64_t wait)
{
    return norm(x, residual, weight, eps, out, rows, 1, width, stride, rows_per_chunk, counters, wait, BF16_OUT, 0);
}

/* Rows (`width` values, rows `width` floats apart in x and residual) normalized into int8 codes for a W8A8 product
 * (int8_rows.h): codes [rows][padded], scales [rows]. */
int64_t rms_norm_f32_int8(const float *x, float *residual, const float *weight, float eps, int8_t *codes,
                          float *scales, float static_scale, int64_t unsigned_codes, int64_t rows, int64_t width,
                          int64_t padded, int64_t rows_per_chunk, int64_t *counters, int64_t wait)
{
    if (width > INT8_ROWS_MAX_WIDTH || width < 1)
        return -1;
    float row[width]; /* this thread's normalized row before it is quantized */
    const struct codes_out out = {codes, scales, static_scale, unsigned_codes, padded, row};
    return norm(x, residual, weight, eps, 0, rows, 1, width, width, rows_per_chunk, counters, wait, CODES_OUT, &out);
}

int64_t rms_norm_heads_f32(const float *x, const float *weight, float eps, float *out, int64_t rows, int64_t heads,
                           int64_t width, int64_t stride, int64_t rows_per_chunk, int64_t *counters, int64_t wait)
{
    return norm(x, 0, weight, eps, out, rows, heads, width, stride, rows_per_chunk, counters, wait, FLOAT_OUT, 0);
}

/* The same calls as tasks of helper_pool.c: the arguments before the counters as words, in order (eps
 * as a float's bits). */
#define NORM_TASK(NAME, KIND)                                                                           \
    int64_t NAME##_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)               \
    {                                                                                                   \
        (void)thread;                                                                                   \
        return norm((const float *)w[0], (float *)w[1], (const float *)w[2], float_of_bits(w[3]), (void *)w[4], \
                    w[5], 1, w[6], w[7], w[8], counters, wait, KIND, 0);                                \
    }                                                                                                   \
    int64_t NAME##_task_words(void) { return 9; }
NORM_TASK(rms_norm_f32, FLOAT_OUT)
NORM_TASK(rms_norm_f32_bf16, BF16_OUT)
#undef NORM_TASK

int64_t rms_norm_heads_f32_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return norm((const float *)w[0], 0, (const float *)w[1], float_of_bits(w[2]), (void *)w[3], w[4], w[5], w[6], w[7],
                w[8], counters, wait, FLOAT_OUT, 0);
}
int64_t rms_norm_heads_f32_task_words(void) { return 9; }

int64_t rms_norm_f32_int8_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)
{
    (void)thread;
    return rms_norm_f32_int8((const float *)w[0], (float *)w[1], (const float *)w[2], float_of_bits(w[3]),
                             (int8_t *)w[4], (float *)w[5], float_of_bits(w[6]), w[7], w[8], w[9], w[10], w[11],
                             counters, wait);
}
int64_t rms_norm_f32_int8_task_words(void) { return 12; }

/* The argument types of rms_norm_f32, as kernels/native.py checks them before any call: p a pointer,
 * i an int64_t, f a float; after the colon the result (v: none). */
const char *rms_norm_f32_signature(void) { return "pppfpiiiipi:i"; }
const char *rms_norm_f32_task_words_signature(void) { return ":i"; }
const char *rms_norm_f32_bf16_signature(void) { return "pppfpiiiipi:i"; }
const char *rms_norm_f32_bf16_task_words_signature(void) { return ":i"; }
const char *rms_norm_f32_int8_signature(void) { return "pppfppfiiiiipi:i"; }
const char *rms_norm_f32_int8_task_words_signature(void) { return ":i"; }
const char *rms_norm_heads_f32_signature(void) { return "ppfpiiiiipi:i"; }
const char *rms_norm_heads_f32_task_words_signature(void) { return ":i"; }
