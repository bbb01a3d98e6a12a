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

/* ---- Larger steps: the codes of a block made bf16 in cache, then tiles of rows -----------------------------------
 * For more rows than the kernel above serves, with bf16 x on AVX512-BF16. Per block of 48 outputs and chunk of its
 * group (32, 64 or 128 inputs), the codes become the bf16 numbers 128 + code (exact, as the kernel above makes them:
 * 0x4300 | code) in vdpbf16ps' operand layout, [inputs/2][48] pairs, 64 bytes of 16 outputs transposed at a time;
 * every tile of 8 rows then reads that from L1: each pair of x broadcast once for 48 outputs, each 64 bytes loaded
 * once for 8 rows, fp32 sums in registers. At the chunk's end scale * sums - offset * sum(x) goes into `total`
 * (the chunk's group's scale and offset, as the kernel above applies them). The weight is read once a step and never
 * written out as floats. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
enum { W4_BLOCK = 48, W4_TILE_ROWS = 8 };

/* 16 bytes (a pair of inputs of 16 outputs each) as 16 dwords of two bf16 128 + code: 0x4300 | low nibble, then
 * 0x4300 | high nibble. The byte copied 12 bits up puts its high nibble at bits 16-19, and the row kernel's
 * (w & 0x000F000F) | 0x43004300 does the rest. */
static inline __m512i w4_expand(__m128i bytes) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    return _mm512_ternarylogic_epi32(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000F000F),
                                     _mm512_set1_epi32(0x43004300), 0xEA); /* (a & b) | c */
}

/* The block's pairs [p0, p0 + pairs), pairs <= 64, as bf16 (128 + code) pairs into `tile` [pairs][3][16 dwords]:
 * 64 bytes of each of 16 outputs loaded, transposed in registers (4 rounds of unpacks: after them register j's
 * 128-bit lane l holds pair 16 l + j of the 16 outputs), then widened. Outputs past n read as zero. */
static void w4_fill_tile(const uint8_t *codes, int64_t half_k, int64_t n, int64_t b, int64_t p0, int64_t pairs,
                         __m512i *tile) {
    const __mmask64 m = pairs >= 64 ? ~0ULL : (__mmask64)((1ULL << pairs) - 1);
    for (int g = 0; g < W4_BLOCK / 16; g++) {
        __m512i r[16], t[16];
        for (int c = 0; c < 16; c++) {
            const int64_t col = b + 16 * g + c;
            if (col >= n) {
                r[c] = _mm512_setzero_si512();
                continue;
            }
            r[c] = _mm512_maskz_loadu_epi8(m, codes + col * half_k + p0);
        }
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) {
            r[4 * i] = _mm512_unpacklo_epi16(t[4 * i], t[4 * i + 2]);
            r[4 * i + 1] = _mm512_unpackhi_epi16(t[4 * i], t[4 * i + 2]);
            r[4 * i + 2] = _mm512_unpacklo_epi16(t[4 * i + 1], t[4 * i + 3]);
            r[4 * i + 3] = _mm512_unpackhi_epi16(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int h = 0; h < 2; h++)
            for (int q = 0; q < 4; q++) {
                t[8 * h + 2 * q] = _mm512_unpacklo_epi32(r[8 * h + q], r[8 * h + 4 + q]);
                t[8 * h + 2 * q + 1] = _mm512_unpackhi_epi32(r[8 * h + q], r[8 * h + 4 + q]);
            }
        for (int x = 0; x < 8; x++) {
            r[2 * x] = _mm512_unpacklo_epi64(t[x], t[8 + x]);
            r[2 * x + 1] = _mm512_unpackhi_epi64(t[x], t[8 + x]);
        }
        for (int j = 0; j < 16; j++) {
            if (j < pairs) tile[j * 3 + g] = w4_expand(_mm512_castsi512_si128(r[j]));
            if (16 + j < pairs) tile[(16 + j) * 3 + g] = w4_expand(_mm512_extracti32x4_epi32(r[j], 1));
            if (32 + j < pairs) tile[(32 + j) * 3 + g] = w4_expand(_mm512_extracti32x4_epi32(r[j], 2));
            if (48 + j < pairs) tile[(48 + j) * 3 + g] = w4_expand(_mm512_extracti32x4_epi32(r[j], 3));
        }
    }
}

