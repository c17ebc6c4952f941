/* Paged decode attention on the CPU: one query row per sequence, read straight from the pages.

   A work item is (decode row, kv head): its q heads (the GQA group) are scaled into fp32 once, then
   the row's visible keys [first_position, seq_len) are read in tiles of TILE keys through the block
   table, converted to fp32 where the page holds another dtype, and folded into an online softmax
   (running max, running sum, output accumulator per q head). The last position is read from the
   step's own rows when they are given (in flight: not stored yet), and with `store_slots` the item then
   stores them into their slot (slot -1: not stored); with `store_first` every row is stored before any is
   read instead (the rows of a short chunk read the chunk's earlier keys from the pages). Items run in
   parallel on torch's OpenMP pool (the library loads torch's libgomp, so no second pool spins beside it).

   The loops are vectorizable without -ffast-math: independent lanes, fixed reduction trees, exp as a
   polynomial (within 1 ulp of the C library's expf on [-87, 0]). With AVX2 the scores of 8 keys share
   one horizontal reduction. The weighted values of a tile are summed for several q heads of the group
   in one pass, in register sums (each value chunk loaded once for them all, and enough independent
   sums that the adder's latency never waits). A tile's key addresses are laid out per run of tokens of
   one block; a row's kv heads go to one thread together (they share the pages' cache lines), unless
   one row holds so much of the work that the threads could not share it evenly.

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

/* acc[h] += sum_j weights[h][j] * value_ptrs[j] for a GQA group's q heads h, 8 lanes at a time, in register
   accumulators: HEADS q heads by CHUNKS chunks of 8 lanes per pass over the tile's keys. Each value
   chunk is loaded once for all HEADS heads, and the HEADS * CHUNKS accumulators are independent chains
   of multiply-adds (one chain per chunk would wait on the adder's latency at every key). */
typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4)));

#if defined(__AVX512F__)
#define ACCUMULATORS 16 /* 32 vector registers: 16 sums, the chunks and the weights fit */
#else
#define ACCUMULATORS 8
#endif

#define DEFINE_ADD_WEIGHTED(HEADS, CHUNKS)                                                                    \
    static void add_weighted_##HEADS##x##CHUNKS(float *acc, int value_dim, const float *weights,             \
                                                const float *const *value_ptrs, int count, int offset) {    \
        lanes8 sums[HEADS][CHUNKS];                                                                          \
        for (int h = 0; h < HEADS; h++)                                                                      \
            for (int c = 0; c < CHUNKS; c++)                                                                 \
                sums[h][c] = *(const lanes8_unaligned *)(acc + h * value_dim + offset + 8 * c);              \
        for (int j = 0; j < count; j++) {                                                                    \
            const float *value = value_ptrs[j] + offset;                                                     \
            lanes8 chunk[CHUNKS];                                                                            \
            for (int c = 0; c < CHUNKS; c++) chunk[c] = *(const lanes8_unaligned *)(value + 8 * c);          \
            for (int h = 0; h < HEADS; h++) {                                                                \
                const float weight = weights[h * TILE + j];                                                  \
                for (int c = 0; c < CHUNKS; c++) sums[h][c] += weight * chunk[c];                            \
            }                                                                                                \
        }                                                                                                    \
        for (int h = 0; h < HEADS; h++)                                                                      \
            for (int c = 0; c < CHUNKS; c++)                                                                 \
                *(lanes8_unaligned *)(acc + h * value_dim + offset + 8 * c) = sums[h][c];                    \
    }
DEFINE_ADD_WEIGHTED(1, 1)
DEFINE_ADD_WEIGHTED(1, 2)
DEFINE_ADD_WEIGHTED(1, 4)
DEFINE_ADD_WEIGHTED(1, 8)
DEFINE_ADD_WEIGHTED(2, 1)
DEFINE_ADD_WEIGHTED(2, 2)
DEFINE_ADD_WEIGHTED(2, 4)
DEFINE_ADD_WEIGHTED(4, 1)
DEFINE_ADD_WEIGHTED(4, 2)
#if ACCUMULATORS >= 16
DEFINE_ADD_WEIGHTED(2, 8)
DEFINE_ADD_WEIGHTED(4, 4)
#endif

typedef void (*AddWeighted)(float *, int, const float *, const float *const *, int, int);

/* The pass for `heads` (1, 2 or 4) q heads by `chunks` (1, 2, 4 or 8) chunks, at most ACCUMULATORS sums. */
static AddWeighted add_weighted_pass(int heads, int chunks) {
    static const AddWeighted passes[3][4] = {
        {add_weighted_1x1, add_weighted_1x2, add_weighted_1x4, add_weighted_1x8},
        {add_weighted_2x1, add_weighted_2x2, add_weighted_2x4,
#if ACCUMULATORS >= 16
         add_weighted_2x8
#else
         0
#endif
        },
        {add_weighted_4x1, add_weighted_4x2,
#if ACCUMULATORS >= 16
         add_weighted_4x4,
#else
         0,
#endif
         0},
    };
    return passes[heads == 4 ? 2 : heads - 1][chunks == 8 ? 3 : chunks == 4 ? 2 : chunks - 1];
}

