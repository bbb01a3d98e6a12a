/* W8A8 projections (quant_linear.h: the layout), and which instruction set the library was built for. */
#include "quant_linear.h"

int overlap_quant_linear_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
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
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VNNI 1
#else
#define VNNI 0
#endif

/* The packed weight (overlap_w8a8_pack, once at load): N padded to 16 columns and K to 4 inputs with zeros, the
 * columns in blocks of W8_BLOCK (the last one 16 or 32 wide), each block one contiguous run [K/4][width][4]: 4 inputs
 * of 16 columns make the 64 bytes that one vpdpbusd multiplies by 4 bytes of x broadcast, so a tile of rows x columns
 * keeps its sums in registers with no reduction at the end, and reads the weight front to back. */
enum { W8_BLOCK = 48, W8_COLS = 16, W8_TILE_ROWS = 8 };

static inline int64_t pad_to(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static inline int32_t four_bytes(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

int64_t overlap_w8a8_packed_size(int64_t n, int64_t k) { return pad_to(n, W8_COLS) * pad_to(k, 4); }

int overlap_w8a8_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed) {
    if (n < 1 || k < 1) return -1;
    const int64_t np = pad_to(n, W8_COLS), kp = pad_to(k, 4);
    for (int64_t b = 0; b < np; b += W8_BLOCK) {
        const int64_t width = np - b < W8_BLOCK ? np - b : W8_BLOCK;
        int8_t *dst = packed + b * kp;
        for (int64_t i = 0; i < kp; i += 4)
            for (int64_t c = b; c < b + width; c++)
                for (int64_t j = i; j < i + 4; j++) *dst++ = c < n && j < k ? w[c * k + j] : 0;
    }
    return 0;
}

#if VNNI
/* acc += x (unsigned bytes) . w (signed bytes), 4 at a time into each int32 lane. As inline assembly: GCC 12 copies
 * the intrinsic's accumulators around each vpdpbusd, which halved the rate. */
#define DPBUSD(acc, x, w) __asm__("vpdpbusd %[wv], %[xv], %[a]" : [a] "+v"(acc) : [xv] "v"(x), [wv] "v"(w));

/* fp32 to bf16, round to nearest even as torch's cast, NaN kept a NaN (vcvtneps2bf16 where AVX512-BF16 exists
 * rounds alike; this runs on every VNNI CPU). */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* 16 columns of row r's sums, minus 128 * sum(w) (x + 128 was multiplied), times both scales, stored as fp32 or bf16;
 * columns past N are not written. */
static inline __attribute__((always_inline)) void w8_store(__m512i acc, int r, int c, const int32_t *rowsum,
                                                           const float *w_scale, const float *x_scale,
                                                           int64_t cols_left, void *out, int64_t n, int out_bf16) {
    const int64_t left = cols_left - 16 * c;
    if (left <= 0) return;
    const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    const __m512i off = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, rowsum + 16 * c), 7);
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, off)),
                                                 _mm512_maskz_loadu_ps(m, w_scale + 16 * c)),
                                   _mm512_set1_ps(x_scale[r]));
    if (out_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)out + r * n + 16 * c, m, bf16x16(y));
    else
        _mm512_mask_storeu_ps((float *)out + r * n + 16 * c, m, y);
}

/* Rows [R] x columns [NB * 16] of one block: R * NB sums in registers, each 64 bytes of weight loaded once for R
 * vpdpbusd and each 4 bytes of x broadcast once for NB. R and NB are constants at every call, so the accumulators
 * that are not used compile away (named one by one: GCC keeps an array of them in memory). With more rows than one
 * tile, K goes in chunks (W8_CHUNK): every row tile takes a chunk while it is in L1, its sums kept in `partial`
 * between chunks, so the weight streams from memory while all of them run. */
