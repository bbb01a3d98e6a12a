/* Decode attention over the paged KV pool, one query token per sequence, fp32 or bf16 (q, pools and out all of one
 * dtype; every sum is fp32, as in oneDNN's bf16 kernels). In bf16 the softmax is computed in fp32 and its weights
 * are rounded to bf16 before they multiply V, as transformers casts its fp32 softmax to the value dtype; the output
 * is rounded once at the end.
 *
 * Built on first use by engine/src/overlap/engine/model/native.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes. The sequences of a call are shared among OpenMP threads, torch's own (the library names libgomp.so.1, which
 * resolves to the copy torch has loaded), with no Python thread in the way. One call covers a layer's decodes, where
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
 * Query heads h share KV head h / (num_heads / num_kv_heads) (grouped-query attention). A softcap > 0 (Gemma 2)
 * caps each scaled score s at softcap * tanh(s / softcap) before the softmax, as transformers does. `sinks` (gpt-oss),
 * where not NULL, holds one learned logit per query head that joins each head's softmax denominator and nothing else:
 * weights exp(s_p - m) / (sum_p exp(s_p - m) + exp(sink - m)), m the largest of the scores and the sink, as
 * transformers' eager attention computes them.
 *
 * Returns 0, or -1 when scratch memory cannot be allocated (the caller then raises).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "bf16.h"

/* Gemma 2's soft-capping of the attention logits, in place over each head's scores row: s -> cap * tanh(s / cap).
 * Scalar tanhf: only soft-capped models pay for it, once per score. */