#define W4_ACC(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define W4_DOT(r)                                                                                                     \
    if (R > r) {                                                                                                      \
        uint32_t pair;                                                                                                \
        memcpy(&pair, x + (r) * x_stride + 2 * (p0 + p), sizeof pair);                                               \
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);                                                   \
        a##r##0 = _mm512_dpbf16_ps(a##r##0, xb, (__m512bh)w0);                                                        \
        a##r##1 = _mm512_dpbf16_ps(a##r##1, xb, (__m512bh)w1);                                                        \
        a##r##2 = _mm512_dpbf16_ps(a##r##2, xb, (__m512bh)w2);                                                        \
    }
/* total = scale * sums - offset * sum(x) (+ total after the first chunk); out as bf16 after the last */
#define W4_MERGE(r)                                                                                                   \
    if (R > r) {                                                                                                      \
        const __m512 xs = _mm512_set1_ps(xsum[(r) * chunks]);                                                         \
        w4_merge(a##r##0, sc[0], of[0], xs, total + (r) * W4_BLOCK, first, last, out + (r) * n, cols_left);           \
        w4_merge(a##r##1, sc[1], of[1], xs, total + (r) * W4_BLOCK + 16, first, last, out + (r) * n + 16,             \
                 cols_left - 16);                                                                                     \
        w4_merge(a##r##2, sc[2], of[2], xs, total + (r) * W4_BLOCK + 32, first, last, out + (r) * n + 32,             \
                 cols_left - 32);                                                                                     \
    }

static inline void w4_merge(__m512 sums, __m512 scale, __m512 offset, __m512 xsum, float *total, int first, int last,
                            uint16_t *out, int64_t left) {
    __m512 t = _mm512_fnmadd_ps(offset, xsum, _mm512_mul_ps(scale, sums));
    if (!first) t = _mm512_add_ps(t, _mm512_loadu_ps(total));
    if (!last) {
        _mm512_storeu_ps(total, t);
    } else if (left > 0) { /* rounded to bf16 as torch's cast rounds; the columns past n left alone */
        const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(t));
    }
}

static inline __attribute__((always_inline)) void w4_tile_rows(const uint16_t *x, int64_t x_stride, int64_t p0,
                                                               int64_t pairs, const __m512i *tile, const float *xsum,
                                                               int64_t chunks, const __m512 *sc, const __m512 *of,
                                                               float *total, int first, int last, uint16_t *out,
                                                               int64_t n, int64_t cols_left, const uint8_t *ahead,
                                                               int64_t ahead_lines, const int R) {
    W4_ACC(0) W4_ACC(1) W4_ACC(2) W4_ACC(3) W4_ACC(4) W4_ACC(5) W4_ACC(6) W4_ACC(7)
    for (int64_t p = 0; p < pairs; p++) {
        if (p < ahead_lines) __builtin_prefetch(ahead + 64 * p, 0, 0);
        const __m512i w0 = tile[3 * p], w1 = tile[3 * p + 1], w2 = tile[3 * p + 2];
        W4_DOT(0) W4_DOT(1) W4_DOT(2) W4_DOT(3) W4_DOT(4) W4_DOT(5) W4_DOT(6) W4_DOT(7)
    }
    W4_MERGE(0) W4_MERGE(1) W4_MERGE(2) W4_MERGE(3) W4_MERGE(4) W4_MERGE(5) W4_MERGE(6) W4_MERGE(7)
}
#endif

/* out [rows][n] bf16 = x [rows][k] bf16 times the W4A16 weight of overlap_w4a16_rows' bf16-path arguments (offset =
 * scale * (zero + 128)), for steps of many rows. 0; -1 for bad arguments or no memory; -2 where this CPU (no
 * AVX512-BF16) has no such path: the caller dequantizes instead. */
