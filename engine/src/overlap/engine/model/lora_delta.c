/* A step's LoRA delta for one projection in one call (model/lora.py's CPU path): for every row r with an adapter slot
 * s = slots[r] >= 0, y[r] += B[s] (A[s] x[r]). torch ran it as a gather, two small matmuls, a gather, an add and a
 * scatter per adapter in use, for every projection of every layer, and at decode batch sizes those ops' fixed costs
 * were most of the step.
 *
 * The rows come ordered by slot (`order`), so the rows of one adapter follow each other and read its A and B from
 * cache after the first. Shrink: each (row, 4 ranks) unit dots 4 rows of A with x[r] (4 sums in flight, x read once),
 * the units shared among the threads. Expand: the output columns split into tiles among the threads; a tile takes
 * every row in turn, LANES columns at a time summed over the ranks. B is stored transposed per slot, [slots, R, out],
 * so a rank's row of it is contiguous across output columns and the sums vectorise along them. Sums are fp32; y is rounded once.
 *
 * Built with paged_attention.c and cpu_ops.c into one library by native.py (cc -O3 -march=native -fopenmp; plain
 * loops the compiler vectorises, on AVX2 and AVX-512 alike).
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

enum { RANKS = 4, COL_TILE = 256, LANES = 32 };

static inline __attribute__((always_inline)) void shrink(const void *x, int64_t x_stride, const int32_t *order,
                                                         const int32_t *slots, int64_t units, const void *a,
                                                         int32_t rank, int32_t inputs, float *h, const int bf16) {
    const int32_t blocks = (rank + RANKS - 1) / RANKS;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t i = u / blocks, j0 = (u % blocks) * RANKS, x_at = (int64_t)order[i] * x_stride;
        int64_t at[RANKS]; /* past the last rank, the last one again (computed, not stored) */
        for (int q = 0; q < RANKS; q++)
            at[q] = ((int64_t)slots[order[i]] * rank + (j0 + q < rank ? j0 + q : rank - 1)) * inputs;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int32_t k = 0; k < inputs; k++) {
            const float v = load(x, x_at + k, bf16);
            s0 += v * load(a, at[0] + k, bf16);
            s1 += v * load(a, at[1] + k, bf16);
            s2 += v * load(a, at[2] + k, bf16);
            s3 += v * load(a, at[3] + k, bf16);
        }
        const float sums[RANKS] = {s0, s1, s2, s3};
        for (int q = 0; q < RANKS && j0 + q < rank; q++) h[i * rank + j0 + q] = sums[q];
    }
}

static inline __attribute__((always_inline)) void expand(void *y, int64_t y_stride, const int32_t *order,
                                                         const int32_t *slots, int32_t rows, const void *bt,
                                                         int32_t rank, int32_t outputs, const float *h,
                                                         const int bf16) {
    const int32_t tiles = (outputs + COL_TILE - 1) / COL_TILE;
#pragma omp for schedule(static)
    for (int32_t t = 0; t < tiles; t++) {
        const int32_t o0 = t * COL_TILE, o1 = o0 + COL_TILE < outputs ? o0 + COL_TILE : outputs;
        for (int32_t i = 0; i < rows; i++) {
            const int64_t y_at = (int64_t)order[i] * y_stride, b_at = (int64_t)slots[order[i]] * rank * outputs;
            const float *hi = h + (int64_t)i * rank;
            for (int32_t c = o0; c < o1; c += LANES) {
                const int32_t width = o1 - c < LANES ? o1 - c : LANES;
                float acc[LANES] = {0.0f};
                for (int32_t j = 0; j < rank; j++) {
                    const float hj = hi[j];
                    const int64_t row = b_at + (int64_t)j * outputs + c;
                    if (width == LANES) {
#pragma omp simd
                        for (int32_t o = 0; o < LANES; o++) acc[o] += hj * load(bt, row + o, bf16);
                    } else {
                        for (int32_t o = 0; o < width; o++) acc[o] += hj * load(bt, row + o, bf16);
                    }
                }
#pragma omp simd
                for (int32_t o = 0; o < width; o++) store(y, y_at + c + o, load(y, y_at + c + o, bf16) + acc[o], bf16);
            }
        }
    }
}

/* y[order[i]] += B[s] (A[s] x[order[i]]), s = slots[order[i]], for i < rows (rows ordered by slot, each once; rows
 * not in `order` untouched). x [*, inputs] and y [*, outputs] rows x_stride and y_stride elements apart; A
 * [slots, rank, inputs] and B^T [slots, rank, outputs] contiguous; all fp32, or all bf16 (`bf16` = 1). `threads`
 * OpenMP threads. Returns 0, or -1 when its scratch cannot be allocated. */
int overlap_lora_delta(const void *x, int64_t x_stride, void *y, int64_t y_stride, const int32_t *order,
                       const int32_t *slots, int32_t rows, const void *a, const void *bt, int32_t rank, int32_t inputs,
                       int32_t outputs, int32_t bf16, int32_t threads) {
    if (rows < 1 || rank < 1)
        return 0;
    float *h = malloc((size_t)rows * rank * sizeof(float)); /* each row's A x */
    if (h == NULL)
        return -1;
    const int64_t units = (int64_t)rows * ((rank + RANKS - 1) / RANKS);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (bf16) {
            shrink(x, x_stride, order, slots, units, a, rank, inputs, h, 1);
            expand(y, y_stride, order, slots, rows, bt, rank, outputs, h, 1); /* after the barrier that ends shrink */
        } else {
            shrink(x, x_stride, order, slots, units, a, rank, inputs, h, 0);
            expand(y, y_stride, order, slots, rows, bt, rank, outputs, h, 0);
        }
    }
    free(h);
    return 0;
}
