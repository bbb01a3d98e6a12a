/* Projections at decode sizes (1-64 rows) on CPUs with AVX-512, fp32 or bf16 (with AVX512-BF16), and in fp32 on CPUs
 * with AVX2 alone, reading the weight in the blocked layout oneDNN packs it into, so the runner keeps one copy of every
 * weight and oneDNN serves the larger (prefill) steps.
 *
 * At these sizes oneDNN streams an out-of-cache weight at 50-75% of the read bandwidth. Here every thread streams one
 * contiguous run of the packed weight, once per call, asking for it in L2 ahead of use, and each 16 KiB chunk of it
 * serves every row from L1. docs/engine.md ("Real sizes") has the measurements against oneDNN on the same weights.
 *
 * The layouts (layers/linear.py checks them on the running CPU before the runner uses this): output columns in blocks
 * of 64; within a block, in bf16, for each pair of inputs (k, k + 1) the 64 columns' two values side by side, so one
 * 512-bit load holds 16 outputs x 2 inputs, what `vdpbf16ps` multiplies against a broadcast pair of x; in fp32, for
 * each input the 64 columns' values. K is padded with zeros (to 32 in bf16, 16 in fp32), N to a multiple of 64. Sums
 * are fp32 (in bf16, of pairs of products, as oneDNN's kernels on this ISA); the bias is added and SiLU applied in fp32,
 * and a bf16 output is rounded once. oneDNN limited to AVX2 packs fp32 weights the same way for most shapes (a few
 * narrow ones in blocks of 16 columns, which the runner's one-row check sends back to oneDNN); there a 256-bit register
 * holds 8 outputs, so a tile covers half a block, 3 rows x 32 columns, and each chunk is read twice, from L1.
 *
 * `overlap_experts_packed` runs a mixture of experts' gated MLPs the same way, every active expert over its own rows
 * in one parallel region (one work item per expert and 64-column block), so a decode step of 128 experts pays one
 * fork and two barriers a layer instead of three calls per expert.
 *
 * Built into its own library with -fopenmp: the shared object names libgomp.so.1, which resolves to the copy torch has
 * already loaded, so this kernel's threads are torch's OpenMP threads.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#if defined(__AVX512BF16__)
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

/* A chunk is 64 steps of 256 bytes of weight (a pair of bf16 inputs, or one fp32 input, for 64 outputs). */
enum { BLOCK_COLS = 64, CHUNK_STEPS = 64, TILE_ROWS = 6, MAX_ROWS = 64 };
/* How far ahead (bf16 elements, 64 KiB) the first row tile asks for the weight in L2: far enough to cover the DRAM
 * latency of a chunk, near enough to stay in a 1 MiB L2. */
enum { PREFETCH_AHEAD = 32768 };

#if HAVE_BF16
/* acc[r][0..63] (+)= sum over pairs p0..p1-1 of x[r] pair p times the block's columns: R rows, 4 x 16 columns. */
static inline __attribute__((always_inline)) void tile(const int R, const uint32_t *x, int64_t x_stride32,
                                                       const uint16_t *w, int64_t p0, int64_t p1, float *acc,
                                                       int first_chunk, int prefetch) {
    __m512 a[TILE_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *wp = w + p * 2 * BLOCK_COLS;
        if (prefetch)
            for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(wp + PREFETCH_AHEAD + 32 * line), _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * x_stride32 + p]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, w1);
            a[r][2] = _mm512_dpbf16_ps(a[r][2], xv, w2);
            a[r][3] = _mm512_dpbf16_ps(a[r][3], xv, w3);
        }
    }
    for (int r = 0; r < R; r++) /* each chunk summed on its own, then added: rounding grows with chunks, not inputs */
        for (int c = 0; c < 4; c++) {
            float *to = acc + r * BLOCK_COLS + 16 * c;
            _mm512_store_ps(to, first_chunk ? a[r][c] : _mm512_add_ps(a[r][c], _mm512_load_ps(to)));
        }
}

#endif

