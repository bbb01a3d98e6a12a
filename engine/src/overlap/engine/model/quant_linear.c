/* Quantized projections on CPU: 4-bit weights with 16-bit activations (W4A16), and int8 weights with int8 activations
 * quantized per token (W8A8), for decode-sized steps; and the 4-bit weight dequantized into a float buffer, for the
 * larger steps that oneDNN's matmul then serves.
 *
 * A decode step streams every weight once, so these kernels read the fewest bytes: half a byte (W4A16) or one byte
 * (W8A8) a weight, each thread one contiguous run of output rows, each row of weights read once per tile of up to 8
 * rows of x (from L1 after the first).
 *
 * Layouts (quant/kernels.py makes them at load):
 * - W4A16: codes [N][K/2] bytes, byte i holding input 2i in its low nibble and 2i + 1 in its high one (GPTQ's and
 *   compressed-tensors' order within a word). scale and zero [N][K/G] fp32: W[n][k] = (code - zero) * scale. Sums
 *   are fp32: per group sum(code * x), then scale * (that - zero * sum(x)). With AVX512-BF16 and bf16 x, the codes
 *   become bf16 through one table lookup and each pair of inputs is one vdpbf16ps lane (twice fp32's multiply-adds);
 *   else the low and high nibbles meet x's even and odd inputs, split once per call.
 * - W8A8: weight int8 [N][K] (symmetric), its row sums, a scale per row. x is quantized here per row, as
 *   compressed-tensors does it (scale = absmax / 127.5, round half to even, clamp to [-128, 127]); sums are int32:
 *   VNNI's vpdpbusd multiplies unsigned by signed bytes, so x + 128 is used and 128 * rowsum taken off.
 *
 * Each path is compiled for what this CPU has (-march=native): AVX-512 (with VNNI for W8A8), AVX2, or plain C.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { ROW_TILE = 8, MAX_ROWS = 64, MAX_K = 65536 };

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

/* ---- W4A16 ------------------------------------------------------------------------------------------------------ */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define W4_BF16 1
/* bf16 bits of 0..15: vpermw turns each 16-bit code into its bf16 value */
static const uint16_t BF16_OF[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
#else
#define W4_BF16 0
#endif

/* Sum over one group of code * x, for R rows and one output row, into acc (per row, vector lanes or a float). The
 * codes are 2 a byte: input 2i in the low nibble of byte i, input 2i + 1 in the high one. fp32 x comes split into its
 * even and odd inputs (xe, xo: [R][K/2]) so that the low and high nibbles each meet a contiguous run of x. */
static void w4_row(const float *xe, const float *xo, const uint16_t *xb, int64_t half_k, int R, const uint8_t *codes,
                   const float *scale, const float *zero, int64_t k, int64_t group, const float *xsum, int64_t groups,
                   float *out) {
    float total[ROW_TILE], correction[ROW_TILE];
    for (int r = 0; r < R; r++) total[r] = correction[r] = 0.0f;
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < R; r++) correction[r] += scale[g] * zero[g] * xsum[r * groups + g];
#if defined(__AVX512F__)
    __m512 tot[ROW_TILE];
    for (int r = 0; r < R; r++) tot[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0xF);
#if W4_BF16
    const __m512i table = _mm512_loadu_si512(BF16_OF);
#endif
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[ROW_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k0 / 2)));
#if W4_BF16
            if (xb) { /* bf16 x: each 32-bit lane a pair of inputs (2i, 2i + 1), one vdpbf16ps a row */
                const __m512i pairs = _mm512_or_si512(_mm512_and_si512(v, low),
                                                      _mm512_slli_epi32(_mm512_srli_epi32(v, 4), 16));
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(pairs, table);
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(xb + r * k + k0), w);
                continue;
            }
