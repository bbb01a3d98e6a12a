/* Decode attention over the paged KV pool, one query token per sequence, fp32 or bf16 (q, pools and out all of one
 * dtype; bf16 values are widened to fp32 as they are loaded and every sum is fp32, as in oneDNN's bf16 kernels).
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
#include <string.h>

/* bf16 is the top half of an fp32: widening is a shift, which the compiler vectorises. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a q, K or V array: `bf16` is a constant at every call site, so each variant compiles to plain loads. */
static inline __attribute__((always_inline)) float load(const void *base, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 consecutive q, K or V elements as fp32. */
static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* Lane i of the result is the sum of v[i]'s 16 lanes: a transposing tree of adds, about 2 instructions per vector
 * where reducing each vector alone takes 8. */
static inline __attribute__((always_inline)) __m512 sum16(__m512 v[16]) {
    __m512 w[8], u[4], z[2];
    for (int i = 0; i < 8; i++) w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                                      _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(w[2 * i]), y = _mm512_castps_pd(w[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp(x) for x <= 0 (softmax after the max is subtracted): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial
 * for e^r, then 2^n by scalef; within 2 ulp of expf, and 0 below about -87. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 e = _mm512_set1_ps(1.38888889e-3f);
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(8.33333333e-3f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(4.16666667e-2f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.66666667e-1f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}

/* attend_one with AVX-512, for head_dim a multiple of 32 (a constant at each call site). Both passes stream the
 * K and V rows block by block, in position order, and go head by head within a block (its rows stay in L1): the QK
 * pass reduces 16 positions' dot products at once, and the V pass loads and stores a head's fp32 output once per
 * block rather than once per position. With AVX512-BF16 the bf16 QK products are `vdpbf16ps` (pairs of bf16
 * multiplied and summed into fp32, no widening). `inv_sums` is scratch for one float per head. */
static inline __attribute__((always_inline)) void attend_one_avx512(
    const void *q_row, const void *k_pool, const void *v_pool, const int32_t *table, int32_t len, float *o,
    float *scores, int32_t max_len, float *inv_sums, int32_t num_heads, int32_t num_kv_heads, const int32_t head_dim,
    int32_t block_size, float scale, const int bf16) {
    enum { MAX_VECS = 8 }; /* head_dim <= 128 */
    const int32_t group = num_heads / num_kv_heads, vecs = head_dim / 16;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;

    /* scores[h * max_len + p] = scale * q_h . k_p */
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const int64_t k_block = (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        for (int32_t r0 = 0; r0 < rows; r0 += 16) {
            const int32_t n = rows - r0 < 16 ? rows - r0 : 16;
            for (int32_t h = 0; h < num_heads; h++) {
                const int64_t q_head = (int64_t)h * head_dim, k_head = k_block + (int64_t)(h / group) * head_dim;
                __m512 acc[16];
#if defined(__AVX512BF16__)
                if (bf16) {
                    __m512bh qb[MAX_VECS / 2];
                    for (int j = 0; j < vecs / 2; j++)
                        qb[j] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q_row + q_head + 32 * j);
                    for (int32_t i = 0; i < 16; i++) {
                        acc[i] = _mm512_setzero_ps();
                        if (i >= n) continue;
                        const uint16_t *k = (const uint16_t *)k_pool + k_head + (int64_t)(r0 + i) * slot_stride;
                        for (int j = 0; j < vecs / 2; j++)
                            acc[i] = _mm512_dpbf16_ps(acc[i], qb[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
                    }
                } else
#endif
                {
                    __m512 qv[MAX_VECS];
                    for (int j = 0; j < vecs; j++) qv[j] = load16(q_row, q_head + 16 * j, bf16);
                    for (int32_t i = 0; i < 16; i++) {
                        acc[i] = _mm512_setzero_ps();
                        if (i >= n) continue;
                        const int64_t k = k_head + (int64_t)(r0 + i) * slot_stride;
                        for (int j = 0; j < vecs; j++)
                            acc[i] = _mm512_fmadd_ps(qv[j], load16(k_pool, k + 16 * j, bf16), acc[i]);
                    }
                }
                _mm512_mask_storeu_ps(scores + (int64_t)h * max_len + p0 + r0, (__mmask16)((1u << n) - 1u),
                                      _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
            }
        }
    }

    /* softmax per head, 16 positions at a time (the tail under a mask); the 1 / sum is applied to the output */
    for (int32_t h = 0; h < num_heads; h++) {
        float *row = scores + (int64_t)h * max_len;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int32_t p = 0; p < len; p += 16) {
            const __mmask16 m = len - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - p)) - 1u);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + p));
        }
        const __m512 top_all = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int32_t p = 0; p < len; p += 16) {
            const __mmask16 m = len - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - p)) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + p), top_all)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(row + p, m, e);
        }
        inv_sums[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }

    /* o_h = sum_p w_hp v_p / sum_p w_hp, streaming V rows block by block like K */
    for (int32_t i = 0; i < num_heads * head_dim; i++) o[i] = 0.0f;
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const int64_t v_block = (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        for (int32_t h = 0; h < num_heads; h++) {
            const int64_t v_head = v_block + (int64_t)(h / group) * head_dim;
            const float *w = scores + (int64_t)h * max_len + p0;
            float *o_head = o + (int64_t)h * head_dim;
            __m512 out[MAX_VECS];
            for (int j = 0; j < vecs; j++) out[j] = _mm512_loadu_ps(o_head + 16 * j);
            for (int32_t r = 0; r < rows; r++) {
                const __m512 w_r = _mm512_set1_ps(w[r]);
                const int64_t v = v_head + (int64_t)r * slot_stride;
                for (int j = 0; j < vecs; j++) out[j] = _mm512_fmadd_ps(w_r, load16(v_pool, v + 16 * j, bf16), out[j]);
            }
            for (int j = 0; j < vecs; j++) _mm512_storeu_ps(o_head + 16 * j, out[j]);
        }
    }
    for (int32_t h = 0; h < num_heads; h++) {
        const __m512 inv = _mm512_set1_ps(inv_sums[h]);
        float *o_head = o + (int64_t)h * head_dim;
        for (int j = 0; j < vecs; j++) _mm512_storeu_ps(o_head + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(o_head + 16 * j), inv));
    }
}
#endif

