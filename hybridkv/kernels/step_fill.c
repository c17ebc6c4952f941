/* A step's slot mapping and block-table rows, written into the step buffers in one call (step_buffers.py).

   The numpy path does the same in about ten array operations. Each of those costs tens of microseconds once a
   forward has evicted numpy's code from the caches, where this loop over a few hundred entries costs a few.

   For every group g of one block size: the query rows of sequence s (query_lens[s] of them, in order) read
   table row rows[s]; row t at `positions[t]` is stored at slot entry * block_size + position % block_size of
   the entry at its block, or nowhere (-1) where that entry is the null block (0) or a block read here and
   stored elsewhere this step (-id); the step's table row s is the first block_width entries of the table
   row, each as a block id (|entry|). A row or position outside the tables (num_rows rows of row_stride
   entries) stops it and returns 1, the buffers part written: the caller raises before the step runs. */

#include <stdint.h>

int hybridkv_step_fill(const int32_t *groups, int64_t num_groups, int64_t num_rows, int64_t row_stride,
                       const int64_t *rows, const int64_t *query_lens, int64_t num_seqs, const int64_t *positions,
                       int64_t block_size, int64_t block_width, int64_t *slots, int64_t slots_group_stride,
                       int32_t *tables, int64_t tables_group_stride, int64_t tables_row_stride) {
    const int64_t group_stride = num_rows * row_stride;
    for (int64_t g = 0; g < num_groups; g++) {
        const int32_t *group = groups + g * group_stride;
        int64_t *group_slots = slots + g * slots_group_stride;
        int32_t *group_tables = tables + g * tables_group_stride;
        int64_t t = 0;
        for (int64_t s = 0; s < num_seqs; s++) {
            if (rows[s] < 0 || rows[s] >= num_rows) return 1;
            const int32_t *row = group + rows[s] * row_stride;
            for (int64_t j = 0; j < query_lens[s]; j++, t++) {
                int64_t position = positions[t];
                if (position < 0 || position / block_size >= row_stride) return 1;
                int32_t entry = row[position / block_size];
                group_slots[t] = entry > 0 ? (int64_t)entry * block_size + position % block_size : -1;
            }
            int32_t *out = group_tables + s * tables_row_stride;
            for (int64_t b = 0; b < block_width; b++) out[b] = row[b] < 0 ? -row[b] : row[b];
        }
    }
    return 0;
}