#endif
            const __m512 c0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
            const __m512 c1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_fmadd_ps(c0, _mm512_loadu_ps(xe + r * half_k + k0 / 2), acc[r]);
                acc[r] = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xo + r * half_k + k0 / 2), acc[r]);
            }
        }
        const __m512 s = _mm512_set1_ps(scale[g]);
        for (int r = 0; r < R; r++) tot[r] = _mm512_fmadd_ps(s, acc[r], tot[r]);
    }
    for (int r = 0; r < R; r++) total[r] = _mm512_reduce_add_ps(tot[r]);
#elif defined(__AVX2__)
    (void)xb;
    for (int r0 = 0; r0 < R; r0 += 4) { /* 16 ymm registers: 4 rows at a time */
        const int RR = R - r0 < 4 ? R - r0 : 4;
        __m256 tot[4];
        for (int r = 0; r < RR; r++) tot[r] = _mm256_setzero_ps();
        const __m256i low = _mm256_set1_epi32(0xF);
        for (int64_t g = 0; g < groups; g++) {
            __m256 acc[4];
            for (int r = 0; r < RR; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 16) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + k0 / 2)));
                const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
                const __m256 c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                for (int r = 0; r < RR; r++) {
                    const int64_t at = (r0 + r) * half_k + k0 / 2;
                    acc[r] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xe + at), acc[r]);
                    acc[r] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xo + at), acc[r]);
                }
            }
            const __m256 s = _mm256_set1_ps(scale[g]);
            for (int r = 0; r < RR; r++) tot[r] = _mm256_fmadd_ps(s, acc[r], tot[r]);
        }
        for (int r = 0; r < RR; r++) {
            __m128 q = _mm_add_ps(_mm256_castps256_ps128(tot[r]), _mm256_extractf128_ps(tot[r], 1));
            q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            q = _mm_add_ss(q, _mm_movehdup_ps(q));
            total[r0 + r] = _mm_cvtss_f32(q);
        }
    }
#else
    (void)xb;
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < R; r++) {
            float acc = 0.0f;
            for (int64_t i = g * group / 2; i < (g + 1) * group / 2; i++)
                acc += (float)(codes[i] & 0xF) * xe[r * half_k + i] + (float)(codes[i] >> 4) * xo[r * half_k + i];
            total[r] += scale[g] * acc;
        }
#endif
    for (int r = 0; r < R; r++) out[r] = total[r] - correction[r];
}

static inline float bf16_value(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int overlap_w4a16_bf16_path(void) { return W4_BF16; }

/* out [rows][n] fp32 (row stride out_stride) = x [rows][k] times the W4A16 weight; x is fp32 (x_bf16 == 0) or bf16
 * (x_bf16 == 1, rows dense), its rows x_stride elements apart. 0, or -1 for bad arguments. */
int overlap_w4a16_rows(const void *x, int64_t x_stride, int x_bf16, int rows, const uint8_t *codes,
                       const float *scale, const float *zero, int64_t n, int64_t k, int64_t group, float *out,
                       int64_t out_stride, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % 32 || group % 32 || k % group || n < 1 || threads < 1) return -1;
    if (x_bf16 && x_stride != k) return -1;
    const int64_t groups = k / group, half_k = k / 2;
    float *xsum = malloc(sizeof(float) * rows * groups); /* sum of x over each group, per row */
    float *xe = malloc(sizeof(float) * rows * k);        /* fp32 x: its even inputs, then its odd ones */
    if (!xsum || !xe) {
        free(xsum);
        free(xe);
        return -1;
    }
    float *xo = xe + rows * half_k;
    for (int r = 0; r < rows; r++) {
        for (int64_t i = 0; i < half_k; i++) {
            const float a = x_bf16 ? bf16_value(((const uint16_t *)x)[r * x_stride + 2 * i])
                                   : ((const float *)x)[r * x_stride + 2 * i];
            const float b = x_bf16 ? bf16_value(((const uint16_t *)x)[r * x_stride + 2 * i + 1])
                                   : ((const float *)x)[r * x_stride + 2 * i + 1];
            xe[r * half_k + i] = a;
            xo[r * half_k + i] = b;
        }
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = g * group / 2; i < (g + 1) * group / 2; i++) s += xe[r * half_k + i] + xo[r * half_k + i];
            xsum[r * groups + g] = s;
        }
    }
    const uint16_t *xb = (x_bf16 && W4_BF16) ? (const uint16_t *)x : NULL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float y[ROW_TILE];
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int R = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            w4_row(xe + r0 * half_k, xo + r0 * half_k, xb ? xb + r0 * k : NULL, half_k, R, codes + j * half_k,
                   scale + j * groups, zero + j * groups, k, group, xsum + r0 * groups, groups, y);
            for (int r = 0; r < R; r++) out[(r0 + r) * out_stride + j] = y[r];
        }
    }
    free(xsum);
    free(xe);
    return 0;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* The W4A16 weight as floats [n][k]: fp32 (bf16 == 0) or bf16 (bf16 == 1), for a matmul that takes many rows. */
