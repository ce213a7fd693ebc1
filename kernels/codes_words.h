/* 4-bit codes against a decode's bfloat16 rows by AVX512-VNNI's byte dot product (vpdpbusd), for cpu_gemm.c's
 * gemm_codes: the rows' int16 values and the pieces code_tile_pairs takes them with in place of bfloat16 pairs.
 *
 * The bfloat16 dot product costs several times an integer dot product on some CPUs with both (a Sapphire
 * Rapids-class core retired one a third as often), and at a few rows it, not the memory, bounded the 4-bit kernel
 * there. So each group of a row of x becomes int16 values x_int = x / unit, unit the power of two that puts the
 * group's largest magnitude just under 2^15: exact for every value within 2^7 of that largest one (bfloat16 holds
 * 8 significant bits), the rest rounded to the nearest unit (an error of at most 2^-15 of the group's largest
 * magnitude). An int16 value is 256 x its high byte (signed) + its low byte (unsigned), and the codes are bytes
 * after one mask, so each lane of four codes meets four low bytes (unsigned, against the codes as signed) and
 * four high bytes (signed, against the codes as unsigned) in two byte dot products: sums of c x_int exact in
 * int32 (group x 15 x 2^15 < 2^31 for groups up to CODE_WORDS_MAX_GROUP) at a byte product's cost a code.
 *
 * A word of codes holds inputs k, k + 2, k + 4, k + 6 in its low half's nibbles and k + 1, k + 3, ... in its high
 * half's, so its low nibbles as bytes are inputs (k, k + 4, k + 1, k + 5) and its high nibbles (k + 2, k + 6,
 * k + 3, k + 7): x's bytes are laid out in that order, each 8 inputs as 16 bytes, their low bytes then their high
 * bytes. Each group's sums become floats once: scale x unit x those + offset x the group's sum of x_int x unit. */
typedef int32_t vi __attribute__((vector_size(4 * GEMM_VEC)));

#if BF16_DOT == 1 && defined(__AVX512VNNI__)
#define CODE_WORDS 1
#define CODE_WORDS_MAX_GROUP 4096

/* Up to how many of a decode's rows (those the vector kernel takes) meet 4-bit codes as int16 words, the rest the
 * bfloat16 dot product: the words cost a byte product a code for every row and quantizing a row, the dot product a
 * bfloat16 product per two codes, and where one overtakes the other differs between CPUs, so the worker times it when
 * the build loads (kernels/codes_words_choice.py). */
static int64_t codes_words_rows = INT64_MAX;

/* Sets that limit from now on (`rows`; 0: never words) and answers it, unchanged where `rows` is negative. The tests
 * and benchmarks compare both ways. */
int64_t gemm_codes_words_rows(int64_t rows)
{
    if (rows >= 0)
        codes_words_rows = rows;
    return codes_words_rows;
}

/* Where input i of a block of 8 puts its low byte among the block's 16 bytes (its high byte 8 on). */
static inline int word_byte(int64_t i) { return (int)((i & 3) * 2 + (i >> 2 & 1)); }

/* Rows of bfloat16 x as int16 by groups (layout above): xq [rows][2 K] bytes (K a multiple of 8), and per row and
 * group the unit and the sum of x_int x unit (units, x_sums: [rows][groups]). */
static void quantize_groups(const char *x, int64_t x_stride, int64_t rows, int64_t K, int64_t group, uint8_t *xq,
                            float *units, float *x_sums)
{
    const int64_t groups = K / group;
    /* a 128-bit lane's 8 int16 values (16 bytes) as their low bytes in block order, then their high bytes */
    const __m256i order = _mm256_setr_epi8(0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15, 0, 8, 2, 10, 4, 12, 6,
                                           14, 1, 9, 3, 11, 5, 13, 7, 15);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = (const uint16_t *)x + r * x_stride;
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *values = row + g * group;
            uint32_t exponent = 0; /* the largest biased exponent (bfloat16's is float32's) */
            for (int64_t k = 0; k < group; k++) {
                const uint32_t e = (values[k] >> 7) & 0xffu;
                exponent = e > exponent ? e : exponent;
            }
            /* at least 15, so that 2^(141 - exponent) is a normal float: such tiny groups round to zeros */
            exponent = exponent < 15 ? 15 : exponent;
            const float up = float_of_bits((268 - (int64_t)exponent) << 23);
            const float unit = float_of_bits(((int64_t)exponent - 14) << 23);
            /* |x_int| <= 32640: exact scaling, then rounding to the nearest (the vector conversion's default) */
            uint8_t *out = xq + r * 2 * K + g * group * 2;
            __m512i total = _mm512_setzero_si512();
            int64_t k = 0;
            for (; k + 16 <= group; k += 16) {
                const __m256i halves = _mm256_loadu_si256((const __m256i *)(values + k));
                const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
                const __m512i ints = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(up)));
                const __m256i words = _mm512_cvtepi32_epi16(ints);
                _mm256_storeu_si256((__m256i *)(out + 2 * k), _mm256_shuffle_epi8(words, order));
                total = _mm512_add_epi32(total, ints);
            }
            int32_t sum = _mm512_reduce_add_epi32(total);
            for (; k < group; k++) {
                const int32_t code = (int32_t)lrintf(float_of_bits((int64_t)values[k] << 16) * up);
                uint8_t *block = out + k / 8 * 16;
                block[word_byte(k % 8)] = (uint8_t)(code & 0xff);
                block[8 + word_byte(k % 8)] = (uint8_t)((uint32_t)code >> 8 & 0xff);
                sum += code;
            }
            units[r * groups + g] = unit;
            x_sums[r * groups + g] = (float)sum * unit;
        }
    }
}

/* acc (int32 sums, as their bits) + the products of four of x's bytes (`x_bytes`, broadcast) and each lane's four
 * codes: x's low bytes (j < 2: unsigned, the codes signed) or high bytes (signed, the codes unsigned). */
static inline __attribute__((always_inline)) vf dot_words(vf acc, uint32_t x_bytes, vu codes, int j)
{
    const __m512i x = _mm512_set1_epi32((int32_t)x_bytes);
    return (vf)(j < 2 ? _mm512_dpbusd_epi32((__m512i)acc, x, (__m512i)codes)
                      : _mm512_dpbusd_epi32((__m512i)acc, (__m512i)codes, x));
}
#else
#define CODE_WORDS 0
static const int64_t codes_words_rows = 0;
int64_t gemm_codes_words_rows(int64_t rows)
{
    (void)rows;
    return 0;
}
static inline __attribute__((always_inline)) vf dot_words(vf acc, uint32_t x_bytes, vu codes, int j)
{
    (void)x_bytes, (void)codes, (void)j;
    return acc; /* never called: no build without the instruction takes int16 words */
}
#endif

/* Each lane's low (j even) or high nibbles as bytes: codes of inputs (k, k + 4, k + 1, k + 5) or (k + 2, k + 6, k + 3,
 * k + 7), against x's low bytes (j < 2) or high bytes. */
static inline __attribute__((always_inline)) vu code_words(vu words, int j)
{
    return (words >> (4 * (j & 1))) & 0x0f0f0f0fu;
}
const char *gemm_codes_words_rows_signature(void) { return "i:i"; }