/* The fp32 layout: [N/64][K_padded][64], one input column's 64 outputs per 256 bytes. */
static inline __attribute__((always_inline)) void tile_f32(const int R, const float *x, int64_t x_stride,
                                                           const float *w, int64_t k0, int64_t k1, float *acc,
                                                           int first_chunk, int prefetch) {
    __m512 a[TILE_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const float *wk = w + k * BLOCK_COLS;
        if (prefetch)
            for (int line = 0; line < 4; line++)
                _mm_prefetch((const char *)(wk + PREFETCH_AHEAD / 2 + 16 * line), _MM_HINT_T1);
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
            a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(xv, w3, a[r][3]);
        }
    }
    for (int r = 0; r < R; r++) /* each chunk summed on its own, then added: rounding grows with chunks, not inputs */
        for (int c = 0; c < 4; c++) {
            float *to = acc + r * BLOCK_COLS + 16 * c;
            _mm512_store_ps(to, first_chunk ? a[r][c] : _mm512_add_ps(a[r][c], _mm512_load_ps(to)));
        }
}

#if HAVE_BF16
static void run_tile(int R, const uint32_t *x, int64_t x_stride32, const uint16_t *w, int64_t p0, int64_t p1,
                     float *acc, int first_chunk, int prefetch) {
    switch (R) { /* a constant R per call, so each tile's loops unroll into registers */
    case 1: tile(1, x, x_stride32, w, p0, p1, acc, first_chunk, prefetch); break;
    case 2: tile(2, x, x_stride32, w, p0, p1, acc, first_chunk, prefetch); break;
    case 3: tile(3, x, x_stride32, w, p0, p1, acc, first_chunk, prefetch); break;
    case 4: tile(4, x, x_stride32, w, p0, p1, acc, first_chunk, prefetch); break;
    case 5: tile(5, x, x_stride32, w, p0, p1, acc, first_chunk, prefetch); break;
    default: tile(6, x, x_stride32, w, p0, p1, acc, first_chunk, prefetch); break;
    }
}
#endif

