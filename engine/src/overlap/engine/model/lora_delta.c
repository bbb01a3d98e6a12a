/* A step's LoRA delta for one projection in one call (model/lora.py's CPU path): for every row r with an adapter slot
 * s = slots[r] >= 0, y[r] += B[s] (A[s] x[r]). torch ran it as a gather, two small matmuls, a gather, an add and a
 * scatter per adapter in use, for every projection of every layer, and at decode batch sizes those ops' fixed costs
 * were most of the step. A prefill of one adapter's rows (above `LoraKernel.ROWS_ONE_ADAPTER`) goes back to them.
 *
 * The rows come ordered by slot (`order`), so the rows of one adapter follow each other; up to 4 of them make a block
 * that reads each vector of A and B once for all its rows, the block's sums held in registers. Shrink: each (block, 4
 * ranks) unit dots 4 rows of A with the block's x rows, the units shared among the threads. Expand: the output
 * columns split into tiles among the threads; a tile takes every block in turn, 2 vectors of columns at a time summed
 * over the ranks. B is stored transposed per slot, [slots, R, out], so a rank's row of it is contiguous across output
 * columns.
 *
 * B is block-diagonal: q, k and v (gate and up) are column segments of one projection, each with its own ranks, and
 * an adapter of rank 8 under a maximum of 16 leaves half of them zero. `spans` [slots, segments, 2] holds, per slot
 * and column segment, the ranks [lo, hi) where B is not zero (lora.py derives it from B when a slot is filled), and
 * the sums skip the rest: they would only add zeros.
 *
 * Sums are fp32; y is rounded once. Built with paged_attention.c and cpu_ops.c into one library by native.py (cc -O3
 * -march=native -fopenmp); GCC's vector extensions give one register's width: AVX-512 where the CPU has it, AVX2 else.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX512F__
#define LANES 16
#define SHRINK_ROWS 4
#else
#define LANES 8
#define SHRINK_ROWS 2 /* 16 registers: 8 sums, 4 of A, one of x */
#endif
enum { RANKS = 4, EXPAND_ROWS = 4, CHUNKS = 2, WIDTH = CHUNKS * LANES, COL_TILE = 256, MAX_BLOCK = 4 };

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline __attribute__((always_inline)) vf vload(const void *base, int64_t i, const int bf16) {
    vf f;
    if (bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        const vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)base + i, sizeof f);
    }
    return f;
}

