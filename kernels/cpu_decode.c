/* Paged decode attention on the CPU: one query row per sequence, read straight from the pages.

   A work item is (decode row, kv head): its q heads (the GQA group) are scaled into fp32 once, then
   the row's visible keys [first_position, seq_len) are read in tiles of TILE keys through the block
   table, converted to fp32 where the page holds another dtype, and folded into an online softmax
   (running max, running sum, output accumulator per q head). The last position is read from the
   step's own rows when they are given (in flight: not stored yet), and with `store_slots` the item then
   stores them into their slot (slot -1: not stored). Items run in parallel on torch's
   OpenMP pool (the library loads torch's libgomp, so no second pool spins beside it).

   The loops are vectorizable without -ffast-math: independent lanes, fixed reduction trees, exp as a
   polynomial (within 1 ulp of the C library's expf on [-87, 0]). With AVX2 the scores of 8 keys share
   one horizontal reduction; output sums stay in registers over a tile.

   Element formats: 0 fp32, 1 bf16 (upper half of an fp32), 2 any other 16-bit and 3 any 8-bit
   format, both read through a lookup table of their 65,536 or 256 values. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32
#define LANES 8

enum { FORMAT_F32 = 0, FORMAT_BF16 = 1, FORMAT_LUT16 = 2, FORMAT_LUT8 = 3 };

typedef struct {
    const char *data;
    int64_t block_stride; /* elements */
    int64_t token_stride;
    int64_t head_stride;
} Pages;

/* exp(x), clamped to [-87, 88]: Cephes' expf (range reduction by ln 2 in two parts, a degree-6
   polynomial), vectorizable; within 1 ulp of the C library's expf on [-87, 0] (measured). */
static inline void exp_tile(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i];
        v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
        float k = v * 1.44269504088896341f;
        k = (k + 12582912.0f) - 12582912.0f; /* round to nearest */
        float r = v - k * 0.693359375f + k * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[i] = p * scale;
    }
}

/* cap * tanh(x / cap), through exp: tanh(y) = 1 - 2 / (exp(2y) + 1) (absolute error about cap * 1e-7). */
static inline void softcap_tile(float *x, int n, float cap) {
    float twice[TILE];
    for (int i = 0; i < n; i++) twice[i] = 2.0f * x[i] / cap;
    exp_tile(twice, n);
    for (int i = 0; i < n; i++) x[i] = cap * (1.0f - 2.0f / (twice[i] + 1.0f));
}

/* a . b over n elements in LANES independent partial sums (vectorized, no -ffast-math needed). */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) part[i] += a[d + i] * b[d + i];
    /* A fixed tree, three adds deep: the reduction's latency, not its order, limits a dot this short. */
    float sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

/* `count` elements of a 16- or 8-bit `format` at `src` as fp32 at `dst`. */
static inline void to_float(const char *src, int format, const float *lut, int count, float *dst) {
    if (format == FORMAT_BF16) {
        const uint16_t *bits = (const uint16_t *)src;
        for (int i = 0; i < count; i++) {
            uint32_t word = (uint32_t)bits[i] << 16;
            memcpy(dst + i, &word, sizeof word);
        }
    } else if (format == FORMAT_LUT16) {
        const uint16_t *bits = (const uint16_t *)src;
        for (int i = 0; i < count; i++) dst[i] = lut[bits[i]];
    } else {
        const uint8_t *bits = (const uint8_t *)src;
        for (int i = 0; i < count; i++) dst[i] = lut[bits[i]];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The lane sums of eight vectors, in order: two rounds of pairwise adds, then the halves. */
static inline __m256 sum_lanes_of_8(const __m256 *sums) {
    const __m256 pairs01 = _mm256_hadd_ps(sums[0], sums[1]), pairs23 = _mm256_hadd_ps(sums[2], sums[3]);
    const __m256 pairs45 = _mm256_hadd_ps(sums[4], sums[5]), pairs67 = _mm256_hadd_ps(sums[6], sums[7]);
    const __m256 quads0123 = _mm256_hadd_ps(pairs01, pairs23), quads4567 = _mm256_hadd_ps(pairs45, pairs67);
    return _mm256_add_ps(_mm256_permute2f128_ps(quads0123, quads4567, 0x20),
                         _mm256_permute2f128_ps(quads0123, quads4567, 0x31));
}
#endif

/* scores[j] = q_row . key_ptrs[j] for a tile's keys. With AVX2, eight keys at a time, their lane sums
   reduced together (a dot this short is mostly its horizontal sum); a last partial group of eight
   reads the tile's first key again and drops those scores. */
static inline void tile_scores(const float *q_row, const float *const *key_ptrs, int count, int head_dim,
                               float *scores) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0) {
        for (; j < count; j += 8) {
            __m256 sums[8];
            const float *keys[8];
            for (int k = 0; k < 8; k++) {
                sums[k] = _mm256_setzero_ps();
                keys[k] = key_ptrs[j + k < count ? j + k : 0];
            }
            for (int d = 0; d < head_dim; d += 8) {
                const __m256 q = _mm256_loadu_ps(q_row + d);
                for (int k = 0; k < 8; k++) sums[k] = _mm256_fmadd_ps(q, _mm256_loadu_ps(keys[k] + d), sums[k]);
            }
            float all[8];
            _mm256_storeu_ps(all, sum_lanes_of_8(sums));
            for (int k = 0; k < 8 && j + k < count; k++) scores[j + k] = all[k];
        }
        return;
    }
#endif
    for (; j < count; j++) scores[j] = dot(q_row, key_ptrs[j], head_dim);
}