#define W8_ACC(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define W8_DOT(r)                                                                                                     \
    if (R > r) {                                                                                                      \
        const __m512i xb = _mm512_set1_epi32(four_bytes(xq + r * kp + i));                                            \
        DPBUSD(a##r##0, xb, w0)                                                                                       \
        if (NB > 1) DPBUSD(a##r##1, xb, w1)                                                                           \
        if (NB > 2) DPBUSD(a##r##2, xb, w2)                                                                           \
    }
#define W8_OUT(r)                                                                                                     \
    if (R > r) {                                                                                                      \
        w8_store(a##r##0, r, 0, rowsum, w_scale, x_scale, cols_left, out, n, out_bf16);                               \
        if (NB > 1) w8_store(a##r##1, r, 1, rowsum, w_scale, x_scale, cols_left, out, n, out_bf16);                   \
        if (NB > 2) w8_store(a##r##2, r, 2, rowsum, w_scale, x_scale, cols_left, out, n, out_bf16);                   \
    }
#define W8_LOAD(r)                                                                                                    \
    if (R > r) {                                                                                                      \
        a##r##0 = _mm512_loadu_si512(partial + (r) * W8_BLOCK);                                                       \
        if (NB > 1) a##r##1 = _mm512_loadu_si512(partial + (r) * W8_BLOCK + 16);                                      \
        if (NB > 2) a##r##2 = _mm512_loadu_si512(partial + (r) * W8_BLOCK + 32);                                      \
    }
#define W8_SAVE(r)                                                                                                    \
    if (R > r) {                                                                                                      \
        _mm512_storeu_si512(partial + (r) * W8_BLOCK, a##r##0);                                                       \
        if (NB > 1) _mm512_storeu_si512(partial + (r) * W8_BLOCK + 16, a##r##1);                                      \
        if (NB > 2) _mm512_storeu_si512(partial + (r) * W8_BLOCK + 32, a##r##2);                                      \
    }
static inline __attribute__((always_inline)) void w8_tile(const uint8_t *xq, int64_t kp, const int8_t *block,
                                                          int64_t width, int64_t i0, int64_t i1, int32_t *partial,
                                                          const int32_t *rowsum, const float *w_scale,
                                                          const float *x_scale, int64_t cols_left, void *out,
                                                          int64_t n, int out_bf16, const int R, const int NB) {
    W8_ACC(0) W8_ACC(1) W8_ACC(2) W8_ACC(3) W8_ACC(4) W8_ACC(5) W8_ACC(6) W8_ACC(7)
    if (i0 > 0) {
        W8_LOAD(0) W8_LOAD(1) W8_LOAD(2) W8_LOAD(3) W8_LOAD(4) W8_LOAD(5) W8_LOAD(6) W8_LOAD(7)
    }
    for (int64_t i = i0; i < i1; i += 4) {
        const int8_t *wk = block + i * width; /* inputs i .. i + 3 of the block's columns */
        PREFETCH_WEIGHT(wk);
        if (NB > 1) PREFETCH_WEIGHT(wk + 64);
        if (NB > 2) PREFETCH_WEIGHT(wk + 128);
        const __m512i w0 = _mm512_loadu_si512(wk);
        const __m512i w1 = NB > 1 ? _mm512_loadu_si512(wk + 64) : w0, w2 = NB > 2 ? _mm512_loadu_si512(wk + 128) : w0;
        W8_DOT(0) W8_DOT(1) W8_DOT(2) W8_DOT(3) W8_DOT(4) W8_DOT(5) W8_DOT(6) W8_DOT(7)
    }
    if (i1 < kp) {
        W8_SAVE(0) W8_SAVE(1) W8_SAVE(2) W8_SAVE(3) W8_SAVE(4) W8_SAVE(5) W8_SAVE(6) W8_SAVE(7)
    } else {
        W8_OUT(0) W8_OUT(1) W8_OUT(2) W8_OUT(3) W8_OUT(4) W8_OUT(5) W8_OUT(6) W8_OUT(7)
    }
}

/* every row tile of one block against inputs [i0, i1): 8 rows at a time, then the 1-7 left */
#define W8_ROWS(NB)                                                                                                   \
    {                                                                                                                 \
        int64_t r = 0;                                                                                                \
        for (; r + W8_TILE_ROWS <= rows; r += W8_TILE_ROWS) W8_REST(W8_TILE_ROWS, NB)                                 \
        switch (rows - r) {                                                                                           \
        case 7: W8_REST(7, NB) break;                                                                                 \
        case 6: W8_REST(6, NB) break;                                                                                 \
        case 5: W8_REST(5, NB) break;                                                                                 \
        case 4: W8_REST(4, NB) break;                                                                                 \
        case 3: W8_REST(3, NB) break;                                                                                 \
        case 2: W8_REST(2, NB) break;                                                                                 \
        case 1: W8_REST(1, NB) break;                                                                                 \
        default: break;                                                                                               \
        }                                                                                                             \
    }
#define W8_REST(R, NB)                                                                                                \
    w8_tile(xq + r * kp, kp, block, width, i0, i1, partial + r * W8_BLOCK, rowsum + b, w_scale + b, x_scale + r,      \
            n - b, (char *)out + (r * n + b) * elem, n, out_bf16, R, NB);

enum { W8_CHUNK = 512 }; /* inputs: 24 KB of a 48-column block */

/* `partial`: [rows][W8_BLOCK] int32, the sums between chunks */
static void w8_block(const uint8_t *xq, int64_t rows, int64_t kp, const int8_t *packed, const int32_t *rowsum,
                     const float *w_scale, const float *x_scale, int64_t n, int64_t b, void *out, int out_bf16,
                     int32_t *partial) {
    const int64_t np = pad_to(n, W8_COLS), width = np - b < W8_BLOCK ? np - b : W8_BLOCK;
    const int8_t *block = packed + b * kp;
    const size_t elem = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t chunk = rows <= W8_TILE_ROWS ? kp : W8_CHUNK;
    for (int64_t i0 = 0; i0 < kp; i0 += chunk) {
        const int64_t i1 = i0 + chunk < kp ? i0 + chunk : kp;
        if (width == 48)
            W8_ROWS(3)
        else if (width == 32)
            W8_ROWS(2)
        else
            W8_ROWS(1)
    }
}
#else
/* Without VNNI (AVX2, or plain C): x's codes as signed bytes (no correction), one row at a time against the block's
 * G groups of 4 columns (G a constant at each call: the sums stay in registers), the block read front to back. */
static inline __attribute__((always_inline)) void w8_row(const int8_t *x, int64_t kp, const int8_t *block,
                                                         int32_t *sums, const int G) {
    const int64_t width = 4 * G;
#if defined(__AVX2__)
    /* 4 columns x 4 inputs widened to int16 times x's 4 inputs: 8 int32 lanes, two of each column */
    __m256i acc[12];
    for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_si256();
    for (int64_t i = 0; i < kp; i += 4) {
        const __m256i xv = _mm256_cvtepi8_epi16(_mm_set1_epi32(four_bytes(x + i)));
        const int8_t *wk = block + i * width;
        PREFETCH_WEIGHT(wk);
        if (G > 4) PREFETCH_WEIGHT(wk + 64);
        if (G > 8) PREFETCH_WEIGHT(wk + 128);
        for (int g = 0; g < G; g++)
            acc[g] = _mm256_add_epi32(
                acc[g], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wk + 16 * g))), xv));
    }
    for (int g = 0; g < G; g++) {
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, acc[g]);
        for (int q = 0; q < 4; q++) sums[4 * g + q] = lanes[2 * q] + lanes[2 * q + 1];
    }
#else
    for (int64_t c = 0; c < width; c++) sums[c] = 0;
    for (int64_t i = 0; i < kp; i += 4)
        for (int64_t c = 0; c < width; c++)
            for (int j = 0; j < 4; j++) sums[c] += (int32_t)x[i + j] * block[i * width + 4 * c + j];
#endif
}

static void w8_block(const uint8_t *xq, int64_t rows, int64_t kp, const int8_t *packed, const int32_t *rowsum,
                     const float *w_scale, const float *x_scale, int64_t n, int64_t b, void *out, int out_bf16,
                     int32_t *partial) {
    (void)rowsum;
    (void)partial;
    const int64_t np = pad_to(n, W8_COLS), width = np - b < W8_BLOCK ? np - b : W8_BLOCK;
    const int8_t *block = packed + b * kp;
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *x = (const int8_t *)xq + r * kp;
        int32_t sums[W8_BLOCK];
        if (width == 48)
            w8_row(x, kp, block, sums, 12);
        else if (width == 32)
            w8_row(x, kp, block, sums, 8);
        else
            w8_row(x, kp, block, sums, 4);
        for (int64_t c = 0; c < width && b + c < n; c++)
            store(out, r * n + b + c, (float)sums[c] * w_scale[b + c] * x_scale[r], out_bf16);
    }
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

/* out [rows][n] (fp32, or bf16 where out_bf16) = x [rows][k] (fp32, or bf16 where x_bf16), quantized here per row,
 * times the packed weight (overlap_w8a8_pack) with its row sums and scales. Any number of rows: 1 for a decode step,
 * thousands for a prefill; each thread a contiguous run of column blocks, every row tile against a block while it is
 * in cache. 0, or -1 for bad arguments or no memory. */
int overlap_w8a8(const void *x, int64_t x_stride, int x_bf16, int64_t rows, const int8_t *packed,
                 const int32_t *rowsum, const float *w_scale, int64_t n, int64_t k, void *out, int out_bf16,
                 int threads) {
    if (rows < 1 || k < 1 || k > MAX_K || n < 1 || threads < 1) return -1;
    const int64_t kp = pad_to(k, 4), blocks = (pad_to(n, W8_COLS) + W8_BLOCK - 1) / W8_BLOCK;
    uint8_t *xq = malloc((size_t)(rows * kp));
    float *xs = malloc(sizeof(float) * rows);
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    const size_t elem = x_bf16 ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
    /* one parallel region a call: a step's barriers stay few when the engine's host thread shares the cores */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            int8_t *q = (int8_t *)xq + r * kp;
            const void *row = (const char *)x + r * x_stride * elem;
            if (x_bf16)
                quantize_row(row, k, q, xs + r, 1);
            else
                quantize_row(row, k, q, xs + r, 0);
            for (int64_t i = k; i < kp; i++) q[i] = 0; /* padding meets zero weights */
#if VNNI
            for (int64_t i = 0; i < kp; i++) xq[r * kp + i] ^= 0x80; /* x + 128 as unsigned bytes for vpdpbusd */
#endif
        }
        int32_t *partial = rows > W8_TILE_ROWS ? malloc(sizeof(int32_t) * W8_BLOCK * rows) : NULL;
        if (rows > W8_TILE_ROWS && !partial) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < blocks; blk++)
                w8_block(xq, rows, kp, packed, rowsum, w_scale, xs, n, blk * W8_BLOCK, out, out_bf16, partial);
        }
        free(partial);
    }
    free(xq);
    free(xs);
    return failed ? -1 : 0;
}
