/* W8A8 projections (quant_linear.h: the layout), and which instruction set the library was built for. */
#include "quant_linear.h"

int overlap_quant_linear_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 3; /* AVX-512 with VNNI */
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* ---- W8A8 ------------------------------------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1
#else
#define VNNI 0
#endif

#if VNNI
enum { W8_TILE_N = 4, W8_TILE_R = 4 };

static inline __mmask64 tail_mask(int64_t left) { return left >= 64 ? ~0ULL : (__mmask64)(~0ULL >> (64 - left)); }

/* sum(xu * w) over k, xu = x + 128 as unsigned bytes (the caller takes 128 * sum(w) off). */
static int32_t dot_u8(const int8_t *xu, const int8_t *w, int64_t k) {
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        PREFETCH_WEIGHT(w + i);
        acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(xu + i), _mm512_loadu_si512(w + i));
    }
    if (i < k) {
        const __mmask64 m = tail_mask(k - i); /* bytes past k are zero on both sides */
        acc = _mm512_dpbusd_epi32(acc, _mm512_maskz_loadu_epi8(m, xu + i), _mm512_maskz_loadu_epi8(m, w + i));
    }
    return _mm512_reduce_add_epi32(acc);
}

/* 4 rows of x against 4 outputs: 16 accumulators in registers (named one by one: GCC keeps an array of them in
 * memory), each 64 bytes of x and of w loaded once for 4 vpdpbusd. */
#define MASKED(p) _mm512_maskz_loadu_epi8(m, p)
/* acc += x (unsigned bytes) . w (signed bytes), 4 at a time into each int32 lane. As inline assembly: GCC 12 keeps the
 * intrinsic's 16 accumulators in registers but copies each of them twice per step around the vpdpbusd, which halved
 * the kernel's rate. */
#define DPBUSD(acc, x, w) __asm__("vpdpbusd %[wv], %[xv], %[a]" : [a] "+v"(acc) : [xv] "v"(x), [wv] "v"(w));
#define W8_ROW(r, load)                                                                                               \
    {                                                                                                                 \
        const __m512i xv = load(xu + (r) * k + i);                                                                    \
        DPBUSD(a##r##0, xv, w0) DPBUSD(a##r##1, xv, w1) DPBUSD(a##r##2, xv, w2) DPBUSD(a##r##3, xv, w3)               \
    }
/* row r's 4 sums: lanes paired and added so that each 128-bit lane holds partial sums of outputs 0..3, then the
 * four 128-bit lanes added (14 operations for 4 sums, against 4 full reductions) */
#define W8_OUT(r)                                                                                                     \
    {                                                                                                                 \
        const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a##r##0, a##r##1),                                 \
                                             _mm512_unpackhi_epi32(a##r##0, a##r##1));                                \
        const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a##r##2, a##r##3),                                 \
                                             _mm512_unpackhi_epi32(a##r##2, a##r##3));                                \
        const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));       \
        const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));               \
        const __m128i q = _mm_sub_epi32(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)),    \
                                        _mm_slli_epi32(_mm_loadu_si128((const __m128i *)rowsum), 7));                 \
        const __m128 y = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(q), _mm_set1_ps(x_scale[r])), _mm_loadu_ps(w_scale)); \
        _mm_storeu_ps(out + (r) * out_stride, y);                                                                     \
    }
static void w8_tile(const int8_t *xu, int64_t k, const int8_t *w, const int32_t *rowsum, const float *w_scale,
                    const float *x_scale, float *out, int64_t out_stride) {
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512i a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) { /* plain loads: Zen 4 runs masked byte loads far slower */
        PREFETCH_WEIGHT(w + i);
        PREFETCH_WEIGHT(w + k + i);
        PREFETCH_WEIGHT(w + 2 * k + i);
        PREFETCH_WEIGHT(w + 3 * k + i);
        const __m512i w0 = _mm512_loadu_si512(w + i), w1 = _mm512_loadu_si512(w + k + i);
        const __m512i w2 = _mm512_loadu_si512(w + 2 * k + i), w3 = _mm512_loadu_si512(w + 3 * k + i);
        W8_ROW(0, _mm512_loadu_si512) W8_ROW(1, _mm512_loadu_si512) W8_ROW(2, _mm512_loadu_si512)
        W8_ROW(3, _mm512_loadu_si512)
    }
    if (i < k) { /* the last bytes, past k zero on both sides */
        const __mmask64 m = tail_mask(k - i);
        const __m512i w0 = _mm512_maskz_loadu_epi8(m, w + i), w1 = _mm512_maskz_loadu_epi8(m, w + k + i);
        const __m512i w2 = _mm512_maskz_loadu_epi8(m, w + 2 * k + i), w3 = _mm512_maskz_loadu_epi8(m, w + 3 * k + i);
        W8_ROW(0, MASKED) W8_ROW(1, MASKED) W8_ROW(2, MASKED) W8_ROW(3, MASKED)
    }
    W8_OUT(0) W8_OUT(1) W8_OUT(2) W8_OUT(3)
}
#else
static int32_t dot_s8(const int8_t *x, const int8_t *w, int64_t k) {
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) { /* widened to int16: exact for every int8 pair, -128 included */
        PREFETCH_WEIGHT(w + i);
        const __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + i)));
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(xv, wv));
    }
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    int32_t total = _mm_cvtsi128_si32(s);
    for (; i < k; i++) total += (int32_t)x[i] * w[i];
    return total;