/* The largest of a tile's TILE scores and `start`, in LANES running maxima (exact in any order). */
static inline float max_of_tile(const float *scores, float start) {
    float lanes[LANES];
    for (int i = 0; i < LANES; i++) lanes[i] = start;
    for (int j = 0; j < TILE; j += LANES)
        for (int i = 0; i < LANES; i++) lanes[i] = scores[j + i] > lanes[i] ? scores[j + i] : lanes[i];
    float result = lanes[0];
    for (int i = 1; i < LANES; i++) result = lanes[i] > result ? lanes[i] : result;
    return result;
}

/* The sum of a tile's first `count` weights, in LANES partial sums added as a fixed tree. */
static inline float sum_of_tile(const float *weights, int count) {
    float part[LANES] = {0};
    int j = 0;
    for (; j + LANES <= count; j += LANES)
        for (int i = 0; i < LANES; i++) part[i] += weights[j + i];
    float sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
    for (; j < count; j++) sum += weights[j];
    return sum;
}

/* out_row += sum_j weights[j] * value_ptrs[j], 8 lanes at a time in register accumulators (up to 8 of
   them per pass over the tile): the sum over a tile's keys is a chain of multiply-adds, and kept in
   memory each link would wait for the previous store. */
typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4)));

#define DEFINE_ADD_WEIGHTED(CHUNKS)                                                                           \
    static void add_weighted_##CHUNKS(float *out, const float *weights, const float *const *value_ptrs,      \
                                      int count, int offset) {                                               \
        lanes8 sums[CHUNKS];                                                                                 \
        for (int c = 0; c < CHUNKS; c++) sums[c] = *(const lanes8_unaligned *)(out + offset + 8 * c);        \
        for (int j = 0; j < count; j++) {                                                                    \
            const float weight = weights[j];                                                                 \
            const float *value = value_ptrs[j] + offset;                                                     \
            for (int c = 0; c < CHUNKS; c++) sums[c] += weight * *(const lanes8_unaligned *)(value + 8 * c); \
        }                                                                                                    \
        for (int c = 0; c < CHUNKS; c++) *(lanes8_unaligned *)(out + offset + 8 * c) = sums[c];              \
    }
DEFINE_ADD_WEIGHTED(1)
DEFINE_ADD_WEIGHTED(2)
DEFINE_ADD_WEIGHTED(4)
DEFINE_ADD_WEIGHTED(8)

static inline void add_weighted_values(float *out, const float *weights, const float *const *value_ptrs, int count,
                                       int value_dim) {
    int offset = 0;
    for (; offset + 64 <= value_dim; offset += 64) add_weighted_8(out, weights, value_ptrs, count, offset);
    if (offset + 32 <= value_dim) add_weighted_4(out, weights, value_ptrs, count, offset), offset += 32;
    if (offset + 16 <= value_dim) add_weighted_2(out, weights, value_ptrs, count, offset), offset += 16;
    if (offset + 8 <= value_dim) add_weighted_1(out, weights, value_ptrs, count, offset), offset += 8;
    for (; offset < value_dim; offset++)
        for (int j = 0; j < count; j++) out[offset] += weights[j] * value_ptrs[j][offset];
}

