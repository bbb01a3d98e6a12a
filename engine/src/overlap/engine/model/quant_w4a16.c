/* W4A16 projections and the 4-bit weight dequantized (quant_linear.h: the layouts). */
#include "quant_linear.h"

/* ---- W4A16 ------------------------------------------------------------------------------------------------------ */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define W4_BF16 1
/* bf16 x, AVX512-BF16: 128 inputs a step, 64 bytes of codes read as 32 16-bit lanes, lane j holding the codes of
 * inputs 4j .. 4j + 3. Shifting by 4t and masking gives, in every lane, the code of input 4j + t; OR-ing in 0x4300
 * makes it the bf16 number 128 + code, exactly. So four vdpbf16ps a row cover the 128 inputs, against x reordered
 * once per call to match (xp: per 128 inputs and per t, the pairs (8m + t, 8m + 4 + t)); sum((128 + c) x) over a
 * group, less (128 + zero) * sum(x), is sum((c - zero) x). A lane's inputs 8m .. 8m + 7 share a group (groups are a
 * multiple of 32), so a group of 32 or 64 is a run of lanes with their own scale. */
enum { BF16_ROWS = 6 }; /* rows of x a tile, against 2 outputs: 12 sums, 8 code vectors, 4 of x in 32 registers */

/* out[r][jj] for R rows of x and J (1 or 2) outputs, both compile-time constants at each call (w4_tile_bf16_any), so
 * the sums stay in registers; the two outputs' codes share each load of x. */
static inline __attribute__((always_inline)) void w4_tile_bf16(const int R, const int J, const uint16_t *xp, int64_t k,
                                                               const uint8_t *codes, int64_t half_k, const float *scale,
                                                               const float *offset, int64_t group, const float *xsum,
                                                               int64_t groups, float *out, int64_t out_stride) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
    __m512 tot[BF16_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int jj = 0; jj < J; jj++) tot[r][jj] = _mm512_setzero_ps();
    /* lane m's group within a step of 128 inputs, for groups under 128 */
    const __m512i lane_group = _mm512_srli_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                                     6, 5, 4, 3, 2, 1, 0),
                                                                    _mm512_set1_epi32(8)),
                                                 group == 32 ? 5 : 6);
    for (int64_t k0 = 0; k0 < k; k0 += 128) {
        __m512bh c[2][4];
        __m512 s[2];
        for (int jj = 0; jj < J; jj++) {
            PREFETCH_WEIGHT(codes + jj * half_k + k0 / 2);
            const __m512i w = _mm512_loadu_si512(codes + jj * half_k + k0 / 2);
            c[jj][0] = (__m512bh)_mm512_ternarylogic_epi32(w, mask, bias, 0xEA); /* (w & mask) | bias */
            c[jj][1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), mask, bias, 0xEA);
            c[jj][2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), mask, bias, 0xEA);
            c[jj][3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 12), mask, bias, 0xEA);
            const float *sj = scale + jj * groups;
            if (group >= 128)
                s[jj] = _mm512_set1_ps(sj[k0 / group]);
            else
                s[jj] = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps((__mmask16)((1u << (128 / group)) - 1),
                                                                                sj + k0 / group));
        }
        for (int r = 0; r < R; r++) {
            const uint16_t *x = xp + r * k + k0;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x), x1 = (__m512bh)_mm512_loadu_si512(x + 32);
            const __m512bh x2 = (__m512bh)_mm512_loadu_si512(x + 64), x3 = (__m512bh)_mm512_loadu_si512(x + 96);
            for (int jj = 0; jj < J; jj++) {
                __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), x0, c[jj][0]);
                a = _mm512_dpbf16_ps(a, x1, c[jj][1]);
                a = _mm512_dpbf16_ps(a, x2, c[jj][2]);
                a = _mm512_dpbf16_ps(a, x3, c[jj][3]);
                tot[r][jj] = _mm512_fmadd_ps(s[jj], a, tot[r][jj]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int jj = 0; jj < J; jj++) {
            const float *oj = offset + jj * groups, *xs = xsum + r * groups;
            __m512 c = _mm512_setzero_ps();
            int64_t g = 0;
            for (; g + 16 <= groups; g += 16) c = _mm512_fmadd_ps(_mm512_loadu_ps(oj + g), _mm512_loadu_ps(xs + g), c);
            float correction = _mm512_reduce_add_ps(c);
            for (; g < groups; g++) correction += oj[g] * xs[g];
            out[r * out_stride + jj] = _mm512_reduce_add_ps(tot[r][jj]) - correction;
        }
}