/* One sequence. Always inlined into the three call sites below, so for the common head sizes (64, 128) head_dim is
 * a constant and the compiler unrolls the per-head loops. Both passes read K and V rows whole, in position order:
 * an earlier V pass went head by head, reading every V row in num_heads strided pieces, and a batch-64 decode step
 * was slower for it (`overlap bench engine`; the runs are in docs/engine.md). */
static inline __attribute__((always_inline)) void attend_one(const void *q_row, const void *k_pool,
                                                             const void *v_pool, const int32_t *table, int32_t len,
                                                             float *o, float *scores, int32_t max_len,
                                                             float *q_scaled, int32_t num_heads, int32_t num_kv_heads,
                                                             const int32_t head_dim, int32_t block_size, float scale,
                                                             const int bf16) {
    const int32_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    for (int32_t i = 0; i < num_heads * head_dim; i++) q_scaled[i] = load(q_row, i, bf16) * scale;

    /* scores[h * max_len + p] = q_h . k_p, streaming K rows in position order (each row holds every KV head) */
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const int64_t k_block = (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        for (int32_t r = 0; r < rows; r++) {
            const int64_t k_row = k_block + (int64_t)r * slot_stride;
            for (int32_t h = 0; h < num_heads; h++) {
                const int64_t k_head = k_row + (int64_t)(h / group) * head_dim;
                const float *q_head = q_scaled + (int64_t)h * head_dim;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int32_t d = 0; d < head_dim; d++) acc += q_head[d] * load(k_pool, k_head + d, bf16);
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
        const int64_t v_block = (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        for (int32_t r = 0; r < rows; r++) {
            const int64_t v_row = v_block + (int64_t)r * slot_stride;
            for (int32_t h = 0; h < num_heads; h++) {
                const int64_t v_head = v_row + (int64_t)(h / group) * head_dim;
                const float w_p = scores[(int64_t)h * max_len + p0 + r];
                float *o_head = o + (int64_t)h * head_dim;
#pragma omp simd
                for (int32_t d = 0; d < head_dim; d++) o_head[d] += w_p * load(v_pool, v_head + d, bf16);
            }
        }
    }
}

/* Sequences [seq_begin, seq_end). In bf16 each sequence's output is summed in fp32 scratch, then rounded once. */
static inline __attribute__((always_inline)) int decode_attention(
    const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool, const int32_t *block_tables,
    const int32_t *table_starts, const int32_t *ctx_lens, const int32_t *q_rows, void *out, int64_t out_row_stride,
    int32_t seq_begin, int32_t seq_end, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    float scale, const int bf16) {
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t width = (size_t)num_heads * head_dim;
    int32_t max_len = 1;
    for (int32_t s = seq_begin; s < seq_end; s++)
        if (ctx_lens[s] > max_len) max_len = ctx_lens[s];
    /* scratch: one row of attention weights per query head, the scaled query, and (bf16) the fp32 output */
    float *scores = malloc(sizeof(float) * ((size_t)num_heads * max_len + 2 * width + num_heads));
    if (scores == NULL) return -1;
    float *q_scaled = scores + (size_t)num_heads * max_len;
    float *o_f32 = q_scaled + width;
#if defined(__AVX512F__)
    float *inv_sums = o_f32 + width;
#endif

    for (int32_t s = seq_begin; s < seq_end; s++) {
        const char *q_row = (const char *)q + (int64_t)q_rows[s] * q_row_stride * elem;
        char *out_row = (char *)out + (int64_t)q_rows[s] * out_row_stride * elem;
        float *o = bf16 ? o_f32 : (float *)out_row;
        const int32_t *table = block_tables + table_starts[s];
        const int32_t len = ctx_lens[s];
#if defined(__AVX512F__)
        if (head_dim == 64) {
            attend_one_avx512(q_row, k_pool, v_pool, table, len, o, scores, max_len, inv_sums, num_heads,
                              num_kv_heads, 64, block_size, scale, bf16);
        } else if (head_dim == 128) {
            attend_one_avx512(q_row, k_pool, v_pool, table, len, o, scores, max_len, inv_sums, num_heads,
                              num_kv_heads, 128, block_size, scale, bf16);
        } else
#endif
        if (head_dim == 64)
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads, 64,
                       block_size, scale, bf16);
        else if (head_dim == 128)
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads, 128,
                       block_size, scale, bf16);
        else
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads,
                       head_dim, block_size, scale, bf16);
        if (bf16)
            for (size_t i = 0; i < width; i++) ((uint16_t *)out_row)[i] = f32_to_bf16(o_f32[i]);
    }
    free(scores);
    return 0;
}

int overlap_paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                                   const int32_t *block_tables, const int32_t *table_starts, const int32_t *ctx_lens,
                                   const int32_t *q_rows, float *out, int64_t out_row_stride, int32_t seq_begin,
                                   int32_t seq_end, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                                   int32_t block_size, float scale) {
    return decode_attention(q, q_row_stride, k_pool, v_pool, block_tables, table_starts, ctx_lens, q_rows, out,
                            out_row_stride, seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale,
                            0);
}

/* The same with q, the pools and out in bf16 (uint16_t bit patterns); strides count elements, as above. */
int overlap_paged_decode_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_pool,
                                        const uint16_t *v_pool, const int32_t *block_tables,
                                        const int32_t *table_starts, const int32_t *ctx_lens, const int32_t *q_rows,
                                        uint16_t *out, int64_t out_row_stride, int32_t seq_begin, int32_t seq_end,
                                        int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                                        float scale) {
    return decode_attention(q, q_row_stride, k_pool, v_pool, block_tables, table_starts, ctx_lens, q_rows, out,
                            out_row_stride, seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale,
                            1);
}