/* A tile of `count` keys folded into the group's online softmax: scores, running max and sum, output. */
static inline __attribute__((always_inline)) void fold_tile(int group, int head_dim, int value_dim, const float *q,
                                                            const float *const *key_ptrs, const float *const *value_ptrs,
                                                            int count, float softcap, float *row_max, float *row_sum,
                                                            float *acc) {
    float scores[TILE];
    for (int g = 0; g < group; g++) {
        const float *q_row = q + g * head_dim;
        tile_scores(q_row, key_ptrs, count, head_dim, scores);
        if (softcap > 0.0f) softcap_tile(scores, count, softcap);
        for (int j = count; j < TILE; j++) scores[j] = -INFINITY; /* exp gives 0: unused keys weigh nothing */
        const float tile_max = max_of_tile(scores, row_max[g]);
        float *out_row = acc + g * value_dim;
        if (tile_max > row_max[g]) {
            const float correction = row_max[g] == -INFINITY ? 0.0f : expf(row_max[g] - tile_max);
            row_sum[g] *= correction;
            for (int d = 0; d < value_dim; d++) out_row[d] *= correction;
            row_max[g] = tile_max;
        }
        for (int j = 0; j < count; j++) scores[j] -= row_max[g];
        exp_tile(scores, count);
        row_sum[g] += sum_of_tile(scores, count);
        add_weighted_values(out_row, scores, value_ptrs, count, value_dim);
    }
}

/* Returns 0, or 1 if a GQA group's rows are too large for the stack buffers (the caller takes the torch
   path). */