static void w4_tile_bf16_any(int R, int J, const uint16_t *xp, int64_t k, const uint8_t *codes, int64_t half_k,
                             const float *scale, const float *offset, int64_t group, const float *xsum, int64_t groups,
                             float *out, int64_t out_stride) {
#define W4_TILE(r, j) w4_tile_bf16(r, j, xp, k, codes, half_k, scale, offset, group, xsum, groups, out, out_stride)
    if (J == 2) {
        switch (R) {
        case 1: W4_TILE(1, 2); break;
        case 2: W4_TILE(2, 2); break;
        case 3: W4_TILE(3, 2); break;
        case 4: W4_TILE(4, 2); break;
        case 5: W4_TILE(5, 2); break;
        default: W4_TILE(6, 2); break;
        }
    } else {
        switch (R) {
        case 1: W4_TILE(1, 1); break;
        case 2: W4_TILE(2, 1); break;
        case 3: W4_TILE(3, 1); break;
        case 4: W4_TILE(4, 1); break;
        case 5: W4_TILE(5, 1); break;
        default: W4_TILE(6, 1); break;
        }
    }
#undef W4_TILE
}
#else
#define W4_BF16 0
#endif

/* Sum over one group of code * x, for R rows and one output row, into acc (per row, vector lanes or a float). The
 * codes are 2 a byte: input 2i in the low nibble of byte i, input 2i + 1 in the high one. fp32 x comes split into its
 * even and odd inputs (xe, xo: [R][K/2]) so that the low and high nibbles each meet a contiguous run of x. */
static void w4_row(const float *xe, const float *xo, int64_t half_k, int R, const uint8_t *codes, const float *scale,
                   const float *offset, int64_t group, const float *xsum, int64_t groups, float *out) {
    float total[ROW_TILE], correction[ROW_TILE];
    for (int r = 0; r < R; r++) total[r] = correction[r] = 0.0f;
    for (int64_t g = 0; g < groups; g++)
        for (int r = 0; r < R; r++) correction[r] += offset[g] * xsum[r * groups + g];
#if defined(__AVX512F__)
    __m512 tot[ROW_TILE];
    for (int r = 0; r < R; r++) tot[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0xF);
    for (int64_t g = 0; g < groups; g++) {
        PREFETCH_WEIGHT(codes + g * group / 2);
        __m512 acc[ROW_TILE];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k0 / 2)));
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
    for (int r0 = 0; r0 < R; r0 += 4) { /* 16 ymm registers: 4 rows at a time */
        const int RR = R - r0 < 4 ? R - r0 : 4;
        __m256 tot[4];
        for (int r = 0; r < RR; r++) tot[r] = _mm256_setzero_ps();
        const __m256i low = _mm256_set1_epi32(0xF);
        for (int64_t g = 0; g < groups; g++) {
            PREFETCH_WEIGHT(codes + g * group / 2);
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
    for (int64_t g = 0; g < groups; g++) {
        PREFETCH_WEIGHT(codes + g * group / 2);
        for (int r = 0; r < R; r++) {
            float acc = 0.0f;
            for (int64_t i = g * group / 2; i < (g + 1) * group / 2; i++)
                acc += (float)(codes[i] & 0xF) * xe[r * half_k + i] + (float)(codes[i] >> 4) * xo[r * half_k + i];
            total[r] += scale[g] * acc;
        }
    }
#endif
    for (int r = 0; r < R; r++) out[r] = total[r] - correction[r];
}

/* Whether overlap_w4a16_rows takes bf16 x through vdpbf16ps for this k and group (the caller then passes
 * offset = scale * (128 + zero); else offset = scale * zero). */
int overlap_w4a16_bf16_path(int64_t k, int64_t group) {
    return W4_BF16 && k % 128 == 0 && (group == 32 || group == 64 || group % 128 == 0);
}

/* out [rows][n] fp32 (row stride out_stride) = x [rows][k] times the W4A16 weight; x is fp32 (x_bf16 == 0) or bf16
 * (x_bf16 == 1, rows dense), its rows x_stride elements apart. offset [n][k / group]: scale * zero, or on the bf16
 * path scale * (128 + zero). 0, or -1 for bad arguments. */
int overlap_w4a16_rows(const void *x, int64_t x_stride, int x_bf16, int rows, const uint8_t *codes,
                       const float *scale, const float *offset, int64_t n, int64_t k, int64_t group, float *out,
                       int64_t out_stride, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % 32 || group % 32 || k % group || n < 1 || threads < 1) return -1;
    const int bf16_path = x_bf16 && overlap_w4a16_bf16_path(k, group);
    const int64_t groups = k / group, half_k = k / 2;
    float *xsum = malloc(sizeof(float) * rows * groups); /* sum of x over each group, per row */
    float *xe = malloc(sizeof(float) * rows * k);        /* x as fp32: its even inputs, then its odd ones */
    uint16_t *xp = bf16_path ? malloc(sizeof(uint16_t) * rows * k) : NULL; /* bf16 x in w4_row_bf16's order */
    if (!xsum || !xe || (bf16_path && !xp)) {
        free(xsum);
        free(xe);
        free(xp);
        return -1;
    }
    float *xo = xe + rows * half_k;
    for (int r = 0; r < rows; r++) { /* on this thread, like W8A8's quantization: one parallel region a call */
        for (int64_t i = 0; i < half_k; i++) {
            const float a = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * x_stride + 2 * i])
                                   : ((const float *)x)[r * x_stride + 2 * i];
            const float b = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * x_stride + 2 * i + 1])
                                   : ((const float *)x)[r * x_stride + 2 * i + 1];
            xe[r * half_k + i] = a;
            xo[r * half_k + i] = b;
        }
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = g * group / 2; i < (g + 1) * group / 2; i++) s += xe[r * half_k + i] + xo[r * half_k + i];
            xsum[r * groups + g] = s;
        }
        if (bf16_path) {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride;
            for (int64_t k0 = 0; k0 < k; k0 += 128)
                for (int t = 0; t < 4; t++)
                    for (int m = 0; m < 16; m++) {
                        xp[r * k + k0 + 32 * t + 2 * m] = xr[k0 + 8 * m + t];
                        xp[r * k + k0 + 32 * t + 2 * m + 1] = xr[k0 + 8 * m + 4 + t];
                    }
        }
    }