static inline __attribute__((always_inline)) void softcap_scores(float *scores, int32_t num_heads, int32_t max_len,
                                                                 int32_t len, float softcap) {
    if (softcap <= 0.0f) return;
    for (int32_t h = 0; h < num_heads; h++)
        for (int32_t p = 0; p < len; p++) {
            float *s = scores + (int64_t)h * max_len + p;
            *s = softcap * tanhf(*s / softcap);
        }
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

/* Each lane rounded to the nearest bf16 (ties to even) and widened back; for finite values (softmax weights). */
static inline __attribute__((always_inline)) __m512 round16_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
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

/* Prefetch share `share` of `shares` of the next block's `bytes` at `base` into L1: the passes spread it over the
 * current block's heads, so its lines arrive while this block computes. */
static inline __attribute__((always_inline)) void prefetch_share(const void *base, int64_t bytes, int32_t share,
                                                                 int32_t shares) {
    const int64_t lines = (bytes + 63) / 64, from = lines * share / shares, to = lines * (share + 1) / shares;
    for (int64_t i = from; i < to; i++) _mm_prefetch((const char *)base + 64 * i, _MM_HINT_T0);
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

#if defined(__AVX512BF16__)
/* Query heads one V pass takes together: their fp32 outputs (head_dim / 16 registers each) stay in registers beside one
 * interleaved row pair of V, within the 32 AVX-512 registers. */
enum { MAX_V_HEADS = 6 };
#define V_HEADS(head_dim) ((head_dim) <= 64 ? MAX_V_HEADS : 3)

/* The V pass of N query heads sharing one KV head over one block's rows, bf16 pairs (see attend_one_avx512):
 * o[n] += sum over pairs (p, p + 1) of the weights' pair times V rows p and p + 1 interleaved. unpacklo/hi of rows r
 * and r + 1 pair up their elements within each 128-bit lane, so out[2j] holds dims 32j + 8l + 0..3 and out[2j + 1]
 * dims 32j + 8l + 4..7 in lane l: the caller puts them back in order at the end. */
static inline __attribute__((always_inline)) void v_pass_heads(const int N, const int vecs, const uint16_t *v_rows,
                                                               int64_t slot_stride, int32_t rows,
                                                               const uint16_t *w_pairs, int64_t weights_stride,
                                                               float *o, int32_t head_dim) {
    enum { MAX_VECS = 8 };
    __m512 out[MAX_V_HEADS][MAX_VECS];
    for (int n = 0; n < N; n++)
        for (int j = 0; j < vecs; j++) out[n][j] = _mm512_loadu_ps(o + n * head_dim + 16 * j);
    for (int32_t r = 0; r < rows; r += 2) {
        const uint16_t *a = v_rows + (int64_t)r * slot_stride;
        __m512bh u[MAX_VECS];
        for (int j = 0; j < vecs / 2; j++) {
            const __m512i x = _mm512_loadu_si512(a + 32 * j);
            /* an odd last row pairs with zeros: the slot past it may hold anything, even a NaN */
            const __m512i y = r + 1 < rows ? _mm512_loadu_si512(a + slot_stride + 32 * j) : _mm512_setzero_si512();
            u[2 * j] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            u[2 * j + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int n = 0; n < N; n++) {
            uint32_t w2;
            memcpy(&w2, w_pairs + n * weights_stride + r, sizeof w2);
            const __m512bh w_r = (__m512bh)_mm512_set1_epi32((int32_t)w2);
            for (int j = 0; j < vecs; j++) out[n][j] = _mm512_dpbf16_ps(out[n][j], w_r, u[j]);
        }
    }
    for (int n = 0; n < N; n++)
        for (int j = 0; j < vecs; j++) _mm512_storeu_ps(o + n * head_dim + 16 * j, out[n][j]);
}

/* v_pass_heads with N a constant per call, so its loops unroll into registers. */
static inline __attribute__((always_inline)) void v_pass_pairs_heads(int N, const int vecs, const uint16_t *v_rows,
                                                                     int64_t slot_stride, int32_t rows,
                                                                     const uint16_t *w_pairs, int64_t weights_stride,
                                                                     float *o, int32_t head_dim) {
    switch (N) {
    case 1: v_pass_heads(1, vecs, v_rows, slot_stride, rows, w_pairs, weights_stride, o, head_dim); break;
    case 2: v_pass_heads(2, vecs, v_rows, slot_stride, rows, w_pairs, weights_stride, o, head_dim); break;
    case 3: v_pass_heads(3, vecs, v_rows, slot_stride, rows, w_pairs, weights_stride, o, head_dim); break;
    case 4: v_pass_heads(4, vecs, v_rows, slot_stride, rows, w_pairs, weights_stride, o, head_dim); break;
    case 5: v_pass_heads(5, vecs, v_rows, slot_stride, rows, w_pairs, weights_stride, o, head_dim); break;
    default: v_pass_heads(MAX_V_HEADS, vecs, v_rows, slot_stride, rows, w_pairs, weights_stride, o, head_dim); break;
    }
}
#endif

/* attend_one with AVX-512, for head_dim a multiple of 32 (a constant at each call site). Both passes stream the
 * K and V rows block by block, in position order, and go head by head within a block (its rows stay in L1): the QK
 * pass reduces 16 positions' dot products at once, and the V pass loads and stores a head's fp32 output once per
 * block rather than once per position. With AVX512-BF16 the bf16 QK products are `vdpbf16ps` (pairs of bf16
 * multiplied and summed into fp32, no widening), and so are the V pass's (below). `inv_sums` is scratch for one float
 * per head, `weights` for the bf16 attention weights (num_heads rows of round_up(max_len, 16)). */
static inline __attribute__((always_inline)) void attend_one_avx512(
    const void *q_row, const void *k_pool, const void *v_pool, const int32_t *table, int32_t len, float *o,
    float *scores, int32_t max_len, float *inv_sums, uint16_t *weights, int32_t num_heads, int32_t num_kv_heads,
    const int32_t head_dim, int32_t block_size, float scale, float softcap, const float *sinks, const int bf16) {
    enum { MAX_VECS = 8 }; /* head_dim <= 128 */
    const int32_t group = num_heads / num_kv_heads, vecs = head_dim / 16;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t weights_stride = ((int64_t)max_len + 15) / 16 * 16;
#if defined(__AVX512BF16__)
    /* The V pass multiplies bf16 pairs: the weights of positions (p, p + 1) against their two V rows interleaved. A
     * pair never straddles two blocks when the block size is even (it always is in the runner; odd sizes widen). */
    const int pairs = bf16 && block_size % 2 == 0;
#else
    const int pairs = 0;
    (void)weights_stride;
#endif

    /* scores[h * max_len + p] = scale * q_h . k_p */
    const size_t elem = bf16 ? 2 : 4;
    /* Prefetch the next block where a block computes long enough for it to land and it fits in L1 beside this one:
     * blocks of at most 16 KiB, or any block whose KV heads serve several query heads (each line is used `group`
     * times). With one query head per KV head and larger blocks the hardware prefetcher keeps up and the software
     * one only evicts: measured in docs/engine.md, 3-30% slower there, 8-100% faster elsewhere. */
    const int prefetch = group > 1 || (int64_t)block_size * slot_stride * elem <= 16384;
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const int64_t k_block = (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        /* what the next block reads: the next K block, or after the last one V's first */
        const int32_t next_p0 = p0 + block_size < len ? p0 + block_size : 0;
        const void *next = (const char *)(next_p0 ? k_pool : v_pool) +
                           (int64_t)table[next_p0 / block_size] * block_size * slot_stride * elem;
        const int64_t next_bytes =
            prefetch ? (len - next_p0 < block_size ? len - next_p0 : block_size) * slot_stride * elem : 0;
        const int32_t shares = (rows + 15) / 16 * num_heads;
        for (int32_t r0 = 0; r0 < rows; r0 += 16) {
            const int32_t n = rows - r0 < 16 ? rows - r0 : 16;
            for (int32_t h = 0; h < num_heads; h++) {
                prefetch_share(next, next_bytes, r0 / 16 * num_heads + h, shares);
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

    softcap_scores(scores, num_heads, max_len, len, softcap);
    /* softmax per head, 16 positions at a time (the tail under a mask); the 1 / sum is applied to the output */
    for (int32_t h = 0; h < num_heads; h++) {
        float *row = scores + (int64_t)h * max_len;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int32_t p = 0; p < len; p += 16) {
            const __mmask16 m = len - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - p)) - 1u);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + p));
        }
        float top_h = _mm512_reduce_max_ps(top);
        if (sinks && sinks[h] > top_h) top_h = sinks[h];
        const __m512 top_all = _mm512_set1_ps(top_h);
        __m512 sum = _mm512_setzero_ps();
        for (int32_t p = 0; p < len; p += 16) {
            const __mmask16 m = len - p >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - p)) - 1u);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + p), top_all)));
            sum = _mm512_add_ps(sum, e);
