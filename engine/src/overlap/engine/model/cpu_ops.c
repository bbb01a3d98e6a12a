/* Small ops on CPU, fp32 or bf16, each one call over all of a step's rows: a decoder layer's RMSNorm, and RoPE
 * together with the K/V write into the paged pool; the sampler's greedy argmax; silu(gate) * up where a gated MLP's
 * gate and up are one matmul (quantized weights: oneDNN fuses SiLU into a float matmul, not into these). torch runs
 * the first two as several kernels each (RMSNorm ~8: pow, mean, add, rsqrt, mul, mul and, in bf16, the conversions
 * to fp32 and back; RoPE a cat, a mul and an addcmul, then one index_copy_ per pool), and at decode batch sizes their
 * fixed costs exceed the work; its CPU argmax does not vectorise (a [64, 8192] argmax takes ten times an amax). Sums
 * and products are fp32; each output is rounded once.
 *
 * Built with paged_attention.c into one library by native.py (cc -O3 -march=native; the loops are written for the
 * compiler to vectorise) and called through ctypes, which releases the GIL.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline __attribute__((always_inline)) void rms_norm(const void *x, int64_t x_stride, const void *weight,
                                                           void *out, int64_t out_stride, int32_t rows,
                                                           int32_t hidden, float eps, const int bf16,
                                                           const int weight_bf16) {
    for (int32_t r = 0; r < rows; r++) {
        const int64_t in_row = (int64_t)r * x_stride, out_row = (int64_t)r * out_stride;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int32_t i = 0; i < hidden; i++) {
            const float v = load(x, in_row + i, bf16);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int32_t i = 0; i < hidden; i++)
            store(out, out_row + i, load(x, in_row + i, bf16) * inv * load(weight, i, weight_bf16), bf16);
    }
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for rows 0 .. rows - 1 (torch's rms_norm); strides count
 * elements. The weight is x's dtype, or fp32 beside bf16 rows (Gemma's 1 + w, kept in fp32 as transformers adds
 * it). */
void overlap_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t out_stride,
                      int32_t rows, int32_t hidden, float eps, int32_t bf16, int32_t weight_bf16) {
    if (bf16 && weight_bf16)
        rms_norm(x, x_stride, weight, out, out_stride, rows, hidden, eps, 1, 1);
    else if (bf16)
        rms_norm(x, x_stride, weight, out, out_stride, rows, hidden, eps, 1, 0);
    else
        rms_norm(x, x_stride, weight, out, out_stride, rows, hidden, eps, 0, 0);
}

static inline __attribute__((always_inline)) void rope_store_kv(
    void *qkv, int64_t row_stride, const int64_t *positions, const void *cos, const void *sin_signed,
    const int64_t *slots, void *k_pool, void *v_pool, int32_t tokens, int32_t heads, int32_t kv_heads,
    int32_t head_dim, const int bf16) {
    const int32_t half = head_dim / 2;
    const int64_t slot_width = (int64_t)kv_heads * head_dim;
    float x[head_dim];
    for (int32_t t = 0; t < tokens; t++) {
        const int64_t row = (int64_t)t * row_stride, table = positions[t] * head_dim;
        const int64_t slot = slots[t] * slot_width;
        for (int32_t h = 0; h < heads + kv_heads; h++) {
            const int64_t at = row + (int64_t)h * head_dim;
#pragma omp simd
            for (int32_t d = 0; d < head_dim; d++) x[d] = load(qkv, at + d, bf16);
            /* x cos + rotate_half(x) sin: rotate_half swaps the halves, its sign is folded into sin_signed */
#pragma omp simd
            for (int32_t d = 0; d < half; d++)
                x[d] = x[d] * load(cos, table + d, bf16) + load(qkv, at + half + d, bf16) * load(sin_signed, table + d, bf16);
#pragma omp simd
            for (int32_t d = half; d < head_dim; d++)
                x[d] = x[d] * load(cos, table + d, bf16) + load(qkv, at + d - half, bf16) * load(sin_signed, table + d, bf16);
            const int64_t k_at = slot + (int64_t)(h - heads) * head_dim;
#pragma omp simd
            for (int32_t d = 0; d < head_dim; d++) {
                store(qkv, at + d, x[d], bf16);
                if (h >= heads) store(k_pool, k_at + d, x[d], bf16);
            }
        }
        const int64_t v_at = row + (int64_t)(heads + kv_heads) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < slot_width; i++) store(v_pool, slot + i, load(qkv, v_at + i, bf16), bf16);
    }
}