#else
    int32_t total = 0;
    for (int64_t i = 0; i < k; i++) total += (int32_t)x[i] * w[i];
    return total;
#endif
}

#endif

/* 16 inputs of x from index i as fp32: bf16 widens exactly (its bits are an fp32's top half). */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 load16(const void *x, int64_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* One row of x (fp32 or bf16) as int8 codes, as compressed-tensors quantizes per token: scale = absmax / 127.5,
 * x / scale rounded half to even (the default rounding mode), clamped to [-128, 127]. */
static inline __attribute__((always_inline)) void quantize_row(const void *x, int64_t k, int8_t *q, float *scale_out,
                                                               const int bf16) {
    float amax = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x, i, bf16)));
    amax = _mm512_reduce_max_ps(m);
#endif
    for (; i < k; i++) amax = fmaxf(amax, fabsf(load(x, i, bf16)));
    const float scale = amax / 127.5f > 1.17549435e-38f ? amax / 127.5f : 1.17549435e-38f;
    i = 0;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= k; i += 16) { /* cvtps rounds half to even; cvtsepi32 saturates to [-128, 127] */
        const __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(load16(x, i, bf16), s));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
#endif
    for (; i < k; i++) {
        const float v = nearbyintf(load(x, i, bf16) / scale);
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -128.0f ? -128.0f : v);
    }
    *scale_out = scale;
}

/* x [rows][k] (fp32, or bf16 where x_bf16: read as it is, no fp32 copy) quantized per row as quantize_row does,
 * stored as code + 128 (unsigned, for oneDNN's u8 x s8 matmul), with each row's scale. 0, or -1 for bad arguments. */
int overlap_w8a8_quantize(const void *x, int64_t x_stride, int x_bf16, int rows, int64_t k, uint8_t *codes,
                          float *scales, int threads) {
    if (rows < 1 || k < 1 || threads < 1) return -1;
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        int8_t *q = (int8_t *)codes + (int64_t)r * k;
        const void *row = (const char *)x + (int64_t)r * x_stride * elem;
        if (x_bf16)
            quantize_row(row, k, q, scales + r, 1);
        else
            quantize_row(row, k, q, scales + r, 0);
        for (int64_t i = 0; i < k; i++) codes[(int64_t)r * k + i] = (uint8_t)((int)q[i] + 128);
    }
    return 0;
}

/* out [rows][n] = sums [rows][n] * x_scale[r], rounded once to out's dtype (bf16 where out_bf16, round to nearest
 * even as torch's cast; else fp32): oneDNN's u8 x s8 sums, already times the weight's scales, given x's per-token
 * scale in one pass (oneDNN's call takes one scale for all of x). 0, or -1 for bad arguments. */
int overlap_w8a8_scale_rows(const float *sums, int64_t rows, int64_t n, const float *x_scale, void *out, int out_bf16,
                            int threads) {
    if (rows < 1 || n < 1 || threads < 1) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *in = sums + r * n;
        const float s = x_scale[r];
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(in[j] * s);
        } else {
            float *o = (float *)out + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) o[j] = in[j] * s;
        }
    }
    return 0;
}

/* out [rows][n] = x [rows][k] (fp32, quantized here per row) times the W8A8 weight. 0, or -1 for bad arguments. */
int overlap_w8a8_rows(const float *x, int64_t x_stride, int rows, const int8_t *w, const int32_t *w_rowsum,
                      const float *w_scale, int64_t n, int64_t k, float *out, int64_t out_stride, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k < 1 || k > MAX_K || n < 1 || threads < 1) return -1;
    int8_t *xq = malloc((size_t)rows * k);
    float *xs = malloc(sizeof(float) * rows);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    /* On this thread: at most 64 rows, vectorized, cheaper than waking the team twice more for it (one parallel
     * region a call keeps a step's barriers few when the engine's host thread shares the cores). */
    for (int r = 0; r < rows; r++) quantize_row(x + r * x_stride, k, xq + r * k, xs + r, 0);
#if VNNI
    /* x + 128 as unsigned bytes, once for every output (dot_s8 and the tiles take 128 * sum(w) off after) */
    for (int64_t i = 0; i < (int64_t)rows * k; i++) xq[i] = (int8_t)((uint8_t)xq[i] ^ 0x80);
    const int64_t full = n / W8_TILE_N * W8_TILE_N;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < full; j += W8_TILE_N) {
        int r = 0;
        for (; r + W8_TILE_R <= rows; r += W8_TILE_R) w8_tile(xq + r * k, k, w + j * k, w_rowsum + j, w_scale + j, xs + r,
                                                             out + r * out_stride + j, out_stride);
        for (; r < rows; r++)
            for (int jj = j; jj < j + W8_TILE_N; jj++)
                out[r * out_stride + jj] =
                    (float)(dot_u8(xq + r * k, w + jj * k, k) - 128 * w_rowsum[jj]) * xs[r] * w_scale[jj];
    }
    for (int64_t j = full; j < n; j++)
        for (int r = 0; r < rows; r++)
            out[r * out_stride + j] = (float)(dot_u8(xq + r * k, w + j * k, k) - 128 * w_rowsum[j]) * xs[r] * w_scale[j];
#else
    (void)w_rowsum;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *wj = w + j * k;
        for (int r = 0; r < rows; r++) out[r * out_stride + j] = (float)dot_s8(xq + r * k, wj, k) * xs[r] * w_scale[j];
    }
#endif
    free(xq);
    free(xs);
    return 0;
}
