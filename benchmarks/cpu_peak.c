/* What one core of this CPU can do at most, for benchmarks/cpu_linear_bench.py to measure the linear
 * layers against: float32 multiply-adds in the widest vectors the build has, bfloat16 pairs by the
 * AVX512-BF16 dot product where the build has it, and reads from memory.
 *
 * Built with -O3 -march=native by the bench. Each loop keeps 12 independent accumulators, enough to hide
 * the multiply-add's latency on every core seen (4-5 cycles, 2 a cycle).
 */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define WIDTH 16
#else
#define WIDTH 8
#endif
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(4 * WIDTH)));

/* Twelve accumulators as named locals (an array of them the compiler keeps in memory, and then each
 * multiply-add waits on a store and a load). */
#define TWELVE(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

/* `iterations` rounds of 12 vector multiply-adds: 24 * WIDTH float operations a round. */
float fma_rounds(int64_t iterations)
{
    const vf x = (vf){0} + 1.0000001f, y = (vf){0} + 1e-7f;
#define START(i) vf a##i = x + (float)i;
    TWELVE(START)
    for (int64_t n = 0; n < iterations; n++) {
#define ROUND(i) a##i = a##i * x + y;
        TWELVE(ROUND)
    }
    vf sum = (vf){0};
#define ADD(i) sum += a##i;
    TWELVE(ADD)
    return sum[0];
}

/* The same with the bfloat16 dot product (48 * WIDTH operations a round: two products and two adds
 * per lane); -1 where the build lacks it. */
float dot_rounds(int64_t iterations)
{
#if defined(__AVX512BF16__) && WIDTH == 16
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
#define DOT_START(i) __m512 d##i = _mm512_set1_ps((float)i);
    TWELVE(DOT_START)
    for (int64_t n = 0; n < iterations; n++) {
#define DOT_ROUND(i) d##i = _mm512_dpbf16_ps(d##i, x, y);
        TWELVE(DOT_ROUND)
    }
    float sum = 0;
#define DOT_ADD(i) sum += _mm512_reduce_add_ps(d##i);
    TWELVE(DOT_ADD)
    return sum;
#else
    (void)iterations;
    return -1.0f;
#endif
}

int64_t vector_width(void) { return WIDTH; }

/* A read of `bytes` (a multiple of 256) in whole vectors: the streaming rate from memory. */
float read_all(const float *data, int64_t bytes)
{
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (const float *p = data, *end = data + bytes / 4; p + 4 * WIDTH <= end; p += 4 * WIDTH) {
        vf v0, v1, v2, v3;
        memcpy(&v0, p, sizeof v0);
        memcpy(&v1, p + WIDTH, sizeof v1);
        memcpy(&v2, p + 2 * WIDTH, sizeof v2);
        memcpy(&v3, p + 3 * WIDTH, sizeof v3);
        a0 += v0;
        a1 += v1;
        a2 += v2;
        a3 += v3;
    }
    vf total = a0 + a1 + a2 + a3;
    return total[0];
}