/* For each token t of a step: RoPE on its q and k heads in place in its qkv row (rotate-half form: x cos +
 * rotate_half(x) sin, the tables [positions, head_dim] with sin's first half negated), then its rotated K heads and
 * its V heads into slot slots[t] of the pools ([slots, kv_heads, head_dim]). A row holds heads q heads, kv_heads k
 * heads, kv_heads v heads, head_dim each; rows are row_stride elements apart. */
void overlap_rope_store_kv(void *qkv, int64_t row_stride, const int64_t *positions, const void *cos,
                           const void *sin_signed, const int64_t *slots, void *k_pool, void *v_pool, int32_t tokens,
                           int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t bf16) {
    if (bf16)
        rope_store_kv(qkv, row_stride, positions, cos, sin_signed, slots, k_pool, v_pool, tokens, heads, kv_heads,
                      head_dim, 1);
    else
        rope_store_kv(qkv, row_stride, positions, cos, sin_signed, slots, k_pool, v_pool, tokens, heads, kv_heads,
                      head_dim, 0);
}

/* The index of a row's largest value, the first one on ties, as torch.argmax: a NaN counts as the largest (the first
 * NaN's index), and a row of -inf gives 0. */
static inline __attribute__((always_inline)) int64_t argmax_row(const void *row, int32_t cols, const int bf16) {
    float top = -INFINITY;
    int32_t nans = 0;
#pragma omp simd reduction(max : top) reduction(+ : nans)
    for (int32_t i = 0; i < cols; i++) {
        const float v = load(row, i, bf16);
        top = v > top ? v : top;
        nans += v != v;
    }
    int32_t i = 0;
    if (nans)
        while (load(row, i, bf16) == load(row, i, bf16)) i++;
    else
        while (i < cols - 1 && load(row, i, bf16) != top) i++;
    return i;
}

/* out[r] = argmax of row r, rows of `cols` fp32 or bf16 values (bf16 widens exactly: the same index), rows_stride
 * apart, the rows shared among `threads` OpenMP threads. */
void overlap_argmax_rows(const void *x, int64_t row_stride, int32_t rows, int32_t cols, int64_t *out, int32_t bf16,
                         int32_t threads) {
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int32_t r = 0; r < rows; r++) {
        const void *row = (const char *)x + (int64_t)r * row_stride * elem;
        out[r] = bf16 ? argmax_row(row, cols, 1) : argmax_row(row, cols, 0);
    }
}

/* exp(x) for fp32 x in plain arithmetic that the compiler vectorises (libm's expf is a call per element): x = n ln2
 * + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, 2^(n - 1) built in the exponent bits and doubled
 * (2^128 has none). Within 2 ulp of expf up to its overflow to inf at 88.7; below -86 it gives e^-86 (no
 * subnormals). */
static inline __attribute__((always_inline)) float exp_vec(float x) {
    x = x < -86.0f ? -86.0f : x > 89.0f ? 89.0f : x; /* a NaN stays NaN */
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 126) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * 2.0f;
}

static inline __attribute__((always_inline)) void silu_mul_row(const void *gate_up, int64_t row, void *out,
                                                               int64_t out_row, int32_t inter, const int bf16) {
#pragma omp simd
    for (int32_t i = 0; i < inter; i++) {
        const float g = load(gate_up, row + i, bf16);
        store(out, out_row + i, g / (1.0f + exp_vec(-g)) * load(gate_up, row + inter + i, bf16), bf16);
    }
}

/* out[r][i] = silu(x[r][i]) * x[r][inter + i] for rows of x = [gate | up] (a gated MLP's one matmul), row_stride
 * apart; out [rows][inter] contiguous, rounded once (torch's silu then mul round twice in bf16). */
void overlap_silu_mul(const void *gate_up, int64_t row_stride, int32_t rows, int32_t inter, void *out, int32_t bf16,
                      int32_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && (int64_t)rows * inter > 32768)
    for (int32_t r = 0; r < rows; r++) {
        if (bf16)
            silu_mul_row(gate_up, (int64_t)r * row_stride, out, (int64_t)r * inter, inter, 1);
        else
            silu_mul_row(gate_up, (int64_t)r * row_stride, out, (int64_t)r * inter, inter, 0);
    }
}