/* acc[h] += sum_j weights[h * TILE + j] * value_ptrs[j] for the group's `group` q heads. */
static inline void add_weighted_values(float *acc, int group, const float *weights, const float *const *value_ptrs,
                                       int count, int value_dim) {
    int offset = 0;
    while (offset + 8 <= value_dim) {
        const int left = (value_dim - offset) / 8;
        const int chunks = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const int most_heads = ACCUMULATORS / chunks;
        for (int h = 0; h < group;) {
            int heads = group - h;
            heads = heads > most_heads ? most_heads : heads;
            heads = heads >= 4 ? 4 : heads >= 2 ? 2 : 1;
            add_weighted_pass(heads, chunks)(acc + h * value_dim, value_dim, weights + h * TILE, value_ptrs, count,
                                             offset);
            h += heads;
        }
        offset += 8 * chunks;
    }
    for (; offset < value_dim; offset++)
        for (int h = 0; h < group; h++)
            for (int j = 0; j < count; j++) acc[h * value_dim + offset] += weights[h * TILE + j] * value_ptrs[j][offset];
}

/* A tile of `count` keys folded into the group's online softmax: each q head's scores, running max and
   sum (its output rescaled where the max grows), then the weighted values of all the group's heads. */
static inline __attribute__((always_inline)) void fold_tile(int group, int head_dim, int value_dim, const float *q,
                                                            const float *const *key_ptrs, const float *const *value_ptrs,
                                                            int count, float softcap, float *row_max, float *row_sum,
                                                            float *acc, float *weights) {
    for (int g = 0; g < group; g++) {
        float *scores = weights + g * TILE;
        tile_scores(q + g * head_dim, key_ptrs, count, head_dim, scores);
        if (softcap > 0.0f) softcap_tile(scores, count, softcap);
        for (int j = count; j < TILE; j++) scores[j] = -INFINITY; /* exp gives 0: unused keys weigh nothing */
        const float tile_max = max_of_tile(scores, row_max[g]);
        if (tile_max > row_max[g]) {
            const float correction = row_max[g] == -INFINITY ? 0.0f : expf(row_max[g] - tile_max);
            float *out_row = acc + g * value_dim;
            row_sum[g] *= correction;
            for (int d = 0; d < value_dim; d++) out_row[d] *= correction;
            row_max[g] = tile_max;
        }
        for (int j = 0; j < count; j++) scores[j] -= row_max[g];
        exp_tile(scores, count);
        row_sum[g] += sum_of_tile(scores, count);
    }
    add_weighted_values(acc, group, weights, value_ptrs, count, value_dim);
}

/* The positions from `position` up to `end` that share its block end at the returned position; `key_src` and
   `value_src` get the first one's key and value for `kv_head` (the next are a token stride apart). */
static inline int64_t block_run(const Pages *keys, const Pages *values, const int32_t *table, int64_t position,
                                int64_t end, int block_size, int kv_head, int element_size, const char **key_src,
                                const char **value_src) {
    const int64_t block = position / block_size, offset = position - block * block_size;
    const int64_t block_id = table[block];
    *key_src = keys->data +
               (block_id * keys->block_stride + offset * keys->token_stride + kv_head * keys->head_stride) * element_size;
    *value_src = values->data + (block_id * values->block_stride + offset * values->token_stride +
                                 kv_head * values->head_stride) * element_size;
    const int64_t block_end = position - offset + block_size;
    return block_end < end ? block_end : end;
}

