/* Paged attention for the CPU in float32, reading keys and values straight from the paged cache.
 *
 * The contract is paged_attention_reference's (kernels/paged_attention.py): query row i of
 * sequence s sits at position context_lens[s] - num_queries + i and sees that sequence's keys up
 * to its own position (within the sliding window when window > 0), found through its row of the
 * block table. Nothing is gathered into a workspace first; each cached token (its keys or values
 * for every KV head, one row) is read once for up to QUERY_BLOCK queries of a sequence (a prompt's
 * chunk, or a decode with the proposals it verifies) and for all the query heads.
 * Built with -O3 -ffast-math so the head_dim loops become SIMD and expf the vector library's.
 */
/* Global common subexpression elimination, before and after register allocation, took about half the time of
 * compiling this file at -O3 (its specialized functions are large) and changed neither the results nor the speed
 * of the attention measured with and without it. */
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "claims.h"

#ifdef __AVX2__
#include <immintrin.h>
#else
/* Without AVX a vector of 8 floats passed by value changes the ABI; none crosses a call here (each such
 * function is inlined), so GCC's note of it says nothing. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define QUERY_BLOCK 8 /* queries of one sequence served together: each key and value is read once for all */
#define TILE 16       /* cached tokens whose keys (or values) every query row and head takes in turn */

/* The cached row of position p (every KV head's keys or values), and in *stop the end of the run of
 * positions up to `end` that share p's block: a caller walks the table block by block, with one
 * division per block rather than one per position. token_bytes: the bytes of one position's row. */
static inline const char *block_run(const char *cache, const int32_t *table, int64_t p, int64_t end,
                                    int64_t block_size, int64_t token_bytes, int64_t *stop)
{
    const int64_t offset = p % block_size;
    *stop = p - offset + block_size < end ? p - offset + block_size : end;
    return cache + ((int64_t)table[p / block_size] * block_size + offset) * token_bytes;
}

/* The first position a query at position `high` sees: all of them, or the last `window` (window > 0). */
static inline int64_t first_visible(int64_t high, int64_t window)
{
    return window > 0 && high - window + 1 > 0 ? high - window + 1 : 0;
}

/* How a cached row holds its values: float32; bfloat16 or float16 (the model's dtype where it is a
 * half type); or head_dim one-byte values (int8, or OCP E4M3 floats) followed by their float32
 * scale (kernels/kv_quant.py). */
enum row_kind { ROW_F32, ROW_BF16, ROW_F16, ROW_I8, ROW_F8 };

static inline int quantized(int kind) { return kind == ROW_I8 || kind == ROW_F8; }

/* The bytes of one KV head's row. */
static inline int64_t head_row_bytes(int64_t head_dim, int kind)
{
    if (quantized(kind))
        return head_dim + (int64_t)sizeof(float);
    return head_dim * (kind == ROW_F32 ? 4 : 2);
}

/* One KV head's keys (or values) at `row`: returns the row's scale (1 where it has none). */
static inline float head_scale(const char *row, int64_t head_dim, int kind)
{
    float scale = 1.f;
    if (quantized(kind))
        memcpy(&scale, row + head_dim, sizeof scale);
    return scale;
}