int overlap_w4a16_tiles(const uint16_t *x, int64_t x_stride, int64_t rows, const uint8_t *codes, const float *scale,
                        const float *offset, int64_t n, int64_t k, int64_t group, uint16_t *out, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
    if (k % 32 || group % 32 || k % group || n < 1 || rows < 1 || threads < 1) return -1;
    /* the scales' granularity: a divisor of both the group and the 128 inputs a tile holds */
    const int64_t chunk = group % 128 == 0 ? 128 : group % 64 == 0 ? 64 : 32, chunks = k / chunk;
    const int64_t blocks = (n + W4_BLOCK - 1) / W4_BLOCK, groups = k / group, half_k = k / 2;
    const int64_t fill = 128 / chunk; /* chunks a tile holds: one fill of 128 inputs */
    float *xsum = malloc(sizeof(float) * rows * chunks); /* sum(x) over each chunk of each row */
    if (!xsum) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < chunks; c++) {
                float t = 0.0f;
                for (int64_t i = c * chunk; i < (c + 1) * chunk; i++) t += bf16_to_f32(x[r * x_stride + i]);
                xsum[r * chunks + c] = t;
            }
        __m512i *tile = aligned_alloc(64, sizeof(__m512i) * 64 * 3);
        float *total = malloc(sizeof(float) * W4_BLOCK * rows);
        if (!tile || !total) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t b = blk * W4_BLOCK;
                for (int64_t c = 0; c < chunks; c++) {
                    if (c % fill == 0) {
                        const int64_t left = half_k - c * chunk / 2;
                        w4_fill_tile(codes, half_k, n, b, c * chunk / 2, left < 64 ? left : 64, tile);
                    }
                    const __m512i *sub = tile + (c % fill) * (chunk / 2) * 3;
                    float s[W4_BLOCK], o[W4_BLOCK];
                    for (int j = 0; j < W4_BLOCK; j++) {
                        const int64_t col = b + j < n ? b + j : n - 1, at = col * groups + c * chunk / group;
                        s[j] = scale[at];
                        o[j] = offset[at];
                    }
                    const __m512 sc[3] = {_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16), _mm512_loadu_ps(s + 32)};
                    const __m512 of[3] = {_mm512_loadu_ps(o), _mm512_loadu_ps(o + 16), _mm512_loadu_ps(o + 32)};
                    const int first = c == 0, last = c == chunks - 1;
                    /* The block's codes are one run of 48 rows, read 64 bytes of each at a time: too many streams
                     * for the hardware prefetchers. So the first row tile of each chunk asks for the chunk's share
                     * of the next block's run, front to back, spread over its loop (none past n). */
                    const int64_t share = W4_BLOCK * 64 / fill, from = (b + W4_BLOCK) * half_k + c * share;
                    const int64_t left = n * half_k - from, lines = left <= 0 ? 0 : (left < share ? left : share) / 64;
                    int64_t r = 0;
#define W4_ROWS(R)                                                                                                    \
    w4_tile_rows(x + r * x_stride, x_stride, c * chunk / 2, chunk / 2, sub, xsum + r * chunks + c, chunks, sc, of,     \
                 total + r * W4_BLOCK, first, last, out + r * n + b, n, n - b, codes + from, r == 0 ? lines : 0, R);
                    for (; r + W4_TILE_ROWS <= rows; r += W4_TILE_ROWS) W4_ROWS(W4_TILE_ROWS)
                    switch (rows - r) {
                    case 7: W4_ROWS(7) break;
                    case 6: W4_ROWS(6) break;
                    case 5: W4_ROWS(5) break;
                    case 4: W4_ROWS(4) break;
                    case 3: W4_ROWS(3) break;
                    case 2: W4_ROWS(2) break;
                    case 1: W4_ROWS(1) break;
                    default: break;
                    }
                }
            }
        }
        free(tile);
        free(total);
    }
    free(xsum);
    return failed ? -1 : 0;
#else
    (void)x, (void)x_stride, (void)rows, (void)codes, (void)scale, (void)offset, (void)n, (void)k, (void)group;
    (void)out, (void)threads;
    return -2;
#endif
}