/* One kv head of the step's row `row` into its slot `store_slots[row]` (none where it is -1). */
static void store_row(const Pages *keys, const Pages *values, const char *key_rows, const char *value_rows,
                      int64_t key_row_stride, int64_t key_row_head_stride, int64_t value_row_stride,
                      int64_t value_row_head_stride, const int64_t *store_slots, int64_t row, int kv_head,
                      int block_size, int key_bytes, int value_bytes, int element_size) {
    const int64_t slot = store_slots[row];
    if (slot < 0) return;
    const int64_t block = slot / block_size, offset = slot - block * block_size;
    memcpy((char *)keys->data +
               (block * keys->block_stride + offset * keys->token_stride + kv_head * keys->head_stride) * element_size,
           key_rows + (row * key_row_stride + kv_head * key_row_head_stride) * element_size, (size_t)key_bytes);
    memcpy((char *)values->data +
               (block * values->block_stride + offset * values->token_stride + kv_head * values->head_stride) *
                   element_size,
           value_rows + (row * value_row_stride + kv_head * value_row_head_stride) * element_size,
           (size_t)value_bytes);
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
    const int64_t *store_slots, int store_first, int format, int element_size, const float *lut,
    int num_q_heads, int num_kv_heads, int head_dim, int value_dim, int block_size,
    float scale, float v_scale, float softcap, const float *sinks, int num_threads, int64_t work) {
    const int group = num_q_heads / num_kv_heads;
    if ((int64_t)group * (head_dim + value_dim + 2 + TILE) + (int64_t)TILE * (head_dim + value_dim) > 65536) return 1;
    const Pages keys = {key_cache, key_block_stride, key_token_stride, key_head_stride};
    const Pages values = {value_cache, value_block_stride, value_token_stride, value_head_stride};
    const int64_t num_items = num_rows * num_kv_heads;
    const int parallel = num_threads > 1 && work >= 65536;
    const int64_t key_token_bytes = key_token_stride * element_size, value_token_bytes = value_token_stride * element_size;
    const int key_bytes = head_dim * element_size, value_bytes = value_dim * element_size;

    /* A row's kv heads share its pages' cache lines (and the hardware's prefetches of them): one thread takes
       them together, unless one row holds too much of the work for the threads to share it evenly. */
    int64_t total_keys = 0, longest = 0;
    for (int64_t index = 0; index < num_rows; index++) {
        const int64_t keys = seq_lens[index] - first_positions[index];
        total_keys += keys;
        longest = keys > longest ? keys : longest;
    }
    const int64_t chunk = longest * 2 * num_threads <= total_keys ? num_kv_heads : 1;
    if (store_slots && key_rows && store_first) { /* every row stored, then none after its item's reads */
        for (int64_t index = 0; index < num_rows; index++)
            for (int kv_head = 0; kv_head < num_kv_heads; kv_head++)
                store_row(&keys, &values, key_rows, value_rows, key_row_stride, key_row_head_stride, value_row_stride,
                          value_row_head_stride, store_slots, rows[index], kv_head, block_size, key_bytes,
                          value_bytes, element_size);
        store_slots = NULL;
    }
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads) if (parallel)
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
        float keys_f32[TILE * head_dim], values_f32[TILE * value_dim], weights[group * TILE];
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
            /* The tile's keys and values: runs of consecutive tokens of one block, then the row's own (in flight). */
            const int64_t tile_end = tile_start + count, stored_end = tile_end < cached_end ? tile_end : cached_end;
            const char *key_srcs[TILE], *value_srcs[TILE];
            int j = 0;
            for (int64_t position = tile_start; position < stored_end;) {
                const char *key_src, *value_src;
                const int64_t run_end = block_run(&keys, &values, table, position, stored_end, block_size, kv_head,
                                                  element_size, &key_src, &value_src);
                for (; position < run_end; position++, j++) {
                    key_srcs[j] = key_src, value_srcs[j] = value_src;
                    key_src += key_token_bytes, value_src += value_token_bytes;
                }
            }
            if (j < count) { /* the last position, read from the step's own rows */
                key_srcs[j] = key_rows + (row * key_row_stride + kv_head * key_row_head_stride) * element_size;
                value_srcs[j] = value_rows + (row * value_row_stride + kv_head * value_row_head_stride) * element_size;
            }
            if (format == FORMAT_F32) {
                for (j = 0; j < count; j++) {
                    key_ptrs[j] = (const float *)key_srcs[j];
                    value_ptrs[j] = (const float *)value_srcs[j];
                }
            } else {
                for (j = 0; j < count; j++) {
                    to_float(key_srcs[j], format, lut, head_dim, keys_f32 + j * head_dim);
                    key_ptrs[j] = keys_f32 + j * head_dim;
                    to_float(value_srcs[j], format, lut, value_dim, values_f32 + j * value_dim);
                    value_ptrs[j] = values_f32 + j * value_dim;
                }
            }
            /* The next tile's blocks, requested now: each block is a fresh memory stream, and the pages of
               a step's rows are rarely in cache (the model's weights have just gone through it). */
            const int64_t next_end = tile_end + TILE < cached_end ? tile_end + TILE : cached_end;
            for (int64_t position = tile_end; position < next_end;) {
                const char *key_src, *value_src;
                const int64_t run_end = block_run(&keys, &values, table, position, next_end, block_size, kv_head,
                                                  element_size, &key_src, &value_src);
                for (; position < run_end; position++) {
                    for (int byte = 0; byte < key_bytes; byte += 64) __builtin_prefetch(key_src + byte);
                    for (int byte = 0; byte < value_bytes; byte += 64) __builtin_prefetch(value_src + byte);
                    key_src += key_token_bytes, value_src += value_token_bytes;
                }
            }
            fold_tile(group, head_dim, value_dim, q, key_ptrs, value_ptrs, count, softcap, row_max, row_sum, acc, weights);
        }
        for (int g = 0; g < group; g++) {
            float *dst = out + row * out_row_stride + (int64_t)(kv_head * group + g) * out_head_stride;
            const float normalizer = v_scale / row_sum[g];
            for (int d = 0; d < value_dim; d++) dst[d] = acc[g * value_dim + d] * normalizer;
        }
        /* The row's own K/V into its slot, after this item's reads: no other item reads this head's slot
           (a block a step writes is held by this sequence alone). */
        if (store_slots && key_rows)
            store_row(&keys, &values, key_rows, value_rows, key_row_stride, key_row_head_stride, value_row_stride,
                      value_row_head_stride, store_slots, row, kv_head, block_size, key_bytes, value_bytes,
                      element_size);
    }
    return 0;
}