/* A bfloat16 value's bits as a float: the upper half of its float32. */
static inline float bf16_value(uint16_t bits)
{
    const uint32_t word = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

/* An E4M3 byte as a float, in operations that vectorize and without float32 subnormals (which
 * -ffast-math may flush): exponent and mantissa move into float32's fields, rebiased (7 -> 127);
 * an exponent of 0 is E4M3's subnormal range, mantissa x 2^-9. 0x7f and 0xff (NaN) are never written. */
static inline float fp8_e4m3_value(uint8_t byte)
{
    const uint32_t magnitude = byte & 0x7fu;
    union { uint32_t bits; float value; } normal = { .bits = (magnitude << 20) + (120u << 23) }, result;
    const float subnormal = (float)(int32_t)(magnitude & 7u) * 0x1p-9f;
    result.value = magnitude >= 8u ? normal.value : subnormal;
    result.bits |= (uint32_t)(byte & 0x80u) << 24;
    return result.value;
}

#ifdef __AVX512F__
/* Sixteen bytes of a one-byte row as floats (scale apart): int8 as it is, E4M3 as fp8_e4m3_value reads it. */
static inline __attribute__((always_inline)) __m512 widen16(const char *bytes, const int kind)
{
    const __m128i raw = _mm_loadu_si128((const __m128i *)bytes);
    if (kind == ROW_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    const __m512i byte = _mm512_cvtepu8_epi32(raw), magnitude = _mm512_and_si512(byte, _mm512_set1_epi32(0x7f));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(magnitude, _mm512_set1_epi32(7))),
                                           _mm512_set1_ps(0x1p-9f));
    const __mmask16 is_normal = _mm512_cmpge_epi32_mask(magnitude, _mm512_set1_epi32(8));
    const __m512i bits = _mm512_mask_mov_epi32(_mm512_castps_si512(subnormal), is_normal, normal);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(byte, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}
#endif

#define MAX_DECODED 16384 /* floats of a tile's half or one-byte rows decoded at once: TILE x num_kv_heads x head_dim at most
                          * (kernels/cpu_attention.py checks) */

/* Every KV head's values (half types, int8 or E4M3) of one cached token, as floats (scales apart):
 * decoded once for all the query heads and query rows that read them. */
static inline void decode_token(const char *restrict row, int64_t num_kv_heads, int64_t head_dim,
                                int64_t head_bytes, float *restrict decoded, const int kind)
{
    for (int64_t h = 0; h < num_kv_heads; h++) {
        const char *bytes = row + h * head_bytes;
        float *values = decoded + h * head_dim;
        if (kind == ROW_BF16)
            for (int64_t d = 0; d < head_dim; d++)
                values[d] = bf16_value(((const uint16_t *)bytes)[d]);
        else if (kind == ROW_F16)
            for (int64_t d = 0; d < head_dim; d++)
                values[d] = (float)((const _Float16 *)bytes)[d];
#ifdef __AVX512F__
        else if (head_dim % 16 == 0) /* one-byte rows, 16 values at a time */
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(values + d, widen16(bytes + d, kind));
#endif
        else if (kind == ROW_I8)
            for (int64_t d = 0; d < head_dim; d++)
                values[d] = (float)((const int8_t *)bytes)[d];
        else
            for (int64_t d = 0; d < head_dim; d++)
                values[d] = fp8_e4m3_value(((const uint8_t *)bytes)[d]);
    }
}

/* A tile's `count` cached tokens, one after another from `run`, decoded as decode_token does. */
static inline void decode_tile(const char *run, int64_t count, int64_t token_bytes, int64_t num_kv_heads,
                               int64_t head_dim, int64_t head_bytes, float *decoded, const int kind)
{
    for (int64_t u = 0; u < count; u++)
        decode_token(run + u * token_bytes, num_kv_heads, head_dim, head_bytes, decoded + u * num_kv_heads * head_dim,
                     kind);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Scores from .. to - 1 become their softmax, in place. */
static inline __attribute__((always_inline)) void softmax(float *weights, int64_t from, int64_t to)
{
    float top = weights[from];
    for (int64_t t = from + 1; t < to; t++)
        top = weights[t] > top ? weights[t] : top;
    float total = 0.f;
    for (int64_t t = from; t < to; t++) {
        weights[t] = expf(weights[t] - top);
        total += weights[t];
    }
    const float inverse = 1.f / total;
    for (int64_t t = from; t < to; t++)
        weights[t] *= inverse;
}

#define AHEAD 8 /* cached tokens whose rows are asked for before they are read: a block's rows are contiguous,
                 * but blocks lie anywhere, and the hardware's prefetchers stop at every page */

/* Asks for the cached rows of one sequence's positions from .. to - 1, into the second-level cache: attention over
 * contexts in memory (not in cache) takes markedly less time (docs/kernel-measurements.md). */
static inline void prefetch_rows(const char *cache, const int32_t *table, int64_t from, int64_t to,
                                 int64_t block_size, int64_t token_bytes)
{
    for (int64_t q = from, stop; q < to; q = stop) {
        const char *run = block_run(cache, table, q, to, block_size, token_bytes, &stop);
        for (const char *line = run, *last = run + (stop - q) * token_bytes; line < last; line += 64)
            __builtin_prefetch(line, 0, 2);
    }
}

/* A decode row reads one stream: its keys, then its values, then the next row's keys. Its blocks lie anywhere, and
 * the hardware's prefetchers start afresh at each page, so while it reads a tile it asks for the rows AHEAD_BYTES
 * on in that stream: far enough for memory's latency, near enough that several threads' requests do not crowd out
 * one another (one block on was faster than two or four sequences on; docs/kernel-measurements.md). */
#define AHEAD_BYTES 8192
struct next_row { const int32_t *table; int64_t low, count; }; /* count 0: none */

/* How many positions of a stream whose tokens are token_bytes each AHEAD_BYTES is: a tile at least. */
static inline int64_t stream_ahead(int64_t token_bytes) { return max64(TILE, AHEAD_BYTES / token_bytes); }

/* Where the decode row after row s of this thread's share (before `end`) reads: none unless both are decode rows. */
static inline struct next_row next_decode_row(const int32_t *block_tables, int64_t table_stride,
                                              const int32_t *query_start, const int32_t *context_lens, int64_t s,
                                              int64_t end, int64_t window)
{
    struct next_row next = {block_tables, 0, 0};
    if (s + 1 < end && query_start[s + 1] - query_start[s] == 1 && query_start[s + 2] - query_start[s + 1] == 1) {
        const int64_t high = context_lens[s + 1] - 1;
        next.table = block_tables + (s + 1) * table_stride;
        next.low = first_visible(high, window);
        next.count = high + 1 - next.low;
    }
    return next;
}

/* Offsets from .. to - 1 of one pass of a row's stream: rows of `cache` from position low on below n, and past n
 * the next pass's rows (`then`, from then_low on, then_count of them; none where then is NULL). */
static inline void prefetch_stream(const char *cache, const int32_t *table, int64_t low, int64_t n, const char *then,
                                   const int32_t *then_table, int64_t then_low, int64_t then_count, int64_t from,
                                   int64_t to, int64_t block_size, int64_t token_bytes)
{
    if (from < n)
        prefetch_rows(cache, table, low + from, low + min64(to, n), block_size, token_bytes);
    if (then && to > n) {
        const int64_t a = max64(from, n) - n, b = min64(to - n, then_count);
        if (a < b)
            prefetch_rows(then, then_table, then_low + a, then_low + b, block_size, token_bytes);
    }
}

/* Half the core's second-level cache: the values a decode row may ask for early (below). */
static inline int64_t values_early_bytes(void)
{
    static int64_t bytes; /* every thread works out the same value */
    int64_t known = __atomic_load_n(&bytes, __ATOMIC_RELAXED);
    if (known == 0) {
        const long level2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        known = level2 > 0 ? level2 / 2 : 256 << 10;
        __atomic_store_n(&bytes, known, __ATOMIC_RELAXED);
    }
    return known;
}

/* Where a decode row reads and what it asks for ahead. Its values are read in several passes after all its keys (a
 * few heads of a group at a time, their sums in registers), so a pass's tile takes a fraction of a key tile's work:
 * values asked for one tile ahead there arrive late. Where a row's values fit in `early_bytes`, each key tile asks
 * for the values of its own positions too, so that the value passes read them from the second-level cache, and the
 * passes spread over themselves the next row's keys at their own positions (docs/kernel-measurements.md). Longer
 * rows ask for their values one tile ahead in the first pass. */
struct decode_stream {
    const char *key_cache, *value_cache;
    const int32_t *table;
    int64_t low, n, ahead, block_size, token_bytes, passes;
    int values_early;
    const struct next_row *next;
};

static inline struct decode_stream decode_stream(const char *key_cache, const char *value_cache, const int32_t *table,
                                                 int64_t low, int64_t n, int64_t block_size, int64_t token_bytes,
                                                 int64_t passes, int64_t early_bytes, const struct next_row *next)
{
    const struct decode_stream stream = {
        .key_cache = key_cache,
        .value_cache = value_cache,
        .table = table,
        .low = low,
        .n = n,
        .ahead = stream_ahead(token_bytes),
        .block_size = block_size,
        .token_bytes = token_bytes,
        .passes = passes,
        .values_early = n * token_bytes <= early_bytes,
        .next = next,
    };
    return stream;
}

/* While head `head` of `num_heads` scores the key tile of `count` tokens at position p: its slice of the stream
 * ahead (keys, then values unless they come early), and where they do, its slice of the tile's values. */
static inline void ask_while_scoring(const struct decode_stream *s, int64_t p, int64_t count, int64_t head,
                                     int64_t num_heads)
{
    const int64_t from = head * count / num_heads, to = (head + 1) * count / num_heads;
    const int64_t offset = p - s->low + s->ahead;
    prefetch_stream(s->key_cache, s->table, s->low, s->n, s->values_early ? 0 : s->value_cache, s->table, s->low,
                    s->n, offset + from, offset + to, s->block_size, s->token_bytes);
    if (s->values_early)
        prefetch_rows(s->value_cache, s->table, p + from, p + to, s->block_size, s->token_bytes);
}

/* While pass `pass` sums the value tile of `count` tokens at position p: with values early, its slice of the next
 * decode row's keys at the same offset; otherwise the first pass asks for the values a tile ahead and the last for
 * the next row's keys past them. */
static inline void ask_while_summing(const struct decode_stream *s, int64_t p, int64_t count, int64_t pass)
{
    const int64_t offset = p - s->low;
    if (s->values_early) {
        const int64_t from = offset + pass * count / s->passes;
        const int64_t to = min64(offset + (pass + 1) * count / s->passes, s->next->count);
        if (from < to)
            prefetch_rows(s->key_cache, s->next->table, s->next->low + from, s->next->low + to, s->block_size,
                          s->token_bytes);
        return;
    }
    if (pass == 0)
        prefetch_stream(s->value_cache, s->table, s->low, s->n, 0, 0, 0, 0, offset + s->ahead,
                        offset + s->ahead + count, s->block_size, s->token_bytes);
    if (pass == s->passes - 1)
        prefetch_stream(s->value_cache, s->table, s->low, s->n, s->key_cache, s->next->table, s->next->low,
                        s->next->count, max64(s->n, offset + s->ahead), offset + s->ahead + count, s->block_size,
                        s->token_bytes);
}

/* The value passes of a row whose group of `group` heads is summed `at_once` heads at a time, and the pass that
 * starts at head `first`. */
static inline int64_t value_passes(int64_t num_kv_heads, int64_t group, int64_t at_once)
{
    return num_kv_heads * ((group + at_once - 1) / at_once);
}
static inline int64_t value_pass(int64_t first, int64_t group, int64_t at_once)
{
    return first / group * ((group + at_once - 1) / at_once) + first % group / at_once;
}

/* One query row's attention over one-byte rows (int8, E4M3) at head size 64, in whole vectors of 8 floats
 * (GCC's vector extensions: AVX on x86-64-v3 and native builds, narrower vectors elsewhere): a decode step's
 * row, and a chunk's row alone in its block of QUERY_BLOCK queries (its ninth, seventeenth, ...). Each cached
 * row is converted to floats in registers as it is read, with no decoded copy stored and read back; query heads
 * take it two at a time; and each head's output stays in registers over the whole context. Builds with AVX-512
 * take attend_one_query_floats's path instead, which widens 16 values at a time. It is faster than the
 * tiled walk below for int8 at groups of 2 and 4 and for E4M3 at groups of 2 (docs/kernel-measurements.md); with more heads
 * a group converts each row again for every pair, and E4M3 costs more to convert than int8, so the walk keeps
 * those, as it does odd groups, other head sizes, half types and float32 rows. */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

/* Eight bytes of a row widened to 32-bit lanes: sign-extended (int8) or not (E4M3). GCC widens a vector of 8
 * bytes lane by lane, so AVX2 does it in one instruction where the build has it. */
static inline __attribute__((always_inline)) vi8 widen_bytes(const char *bytes, const int is_signed)
{
#ifdef __AVX2__
    const __m128i x = _mm_loadl_epi64((const __m128i *)bytes);
    return (vi8)(is_signed ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x));
#else
    vi8 lanes;
    for (int i = 0; i < 8; i++)
        lanes[i] = is_signed ? ((const int8_t *)bytes)[i] : ((const uint8_t *)bytes)[i];
    return lanes;
#endif
}

/* Values c * 8 .. c * 8 + 7 of a one-byte row as floats (scale apart), as decode_token reads them. */
static inline __attribute__((always_inline)) vf8 row_chunk(const char *row, int64_t c, const int kind)
{
    const vi8 byte = widen_bytes(row + c * 8, kind == ROW_I8);
    if (kind == ROW_I8)
        return __builtin_convertvector(byte, vf8);
    const vi8 magnitude = byte & 0x7f;
    const vi8 normal = (magnitude << 20) + (120 << 23), is_normal = magnitude >= 8;
    const vf8 subnormal = __builtin_convertvector(magnitude & 7, vf8) * 0x1p-9f;
    vi8 subnormal_bits;
    memcpy(&subnormal_bits, &subnormal, sizeof subnormal_bits);
    const vi8 bits = (normal & is_normal) | (subnormal_bits & ~is_normal) | ((byte & 0x80) << 24);
    vf8 value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline __attribute__((always_inline)) float lanes_sum(vf8 x)
{
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

#define MAX_CHUNKS 8 /* head_dim / 8 at head size 64, the one it serves */

static inline __attribute__((always_inline)) void attend_one_query(
    const float *restrict q, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict table, int64_t low, int64_t high, int64_t num_heads, int64_t num_kv_heads,
    int64_t token_heads, const int64_t head_dim, int64_t block_size, float scale, float *restrict scores,
    float *restrict out, const int kind)
{
    const int64_t group = num_heads / num_kv_heads, chunks = head_dim / 8, n = high + 1 - low;
    const int64_t head_bytes = head_dim + (int64_t)sizeof(float), token_bytes = token_heads * head_bytes;
    prefetch_rows(key_cache, table, low, min64(low + AHEAD, high + 1), block_size, token_bytes);
    for (int64_t kv = 0; kv < num_kv_heads; kv++)
        for (int64_t head = kv * group; head < (kv + 1) * group; head += 2) {
            vf8 q0[MAX_CHUNKS], q1[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) {
                memcpy(&q0[c], q + head * head_dim + c * 8, sizeof q0[c]);
                memcpy(&q1[c], q + (head + 1) * head_dim + c * 8, sizeof q1[c]);
            }
            float *s0 = scores + head * n, *s1 = scores + (head + 1) * n;
            for (int64_t p = low, stop; p <= high;) {
                const char *run = block_run(key_cache, table, p, high + 1, block_size, token_bytes, &stop);
                if (kv == 0 && head == 0)
                    prefetch_rows(key_cache, table, min64(stop + AHEAD - 1, high + 1),
                                  min64(stop + AHEAD - 1 + block_size, high + 1), block_size, token_bytes);
                for (const char *row = run + kv * head_bytes; p < stop; p++, row += token_bytes) {
                    vf8 a0 = {0}, a1 = {0};
                    for (int64_t c = 0; c < chunks; c++) {
                        const vf8 k = row_chunk(row, c, kind);
                        a0 += q0[c] * k;
                        a1 += q1[c] * k;
                    }
                    const float row_scale = head_scale(row, head_dim, kind) * scale;
                    s0[p - low] = lanes_sum(a0) * row_scale;
                    s1[p - low] = lanes_sum(a1) * row_scale;
                }
            }
        }
    prefetch_rows(value_cache, table, low, min64(low + AHEAD, high + 1), block_size, token_bytes);
    for (int64_t head = 0; head < num_heads; head++)
        softmax(scores + head * n, 0, n);
    for (int64_t kv = 0; kv < num_kv_heads; kv++)
        for (int64_t head = kv * group; head < (kv + 1) * group; head += 2) {
            vf8 o0[MAX_CHUNKS], o1[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++)
                o0[c] = o1[c] = (vf8){0};
            const float *w0 = scores + head * n, *w1 = scores + (head + 1) * n;
            for (int64_t p = low, stop; p <= high;) {
                const char *run = block_run(value_cache, table, p, high + 1, block_size, token_bytes, &stop);
                if (kv == 0 && head == 0)
                    prefetch_rows(value_cache, table, min64(stop + AHEAD - 1, high + 1),
                                  min64(stop + AHEAD - 1 + block_size, high + 1), block_size, token_bytes);
                for (const char *row = run + kv * head_bytes; p < stop; p++, row += token_bytes) {
                    const float row_scale = head_scale(row, head_dim, kind);
                    const float weight0 = w0[p - low] * row_scale, weight1 = w1[p - low] * row_scale;
                    for (int64_t c = 0; c < chunks; c++) {
                        const vf8 v = row_chunk(row, c, kind);
                        o0[c] += weight0 * v;
                        o1[c] += weight1 * v;
                    }
                }
            }
            for (int64_t c = 0; c < chunks; c++) {
                memcpy(out + head * head_dim + c * 8, &o0[c], sizeof o0[c]);
                memcpy(out + (head + 1) * head_dim + c * 8, &o1[c], sizeof o1[c]);
            }
        }
}

#ifdef __AVX512F__
#define F32_ROWS 1
#define VALUE_HEADS 4 /* heads of a group whose value sums are held together */

/* Lane u of the result: the sum of a[u]'s lanes. Four steps each halve the vectors and double the keys per vector;
 * the last leaves key 4j + k in lane 4k + j, which the permutation puts back in order. */
static inline __attribute__((always_inline)) __m512 fold16(const __m512 a[16])
{
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xee));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

/* One query head's products with a tile's first `count` keys (float32 rows `stride` bytes apart), before their scales:
 * lane u is key u's sum, by fold16's lane tree, the same for every key of a tile wherever the tile starts. */
static inline __attribute__((always_inline)) __m512 tile_dots(const char *keys, int64_t stride, const float *qh,
                                                              const int64_t vectors, int64_t count)
{
    __m512 sums[16]; /* both loops unrolled, so that the sums stay in registers */
#pragma GCC unroll 16
    for (int64_t u = 0; u < 16; u++) {
        sums[u] = _mm512_setzero_ps();
        if (u < count)
#pragma GCC unroll 8
            for (int64_t c = 0; c < vectors; c++)
                sums[u] = _mm512_fmadd_ps(_mm512_loadu_ps(keys + u * stride + c * 64), _mm512_loadu_ps(qh + c * 16),
                                          sums[u]);
    }
    return fold16(sums);
}

/* One query row's attention over a float32 cache, or over one-byte rows (int8, E4M3), at head sizes of whole 16-value
 * vectors (up to 128): a decode's row. As attend_one_query_bf16 below: keys 16 cached tokens at a time, a row's
 * scores for them one vector folded from 16 sums (fold16), the row's stream asked for AHEAD_BYTES on; values summed
 * for up to VALUE_HEADS heads of a group at a time over the whole context, each token's weight broadcast to its row.
 * One-byte rows are widened to floats in registers: a key tile once for all its heads (into `decoded`), a value row
 * once for the heads of its pass; each score and weight takes its row's scale. Rather than the walk below, which
 * sums each key's products across one vector's lanes in turn (docs/kernel-measurements.md). */
static inline __attribute__((always_inline)) void attend_one_query_floats(
    const float *restrict q, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict table, int64_t low, int64_t high, int64_t num_heads, int64_t num_kv_heads,
    int64_t token_heads, const int64_t vectors, int64_t block_size, float scale, float *restrict scores,
    float *restrict out, const struct next_row *next, const int kind, float *restrict decoded)
{
    const int64_t group = num_heads / num_kv_heads, head_dim = vectors * 16, n = high + 1 - low;
    const int64_t value_heads = vectors <= 4 ? VALUE_HEADS : VALUE_HEADS / 2; /* sums in registers */
    const int64_t head_bytes = head_row_bytes(head_dim, kind), token_bytes = token_heads * head_bytes;
    /* a float32 row's values early in half the room of a bfloat16 row's: its keys stream past in twice the room */
    const struct decode_stream stream = decode_stream(key_cache, value_cache, table, low, n, block_size, token_bytes,
                                                      value_passes(num_kv_heads, group, value_heads),
                                                      values_early_bytes() / (kind == ROW_F32 ? 2 : 1), next);
    /* where the key tile's rows are read: the cache (float32), or their widened copy, num_kv_heads rows a token */
    const int64_t key_stride = kind == ROW_F32 ? token_bytes : num_kv_heads * head_dim * 4;
    const int64_t key_head_stride = kind == ROW_F32 ? head_bytes : head_dim * 4;
    for (int64_t p = low, stop; p <= high;) {
        const char *run = block_run(key_cache, table, p, high + 1, block_size, token_bytes, &stop);
        for (int64_t count; p < stop; p += count, run += count * token_bytes) {
            count = min64(16, stop - p);
            if (kind != ROW_F32)
                decode_tile(run, count, token_bytes, num_kv_heads, head_dim, head_bytes, decoded, kind);
            const char *keys = kind == ROW_F32 ? run : (const char *)decoded;
            __m512 row_scales = _mm512_set1_ps(scale);
            for (int64_t head = 0; head < num_heads; head++) {
                ask_while_scoring(&stream, p, count, head, num_heads);
                if (kind != ROW_F32 && head % group == 0) {
                    float each[16] = {0};
                    for (int64_t u = 0; u < count; u++)
                        each[u] = head_scale(run + u * token_bytes + (head / group) * head_bytes, head_dim, kind);
                    row_scales = _mm512_mul_ps(_mm512_loadu_ps(each), _mm512_set1_ps(scale));
                }
                const char *rows = keys + (head / group) * key_head_stride;
                _mm512_mask_storeu_ps(scores + head * n + (p - low), (__mmask16)((1u << count) - 1),
                                      _mm512_mul_ps(tile_dots(rows, key_stride, q + head * head_dim, vectors, count),
                                                    row_scales));
            }
        }
    }
    for (int64_t head = 0; head < num_heads; head++)
        softmax(scores + head * n, 0, n);
    for (int64_t first = 0, heads; first < num_heads; first += heads) {
        const int64_t kv = first / group;
        heads = min64(value_heads, (kv + 1) * group - first);
        __m512 sums[VALUE_HEADS][8];
        for (int64_t h = 0; h < value_heads; h++)
            for (int64_t c = 0; c < vectors; c++)
                sums[h][c] = _mm512_setzero_ps();
        for (int64_t p = low, stop; p <= high;) {
            const char *run =
                block_run(value_cache, table, p, high + 1, block_size, token_bytes, &stop) + kv * head_bytes;
            for (int64_t count; p < stop; p += count, run += count * token_bytes) {
                count = min64(16, stop - p);
                ask_while_summing(&stream, p, count, value_pass(first, group, value_heads));
                for (int64_t u = 0; u < count; u++) {
                    const char *row = run + u * token_bytes;
                    const float row_scale = head_scale(row, head_dim, kind); /* 1 for float32 rows */
                    __m512 values[8];
                    for (int64_t c = 0; c < vectors; c++)
                        values[c] = kind == ROW_F32 ? _mm512_loadu_ps(row + c * 64) : widen16(row + c * 16, kind);
                    for (int64_t h = 0; h < heads; h++) {
                        const __m512 weight = _mm512_set1_ps(scores[(first + h) * n + (p - low) + u] * row_scale);
                        for (int64_t c = 0; c < vectors; c++)
                            sums[h][c] = _mm512_fmadd_ps(values[c], weight, sums[h][c]);
                    }
                }
            }
        }
        for (int64_t h = 0; h < heads; h++)
            for (int64_t c = 0; c < vectors; c++)
                _mm512_storeu_ps(out + (first + h) * head_dim + c * 16, sums[h][c]);
    }
}

/* Rows 0 .. rows - 1 of one sequence's prompt over one-byte rows (int8, E4M3), row b at position high[b], every one
 * seeing from `low`: each tile of keys, and then of values, is widened once for all the rows, and each row's scores,
 * weights and sums come from the very operations attend_one_query_floats makes for it alone (a key's score depends
 * on its own products only, and each sum takes its tokens in order, whether it waits in a register or in `out`), so
 * that a prompt recomputed after a preemption attends as its decode steps did, to the bit. Row b's scores for head h
 * live at scores[b * num_heads * span + h * n_b + t], span the block's positions and n_b the row's own. */
static inline __attribute__((always_inline)) void attend_queries_floats(
    const float *restrict query, int64_t query_stride, int64_t rows, int64_t low, const int64_t *restrict high,
    const char *restrict key_cache, const char *restrict value_cache, const int32_t *restrict table,
    int64_t num_heads, int64_t num_kv_heads, const int64_t vectors, int64_t block_size, float scale,
    float *restrict scores, float *restrict out, const int kind, float *restrict decoded)
{
    const int64_t group = num_heads / num_kv_heads, head_dim = vectors * 16, top = high[rows - 1];
    const int64_t span = top + 1 - low, value_heads = vectors <= 4 ? VALUE_HEADS : VALUE_HEADS / 2;
    const int64_t head_bytes = head_row_bytes(head_dim, kind), token_bytes = num_kv_heads * head_bytes;
    const int64_t key_stride = num_kv_heads * head_dim; /* floats of a widened token */
    for (int64_t p = low, stop; p <= top;) {
        const char *run = block_run(key_cache, table, p, top + 1, block_size, token_bytes, &stop);
        for (int64_t count; p < stop; p += count, run += count * token_bytes) {
            count = min64(16, stop - p);
            decode_tile(run, count, token_bytes, num_kv_heads, head_dim, head_bytes, decoded, kind);
            for (int64_t kv = 0; kv < num_kv_heads; kv++) {
                float each[16] = {0};
                for (int64_t u = 0; u < count; u++)
                    each[u] = head_scale(run + u * token_bytes + kv * head_bytes, head_dim, kind);
                const __m512 row_scales = _mm512_mul_ps(_mm512_loadu_ps(each), _mm512_set1_ps(scale));
                const float *keys = decoded + kv * head_dim;
                for (int64_t b = 0; b < rows; b++) {
                    const int64_t seen = min64(count, high[b] + 1 - p), n = high[b] + 1 - low;
                    for (int64_t head = kv * group; seen > 0 && head < (kv + 1) * group; head++) {
                        const __m512 dots = tile_dots((const char *)keys, key_stride * 4,
                                                      query + b * query_stride + head * head_dim, vectors, seen);
                        _mm512_mask_storeu_ps(scores + b * num_heads * span + head * n + (p - low),
                                              (__mmask16)((1u << seen) - 1), _mm512_mul_ps(dots, row_scales));
                    }
                }
            }
        }
    }
    for (int64_t b = 0; b < rows; b++) {
        for (int64_t head = 0; head < num_heads; head++)
            softmax(scores + b * num_heads * span + head * (high[b] + 1 - low), 0, high[b] + 1 - low);
        memset(out + b * num_heads * head_dim, 0, num_heads * head_dim * sizeof(float));
    }
    for (int64_t p = low, stop; p <= top;) {
        const char *run = block_run(value_cache, table, p, top + 1, block_size, token_bytes, &stop);
        for (int64_t count; p < stop; p += count, run += count * token_bytes) {
            count = min64(16, stop - p);
            decode_tile(run, count, token_bytes, num_kv_heads, head_dim, head_bytes, decoded, kind);
            for (int64_t b = 0; b < rows; b++) {
                const int64_t seen = min64(count, high[b] + 1 - p), n = high[b] + 1 - low;
                const float *weights = scores + b * num_heads * span + (p - low);
                float *o = out + b * num_heads * head_dim;
                for (int64_t first = 0, heads; seen > 0 && first < num_heads; first += heads) {
                    const int64_t kv = first / group;
                    heads = min64(value_heads, (kv + 1) * group - first);
                    __m512 sums[VALUE_HEADS][8];
                    for (int64_t h = 0; h < heads; h++)
                        for (int64_t c = 0; c < vectors; c++)
                            sums[h][c] = _mm512_loadu_ps(o + (first + h) * head_dim + c * 16);
                    for (int64_t u = 0; u < seen; u++) {
                        const float row_scale = head_scale(run + u * token_bytes + kv * head_bytes, head_dim, kind);
                        const float *row = decoded + (u * num_kv_heads + kv) * head_dim;
                        __m512 values[8];
                        for (int64_t c = 0; c < vectors; c++)
                            values[c] = _mm512_loadu_ps(row + c * 16);
                        for (int64_t h = 0; h < heads; h++) {
                            const __m512 weight = _mm512_set1_ps(weights[(first + h) * n + u] * row_scale);
                            for (int64_t c = 0; c < vectors; c++)
                                sums[h][c] = _mm512_fmadd_ps(values[c], weight, sums[h][c]);
                        }
                    }
                    for (int64_t h = 0; h < heads; h++)
                        for (int64_t c = 0; c < vectors; c++)
                            _mm512_storeu_ps(o + (first + h) * head_dim + c * 16, sums[h][c]);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void attend_queries_floats_sized(
    const float *restrict query, int64_t query_stride, int64_t rows, int64_t low, const int64_t *restrict high,
    const char *restrict key_cache, const char *restrict value_cache, const int32_t *restrict table,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    float *restrict scores, float *restrict out, const int kind, float *restrict decoded)
{
#define SIZED(VECTORS)                                                                                           \
    attend_queries_floats(query, query_stride, rows, low, high, key_cache, value_cache, table, num_heads,       \
                          num_kv_heads, VECTORS, block_size, scale, scores, out, kind, decoded)
    switch (head_dim) {
    case 64: SIZED(4); break;
    case 128: SIZED(8); break;
    default: SIZED(head_dim / 16);
    }
#undef SIZED
}

/* attend_one_query_floats with the head size known to the compiler where it is a common one, so that every sum stays
 * in a register. */
static inline __attribute__((always_inline)) void attend_one_query_floats_sized(
    const float *restrict q, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict table, int64_t low, int64_t high, int64_t num_heads, int64_t num_kv_heads,
    int64_t token_heads, int64_t head_dim, int64_t block_size, float scale, float *restrict scores,
    float *restrict out, const struct next_row *next, const int kind, float *restrict decoded)
{
#define SIZED(VECTORS)                                                                                         \
    attend_one_query_floats(q, key_cache, value_cache, table, low, high, num_heads, num_kv_heads, token_heads, \
                            VECTORS, block_size, scale, scores, out, next, kind, decoded)
    switch (head_dim) {
    case 64: SIZED(4); break;
    case 128: SIZED(8); break;
    default: SIZED(head_dim / 16);
    }
#undef SIZED
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOT 1
#define MAX_BF16_HEADS 64 /* query heads this path serves at most (their queries live on the stack) */
/* Head sizes of whole 16-value halves: vector c of 32 dimensions is whole, or the head's last half (its upper
 * 16 read as zero, nothing past the head read, and only its lower 16 sums stored). */
static inline int half_vector(int64_t c, int64_t head_dim) { return (c + 1) * 32 > head_dim; }
static inline __attribute__((always_inline)) __m512i load_dims(const char *p, int64_t c, int64_t head_dim)
{
    return half_vector(c, head_dim) ? _mm512_maskz_loadu_epi16((__mmask32)0xffff, p + c * 64)
                                    : _mm512_loadu_si512(p + c * 64);
}
static inline __attribute__((always_inline)) __m512bh query_dims(const float *q, int64_t c, int64_t head_dim)
{
    const __m512 high = half_vector(c, head_dim) ? _mm512_setzero_ps() : _mm512_loadu_ps(q + c * 32 + 16);
    return _mm512_cvtne2ps_pbh(high, _mm512_loadu_ps(q + c * 32));
}
/* A vector's 32 sums, as unpacklo/unpackhi of two tokens' rows left them in `low` and `high`, into o in order:
 * the lower 16 only for a head's last half. */
static inline __attribute__((always_inline)) void store_dims(float *o, __m512 low, __m512 high, int64_t c,
                                                               int64_t head_dim)
{
    const __m512i low_order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high_order = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    _mm512_storeu_ps(o + c * 32, _mm512_permutex2var_ps(low, low_order, high));
    if (!half_vector(c, head_dim))
        _mm512_storeu_ps(o + c * 32 + 16, _mm512_permutex2var_ps(low, high_order, high));
}
/* One query row's attention over a bfloat16 cache by the bfloat16 dot product (VDPBF16PS, float32 sums), at head
 * sizes of whole 16-value halves: a decode's row (a prompt's rows go in blocks, block_attention). The query and
 * the softmax's weights are rounded to bfloat16 as the products take them, as a bfloat16 model's own attention
 * holds them; the cached rows are read as they are, nothing widened or stored again. Keys: 16 cached tokens at a
 * time, every KV head's row of each, in memory order; a row's scores for them come as one vector folded from 16
 * sums (fold16); meanwhile the row's stream is asked for AHEAD_BYTES on, a slice per head (prefetch_stream).
 * Values: two tokens' rows are interleaved so that one product adds both tokens' weighted values, into sums held
 * over the whole context. Faster than the float32 walk below at every size measured (docs/kernel-measurements.md). */
static inline __attribute__((always_inline)) void attend_one_query_bf16(
    const float *restrict q, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict table, int64_t low, int64_t high, int64_t num_heads, int64_t num_kv_heads,
    int64_t token_heads, const int64_t head_dim, int64_t block_size, float scale, float *restrict scores,
    float *restrict out, const struct next_row *next)
{
    const int64_t group = num_heads / num_kv_heads, vectors = (head_dim + 31) / 32, n = high + 1 - low;
    const int64_t head_bytes = head_dim * 2, token_bytes = token_heads * head_bytes;
    const struct decode_stream stream = decode_stream(key_cache, value_cache, table, low, n, block_size, token_bytes,
                                                      value_passes(num_kv_heads, group, VALUE_HEADS),
                                                      values_early_bytes(), next);
    __m512bh query[MAX_BF16_HEADS][4];
    for (int64_t head = 0; head < num_heads; head++)
        for (int64_t c = 0; c < vectors; c++)
            query[head][c] = query_dims(q + head * head_dim, c, head_dim);
    /* Keys, 16 cached tokens at a time (each token's row, every KV head's, read in turn from memory) */
    for (int64_t p = low, stop; p <= high;) {
        const char *run = block_run(key_cache, table, p, high + 1, block_size, token_bytes, &stop);
        for (int64_t count; p < stop; p += count, run += count * token_bytes) {
            count = min64(16, stop - p);
            for (int64_t head = 0; head < num_heads; head++) {
                ask_while_scoring(&stream, p, count, head, num_heads);
                const char *rows = run + (head / group) * head_bytes;
                __m512 sums[16];
                for (int64_t u = 0; u < 16; u++) {
                    sums[u] = _mm512_setzero_ps();
                    if (u < count)
                        for (int64_t c = 0; c < vectors; c++)
                            sums[u] = _mm512_dpbf16_ps(sums[u], (__m512bh)load_dims(rows + u * token_bytes, c, head_dim),
                                                       query[head][c]);
                }
                _mm512_mask_storeu_ps(scores + head * n + (p - low), (__mmask16)((1u << count) - 1),
                                      _mm512_mul_ps(fold16(sums), _mm512_set1_ps(scale)));
            }
        }
    }
    for (int64_t head = 0; head < num_heads; head++)
        softmax(scores + head * n, 0, n);
    /* Values, for up to VALUE_HEADS heads of a group at a time: per head and vector of 32 dimensions, sums[..][0]
     * holds dimensions 8L .. 8L + 3 in lanes 4L .. 4L + 3 and sums[..][1] dimensions 8L + 4 .. 8L + 7, as two
     * tokens' rows interleave (unpacklo, unpackhi); they stay in registers over the whole context. */
    for (int64_t first = 0, heads; first < num_heads; first += heads) {
        const int64_t kv = first / group;
        heads = min64(VALUE_HEADS, (kv + 1) * group - first);
        __m512 sums[VALUE_HEADS][4][2];
        for (int64_t h = 0; h < VALUE_HEADS; h++)
            for (int64_t c = 0; c < 4; c++)
                sums[h][c][0] = sums[h][c][1] = _mm512_setzero_ps();
        for (int64_t p = low, stop; p <= high;) {
            const char *run = block_run(value_cache, table, p, high + 1, block_size, token_bytes, &stop) + kv * head_bytes;
            for (int64_t count; p < stop; p += count, run += count * token_bytes) {
                count = min64(16, stop - p);
                ask_while_summing(&stream, p, count, value_pass(first, group, VALUE_HEADS));
                const __mmask16 valid = (__mmask16)((1u << count) - 1);
                __m512i pairs[VALUE_HEADS]; /* word j: the weights of tokens 2j and 2j + 1, two bfloat16 */
                for (int64_t h = 0; h < heads; h++)
                    pairs[h] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(
                        _mm512_maskz_loadu_ps(valid, scores + (first + h) * n + (p - low))));
                for (int64_t j = 0; 2 * j < count; j++) {
                    const char *row = run + 2 * j * token_bytes;
                    for (int64_t c = 0; c < vectors; c++) {
                        const __m512i even = load_dims(row, c, head_dim);
                        const __m512i odd = 2 * j + 1 < count ? load_dims(row + token_bytes, c, head_dim)
                                                              : _mm512_setzero_si512();
                        const __m512bh low_pairs = (__m512bh)_mm512_unpacklo_epi16(even, odd);
                        const __m512bh high_pairs = (__m512bh)_mm512_unpackhi_epi16(even, odd);
                        for (int64_t h = 0; h < heads; h++) {
                            const __m512bh weight =
                                (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32((int)j), pairs[h]);
                            sums[h][c][0] = _mm512_dpbf16_ps(sums[h][c][0], low_pairs, weight);
                            sums[h][c][1] = _mm512_dpbf16_ps(sums[h][c][1], high_pairs, weight);
                        }
                    }
                }
            }
        }
        for (int64_t h = 0; h < heads; h++)
            for (int64_t c = 0; c < vectors; c++)
                store_dims(out + (first + h) * head_dim, sums[h][c][0], sums[h][c][1], c, head_dim);
    }
}
#endif

/* Prompt rows, a block of up to QUERY_BLOCK of one sequence at a time (a prompt's chunk, or a decode with the
 * proposals it verifies), as small matrix products: for one KV head, its cached keys are laid out once per run
 * of the sequence, transposed in tiles of TILE positions (lane u: position u's value of one dimension, or of one
 * pair of dimensions for the bfloat16 dot product), so that each query row's scores for a tile come as one vector
 * of sums with no fold, its query's values broadcast; BLOCK_HEADS heads of the group share each key vector read.
 * The weighted values then add up per query row with the weights broadcast: float32 rows as they are cached,
 * bfloat16 rows of two positions interleaved (laid out once, as the keys are). Float32 and bfloat16 caches. */
typedef float vf16 __attribute__((vector_size(64)));
/* Below AVX-512 such a vector passed by value changes the ABI; none crosses a call (each function is inlined). */
#pragma GCC diagnostic ignored "-Wpsabi"
#define BLOCK_HEADS 2 /* heads of a group whose scores one pass over the keys computes */
#define VALUE_ROWS 4  /* query rows whose weighted sums one pass over the values holds, 64 dimensions each */
#define KEY_PAD 32    /* positions a scratch row holds beyond the context: a tile's or pair's rest */

static inline __attribute__((always_inline)) vf16 load16(const void *p)
{
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The cached row of position p alone (block_run's, for a caller that takes positions one at a time). */
static inline const char *row_at(const char *cache, const int32_t *table, int64_t p, int64_t block_size,
                                 int64_t token_bytes)
{
    int64_t stop;
    return block_run(cache, table, p, p + 1, block_size, token_bytes, &stop);
}

/* One KV head's keys of positions from .. to - 1 (from a multiple of TILE) into `keys`, tile by tile: float32
 * keys[(p / TILE) * head_dim * TILE + d * TILE + p % TILE], or for bfloat16, in 32-bit words of two dimensions,
 * keys[(p / TILE) * head_dim / 2 * TILE + j * TILE + p % TILE] (dimensions 2j, 2j + 1). The tile's rest is zero. */
static inline __attribute__((always_inline)) void lay_out_keys(
    const char *cache, const int32_t *table, int64_t from, int64_t to, int64_t block_size, int64_t token_bytes,
    int64_t offset, const int64_t head_dim, void *keys, const int kind)
{
    const int64_t words = kind == ROW_F32 ? head_dim : head_dim / 2; /* 32-bit words per key */
    uint32_t *out = keys;
    for (int64_t p = from; p < (to + TILE - 1) / TILE * TILE; p++) {
        uint32_t *tile = out + (p / TILE) * words * TILE + p % TILE;
        if (p < to) {
            const uint32_t *row = (const uint32_t *)(row_at(cache, table, p, block_size, token_bytes) + offset);
            for (int64_t j = 0; j < words; j++)
                tile[j * TILE] = row[j];
        } else {
            for (int64_t j = 0; j < words; j++)
                tile[j * TILE] = 0;
        }
    }
}

/* Query rows b < block (row `block - 1` standing in for the rest) of heads h0 .. h0 + HEADS - 1 against the tiles
 * from position `base` to `last`: scores[(b * BLOCK_HEADS + hh) * stride + p - base]. */
static inline __attribute__((always_inline)) void block_scores_f32(
    const float *const *rows, int64_t block, const int64_t head_dim, int64_t h0, const int HEADS, const float *keys,
    int64_t base, int64_t last, float scale, float *scores, int64_t stride)
{
    for (int64_t t = base / TILE; t <= last / TILE; t++) {
        vf16 sums[BLOCK_HEADS][QUERY_BLOCK];
        for (int hh = 0; hh < HEADS; hh++)
            for (int b = 0; b < QUERY_BLOCK; b++)
                sums[hh][b] = (vf16){0};
        const float *tile = keys + t * head_dim * TILE;
        for (int64_t d = 0; d < head_dim; d++) {
            const vf16 k = load16(tile + d * TILE);
            for (int hh = 0; hh < HEADS; hh++)
                for (int b = 0; b < QUERY_BLOCK; b++)
                    sums[hh][b] += k * rows[b][(h0 + hh) * head_dim + d];
        }
        for (int hh = 0; hh < HEADS; hh++)
            for (int b = 0; b < block; b++) {
                const vf16 scaled = sums[hh][b] * scale;
                memcpy(scores + (b * BLOCK_HEADS + hh) * stride + t * TILE - base, &scaled, sizeof scaled);
            }
    }
}

/* Softmax of each row's visible positions, zero elsewhere up to the last tile's end. */
static inline void block_softmax(float *scores, int64_t stride, int64_t block, int64_t heads, const int64_t *low,
                                 const int64_t *high, int64_t base, int64_t width)
{
    for (int64_t b = 0; b < block; b++)
        for (int64_t hh = 0; hh < heads; hh++) {
            float *row = scores + (b * BLOCK_HEADS + hh) * stride;
            softmax(row, low[b] - base, high[b] - base + 1);
            for (int64_t t = 0; t < low[b] - base; t++)
                row[t] = 0.f;
            for (int64_t t = high[b] - base + 1; t < width; t++)
                row[t] = 0.f;
        }
}

/* Head h0 + hh's output of query rows b < block: the weighted sum of float32 values from `base` to `last`. */
static inline __attribute__((always_inline)) void block_values_f32(
    const char *cache, const int32_t *table, int64_t block_size, int64_t token_bytes, int64_t offset,
    const int64_t head_dim, int64_t block, int64_t hh, const float *scores, int64_t stride, int64_t base,
    int64_t last, float *const *outs)
{
    for (int64_t b0 = 0; b0 < block; b0 += VALUE_ROWS)
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int64_t chunks = min64(64, head_dim - d0) / 16;
            const float *weights[VALUE_ROWS];
            for (int r = 0; r < VALUE_ROWS; r++)
                weights[r] = scores + (min64(b0 + r, block - 1) * BLOCK_HEADS + hh) * stride - base;
            vf16 sums[VALUE_ROWS][4];
            for (int r = 0; r < VALUE_ROWS; r++)
                for (int c = 0; c < 4; c++)
                    sums[r][c] = (vf16){0};
            for (int64_t p = base, stop; p <= last;) {
                const char *run = block_run(cache, table, p, last + 1, block_size, token_bytes, &stop) + offset;
                for (; p < stop; p++, run += token_bytes) {
                    const float *v = (const float *)run + d0;
                    for (int c = 0; c < 4; c++)
                        if (c < chunks) {
                            const vf16 value = load16(v + c * 16);
                            for (int r = 0; r < VALUE_ROWS; r++)
                                sums[r][c] += value * weights[r][p];
                        }
                }
            }
            for (int64_t r = 0; r < VALUE_ROWS && b0 + r < block; r++)
                for (int c = 0; c < chunks; c++)
                    memcpy(outs[b0 + r] + d0 + c * 16, &sums[r][c], sizeof sums[r][c]);
        }
}

#ifdef BF16_DOT
/* One KV head's bfloat16 values of positions from .. to - 1 (from even) as interleaved pairs: for the pair of
 * positions 2P, 2P + 1 and 32 dimensions c, two vectors (the words of unpacklo and unpackhi of the two rows) at
 * values + ((P * head_dim / 32 + c) * 2 + half) * 64 bytes; a missing odd position reads as zero. */
static inline void lay_out_values_bf16(const char *cache, const int32_t *table, int64_t from, int64_t to,
                                       int64_t block_size, int64_t token_bytes, int64_t offset, int64_t head_dim,
                                       char *values)
{
    const int64_t vectors = (head_dim + 31) / 32;
    for (int64_t p = from; p < to; p += 2) {
        const char *even = row_at(cache, table, p, block_size, token_bytes) + offset;
        const char *odd = p + 1 < to ? row_at(cache, table, p + 1, block_size, token_bytes) + offset : NULL;
        for (int64_t c = 0; c < vectors; c++) {
            const __m512i e = load_dims(even, c, head_dim);
            const __m512i o = odd ? load_dims(odd, c, head_dim) : _mm512_setzero_si512();
            char *pair = values + ((p / 2 * vectors + c) * 2) * 64;
            _mm512_storeu_si512(pair, _mm512_unpacklo_epi16(e, o));
            _mm512_storeu_si512(pair + 64, _mm512_unpackhi_epi16(e, o));
        }
    }
}

/* block_scores_f32 by the bfloat16 dot product: each query row rounded to bfloat16, as a bfloat16 model holds it. */
static inline __attribute__((always_inline)) void block_scores_bf16(
    const float *const *rows, int64_t block, const int64_t head_dim, int64_t h0, const int HEADS,
    const uint32_t *keys, int64_t base, int64_t last, float scale, float *scores, int64_t stride)
{
    uint32_t query[BLOCK_HEADS][QUERY_BLOCK][128]; /* pairs of bfloat16 dimensions, head sizes up to 256 */
    for (int hh = 0; hh < HEADS; hh++)
        for (int b = 0; b < QUERY_BLOCK; b++)
            for (int64_t c = 0; c < head_dim / 16; c++)
                _mm256_storeu_si256((__m256i *)(query[hh][b] + c * 8),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(rows[b] + (h0 + hh) * head_dim + c * 16)));
    for (int64_t t = base / TILE; t <= last / TILE; t++) {
        __m512 sums[BLOCK_HEADS][QUERY_BLOCK];
        for (int hh = 0; hh < HEADS; hh++)
            for (int b = 0; b < QUERY_BLOCK; b++)
                sums[hh][b] = _mm512_setzero_ps();
        const uint32_t *tile = keys + t * head_dim / 2 * TILE;
        for (int64_t j = 0; j < head_dim / 2; j++) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + j * TILE);
            for (int hh = 0; hh < HEADS; hh++)
                for (int b = 0; b < QUERY_BLOCK; b++)
                    sums[hh][b] = _mm512_dpbf16_ps(sums[hh][b], k, (__m512bh)_mm512_set1_epi32((int)query[hh][b][j]));
        }
        for (int hh = 0; hh < HEADS; hh++)
            for (int b = 0; b < block; b++)
                _mm512_storeu_ps(scores + (b * BLOCK_HEADS + hh) * stride + t * TILE - base,
                                 _mm512_mul_ps(sums[hh][b], _mm512_set1_ps(scale)));
    }
}

/* block_values_f32 over interleaved bfloat16 pairs: each row's weights rounded to bfloat16 pairs in place first. */
static inline __attribute__((always_inline)) void block_values_bf16(
    const char *values, const int64_t head_dim, int64_t block, int64_t hh, float *scores, int64_t stride,
    int64_t base, int64_t last, int64_t width, float *const *outs)
{
    for (int64_t b = 0; b < block; b++) {
        float *row = scores + (b * BLOCK_HEADS + hh) * stride;
        for (int64_t t = 0; t < width; t += 16) /* each store lands on floats already read */
            _mm256_storeu_si256((__m256i *)((uint16_t *)row + t),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + t)));
    }
    const int64_t vectors = (head_dim + 31) / 32;
    for (int64_t b0 = 0; b0 < block; b0 += VALUE_ROWS)
        for (int64_t c0 = 0; c0 < vectors; c0 += 2) {
            const int64_t count = min64(2, vectors - c0);
            const uint32_t *weights[VALUE_ROWS];
            for (int r = 0; r < VALUE_ROWS; r++)
                weights[r] = (const uint32_t *)(scores + (min64(b0 + r, block - 1) * BLOCK_HEADS + hh) * stride)
                             - base / 2;
            __m512 sums[VALUE_ROWS][2][2];
            for (int r = 0; r < VALUE_ROWS; r++)
                for (int c = 0; c < 2; c++)
                    sums[r][c][0] = sums[r][c][1] = _mm512_setzero_ps();
            for (int64_t pair = base / 2; pair <= last / 2; pair++) {
                const char *at = values + ((pair * vectors + c0) * 2) * 64;
                for (int c = 0; c < 2; c++)
                    if (c < count) {
                        const __m512bh low = (__m512bh)_mm512_loadu_si512(at + c * 128);
                        const __m512bh high = (__m512bh)_mm512_loadu_si512(at + c * 128 + 64);
                        for (int r = 0; r < VALUE_ROWS; r++) {
                            const __m512bh weight = (__m512bh)_mm512_set1_epi32((int)weights[r][pair]);
                            sums[r][c][0] = _mm512_dpbf16_ps(sums[r][c][0], low, weight);
                            sums[r][c][1] = _mm512_dpbf16_ps(sums[r][c][1], high, weight);
                        }
                    }
            }
            for (int64_t r = 0; r < VALUE_ROWS && b0 + r < block; r++)
                for (int c = 0; c < count; c++)
                    store_dims(outs[b0 + r], sums[r][c][0], sums[r][c][1], c0 + c, head_dim);
        }
}
#endif

#include "amx_attention.h"

/* Whether block_attention serves a cache of `kind` at this head size. */
static inline int block_path(int kind, int64_t head_dim)
{
#ifdef BF16_DOT
    if (kind == ROW_BF16)
        return head_dim % 16 == 0 && head_dim <= 256;
#endif
    return kind == ROW_F32 && head_dim % 16 == 0;
}

/* Every query row of sequence rows first .. first + num_queries - 1 (the last of a context of `context`), block by
 * block, KV head by KV head. scratch: (head_dim rounded up to 32 + BLOCK_HEADS * QUERY_BLOCK) * (context + KEY_PAD)
 * floats. */
static inline __attribute__((always_inline)) void block_attention(
    const float *restrict query, int64_t query_stride, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict table, int64_t first, int64_t num_queries, int64_t context, int64_t num_heads,
    int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float *restrict scratch, float *restrict out, const int kind)
{
    const int64_t group = num_heads / num_kv_heads, head_bytes = head_row_bytes(head_dim, kind);
    const int64_t token_bytes = num_kv_heads * head_bytes, stride = context + KEY_PAD;
    float *keys = scratch, *scores = scratch + (head_dim + 31) / 32 * 32 * stride; /* after keys and values */
#ifdef BF16_DOT
    char *values = (char *)(scratch + head_dim * stride / 2); /* bfloat16 pairs, after bfloat16 keys */
#endif
#if AMX_PROMPT
    const int amx = amx_block_path(kind, head_dim);
    if (amx)
        amx_configure(6);
#else
    const int amx = 0;
#endif
    const int64_t align = amx ? 32 : TILE; /* positions are taken from a multiple of this */
    /* Every row's keys and values are in the cache already: laid out once, from the first row's first visible tile. */
    const int64_t from = first_visible(context - num_queries, window) / align * align;
    for (int64_t kv = 0; kv < num_kv_heads; kv++) {
        lay_out_keys(key_cache, table, from, context, block_size, token_bytes, kv * head_bytes, head_dim, keys, kind);
#ifdef BF16_DOT
        if (kind == ROW_BF16)
            lay_out_values_bf16(value_cache, table, from, context, block_size, token_bytes, kv * head_bytes, head_dim,
                                values);
        if (amx) /* the pairs of positions past the context up to the tiles' last step */
            memset(values + (context + 1) / 2 * head_dim * 4, 0,
                   ((context + 31) / 32 * 16 - (context + 1) / 2) * head_dim * 4);
#endif
        for (int64_t i0 = 0; i0 < num_queries; i0 += QUERY_BLOCK) {
            const int64_t block = min64(QUERY_BLOCK, num_queries - i0);
            int64_t low[QUERY_BLOCK], high[QUERY_BLOCK];
            const float *rows[QUERY_BLOCK];
            float *outs[QUERY_BLOCK];
            for (int64_t b = 0; b < QUERY_BLOCK; b++) {
                const int64_t i = i0 + min64(b, block - 1);
                high[b] = context - num_queries + i;
                low[b] = first_visible(high[b], window);
                rows[b] = query + (first + i) * query_stride;
                outs[b] = out + (first + i) * num_heads * head_dim;
            }
            const int64_t base = low[0] / align * align, last = high[block - 1];
            const int64_t width = (last / TILE + 1) * TILE - base;
            for (int64_t h0 = kv * group, heads; h0 < (kv + 1) * group; h0 += heads) {
                heads = min64(BLOCK_HEADS, (kv + 1) * group - h0);
#if AMX_PROMPT
                if (amx) {
                    amx_block_rows(rows, block, head_dim, h0, heads, (const uint32_t *)keys, values, low, high, base,
                                   last, scale, scores, stride, outs);
                    continue;
                }
#endif
#ifdef BF16_DOT
                if (kind == ROW_BF16) {
                    const uint32_t *pairs = (const uint32_t *)keys;
                    if (heads == 2)
                        block_scores_bf16(rows, block, head_dim, h0, 2, pairs, base, last, scale, scores, stride);
                    else
                        block_scores_bf16(rows, block, head_dim, h0, 1, pairs, base, last, scale, scores, stride);
                } else
#endif
                if (heads == 2)
                    block_scores_f32(rows, block, head_dim, h0, 2, keys, base, last, scale, scores, stride);
                else
                    block_scores_f32(rows, block, head_dim, h0, 1, keys, base, last, scale, scores, stride);
                block_softmax(scores, stride, block, heads, low, high, base, width);
                for (int64_t hh = 0; hh < heads; hh++) {
                    float *head_outs[QUERY_BLOCK];
                    for (int64_t b = 0; b < QUERY_BLOCK; b++)
                        head_outs[b] = outs[b] + (h0 + hh) * head_dim;
#ifdef BF16_DOT
                    if (kind == ROW_BF16) {
                        block_values_bf16(values, head_dim, block, hh, scores, stride, base, last, width, head_outs);
                        continue;
                    }
#endif
                    block_values_f32(value_cache, table, block_size, token_bytes, kv * head_bytes, head_dim, block, hh,
                                     scores, stride, base, last, head_outs);
                }
            }
        }
    }
#if AMX_PROMPT
    if (amx)
        amx_release();
#endif
}

/* Query rows first .. first + num_queries - 1 of one sequence, the last of a context of `context`, for query heads
 * 0 .. num_heads - 1 and their KV heads' rows from key_cache and value_cache on, in cached tokens' rows of
 * token_heads KV heads each; a query row's outputs are out_stride floats after the one before's. A lone decode row
 * comes here for a slice of its KV heads, every pointer moved to the slice's first head. */
static inline __attribute__((always_inline)) void attend_rows(
    const float *restrict query, int64_t query_stride, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict table, int64_t first, int64_t num_queries, int64_t context, int64_t window,
    int64_t num_heads, int64_t num_kv_heads, int64_t token_heads, const int64_t head_dim, int64_t block_size,
    float scale, float *restrict scores, float *restrict out, int64_t out_stride, const struct next_row *next,
    float *restrict decoded, const int kind)
{
    const int64_t group = num_heads / num_kv_heads, head_bytes = head_row_bytes(head_dim, kind);
    const int64_t token_bytes = token_heads * head_bytes, ahead = stream_ahead(token_bytes);
    int64_t low[QUERY_BLOCK], high[QUERY_BLOCK]; /* each query's visible positions, inclusive */
    for (int64_t i0 = 0; i0 < num_queries; i0 += QUERY_BLOCK) {
        const int64_t block = num_queries - i0 < QUERY_BLOCK ? num_queries - i0 : QUERY_BLOCK;
        for (int64_t b = 0; b < block; b++) {
            high[b] = context - num_queries + i0 + b;
            low[b] = first_visible(high[b], window);
        }
        const int64_t lowest = low[0], n = high[block - 1] + 1 - lowest; /* span of the block's rows */
#ifdef BF16_DOT
        if (kind == ROW_BF16 && head_dim % 16 == 0 && head_dim <= 128 && num_heads <= MAX_BF16_HEADS) {
            for (int64_t b = 0; b < block; b++)
                attend_one_query_bf16(query + (first + i0 + b) * query_stride, key_cache, value_cache, table,
                                      low[b], high[b], num_heads, num_kv_heads, token_heads, head_dim, block_size,
                                      scale, scores, out + (first + i0 + b) * out_stride, next);
            continue;
        }
#endif
#ifdef F32_ROWS
        /* A prompt's rows over one-byte rows take the same operations as its decode rows, a block of them at
         * a time: a request recomputed after preemption then gets the attention its decode steps got, to the
         * bit. Rows that see from different positions (a sliding window) take int8 rows one at a time. */
        if (block > 1 && quantized(kind) && low[0] == low[block - 1] && head_dim % 16 == 0 && head_dim <= 128) {
            attend_queries_floats_sized(query + (first + i0) * query_stride, query_stride, block, low[0], high,
                                        key_cache, value_cache, table, num_heads, num_kv_heads, head_dim,
                                        block_size, scale, scores, out + (first + i0) * out_stride, kind,
                                        decoded);
            continue;
        }
        if ((block == 1 || kind == ROW_I8) && (kind == ROW_F32 || quantized(kind)) && head_dim % 16 == 0 &&
            head_dim <= 128) {
            for (int64_t b = 0; b < block; b++)
                attend_one_query_floats_sized(query + (first + i0 + b) * query_stride, key_cache, value_cache,
                                              table, low[b], high[b], num_heads, num_kv_heads, token_heads, head_dim,
                                              block_size, scale, scores, out + (first + i0 + b) * out_stride, next,
                                              kind, decoded);
            continue;
        }
#endif
        if (block == 1 && head_dim == 64 && group % 2 == 0 && (kind == ROW_I8 || (kind == ROW_F8 && group == 2))) {
            attend_one_query(query + (first + i0) * query_stride, key_cache, value_cache, table, low[0], high[0],
                             num_heads, num_kv_heads, token_heads, head_dim, block_size, scale, scores,
                             out + (first + i0) * out_stride, kind);
            continue;
        }
        /* Scores of row (b, head) at t = p - lowest live at scores[(b * num_heads + head) * n + t]. The
         * positions are walked a tile of up to TILE cached tokens at a time: each token's row (every KV
         * head, consecutive) is read from memory once, and within the tile each query row and head
         * takes the tile's keys in turn, its query held in registers across them. */
        prefetch_rows(key_cache, table, lowest, min64(lowest + AHEAD, lowest + n), block_size, token_bytes);
        for (int64_t p = lowest, end = lowest + n, stop; p < end;) {
            const char *run = block_run(key_cache, table, p, end, block_size, token_bytes, &stop);
            while (p < stop) {
                const int64_t tile_end = min64(p + TILE, stop);
                if (kind != ROW_F32)
                    decode_tile(run, tile_end - p, token_bytes, num_kv_heads, head_dim, head_bytes, decoded, kind);
                const int64_t count = tile_end - p, offset = p - lowest + ahead;
                for (int64_t b = 0; b < block; b++) {
                    const int64_t from = max64(p, low[b]), to = min64(tile_end, high[b] + 1);
                    const float *q = query + (first + i0 + b) * query_stride;
                    for (int64_t head = 0; head < num_heads; head++) {
                        if (b == 0)
                            prefetch_stream((const char *)key_cache, table, lowest, n, (const char *)value_cache,
                                            table, lowest, n, offset + head * count / num_heads,
                                            offset + (head + 1) * count / num_heads, block_size, token_bytes);
                        const float *qh = q + head * head_dim;
                        float *row_scores = scores + (b * num_heads + head) * n;
                        for (int64_t u = from; u < to; u++) {
                            const char *k = run + (u - p) * token_bytes + (head / group) * head_bytes;
                            const float *kf = kind != ROW_F32
                                ? decoded + ((u - p) * num_kv_heads + head / group) * head_dim : (const float *)k;
                            float dot = 0.f;
                            for (int64_t d = 0; d < head_dim; d++)
                                dot += qh[d] * kf[d];
                            row_scores[u - lowest] = dot * head_scale(k, head_dim, kind) * scale;
                        }
                    }
                }
                run += (tile_end - p) * token_bytes;
                p = tile_end;
            }
        }
        for (int64_t b = 0; b < block; b++)
            for (int64_t head = 0; head < num_heads; head++)
                softmax(scores + (b * num_heads + head) * n, low[b] - lowest, high[b] - lowest + 1);
        for (int64_t b = 0; b < block; b++)
            memset(out + (first + i0 + b) * out_stride, 0, num_heads * head_dim * sizeof(float));
        /* Values, tile by tile as the keys were: each output row accumulates the tile's weighted
         * values before it is stored again. */
        for (int64_t p = lowest, end = lowest + n, stop; p < end;) {
            const char *run = block_run(value_cache, table, p, end, block_size, token_bytes, &stop);
            while (p < stop) {
                const int64_t tile_end = min64(p + TILE, stop);
                prefetch_stream((const char *)value_cache, table, lowest, n, (const char *)key_cache, next->table,
                                next->low, next->count, p - lowest + ahead, tile_end - lowest + ahead, block_size,
                                token_bytes);
                if (kind != ROW_F32)
                    decode_tile(run, tile_end - p, token_bytes, num_kv_heads, head_dim, head_bytes, decoded, kind);
                for (int64_t b = 0; b < block; b++) {
                    const int64_t from = max64(p, low[b]), to = min64(tile_end, high[b] + 1);
                    float *o = out + (first + i0 + b) * out_stride;
                    for (int64_t head = 0; head < num_heads; head++) {
                        const float *weights = scores + (b * num_heads + head) * n;
                        float *restrict oh = o + head * head_dim;
                        for (int64_t u = from; u < to; u++) {
                            const char *v = run + (u - p) * token_bytes + (head / group) * head_bytes;
                            const float weight = weights[u - lowest] * head_scale(v, head_dim, kind);
                            const float *vf = kind != ROW_F32
                                ? decoded + ((u - p) * num_kv_heads + head / group) * head_dim : (const float *)v;
                            for (int64_t d = 0; d < head_dim; d++)
                                oh[d] += weight * vf[d];
                        }
                    }
                }
                run += (tile_end - p) * token_bytes;
                p = tile_end;
            }
        }
    }
}

/* Sequences first_seq .. last_seq - 1, and of a decode row (one query) only KV heads kv_first .. kv_first +
 * kv_count - 1 and their query heads, so that threads can share a lone row; a sequence of several query rows is
 * done whole by the slice from KV head 0, and by no other. */
static inline __attribute__((always_inline)) void attend_range(
    const float *restrict query, int64_t query_stride, const char *restrict key_cache, const char *restrict value_cache,
    const int32_t *restrict block_tables, int64_t table_stride, const int32_t *restrict query_start,
    const int32_t *restrict context_lens, int64_t first_seq, int64_t last_seq, int64_t kv_first, int64_t kv_count,
    int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float *restrict scores, float *restrict out, const int kind)
{
    const int64_t group = num_heads / num_kv_heads, head_bytes = head_row_bytes(head_dim, kind);
    float decoded[kind != ROW_F32 ? MAX_DECODED : 1];
    for (int64_t s = first_seq; s < last_seq; s++) {
        const int32_t *table = block_tables + s * table_stride;
        const int64_t first = query_start[s], num_queries = query_start[s + 1] - first;
        const int64_t context = context_lens[s];
        const int whole = num_queries > 1 || kv_count == num_kv_heads;
        if (whole ? kv_first > 0 : kv_count == 0)
            continue;
        if (num_queries > 1 && block_path(kind, head_dim)) {
            block_attention(query, query_stride, key_cache, value_cache, table, first, num_queries, context, num_heads,
                            num_kv_heads, head_dim, block_size, scale, window, scores, out, kind);
            continue;
        }
        const struct next_row next = next_decode_row(block_tables, table_stride, query_start, context_lens, s, last_seq,
                                                     window);
        const int64_t from = whole ? 0 : kv_first, kv_heads = whole ? num_kv_heads : kv_count;
        attend_rows(query + from * group * head_dim, query_stride, key_cache + from * head_bytes,
                    value_cache + from * head_bytes, table, first, num_queries, context, window, kv_heads * group,
                    kv_heads, num_kv_heads, head_dim, block_size, scale, scores, out + from * group * head_dim,
                    num_heads * head_dim, &next, decoded, kind);
    }
}

/* Chunk c of `chunks` is sequences bounds[r] .. bounds[r + 1] - 1, r = c / slices, and of their decode rows the
 * KV heads of slice c % slices (slices at most num_kv_heads, so that a lone row's heads are shared too), claimed in
 * turn by the threads that share the call (claims.h); the caller, wait != 0, returns once every chunk is done.
 * scores: this thread's scratch of QUERY_BLOCK * num_heads * max(context_lens) floats. A constant
 * head_dim lets the compiler unroll the inner loops into whole vectors; a constant row kind drops
 * the other kinds'. */
#define ATTEND_SPECIALIZED(KIND)                                                                        \
    switch (head_dim) {                                                                                 \
    case 64: ATTEND(64, KIND); break;                                                                   \
    case 128: ATTEND(128, KIND); break;                                                                 \
    default: ATTEND(head_dim, KIND);                                                                    \
    }                                                                                                   \
    if (wait)                                                                                           \
        wait_for_chunks(counters, chunks);
#define ATTEND(DIM, KIND)                                                                                             \
    for (int64_t c; (c = claim_chunk(counters)) < chunks; finish_chunk(counters)) {                                   \
        const int64_t run = c / slices, kv_first = c % slices * num_kv_heads / slices;                                \
        attend_range(query, query_stride, (const char *)key_cache, (const char *)value_cache, block_tables,           \
                     table_stride, query_start, context_lens, bounds[run], bounds[run + 1], kv_first,                 \
                     (c % slices + 1) * num_kv_heads / slices - kv_first, num_heads, num_kv_heads, DIM, block_size,   \
                     scale, window, scores, out, KIND);                                                               \
    }

void paged_attention_f32(
    const float *query, int64_t query_stride, const float *key_cache, const float *value_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *query_start, const int32_t *context_lens, const int64_t *bounds,
    int64_t chunks, int64_t *counters, int64_t wait, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t window, int64_t slices, float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_F32)
}

/* The same over a bfloat16 cache, and over a float16 one: each KV head's row is head_dim such values. */
void paged_attention_bf16(
    const float *query, int64_t query_stride, const uint16_t *key_cache, const uint16_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    const int64_t *bounds, int64_t chunks, int64_t *counters, int64_t wait, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t slices,
    float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_BF16)
}

void paged_attention_f16(
    const float *query, int64_t query_stride, const uint16_t *key_cache, const uint16_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    const int64_t *bounds, int64_t chunks, int64_t *counters, int64_t wait, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t slices,
    float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_F16)
}