static void run_tile_f32(int R, const float *x, int64_t x_stride, const float *w, int64_t k0, int64_t k1, float *acc,
                         int first_chunk, int prefetch) {
    switch (R) {
    case 1: tile_f32(1, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    case 2: tile_f32(2, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    case 3: tile_f32(3, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    case 4: tile_f32(4, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    case 5: tile_f32(5, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    default: tile_f32(6, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    }
}

/* exp(v) to a few fp32 ulps (ample for a bf16 output): 2^n * e^r with |r| <= ln2/2, e^r by its Taylor series. */
static inline __m512 exp_ps(__m512 v) {
    v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), v);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Rows of the block's fp32 sums, plus the bias, through SiLU if asked, to y (bf16, rounded once, or fp32). */
static inline __attribute__((always_inline)) void store_block(const float *acc, int64_t rows, const void *bias,
                                                              int64_t n0, int64_t cols, int silu, void *y,
                                                              int64_t y_stride, const int bf16) {
    for (int c = 0; c < 4 && 16 * c < cols; c++) {
        const int64_t left = cols - 16 * c, at = n0 + 16 * c;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 b = _mm512_setzero_ps();
#if HAVE_BF16
        if (bias && bf16) /* bf16 -> fp32 is a shift into the top half */
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + at)), 16));
        else
#endif
            if (bias)
            b = _mm512_maskz_loadu_ps(mask, (const float *)bias + at);
        for (int64_t m = 0; m < rows; m++) {
            __m512 v = _mm512_add_ps(_mm512_load_ps(acc + m * BLOCK_COLS + 16 * c), b);
            if (silu) /* v * sigmoid(v) */
                v = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
#if HAVE_BF16
            if (bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + m * y_stride + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
            else
#endif
                _mm512_mask_storeu_ps((float *)y + m * y_stride + at, mask, v);
        }
    }
}

/* a bf16 rounding of each lane (to nearest even, as torch rounds a bf16 result), back in fp32 */
static inline __m512 round_bf16(__m512 v) {
#if HAVE_BF16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
    return v; /* no bf16 without AVX512-BF16: never called */
#endif
}

/* Rows of silu(gate) * up to y, from their blocks' fp32 sums; in bf16 each factor and the product rounded to bf16,
 * as the two projections' bf16 outputs multiplied by torch would be. */
static inline __attribute__((always_inline)) void store_gated(const float *gate, const float *up, int64_t rows,
                                                              int64_t n0, int64_t cols, void *y, int64_t y_stride,
                                                              const int bf16) {
    for (int c = 0; c < 4 && 16 * c < cols; c++) {
        const int64_t left = cols - 16 * c, at = n0 + 16 * c;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int64_t m = 0; m < rows; m++) {
            __m512 g = _mm512_load_ps(gate + m * BLOCK_COLS + 16 * c), u = _mm512_load_ps(up + m * BLOCK_COLS + 16 * c);
            g = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
#if HAVE_BF16
            if (bf16) {
                const __m512 v = _mm512_mul_ps(round_bf16(g), round_bf16(u));
                _mm256_mask_storeu_epi16((uint16_t *)y + m * y_stride + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
            } else
#endif
                _mm512_mask_storeu_ps((float *)y + m * y_stride + at, mask, _mm512_mul_ps(g, u));
        }
    }
}

/* acc[m][0..63] = x[m] times one 64-column block of the packed weight (wb: the block's start), m < rows. */
static void block_sums(const void *x, int64_t x_stride, int64_t rows, const void *wb, int64_t K, float *acc,
                       const int bf16) {
    const int64_t steps = bf16 ? K / 2 : K; /* k pairs or k */
    for (int64_t s0 = 0; s0 < steps; s0 += CHUNK_STEPS) {
        const int64_t s1 = s0 + CHUNK_STEPS < steps ? s0 + CHUNK_STEPS : steps;
        for (int64_t m = 0; m < rows; m += TILE_ROWS) {
            const int R = rows - m < TILE_ROWS ? (int)(rows - m) : TILE_ROWS;
#if HAVE_BF16
            if (bf16)
                run_tile(R, (const uint32_t *)((const uint16_t *)x + m * x_stride), x_stride / 2,
                         (const uint16_t *)wb, s0, s1, acc + m * BLOCK_COLS, s0 == 0, m == 0);
            else
#endif
                run_tile_f32(R, (const float *)x + m * x_stride, x_stride, (const float *)wb, s0, s1,
                             acc + m * BLOCK_COLS, s0 == 0, m == 0);
        }
    }
}

#define PACKED_DTYPES (1 | (HAVE_BF16 << 1)) /* 1: fp32, 2: bf16 */
#define PACKED_ISA 512

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

enum { BLOCK_COLS = 64, HALF_COLS = 32, CHUNK_STEPS = 64, TILE_ROWS = 3, MAX_ROWS = 64 };
enum { PREFETCH_AHEAD = 16384 }; /* fp32 elements: 64 KiB ahead, as on AVX-512 */

/* acc[r][h*32 .. h*32+31] (+)= sum over inputs k0..k1-1 of x[r][k] times the block's half h: R rows, 4 x 8 columns. */
static inline __attribute__((always_inline)) void tile_avx2(const int R, const float *x, int64_t x_stride,
                                                            const float *w, int64_t k0, int64_t k1, float *acc,
                                                            int first_chunk, int prefetch) {
    __m256 a[TILE_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const float *wk = w + k * BLOCK_COLS;
        if (prefetch)
            for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(wk + PREFETCH_AHEAD + 16 * line), _MM_HINT_T1);
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        const __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(xv, w3, a[r][3]);
        }
    }
    for (int r = 0; r < R; r++) /* each chunk summed on its own, then added, as on AVX-512 */
        for (int c = 0; c < 4; c++) {
            float *to = acc + r * BLOCK_COLS + 8 * c;
            _mm256_store_ps(to, first_chunk ? a[r][c] : _mm256_add_ps(a[r][c], _mm256_load_ps(to)));
        }
}

static void run_tile_avx2(int R, const float *x, int64_t x_stride, const float *w, int64_t k0, int64_t k1, float *acc,
                          int first_chunk, int prefetch) {
    switch (R) {
    case 1: tile_avx2(1, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    case 2: tile_avx2(2, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    default: tile_avx2(3, x, x_stride, w, k0, k1, acc, first_chunk, prefetch); break;
    }
}

/* exp(v) as on AVX-512, 2^n put into the exponent bits (n stays within -127..127 for |v| <= 88). */
static inline __m256 exp_ps(__m256 v) {
    v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), v);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline __m256 silu_ps(__m256 v) { /* v * sigmoid(v) */
    return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

static inline float silu_one(float v) {
    float e[8] __attribute__((aligned(32)));
    _mm256_store_ps(e, exp_ps(_mm256_set1_ps(-v)));
    return v / (1.0f + e[0]);
}

/* Rows of the block's fp32 sums, plus the bias, through SiLU if asked, to y (fp32 only: `bf16` is 0). */
static void store_block(const float *acc, int64_t rows, const void *bias, int64_t n0, int64_t cols, int silu, void *y,
                        int64_t y_stride, const int bf16) {
    (void)bf16;
    for (int64_t m = 0; m < rows; m++) {
        float *out = (float *)y + m * y_stride + n0;
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8) {
            __m256 v = _mm256_load_ps(acc + m * BLOCK_COLS + c);
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps((const float *)bias + n0 + c));
            _mm256_storeu_ps(out + c, silu ? silu_ps(v) : v);
        }
        for (; c < cols; c++) { /* a block cut short by N */
            const float v = acc[m * BLOCK_COLS + c] + (bias ? ((const float *)bias)[n0 + c] : 0.0f);
            out[c] = silu ? silu_one(v) : v;
        }
    }
}

