/* What one core of this CPU can do at most, for benchmarks/cpu_linear_bench.py to measure the linear
 * layers against: float32 multiply-adds in the widest vectors the build has, bfloat16 pairs by the
 * AVX512-BF16 dot product where the build has it, and reads from memory.
 *
 * Built with -O2 -march=native by the bench. Each loop keeps 12 independent accumulators, enough to hide
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

/* `iterations` rounds of 12 vector multiply-adds: 24 * WIDTH float operations a round. */
float fma_rounds(int64_t iterations)
{
    vf acc[12], x = (vf){0} + 1.0000001f, y = (vf){0} + 1e-7f;
    for (int i = 0; i < 12; i++)
        acc[i] = (vf){0} + (float)i;
    for (int64_t n = 0; n < iterations; n++)
        for (int i = 0; i < 12; i++)
            acc[i] = acc[i] * x + y;
    float sum = 0;
    for (int i = 0; i < 12; i++)
        sum += acc[i][0];
    return sum;
}

/* The same with the bfloat16 dot product (48 * WIDTH operations a round: two products and two adds
 * per lane); -1 where the build lacks it. */
float dot_rounds(int64_t iterations)
{
#if defined(__AVX512BF16__) && WIDTH == 16
    __m512 acc[12];
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
    for (int i = 0; i < 12; i++)
        acc[i] = _mm512_set1_ps((float)i);
    for (int64_t n = 0; n < iterations; n++)
        for (int i = 0; i < 12; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    float sum = 0;
    for (int i = 0; i < 12; i++)
        sum += _mm512_reduce_add_ps(acc[i]);
    return sum;
#else
    (void)iterations;
    return -1.0f;
#endif
}

int64_t vector_width(void) { return WIDTH; }

/* A read of `bytes` (a multiple of 64) in whole vectors: the streaming rate from memory. */
float read_all(const float *data, int64_t bytes)
{
    vf acc[4] = {{0}, {0}, {0}, {0}};
    const int64_t count = bytes / (int64_t)sizeof(vf);
    for (int64_t i = 0; i + 3 < count; i += 4)
        for (int j = 0; j < 4; j++) {
            vf v;
            memcpy(&v, data + (i + j) * WIDTH, sizeof v);
            acc[j] += v;
        }
    vf total = acc[0] + acc[1] + acc[2] + acc[3];
    return total[0];
}
