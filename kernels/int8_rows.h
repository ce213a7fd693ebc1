/* Rows of float32 values as int8 codes, a scale per row: the activations of a W8A8 product, quantized by the
 * product itself (cpu_int8_gemm.c) or, one pass sooner, by the kernel that computes them (the RMSNorm before
 * q/k/v and gate/up, the SiLU before down), which then writes a byte a value instead of four and the product's
 * threads no longer each quantize the same rows. Every build and every caller gives the same codes, bit for bit.
 *
 * A row's codes: scale = max|x| / 127.5 and code = round-to-even(x * (127.5 / max|x|)) clamped to [-128, 127], the
 * symmetric dynamic quantization of compressed-tensors' int8 activations; with static_scale > 0, one scale for
 * every row (a checkpoint's input_scale) and code = round(x / static_scale). With `unsigned_codes`, each code
 * goes in as code + 128 (the unsigned bytes of VNNI's vpdpbusd). A row's bytes past K, up to `padded`, hold the
 * code of zero.
 */
#ifndef PAGEDSERVE_INT8_ROWS_H
#define PAGEDSERVE_INT8_ROWS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INT8_ROWS_VECTORS 1
#else
#define INT8_ROWS_VECTORS 0
#endif

/* A row's scale and its inverse from its largest magnitude, as IEEE division gives them (the build's fast math
 * may not turn either into a product by a rounded reciprocal: the torch reference divides). */
__attribute__((noinline, optimize("no-fast-math"))) static void row_scale(float top, float static_scale, float *scale,
                                                                         float *inverse)
{
    if (static_scale > 0) {
        *scale = static_scale;
        *inverse = 1.0f / static_scale;
        return;
    }
    *scale = top > 0 ? top / 127.5f : 1.0f;
    *inverse = top > 0 ? 127.5f / top : 0.0f;
}

#if INT8_ROWS_VECTORS
/* A row's largest magnitude, 16 values a vector (the maximum is the same in any order). */
static float largest_magnitude(const float *x, int64_t K)
{
    __m512 top = _mm512_setzero_ps(), tops[4] = {top, top, top, top}; /* four loads in flight */
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int v = 0; v < 4; v++)
            tops[v] = _mm512_max_ps(tops[v], _mm512_abs_ps(_mm512_loadu_ps(x + k + 16 * v)));
    top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
    for (; k + 16 <= K; k += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    if (k < K)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << (K - k)) - 1), x + k)));
    return _mm512_reduce_max_ps(top);
}

/* The codes of a row's whole vectors of 16 values, as the loop after it computes them one at a time: the product by
 * the inverse scale, rounded to the nearest integer (even at a tie), then clamped, so exact in int32 and in a byte.
 * How far it went. */
static int64_t quantize_vectors(const float *x, int64_t K, float inverse, const int unsigned_codes, int8_t *codes)
{
    const __m512 by = _mm512_set1_ps(inverse), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
    const __m128i flip = _mm_set1_epi8(unsigned_codes ? (char)0x80 : 0);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), by),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, low), high);
        _mm_storeu_si128((__m128i *)(codes + k), _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)), flip));
    }
    return k;
}
#else
static float largest_magnitude(const float *x, int64_t K)
{
    float top = 0;
#pragma omp simd reduction(max : top)
    for (int64_t k = 0; k < K; k++)
        top = fmaxf(top, fabsf(x[k]));
    return top;
}
#endif

/* One row x[0 .. K - 1] as codes[0 .. padded - 1] (see the top of the file); its scale in *scale. */
static inline void quantize_row(const float *x, int64_t K, int64_t padded, int8_t *codes, float *scale,
                                float static_scale, const int unsigned_codes)
{
    float inverse;
    row_scale(static_scale > 0 ? 0 : largest_magnitude(x, K), static_scale, scale, &inverse);
    const int bias = unsigned_codes ? 128 : 0; /* code + 128 as an unsigned byte: the same bits as code ^ 0x80 */
    int64_t k = 0;
#if INT8_ROWS_VECTORS
    k = quantize_vectors(x, K, inverse, unsigned_codes, codes);
#endif
    for (; k < K; k++) {
        const float q = rintf(x[k] * inverse);
        codes[k] = (int8_t)((int)(q > 127.0f ? 127.0f : q < -128.0f ? -128.0f : q) + bias);
    }
    for (k = K; k < padded; k++)
        codes[k] = (int8_t)bias;
}

/* The widest row a kernel quantizes from a row of its own on the stack (the callers check it first). */
#define INT8_ROWS_MAX_WIDTH 65536

#endif
