/* What one core of this CPU can do at most, for benchmarks/cpu_linear_bench.py to measure the linear
 * layers against: float32 multiply-adds in the widest vectors the build has, bfloat16 pairs by the
 * AVX512-BF16 dot product where the build has it, int8 products as the W8A8 kernel makes them (in vectors,
 * and in AMX tiles where the CPU has them), and reads from memory.
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
#if defined(__AVX512BF16__) || defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
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

/* int8 products as the W8A8 kernel (kernels/cpu_int8_gemm.c) makes them: AVX512-VNNI's byte dot product (four
 * multiply-adds a 32-bit lane) where the build has it, else int16 pairs (vpmaddwd, then an add) in AVX2 vectors.
 * int8_ops_per_round() operations (a multiply and an add each) a round; -1 without AVX2. */
int64_t int8_ops_per_round(void)
{
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 12 * 64 * 2;
#elif defined(__AVX2__)
    return 12 * 16 * 2;
#else
    return -1;
#endif
}

int64_t int8_rounds(int64_t iterations)
{
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m512i x = _mm512_set1_epi32(0x01020304), y = _mm512_set1_epi32(0x01010101);
#define I8_START(i) __m512i d##i = _mm512_set1_epi32(i);
    TWELVE(I8_START)
    for (int64_t n = 0; n < iterations; n++) {
#define I8_ROUND(i) d##i = _mm512_dpbusd_epi32(d##i, x, y);
        TWELVE(I8_ROUND)
    }
    int64_t sum = 0;
#define I8_ADD(i) sum += _mm512_reduce_add_epi32(d##i);
    TWELVE(I8_ADD)
    return sum;
#elif defined(__AVX2__)
    const __m256i x = _mm256_set1_epi32(0x00010002), y = _mm256_set1_epi32(0x00010001);
#define W_START(i) __m256i d##i = _mm256_set1_epi32(i);
    TWELVE(W_START)
    for (int64_t n = 0; n < iterations; n++) {
#define W_ROUND(i) d##i = _mm256_add_epi32(d##i, _mm256_madd_epi16(x, y));
        TWELVE(W_ROUND)
    }
    int64_t sum = 0;
#define W_ADD(i) { int32_t lanes[8]; _mm256_storeu_si256((__m256i *)lanes, d##i); sum += lanes[0]; }
    TWELVE(W_ADD)
    return sum;
#else
    (void)iterations;
    return -1;
#endif
}

/* int8 products in AMX tiles, as the W8A8 kernel makes them from 16 rows: tdpbusd into four 16 x 16 int32 tiles
 * from two tiles of x and two of W that stay loaded (each a 16 x 64 byte tile: 16 x 16 x 64 multiply-adds).
 * amx_int8_ops_per_round() operations a round; -1 where the build or Linux gives no tiles. */
int64_t amx_int8_ops_per_round(void)
{
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    return 4 * 16 * 16 * 64 * 2;
#else
    return -1;
#endif
}

int64_t amx_int8_rounds(int64_t iterations)
{
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) /* ARCH_REQ_XCOMP_PERM for the tiles' data */
        return -1;
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(config)); /* the whole configuration as the operand */
    static int8_t operands[16 * 64] __attribute__((aligned(64)));
    memset(operands, 1, sizeof operands);
    _tile_loadd(4, operands, 64);
    _tile_loadd(5, operands, 64);
    _tile_loadd(6, operands, 64);
    _tile_loadd(7, operands, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t n = 0; n < iterations; n++) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    static int32_t sums[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, sums, 64);
    _tile_release();
    return sums[0];
#else
    (void)iterations;
    return -1;
#endif
}

/* The W8A8 kernel's tile loop as it walks a weight (amx_block in kernels/cpu_int8_gemm.c): each step of k one tile of
 * x's codes and two tiles of the weight, into two accumulator tiles, the weight's `bytes` (a multiple of 2 KiB) read
 * in order `passes` times; x's 16 KiB stay in the first-level cache. So where the weight lies (the second-level
 * cache, the third, memory) bounds what the kernel's tiles can do: bytes x 32 operations a pass. */
int64_t amx_int8_stream(const int8_t *weight, int64_t bytes, int64_t passes)
{
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0)
        return -1;
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 5; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
    static int8_t x[16][16 * 64] __attribute__((aligned(64)));
    memset(x, 1, sizeof x);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t pass = 0; pass < passes; pass++)
        for (int64_t at = 0, step = 0; at + 2048 <= bytes; at += 2048, step = (step + 1) % 16) {
            _tile_loadd(2, x[step], 64);
            _tile_loadd(3, weight + at, 128); /* a panel's 32 columns: 16 words of k, 128 bytes apart */
            _tile_loadd(4, weight + at + 64, 128);
            _tile_dpbusd(0, 2, 3);
            _tile_dpbusd(1, 2, 4);
        }
    static int32_t sums[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, sums, 64);
    _tile_release();
    return sums[0];
#else
    (void)weight, (void)bytes, (void)passes;
    return -1;
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
