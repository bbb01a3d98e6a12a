/* Decode attention over the paged KV pool, fp32, one query token per sequence.
 *
 * Built on first use by engine/src/overlap/engine/model/native.py (cc -O3 -march=native) and called through ctypes, which releases the GIL,
 * so the runner's two Python threads can each run a share of the sequences. One call covers a layer's decodes, where
 * torch's per-sequence ops cost ~5 kernel launches per sequence and layer, while the work itself only has to stream
 * each sequence's K/V rows once (`overlap bench engine`: paged decode went from 23% slower than a contiguous cache
 * read by one batched SDPA to 27% faster at batch 64).
 *
 * Layouts (the runner's, see runner.py):
 *   q         row r, head h at q[r * q_row_stride + h * head_dim]
 *   k/v pool  [num_slots, num_kv_heads, head_dim] contiguous; slot = block_table[pos / block_size] * block_size
 *             + pos % block_size
 *   out       row r, head h at out[r * out_row_stride + h * head_dim]
 * Sequence s (seq_begin <= s < seq_end) reads its query from row q_rows[s], attends to positions 0 .. ctx_lens[s]-1
 * through the blocks block_tables[table_starts[s] ...], and writes its output to row q_rows[s].
 * Query heads h share KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 *
 * Returns 0, or -1 when scratch memory cannot be allocated (the caller then raises).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One sequence. Always inlined into the three call sites below, so for the common head sizes (64, 128) head_dim is
 * a constant and the compiler unrolls the per-head loops. Both passes read K and V rows whole, in position order:
 * an earlier V pass went head by head, reading every V row in num_heads strided pieces, and a batch-64 decode step
 * was slower for it (`overlap bench engine`; the runs are in docs/engine.md). */
static inline __attribute__((always_inline)) void attend_one(const float *q_row, const float *k_pool,
                                                             const float *v_pool, const int32_t *table, int32_t len,
                                                             float *o, float *scores, int32_t max_len,
                                                             float *q_scaled, int32_t num_heads, int32_t num_kv_heads,
                                                             const int32_t head_dim, int32_t block_size, float scale) {
    const int32_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    for (int32_t i = 0; i < num_heads * head_dim; i++) q_scaled[i] = q_row[i] * scale;

    /* scores[h * max_len + p] = q_h . k_p, streaming K rows in position order (each row holds every KV head) */
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const float *k_block = k_pool + (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        for (int32_t r = 0; r < rows; r++) {
            const float *k_row = k_block + (int64_t)r * slot_stride;
            for (int32_t h = 0; h < num_heads; h++) {
                const float *k_head = k_row + (int64_t)(h / group) * head_dim;
                const float *q_head = q_scaled + (int64_t)h * head_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int32_t d = 0; d < head_dim; d++) acc += q_head[d] * k_head[d];
                scores[(int64_t)h * max_len + p0 + r] = acc;
            }
        }
    }

    /* softmax per head */
    for (int32_t h = 0; h < num_heads; h++) {
        float *row = scores + (int64_t)h * max_len;
        float top = row[0];
        for (int32_t p = 1; p < len; p++) top = row[p] > top ? row[p] : top;
        float sum = 0.0f;
        for (int32_t p = 0; p < len; p++) {
            row[p] = expf(row[p] - top);
            sum += row[p];
        }
        const float inv_sum = 1.0f / sum;
        for (int32_t p = 0; p < len; p++) row[p] *= inv_sum;
    }

    /* o_h = sum_p w_hp v_p, streaming V rows in position order like K: every head's accumulator lives in `o`
     * (num_heads * head_dim floats, L1-resident), so each V row is read once, front to back */
    for (int32_t i = 0; i < num_heads * head_dim; i++) o[i] = 0.0f;
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const float *v_block = v_pool + (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        for (int32_t r = 0; r < rows; r++) {
            const float *v_row = v_block + (int64_t)r * slot_stride;
            for (int32_t h = 0; h < num_heads; h++) {
                const float *v_head = v_row + (int64_t)(h / group) * head_dim;
                const float w_p = scores[(int64_t)h * max_len + p0 + r];
                float *o_head = o + (int64_t)h * head_dim;
#pragma omp simd
                for (int32_t d = 0; d < head_dim; d++) o_head[d] += w_p * v_head[d];
            }
        }
    }
}

int overlap_paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                                   const int32_t *block_tables, const int32_t *table_starts, const int32_t *ctx_lens,
                                   const int32_t *q_rows, float *out, int64_t out_row_stride, int32_t seq_begin,
                                   int32_t seq_end, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                                   int32_t block_size, float scale) {
    int32_t max_len = 1;
    for (int32_t s = seq_begin; s < seq_end; s++)
        if (ctx_lens[s] > max_len) max_len = ctx_lens[s];
    /* scratch: one row of attention weights per query head, then the scaled query */
    float *scores = malloc(sizeof(float) * ((size_t)num_heads * max_len + (size_t)num_heads * head_dim));
    if (scores == NULL) return -1;
    float *q_scaled = scores + (size_t)num_heads * max_len;

    for (int32_t s = seq_begin; s < seq_end; s++) {
        const float *q_row = q + (int64_t)q_rows[s] * q_row_stride;
        float *o = out + (int64_t)q_rows[s] * out_row_stride;
        const int32_t *table = block_tables + table_starts[s];
        const int32_t len = ctx_lens[s];
        if (head_dim == 64)
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads, 64,
                       block_size, scale);
        else if (head_dim == 128)
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads, 128,
                       block_size, scale);
        else
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads,
                       head_dim, block_size, scale);
    }
    free(scores);
    return 0;
}