/* Rounded to nearest even, NaN kept a NaN: f32_to_bf16 a vector at a time. */
static inline __attribute__((always_inline)) void vstore(void *base, int64_t i, vf v, const int bf16) {
    if (bf16) {
        vu u;
        memcpy(&u, &v, sizeof u);
        const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
        const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
        const vh h = __builtin_convertvector((quiet & nan) | (rounded & ~nan), vh);
        memcpy((uint16_t *)base + i, &h, sizeof h);
    } else {
        memcpy((float *)base + i, &v, sizeof v);
    }
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* The ranks [*lo, *hi) where slot's B is not zero over output columns [c0, c1); *lo >= *hi when none. */
static inline void rank_span(const int32_t *spans, const int32_t *seg_cols, int32_t segments, int32_t slot, int32_t c0,
                             int32_t c1, int32_t *lo, int32_t *hi) {
    *lo = INT32_MAX, *hi = 0;
    for (int32_t s = 0; s < segments; s++) {
        const int32_t *span = spans + ((int64_t)slot * segments + s) * 2;
        if (seg_cols[s] < c1 && seg_cols[s + 1] > c0 && span[0] < span[1]) {
            *lo = span[0] < *lo ? span[0] : *lo;
            *hi = span[1] > *hi ? span[1] : *hi;
        }
    }
}

/* h[i + r][j0 .. j0 + 4) = A[slot][j] . x[order[i + r]] for the block's NB rows (ranks past R computed, not stored). */
static inline __attribute__((always_inline)) void shrink_block(const void *x, int64_t x_stride, const int32_t *order,
                                                               int32_t i, int32_t slot, int32_t j0, const void *a,
                                                               int32_t rank, int32_t inputs, float *h, const int NB,
                                                               const int bf16) {
    int64_t at[RANKS], x_at[MAX_BLOCK];
    for (int q = 0; q < RANKS; q++) at[q] = ((int64_t)slot * rank + (j0 + q < rank ? j0 + q : rank - 1)) * inputs;
    for (int r = 0; r < NB; r++) x_at[r] = (int64_t)order[i + r] * x_stride;
    vf acc[MAX_BLOCK][RANKS];
    for (int r = 0; r < NB; r++)
        for (int q = 0; q < RANKS; q++) acc[r][q] = (vf){0};
    int32_t k = 0;
    for (; k + LANES <= inputs; k += LANES) {
        vf av[RANKS];
        for (int q = 0; q < RANKS; q++) av[q] = vload(a, at[q] + k, bf16);
        for (int r = 0; r < NB; r++) {
            const vf xv = vload(x, x_at[r] + k, bf16);
            for (int q = 0; q < RANKS; q++) acc[r][q] += xv * av[q];
        }
    }
    for (int r = 0; r < NB; r++)
        for (int q = 0; q < RANKS && j0 + q < rank; q++) {
            float s = hsum(acc[r][q]);
            for (int32_t t = k; t < inputs; t++) s += load(x, x_at[r] + t, bf16) * load(a, at[q] + t, bf16);
            h[(int64_t)(i + r) * rank + j0 + q] = s;
        }
}

/* y[order[i + r]][o0 .. o1) += sum over j of h[i + r][j] B^T[slot][j] for the block's NB rows. */
static inline __attribute__((always_inline)) void expand_block(void *y, int64_t y_stride, const int32_t *order,
                                                               int32_t i, int32_t slot, const void *bt, int32_t rank,
                                                               int32_t outputs, const float *h, const int32_t *spans,
                                                               const int32_t *seg_cols, int32_t segments, int32_t o0,
                                                               int32_t o1, const int NB, const int bf16) {
    const int64_t b_at = (int64_t)slot * rank * outputs;
    int64_t y_at[MAX_BLOCK];
    for (int r = 0; r < NB; r++) y_at[r] = (int64_t)order[i + r] * y_stride;
    const float *hi = h + (int64_t)i * rank;
    for (int32_t c = o0; c < o1; c += WIDTH) {
        const int32_t width = o1 - c < WIDTH ? o1 - c : WIDTH;
        int32_t lo, up;
        rank_span(spans, seg_cols, segments, slot, c, c + width, &lo, &up);
        if (lo >= up)
            continue;
        if (width == WIDTH) {
            vf acc[MAX_BLOCK][CHUNKS];
            for (int r = 0; r < NB; r++)
                for (int v = 0; v < CHUNKS; v++) acc[r][v] = (vf){0};
            for (int32_t j = lo; j < up; j++) {
                vf b[CHUNKS];
                for (int v = 0; v < CHUNKS; v++) b[v] = vload(bt, b_at + (int64_t)j * outputs + c + v * LANES, bf16);
                for (int r = 0; r < NB; r++) {
                    const float hj = hi[(int64_t)r * rank + j];
                    for (int v = 0; v < CHUNKS; v++) acc[r][v] += b[v] * hj;
                }
            }
            for (int r = 0; r < NB; r++)
                for (int v = 0; v < CHUNKS; v++) {
                    const int64_t at = y_at[r] + c + v * LANES;
                    vstore(y, at, vload(y, at, bf16) + acc[r][v], bf16);
                }
        } else { /* the last columns of a tile that is not a whole number of WIDTHs */
            for (int r = 0; r < NB; r++)
                for (int32_t o = c; o < c + width; o++) {
                    float s = 0.0f;
                    for (int32_t j = lo; j < up; j++) s += hi[(int64_t)r * rank + j] * load(bt, b_at + (int64_t)j * outputs + o, bf16);
                    store(y, y_at[r] + o, load(y, y_at[r] + o, bf16) + s, bf16);
                }
        }
    }
}

/* The rows i .. i + n of `order` that share row i's slot, n at most `most`. */
static inline int32_t block_rows(const int32_t *order, const int32_t *slots, int32_t rows, int32_t i, int32_t most) {
    int32_t n = 1;
    while (n < most && i + n < rows && slots[order[i + n]] == slots[order[i]]) n++;
    return n;
}

static inline __attribute__((always_inline)) void delta(const void *x, int64_t x_stride, void *y, int64_t y_stride,
                                                        const int32_t *order, const int32_t *slots, int32_t rows,
                                                        const int32_t *starts, int32_t blocks, const void *a,
                                                        const void *bt, int32_t rank, int32_t inputs, int32_t outputs,
                                                        const int32_t *spans, const int32_t *seg_cols,
                                                        int32_t segments, float *h, const int bf16) {
    const int32_t rank_blocks = (rank + RANKS - 1) / RANKS;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < (int64_t)blocks * rank_blocks; u++) {
        const int32_t i = starts[u / rank_blocks], j0 = (int32_t)(u % rank_blocks) * RANKS, slot = slots[order[i]];
        int32_t lo, up;
        rank_span(spans, seg_cols, segments, slot, 0, outputs, &lo, &up);
        if (j0 + RANKS <= lo || j0 >= up)
            continue; /* ranks the expand never reads */
        const int32_t n = block_rows(order, slots, rows, i, SHRINK_ROWS);
        switch (n) {
#if SHRINK_ROWS > 2
        case 4: shrink_block(x, x_stride, order, i, slot, j0, a, rank, inputs, h, 4, bf16); break;
        case 3: shrink_block(x, x_stride, order, i, slot, j0, a, rank, inputs, h, 3, bf16); break;
#endif
        case 2: shrink_block(x, x_stride, order, i, slot, j0, a, rank, inputs, h, 2, bf16); break;
        default: shrink_block(x, x_stride, order, i, slot, j0, a, rank, inputs, h, 1, bf16); break;
        }
    }
    /* the barrier that ends the loop above: every h is written before the expand reads it */
    const int32_t tiles = (outputs + COL_TILE - 1) / COL_TILE;
#pragma omp for schedule(static)
    for (int32_t t = 0; t < tiles; t++) {
        const int32_t o0 = t * COL_TILE, o1 = o0 + COL_TILE < outputs ? o0 + COL_TILE : outputs;
        for (int32_t i = 0, n; i < rows; i += n) {
            const int32_t slot = slots[order[i]];
            n = block_rows(order, slots, rows, i, EXPAND_ROWS);
            switch (n) {
            case 4: expand_block(y, y_stride, order, i, slot, bt, rank, outputs, h, spans, seg_cols, segments, o0, o1, 4, bf16); break;
            case 3: expand_block(y, y_stride, order, i, slot, bt, rank, outputs, h, spans, seg_cols, segments, o0, o1, 3, bf16); break;
            case 2: expand_block(y, y_stride, order, i, slot, bt, rank, outputs, h, spans, seg_cols, segments, o0, o1, 2, bf16); break;
            default: expand_block(y, y_stride, order, i, slot, bt, rank, outputs, h, spans, seg_cols, segments, o0, o1, 1, bf16); break;
            }
        }
    }
}