#if defined(__AVX512BF16__)
            if (pairs) { /* the V pass reads only these bf16 weights (the conversion rounds to nearest even) */
                _mm256_storeu_si256((__m256i *)(weights + h * weights_stride + p), (__m256i)_mm512_cvtneps_pbh(e));
                continue;
            }
#endif
            if (bf16) e = round16_bf16(e);
            _mm512_mask_storeu_ps(row + p, m, e);
        }
        inv_sums[h] = 1.0f / (_mm512_reduce_add_ps(sum) + (sinks ? expf(sinks[h] - top_h) : 0.0f));
    }

    /* o_h = sum_p w_hp v_p / sum_p w_hp, streaming V rows block by block like K */
    for (int32_t i = 0; i < num_heads * head_dim; i++) o[i] = 0.0f;
    for (int32_t p0 = 0; p0 < len; p0 += block_size) {
        const int64_t v_block = (int64_t)table[p0 / block_size] * block_size * slot_stride;
        const int32_t rows = len - p0 < block_size ? len - p0 : block_size;
        const int32_t next_p0 = p0 + block_size;
        const void *next = (const char *)v_pool +
                           (next_p0 < len ? (int64_t)table[next_p0 / block_size] * block_size * slot_stride * elem : 0);
        const int64_t next_bytes = next_p0 >= len || !prefetch
                                       ? 0
                                       : (len - next_p0 < block_size ? len - next_p0 : block_size) * slot_stride * elem;
#if defined(__AVX512BF16__)
        if (pairs) {
            /* The heads of a KV group in runs of up to V_HEADS: each V row pair is loaded and interleaved once per
             * run rather than once per head. */
            const int32_t most = V_HEADS(head_dim);
            for (int32_t h0 = 0; h0 < num_heads;) {
                const int32_t group_end = (h0 / group + 1) * group, n = group_end - h0 < most ? group_end - h0 : most;
                for (int32_t h = h0; h < h0 + n; h++) prefetch_share(next, next_bytes, h, num_heads);
                const uint16_t *v_rows = (const uint16_t *)v_pool + v_block + (int64_t)(h0 / group) * head_dim;
                v_pass_pairs_heads(n, head_dim / 16, v_rows, slot_stride, rows, weights + h0 * weights_stride + p0,
                                   weights_stride, o + (int64_t)h0 * head_dim, head_dim);
                h0 += n;
            }
            continue;
        }
#endif
        for (int32_t h = 0; h < num_heads; h++) {
            prefetch_share(next, next_bytes, h, num_heads);
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
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int32_t h = 0; h < num_heads; h++) {
        const __m512 inv = _mm512_set1_ps(inv_sums[h]);
        float *o_head = o + (int64_t)h * head_dim;
        if (pairs) {
            for (int j = 0; j < vecs / 2; j++) {
                const __m512 x = _mm512_loadu_ps(o_head + 32 * j), y = _mm512_loadu_ps(o_head + 32 * j + 16);
                _mm512_storeu_ps(o_head + 32 * j, _mm512_mul_ps(_mm512_permutex2var_ps(x, first, y), inv));
                _mm512_storeu_ps(o_head + 32 * j + 16, _mm512_mul_ps(_mm512_permutex2var_ps(x, second, y), inv));
            }
            continue;
        }
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
                                                             float softcap, const float *sinks, const int bf16) {
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

    softcap_scores(scores, num_heads, max_len, len, softcap);
    /* softmax per head */
    for (int32_t h = 0; h < num_heads; h++) {
        float *row = scores + (int64_t)h * max_len;
        float top = row[0];
        for (int32_t p = 1; p < len; p++) top = row[p] > top ? row[p] : top;
        if (sinks && sinks[h] > top) top = sinks[h];
        float sum = sinks ? expf(sinks[h] - top) : 0.0f;
        for (int32_t p = 0; p < len; p++) {
            row[p] = expf(row[p] - top);
            sum += row[p];
        }
        const float inv_sum = 1.0f / sum;
        for (int32_t p = 0; p < len; p++) row[p] = (bf16 ? bf16_to_f32(f32_to_bf16(row[p])) : row[p]) * inv_sum;
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

/* Sequences [seq_begin, seq_end), shared among `threads` OpenMP threads a sequence at a time (contexts differ, so
 * a static split would leave one thread waiting). In bf16 each sequence's output is summed in fp32 scratch, then
 * rounded once. */
static inline __attribute__((always_inline)) int decode_attention(
    const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool, const int32_t *block_tables,
    const int32_t *table_starts, const int32_t *ctx_lens, const int32_t *q_rows, void *out, int64_t out_row_stride,
    int32_t seq_begin, int32_t seq_end, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    float scale, float softcap, const float *sinks, int32_t threads, const int bf16) {
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const size_t width = (size_t)num_heads * head_dim;
    int32_t max_len = 1;
    for (int32_t s = seq_begin; s < seq_end; s++)
        if (ctx_lens[s] > max_len) max_len = ctx_lens[s];
    if (threads > seq_end - seq_begin) threads = seq_end - seq_begin;
    if (threads < 1) threads = 1;
    /* scratch per thread: one row of attention weights per query head, the scaled query, and (bf16) the fp32 output;
     * whole cache lines, so no two threads write one */
    const size_t weights_floats = (size_t)num_heads * ((max_len + 15) / 16 * 16) / 2;
    const size_t scratch = ((size_t)num_heads * max_len + 2 * width + num_heads + weights_floats + 15) / 16 * 16;
    float *all_scratch = aligned_alloc(64, sizeof(float) * scratch * threads);
    if (all_scratch == NULL) return -1;

#pragma omp parallel num_threads(threads)
    {
#if defined(_OPENMP)
    float *scores = all_scratch + scratch * omp_get_thread_num();
#else
    float *scores = all_scratch;
#endif
    float *q_scaled = scores + (size_t)num_heads * max_len;
    float *o_f32 = q_scaled + width;
#if defined(__AVX512F__)
    float *inv_sums = o_f32 + width;
    uint16_t *weights = (uint16_t *)(inv_sums + num_heads);
#endif

#pragma omp for schedule(dynamic, 1)
    for (int32_t s = seq_begin; s < seq_end; s++) {
        const char *q_row = (const char *)q + (int64_t)q_rows[s] * q_row_stride * elem;
        char *out_row = (char *)out + (int64_t)q_rows[s] * out_row_stride * elem;
        float *o = bf16 ? o_f32 : (float *)out_row;
        const int32_t *table = block_tables + table_starts[s];
        const int32_t len = ctx_lens[s];
#if defined(__AVX512F__)
        if (head_dim == 64) {
            attend_one_avx512(q_row, k_pool, v_pool, table, len, o, scores, max_len, inv_sums, weights,
                              num_heads, num_kv_heads, 64, block_size, scale, softcap, sinks, bf16);
        } else if (head_dim == 128) {
            attend_one_avx512(q_row, k_pool, v_pool, table, len, o, scores, max_len, inv_sums, weights,
                              num_heads, num_kv_heads, 128, block_size, scale, softcap, sinks, bf16);
        } else
#endif
        if (head_dim == 64)
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads, 64,
                       block_size, scale, softcap, sinks, bf16);
        else if (head_dim == 128)
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads, 128,
                       block_size, scale, softcap, sinks, bf16);
        else
            attend_one(q_row, k_pool, v_pool, table, len, o, scores, max_len, q_scaled, num_heads, num_kv_heads,
                       head_dim, block_size, scale, softcap, sinks, bf16);
        if (bf16)
            for (size_t i = 0; i < width; i++) ((uint16_t *)out_row)[i] = f32_to_bf16(o_f32[i]);
    }
    }
    free(all_scratch);
    return 0;
}

int overlap_paged_decode_attention(const float *q, int64_t q_row_stride, const float *k_pool, const float *v_pool,
                                   const int32_t *block_tables, const int32_t *table_starts, const int32_t *ctx_lens,
                                   const int32_t *q_rows, float *out, int64_t out_row_stride, int32_t seq_begin,
                                   int32_t seq_end, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                                   int32_t block_size, float scale, float softcap, const float *sinks,
                                   int32_t threads) {
    return decode_attention(q, q_row_stride, k_pool, v_pool, block_tables, table_starts, ctx_lens, q_rows, out,
                            out_row_stride, seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale,
                            softcap, sinks, threads, 0);
}

/* The same with q, the pools and out in bf16 (uint16_t bit patterns; `sinks` fp32); strides count elements, as above. */
int overlap_paged_decode_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_pool,
                                        const uint16_t *v_pool, const int32_t *block_tables,
                                        const int32_t *table_starts, const int32_t *ctx_lens, const int32_t *q_rows,
                                        uint16_t *out, int64_t out_row_stride, int32_t seq_begin, int32_t seq_end,
                                        int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                                        float scale, float softcap, const float *sinks, int32_t threads) {
    return decode_attention(q, q_row_stride, k_pool, v_pool, block_tables, table_starts, ctx_lens, q_rows, out,
                            out_row_stride, seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale,
                            softcap, sinks, threads, 1);
}
