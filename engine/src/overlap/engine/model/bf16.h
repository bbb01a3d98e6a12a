/* bf16 <-> fp32 for the native kernels (paged_attention.c, cpu_ops.c); a bf16 is held as its uint16_t bits. */
#ifndef OVERLAP_BF16_H
#define OVERLAP_BF16_H

#include <stdint.h>
#include <string.h>

/* bf16 is the top half of an fp32: widening is a shift, which the compiler vectorises. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a q, K, V, activation or table array: `bf16` is a constant at every call site, so each variant
 * compiles to plain loads and stores. */
static inline __attribute__((always_inline)) float load(const void *base, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store(void *base, int64_t i, float value, const int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(value);
    else
        ((float *)base)[i] = value;
}

#endif