/* Rows of silu(gate) * up to y, from their blocks' fp32 sums (fp32 only). */
static void store_gated(const float *gate, const float *up, int64_t rows, int64_t n0, int64_t cols, void *y,
                        int64_t y_stride, const int bf16) {
    (void)bf16;
    for (int64_t m = 0; m < rows; m++) {
        float *out = (float *)y + m * y_stride + n0;
        const float *g = gate + m * BLOCK_COLS, *u = up + m * BLOCK_COLS;
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8)
            _mm256_storeu_ps(out + c, _mm256_mul_ps(silu_ps(_mm256_load_ps(g + c)), _mm256_load_ps(u + c)));
        for (; c < cols; c++) out[c] = silu_one(g[c]) * u[c];
    }
}

/* acc[m][0..63] = x[m] times one 64-column block of the packed fp32 weight (wb: the block's start), m < rows: each
 * chunk read twice from L1, a half block at a time. */
static void block_sums(const void *x, int64_t x_stride, int64_t rows, const void *wb, int64_t K, float *acc,
                       const int bf16) {
    (void)bf16;
    for (int64_t k0 = 0; k0 < K; k0 += CHUNK_STEPS) {
        const int64_t k1 = k0 + CHUNK_STEPS < K ? k0 + CHUNK_STEPS : K;
        for (int64_t m = 0; m < rows; m += TILE_ROWS) {
            const int R = rows - m < TILE_ROWS ? (int)(rows - m) : TILE_ROWS;
            for (int h = 0; h < 2; h++)
                run_tile_avx2(R, (const float *)x + m * x_stride, x_stride, (const float *)wb + h * HALF_COLS, k0, k1,
                              acc + m * BLOCK_COLS + h * HALF_COLS, k0 == 0, m == 0 && h == 0);
        }
    }
}

#define PACKED_DTYPES 1 /* fp32 */
#define PACKED_ISA 256

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

int overlap_linear_packed_dtypes(void) { return PACKED_DTYPES; }
int overlap_linear_packed_isa(void) { return PACKED_ISA; }

/* y[m][0..N) = x[m] W^T (+ bias) (then SiLU if `silu`), m < rows <= 64, over `threads` OpenMP threads, all of one
 * dtype: bf16 (`bf16` = 1; K even, x rows an even number of elements apart; AVX512-BF16 only) or fp32. W is oneDNN's
 * packed layout, [N/64][K_padded/2][64][2] in bf16 and [N/64][K_padded][64] in fp32; strides count elements. Returns
 * 0, or -1 for arguments it does not take (the caller checks them first). */
int overlap_linear_packed(const void *x, int64_t x_stride, int64_t rows, const void *w, int64_t N, int64_t K,
                          int64_t K_padded, const void *bias, int32_t silu, void *y, int64_t y_stride, int32_t threads,
                          int32_t bf16) {
    if (rows < 1 || rows > MAX_ROWS || K_padded < K || (bf16 && (!(PACKED_DTYPES & 2) || K % 2 || x_stride % 2)))
        return -1;
    const int64_t blocks = (N + BLOCK_COLS - 1) / BLOCK_COLS, size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[MAX_ROWS * BLOCK_COLS] __attribute__((aligned(64)));
        block_sums(x, x_stride, rows, (const char *)w + b * K_padded * BLOCK_COLS * size, K, acc, bf16);
        const int64_t n0 = b * BLOCK_COLS, cols = N - n0 < BLOCK_COLS ? N - n0 : BLOCK_COLS;
        store_block(acc, rows, bias, n0, cols, silu, y, y_stride, bf16);
    }
    return 0;
}