/* y[order[i]] += B[s] (A[s] x[order[i]]), s = slots[order[i]], for i < rows (rows ordered by slot, each once; rows
 * not in `order` untouched). x [*, inputs] and y [*, outputs] rows x_stride and y_stride elements apart; A
 * [slots, rank, inputs] and B^T [slots, rank, outputs] contiguous; all fp32, or all bf16 (`bf16` = 1). `seg_cols`
 * [segments + 1]: where each column segment of y starts, then `outputs`; `spans` [slots, segments, 2]: the ranks
 * where B is not zero in each. `threads` OpenMP threads. Returns 0, or -1 when its scratch cannot be allocated. */
int overlap_lora_delta(const void *x, int64_t x_stride, void *y, int64_t y_stride, const int32_t *order,
                       const int32_t *slots, int32_t rows, const void *a, const void *bt, int32_t rank, int32_t inputs,
                       int32_t outputs, const int32_t *spans, const int32_t *seg_cols, int32_t segments, int32_t bf16,
                       int32_t threads) {
    if (rows < 1 || rank < 1)
        return 0;
    float *h = malloc((size_t)rows * rank * sizeof(float)); /* each row's A x */
    int32_t *starts = malloc((size_t)rows * sizeof(int32_t)); /* where each shrink block of rows begins */
    if (h == NULL || starts == NULL) {
        free(h), free(starts);
        return -1;
    }
    int32_t blocks = 0;
    for (int32_t i = 0; i < rows; i += block_rows(order, slots, rows, i, SHRINK_ROWS)) starts[blocks++] = i;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (bf16)
            delta(x, x_stride, y, y_stride, order, slots, rows, starts, blocks, a, bt, rank, inputs, outputs, spans,
                  seg_cols, segments, h, 1);
        else
            delta(x, x_stride, y, y_stride, order, slots, rows, starts, blocks, a, bt, rank, inputs, outputs, spans,
                  seg_cols, segments, h, 0);
    }
    free(h), free(starts);
    return 0;
}