int overlap_w4a16_dequantize(const uint8_t *codes, const float *scale, const float *zero, int64_t n, int64_t k,
                             int64_t group, void *out, int bf16, int threads) {
    if (k % 32 || group % 32 || k % group || n < 1 || threads < 1) return -1;
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float row[64];
        for (int64_t k0 = 0; k0 < k; k0 += 32) {
            const float s = scale[j * groups + k0 / group], z = zero[j * groups + k0 / group];
            const uint8_t *b = codes + j * (k / 2) + k0 / 2;
            for (int i = 0; i < 16; i++) {
                row[2 * i] = ((float)(b[i] & 0xF) - z) * s;
                row[2 * i + 1] = ((float)(b[i] >> 4) - z) * s;
            }
            if (bf16)
                for (int i = 0; i < 32; i++) ((uint16_t *)out)[j * k + k0 + i] = to_bf16(row[i]);
            else
                memcpy((float *)out + j * k + k0, row, sizeof(float) * 32);
        }
    }
    return 0;
}

/* ---- W8A8 ------------------------------------------------------------------------------------------------------- */
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1
#else
#define VNNI 0
#endif

static int32_t dot_s8(const int8_t *x, const int8_t *w, int64_t k) {
#if VNNI
    /* x + 128 as unsigned bytes; the caller takes 128 * sum(w) off */
    __m512i acc = _mm512_setzero_si512();
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512(x + i), bias);
        acc = _mm512_dpbusd_epi32(acc, xu, _mm512_loadu_si512(w + i));
    }
    if (i < k) {
        const __mmask64 m = (__mmask64)(~0ULL >> (64 - (k - i)));
        const __m512i xu = _mm512_maskz_mov_epi8(m, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, x + i), bias));
        acc = _mm512_dpbusd_epi32(acc, xu, _mm512_maskz_loadu_epi8(m, w + i)); /* zero bytes past k on both sides */
    }
    return _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) { /* widened to int16: exact for every int8 pair, -128 included */
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

/* What dot_s8 adds to the true sum per unit of sum(w): 128 on the VNNI path (x + 128), 0 elsewhere. */
static const int32_t X_OFFSET = VNNI ? 128 : 0;

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
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(xr[i]));
        const float scale = amax / 127.5f > 1.17549435e-38f ? amax / 127.5f : 1.17549435e-38f;
        for (int64_t i = 0; i < k; i++) {
            const float q = nearbyintf(xr[i] / scale); /* round half to even, as torch.round */
            xq[r * k + i] = (int8_t)(q > 127.0f ? 127.0f : q < -128.0f ? -128.0f : q);
        }
        xs[r] = scale;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *wj = w + j * k;
        for (int r = 0; r < rows; r++) {
            const int32_t sum = dot_s8(xq + r * k, wj, k) - X_OFFSET * w_rowsum[j];
            out[r * out_stride + j] = (float)sum * xs[r] * w_scale[j];
        }
    }
    free(xq);
    free(xs);
    return 0;
}
