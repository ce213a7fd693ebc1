/* 4-bit codes against a decode's bfloat16 rows by AVX512-VNNI's int16 dot product (vpdpwssd), for cpu_gemm.c's
 * gemm_codes: the rows' int16 values and the pieces code_tile_pairs takes them with in place of bfloat16 pairs.
 *
 * The bfloat16 dot product costs several times an int16 dot product on some CPUs with both (a Sapphire Rapids-class
 * core retired one a third as often), and at a few rows it, not the memory, bounded the 4-bit kernel there. So
 * each group of a row of x becomes int16 values x_int = x / unit, unit the power of two that puts the group's
 * largest magnitude just under 2^15: exact for every value within 2^7 of that largest one (bfloat16 holds 8
 * significant bits), the rest rounded to the nearest unit (an error of at most 2^-15 of the group's largest
 * magnitude). Codes c are their own int16 values (a mask, no bits to add), so a group's sums of c x_int are
 * exact in int32 (group x 15 x 2^15 < 2^31 for groups up to CODE_WORDS_MAX_GROUP), and become floats once a
 * group: scale x unit x those + offset x the group's sum of x_int x unit. */
typedef int32_t vi __attribute__((vector_size(4 * GEMM_VEC)));

#if BF16_DOT == 1 && defined(__AVX512VNNI__)
#define CODE_WORDS 1
#define CODE_WORDS_MAX_GROUP 4096

static int codes_words_on = 1;

/* Whether a decode's 4-bit products take int16 words from now on (`on`), else the bfloat16 dot product; the answer,
 * unchanged where `on` is negative. The tests and benchmarks compare both ways. */
int64_t gemm_codes_use_words(int64_t on)
{
    if (on >= 0)
        codes_words_on = on != 0;
    return codes_words_on;
}

/* Rows of bfloat16 x as int16 by groups (layout above): xq [rows][K] (K even), and per row and group the unit and
 * the sum of x_int x unit (units, x_sums: [rows][groups]). */
static void quantize_groups(const char *x, int64_t x_stride, int64_t rows, int64_t K, int64_t group, int16_t *xq,
                            float *units, float *x_sums)
{
    const int64_t groups = K / group;
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
            const uint32_t up_bits = (268u - exponent) << 23, unit_bits = (exponent - 14u) << 23;
            float up, unit;
            memcpy(&up, &up_bits, sizeof up);
            memcpy(&unit, &unit_bits, sizeof unit);
            /* |x_int| <= 32640: exact scaling, then rounding to the nearest (the vector conversion's default) */
            int16_t *out = xq + r * K + g * group;
            __m512i total = _mm512_setzero_si512();
            int64_t k = 0;
            for (; k + 16 <= group; k += 16) {
                const __m256i halves = _mm256_loadu_si256((const __m256i *)(values + k));
                const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
                const __m512i ints = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(up)));
                _mm256_storeu_si256((__m256i *)(out + k), _mm512_cvtepi32_epi16(ints));
                total = _mm512_add_epi32(total, ints);
            }
            int32_t sum = _mm512_reduce_add_epi32(total);
            for (; k < group; k++) {
                const uint32_t bits = (uint32_t)values[k] << 16;
                float value;
                memcpy(&value, &bits, sizeof value);
                const int32_t code = (int32_t)lrintf(value * up);
                out[k] = (int16_t)code;
                sum += code;
            }
            units[r * groups + g] = unit;
            x_sums[r * groups + g] = (float)sum * unit;
        }
    }
}

/* acc (int32 sums, as their bits) + the products of the int16 pairs in `x_pair` (broadcast) and in each lane of
 * `codes`. */
static inline __attribute__((always_inline)) vf dot_words(vf acc, uint32_t x_pair, vu codes)
{
    return (vf)_mm512_dpwssd_epi32((__m512i)acc, _mm512_set1_epi32((int32_t)x_pair), (__m512i)codes);
}
#else
#define CODE_WORDS 0
static const int codes_words_on = 0;
int64_t gemm_codes_use_words(int64_t on)
{
    (void)on;
    return 0;
}
static inline __attribute__((always_inline)) vf dot_words(vf acc, uint32_t x_pair, vu codes)
{
    (void)x_pair, (void)codes;
    return acc; /* never called: no build without the instruction takes int16 words */
}
#endif

/* Pair j of each lane's eight 4-bit codes (k + 2j in the low half, k + 2j + 1 in the high) as int16 values. */
static inline __attribute__((always_inline)) vu code_words(vu words, int j) { return (words >> (4 * j)) & 0x000f000fu; }
const char *gemm_codes_use_words_signature(void) { return "i:i"; }