int hybridkv_paged_decode(
    int64_t num_rows, const int32_t *seq_ids, const int32_t *rows, const int32_t *first_positions,
    const int32_t *seq_lens,
    const float *query, int64_t query_row_stride, int64_t query_head_stride,
    float *out, int64_t out_row_stride, int64_t out_head_stride,
    const char *key_cache, int64_t key_block_stride, int64_t key_token_stride, int64_t key_head_stride,
    const char *value_cache, int64_t value_block_stride, int64_t value_token_stride, int64_t value_head_stride,
    const int32_t *block_table, int64_t table_width,
    const char *key_rows, int64_t key_row_stride, int64_t key_row_head_stride,
    const char *value_rows, int64_t value_row_stride, int64_t value_row_head_stride,
    const int64_t *store_slots, int format, int element_size, const float *lut,
    int num_q_heads, int num_kv_heads, int head_dim, int value_dim, int block_size,
    float scale, float v_scale, float softcap, const float *sinks, int num_threads, int64_t work) {
    const int group = num_q_heads / num_kv_heads;
    if ((int64_t)group * (head_dim + value_dim + 2) + (int64_t)TILE * (head_dim + value_dim) > 65536) return 1;
    const Pages keys = {key_cache, key_block_stride, key_token_stride, key_head_stride};
    const Pages values = {value_cache, value_block_stride, value_token_stride, value_head_stride};
    const int64_t num_items = num_rows * num_kv_heads;
    const int parallel = num_threads > 1 && work >= 65536;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (parallel)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t index = item / num_kv_heads;
        const int kv_head = (int)(item % num_kv_heads);
        const int64_t seq = seq_ids[index], row = rows[index];
        const int64_t first = first_positions[index], seq_len = seq_lens[index];
        const int64_t cached_end = key_rows ? seq_len - 1 : seq_len;
        const int32_t *table = block_table + seq * table_width;
        /* q: the group's rows, scaled; a tile's keys and values as fp32 where the page holds another
           format (fp32 pages are read in place, through key_ptrs and value_ptrs). */
        float q[group * head_dim], acc[group * value_dim], row_max[group], row_sum[group];
        float keys_f32[TILE * head_dim], values_f32[TILE * value_dim];
        const float *key_ptrs[TILE], *value_ptrs[TILE];
        for (int g = 0; g < group; g++) {
            const float *src = query + row * query_row_stride + (int64_t)(kv_head * group + g) * query_head_stride;
            for (int d = 0; d < head_dim; d++) q[g * head_dim + d] = src[d] * scale;
            row_max[g] = sinks ? sinks[kv_head * group + g] : -INFINITY;
            row_sum[g] = sinks ? 1.0f : 0.0f;
        }
        memset(acc, 0, sizeof acc);
        for (int64_t tile_start = first; tile_start < seq_len; tile_start += TILE) {
            const int count = seq_len - tile_start < TILE ? (int)(seq_len - tile_start) : TILE;
            int64_t block = tile_start / block_size, offset = tile_start - block * block_size;
            for (int j = 0; j < count; j++, offset++) {
                if (offset == block_size) block++, offset = 0;
                const char *key_src, *value_src;
                if (tile_start + j < cached_end) {
                    const int64_t block_id = table[block];
                    key_src = keys.data + (block_id * keys.block_stride + offset * keys.token_stride +
                                           kv_head * keys.head_stride) * element_size;
                    value_src = values.data + (block_id * values.block_stride + offset * values.token_stride +
                                               kv_head * values.head_stride) * element_size;
                } else {
                    key_src = key_rows + (row * key_row_stride + kv_head * key_row_head_stride) * element_size;
                    value_src = value_rows + (row * value_row_stride + kv_head * value_row_head_stride) * element_size;
                }
                if (format == FORMAT_F32) {
                    key_ptrs[j] = (const float *)key_src;
                    value_ptrs[j] = (const float *)value_src;
                } else {
                    to_float(key_src, format, lut, head_dim, keys_f32 + j * head_dim);
                    key_ptrs[j] = keys_f32 + j * head_dim;
                    to_float(value_src, format, lut, value_dim, values_f32 + j * value_dim);
                    value_ptrs[j] = values_f32 + j * value_dim;
                }
            }
            /* The next tile's blocks, requested now: each block is a fresh memory stream, and the pages of
               a step's rows are rarely in cache (the model's weights have just gone through it). */
            for (int64_t position = tile_start + TILE; position < tile_start + 2 * TILE && position < cached_end;
                 position += block_size - position % block_size) {
                const int64_t block_id = table[position / block_size];
                const int64_t offset = position % block_size;
                const int64_t last = (position / block_size + 1) * block_size;
                const int tokens = (int)((last < cached_end ? last : cached_end) - position);
                for (int t = 0; t < tokens; t++) {
                    const char *key_src = keys.data + (block_id * keys.block_stride + (offset + t) * keys.token_stride +
                                                       kv_head * keys.head_stride) * element_size;
                    const char *value_src = values.data + (block_id * values.block_stride +
                                                           (offset + t) * values.token_stride +
                                                           kv_head * values.head_stride) * element_size;
                    for (int byte = 0; byte < head_dim * element_size; byte += 64) __builtin_prefetch(key_src + byte);
                    for (int byte = 0; byte < value_dim * element_size; byte += 64) __builtin_prefetch(value_src + byte);
                }
            }
            fold_tile(group, head_dim, value_dim, q, key_ptrs, value_ptrs, count, softcap, row_max, row_sum, acc);
        }
        for (int g = 0; g < group; g++) {
            float *dst = out + row * out_row_stride + (int64_t)(kv_head * group + g) * out_head_stride;
            const float normalizer = v_scale / row_sum[g];
            for (int d = 0; d < value_dim; d++) dst[d] = acc[g * value_dim + d] * normalizer;
        }
        /* The row's own K/V into its slot, after this item's reads: no other item reads this head's slot
           (a block a step writes is held by this sequence alone). */
        if (store_slots && key_rows && store_slots[row] >= 0) {
            const int64_t slot = store_slots[row], block = slot / block_size, offset = slot - block * block_size;
            memcpy((char *)keys.data +
                       (block * keys.block_stride + offset * keys.token_stride + kv_head * keys.head_stride) *
                           element_size,
                   key_rows + (row * key_row_stride + kv_head * key_row_head_stride) * element_size,
                   (size_t)head_dim * element_size);
            memcpy((char *)values.data + (block * values.block_stride + offset * values.token_stride +
                                          kv_head * values.head_stride) * element_size,
                   value_rows + (row * value_row_stride + kv_head * value_row_head_stride) * element_size,
                   (size_t)value_dim * element_size);
        }
    }
    return 0;
}