/* A mixture of experts' gated MLPs, y = down(silu(x gate^T) * (x up^T)), expert e over its counts[e] rows of x (the
 * rows sorted by expert, counts[e] <= 64, 0 for an expert no row chose), all in one parallel region: first every
 * active expert's gate and up blocks (into `act`, [rows, I]), then, after the region's barrier, its down blocks (into
 * y, [rows, H]). gate[e], up[e] ([I, H]) and down[e] ([H, I]) are the addresses of expert e's weights in the packed
 * layout above, with inputs padded to H_padded and I_padded; x, act and y are dense rows. Returns 0, or -1 for
 * arguments it does not take. */
int overlap_experts_packed(const void *x, const int64_t *counts, int64_t num_experts, const int64_t *gate,
                           const int64_t *up, const int64_t *down, int64_t H, int64_t H_padded, int64_t I,
                           int64_t I_padded, void *act, void *y, int32_t threads, int32_t bf16) {
    if (H_padded < H || I_padded < I || (bf16 && (!(PACKED_DTYPES & 2) || H % 2 || I % 2)))
        return -1;
    int64_t active = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (counts[e] < 0 || counts[e] > MAX_ROWS)
            return -1;
        active += counts[e] > 0;
    }
    if (active == 0)
        return 0;
    int64_t ids[active], starts[active]; /* the active experts and their first rows */
    for (int64_t e = 0, a = 0, row = 0; e < num_experts; row += counts[e], e++)
        if (counts[e]) ids[a] = e, starts[a++] = row;
    const int64_t size = bf16 ? 2 : 4, inter_blocks = (I + BLOCK_COLS - 1) / BLOCK_COLS;
    const int64_t hidden_blocks = (H + BLOCK_COLS - 1) / BLOCK_COLS;
#pragma omp parallel num_threads(threads)
    {
        float acc[MAX_ROWS * BLOCK_COLS] __attribute__((aligned(64)));
        float acc_up[MAX_ROWS * BLOCK_COLS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < active * inter_blocks; item++) {
            const int64_t a = item / inter_blocks, b = item % inter_blocks, e = ids[a], rows = counts[e];
            const char *xa = (const char *)x + starts[a] * H * size;
            const int64_t block = b * H_padded * BLOCK_COLS * size, n0 = b * BLOCK_COLS;
            block_sums(xa, H, rows, (const char *)(intptr_t)gate[e] + block, H, acc, bf16);
            block_sums(xa, H, rows, (const char *)(intptr_t)up[e] + block, H, acc_up, bf16);
            store_gated(acc, acc_up, rows, n0, I - n0 < BLOCK_COLS ? I - n0 : BLOCK_COLS,
                        (char *)act + starts[a] * I * size, I, bf16);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < active * hidden_blocks; item++) {
            const int64_t a = item / hidden_blocks, b = item % hidden_blocks, e = ids[a], rows = counts[e];
            const int64_t n0 = b * BLOCK_COLS;
            block_sums((const char *)act + starts[a] * I * size, I, rows,
                       (const char *)(intptr_t)down[e] + b * I_padded * BLOCK_COLS * size, I, acc, bf16);
            store_block(acc, rows, 0, n0, H - n0 < BLOCK_COLS ? H - n0 : BLOCK_COLS, 0,
                        (char *)y + starts[a] * H * size, H, bf16);
        }
    }
    return 0;
}

#else /* neither AVX-512 nor AVX2 on the CPU this was built for: the runner keeps oneDNN */

int overlap_linear_packed_dtypes(void) { return 0; }
int overlap_linear_packed_isa(void) { return 0; }

int overlap_linear_packed(const void *x, int64_t x_stride, int64_t rows, const void *w, int64_t N, int64_t K,
                          int64_t K_padded, const void *bias, int32_t silu, void *y, int64_t y_stride, int32_t threads,
                          int32_t bf16) {
    (void)x, (void)x_stride, (void)rows, (void)w, (void)N, (void)K, (void)K_padded, (void)bias, (void)silu, (void)y;
    (void)y_stride, (void)threads, (void)bf16;
    return -1;
}

int overlap_experts_packed(const void *x, const int64_t *counts, int64_t num_experts, const int64_t *gate,
                           const int64_t *up, const int64_t *down, int64_t H, int64_t H_padded, int64_t I,
                           int64_t I_padded, void *act, void *y, int32_t threads, int32_t bf16) {
    (void)x, (void)counts, (void)num_experts, (void)gate, (void)up, (void)down, (void)H, (void)H_padded, (void)I;
    (void)I_padded, (void)act, (void)y, (void)threads, (void)bf16;
    return -1;
}

#endif