#if W4_BF16
    if (bf16_path) {
        /* two outputs a tile where x has rows enough to share (the codes' unpacking then dominates); one at a time
         * for 1-2 rows, which stream the weight fastest that way */
        const int64_t per_tile = rows > 2 ? 2 : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t j = 0; j < n; j += per_tile)
            for (int r0 = 0; r0 < rows; r0 += BF16_ROWS)
                w4_tile_bf16_any(rows - r0 < BF16_ROWS ? rows - r0 : BF16_ROWS, n - j < per_tile ? 1 : (int)per_tile,
                                 xp + r0 * k, k, codes + j * half_k, half_k, scale + j * groups, offset + j * groups,
                                 group, xsum + r0 * groups, groups, out + r0 * out_stride + j, out_stride);
        free(xsum);
        free(xe);
        free(xp);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float y[ROW_TILE];
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int R = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            w4_row(xe + r0 * half_k, xo + r0 * half_k, half_k, R, codes + j * half_k, scale + j * groups,
                   offset + j * groups, group, xsum + r0 * groups, groups, y);
            for (int r = 0; r < R; r++) out[(r0 + r) * out_stride + j] = y[r];
        }
    }
    free(xsum);
    free(xe);
    free(xp);
    return 0;
}


/* The W4A16 weight as floats [n][k]: fp32 (bf16 == 0) or bf16 (bf16 == 1), for a matmul that takes many rows;
 * W = (code + bias) * scale - offset, with overlap_w4a16_rows' offset and bias 128 where it is the bf16 path's. */
int overlap_w4a16_dequantize(const uint8_t *codes, const float *scale, const float *offset, float bias, int64_t n,
                             int64_t k, int64_t group, void *out, int bf16, int threads) {
    if (k % 32 || group % 32 || k % group || n < 1 || threads < 1) return -1;
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float row[64];
        for (int64_t k0 = 0; k0 < k; k0 += 32) {
            const float s = scale[j * groups + k0 / group], o = offset[j * groups + k0 / group];
            const uint8_t *b = codes + j * (k / 2) + k0 / 2;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            /* 16 bytes: the low nibbles are inputs 0, 2, ..., the high ones 1, 3, ...: each to (code + bias) * s - o,
             * then interleaved back into input order (and to bf16, rounded to nearest even, as f32_to_bf16 does) */
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
            const __m512 vs = _mm512_set1_ps(s), vo = _mm512_set1_ps(o), vb = _mm512_set1_ps(bias);
            const __m512 lo = _mm512_fmsub_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), vb), vs, vo);
            const __m512 hi = _mm512_fmsub_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), vb), vs, vo);
#if defined(__AVX512BF16__)
            if (bf16) { /* cvtne2ps puts lo in the low 16 lanes and hi in the high 16: interleave them */
                const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                       22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                _mm512_storeu_si512((uint16_t *)out + j * k + k0,
                                    _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
                continue;
            }
#endif
            if (!bf16) {
                const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
                _mm512_storeu_ps((float *)out + j * k + k0, _mm512_permutex2var_ps(lo, first, hi));
                _mm512_storeu_ps((float *)out + j * k + k0 + 16, _mm512_permutex2var_ps(lo, second, hi));
                continue;
            }
#endif
            for (int i = 0; i < 16; i++) {
                row[2 * i] = ((float)(b[i] & 0xF) + bias) * s - o;
                row[2 * i + 1] = ((float)(b[i] >> 4) + bias) * s - o;
            }
            if (bf16)
                for (int i = 0; i < 32; i++) ((uint16_t *)out)[j * k + k0 + i] = f32_to_bf16(row[i]);
            else
                memcpy((float *)out + j * k + k0, row, sizeof(float) * 32);
        }
    }
    return 0;
}