/* And over an int8 cache: each KV head's row is head_dim int8 values and their float32 scale. */
void paged_attention_i8(
    const float *query, int64_t query_stride, const int8_t *key_cache, const int8_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    const int64_t *bounds, int64_t chunks, int64_t *counters, int64_t wait, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t slices,
    float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_I8)
}

/* And over an E4M3 cache: each KV head's row is head_dim E4M3 bytes and their float32 scale. */
void paged_attention_f8(
    const float *query, int64_t query_stride, const uint8_t *key_cache, const uint8_t *value_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *query_start, const int32_t *context_lens,
    const int64_t *bounds, int64_t chunks, int64_t *counters, int64_t wait, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t slices,
    float *scores, float *out)
{
    ATTEND_SPECIALIZED(ROW_F8)
}
#undef ATTEND
#undef ATTEND_SPECIALIZED

/* The same calls as tasks of helper_pool.c. Words: query, query_stride, key_cache, value_cache,
 * block_tables, table_stride, query_start, context_lens, bounds, chunks, num_heads, num_kv_heads,
 * head_dim, block_size, scale (a float's bits), window, slices, scores, the floats of each thread's scores
 * (thread t's start t times that far on), out. */
#define ATTENTION_TASK(NAME, ELEMENT)                                                                   \
    int64_t NAME##_task(const int64_t *w, int64_t *counters, int64_t thread, int64_t wait)               \
    {                                                                                                   \
        float scale;                                                                                    \
        const uint32_t scale_bits = (uint32_t)w[14];                                                    \
        memcpy(&scale, &scale_bits, sizeof scale);                                                      \
        NAME((const float *)w[0], w[1], (const ELEMENT *)w[2], (const ELEMENT *)w[3], (const int32_t *)w[4], w[5], \
             (const int32_t *)w[6], (const int32_t *)w[7], (const int64_t *)w[8], w[9], counters, wait, w[10], \
             w[11], w[12], w[13], scale, w[15], w[16], (float *)w[17] + thread * w[18], (float *)w[19]);  \
        return 0;                                                                                       \
    }                                                                                                   \
    int64_t NAME##_task_words(void) { return 20; }                                                      \
    const char *NAME##_task_words_signature(void) { return ":i"; }
