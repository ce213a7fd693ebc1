/* RMSNorm of a few rows at a time, optionally fused with the residual add before it: one pass
 * where torch takes several operations (and, on this CPU, tens of microseconds for one row).
 *
 * With residual != NULL: residual += x, then out = residual / rms(residual) * weight (the residual
 * stream and the normalized input of the next sublayer, as a pre-norm decoder needs both).
 * Without: out = x / rms(x) * weight. Rows are `stride` floats apart in x, residual and out alike.
 * Sums of squares run in float32, as HF's RMSNorm computes them for float32 inputs.
 */
#include <math.h>
#include <stdint.h>

int64_t rms_norm_f32(const float *x, float *residual, const float *weight, float eps, float *out, int64_t rows,
                     int64_t width, int64_t stride)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * stride;
        float *source = residual ? residual + r * stride : (float *)in;
        if (residual)
            for (int64_t i = 0; i < width; i++)
                source[i] += in[i];
        float squares = 0.0f;
        for (int64_t i = 0; i < width; i++)
            squares += source[i] * source[i];
        const float scale = 1.0f / sqrtf(squares / (float)width + eps);
        float *o = out + r * stride;
        for (int64_t i = 0; i < width; i++)
            o[i] = source[i] * scale * weight[i];
    }
    return 0;
}

/* The argument types of rms_norm_f32, as kernels/native.py checks them before any call: p a pointer,
 * i an int64_t, f a float; after the colon the result (v: none). */
const char *rms_norm_f32_signature(void) { return "pppfpiii:i"; }