ATTENTION_TASK(paged_attention_f32, float)
ATTENTION_TASK(paged_attention_bf16, uint16_t)
ATTENTION_TASK(paged_attention_f16, uint16_t)
ATTENTION_TASK(paged_attention_i8, int8_t)
ATTENTION_TASK(paged_attention_f8, uint8_t)
#undef ATTENTION_TASK

/* 1 where rows over a bfloat16 cache take the bfloat16 dot product (their query and weights rounded to bfloat16), 0
 * where every row is computed in float32. */
int64_t paged_attention_bf16_dot(void)
{
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}
const char *paged_attention_bf16_dot_signature(void) { return ":i"; }

/* The argument types of paged_attention_f32, _bf16, _f16, _i8 and _f8, as kernels/native.py checks them
 * before any call: p a pointer, i an int64_t, f a float; after the colon the result (v: none). */
const char *paged_attention_f32_signature(void) { return "pipppipppipiiiiifiipp:v"; }
const char *paged_attention_bf16_signature(void) { return "pipppipppipiiiiifiipp:v"; }
const char *paged_attention_f16_signature(void) { return "pipppipppipiiiiifiipp:v"; }
const char *paged_attention_i8_signature(void) { return "pipppipppipiiiiifiipp:v"; }
const char *paged_attention_f8_signature(void) { return "pipppipppipiiiiifiipp:v"; }
