/* Quantized projections on CPU: 4-bit weights with 16-bit activations (W4A16), and int8 weights with int8 activations
 * quantized per token (W8A8); and the 4-bit weight dequantized into a float buffer, for the large steps that oneDNN's
 * matmul then serves.
 *
 * A decode step streams every weight once, so these kernels read the fewest bytes: half a byte (W4A16) or one byte
 * (W8A8) a weight, each thread one contiguous run of outputs, each weight read from memory once a step and from cache
 * for the further rows of x.
 *
 * Layouts (quant/kernels.py makes them at load):
 * - W4A16: codes [N][K/2] bytes, byte i holding input 2i in its low nibble and 2i + 1 in its high one (GPTQ's and
 *   compressed-tensors' order within a word). scale and zero [N][K/G] fp32: W[n][k] = (code - zero) * scale. Sums
 *   are fp32: per group sum(code * x), then scale * (that - zero * sum(x)). With AVX512-BF16 and bf16 x, the codes
 *   become bf16 through one table lookup and each pair of inputs is one vdpbf16ps lane (twice fp32's multiply-adds);
 *   else the low and high nibbles meet x's even and odd inputs, split once per call. For steps of more rows (bf16 x on
 *   AVX512-BF16) a block of codes is made bf16 in cache in vdpbf16ps' operand layout and read by tiles of 8 rows.
 * - W8A8: weight int8 (symmetric) packed at load into vpdpbusd's operand layout (quant_w8a8.c: 48-column blocks of
 *   [K/4][48][4] bytes), its row sums, a scale per row. x is quantized here per row, as compressed-tensors does it
 *   (scale = absmax / 127.5, round half to even, clamp to [-128, 127]); sums are int32: VNNI's vpdpbusd multiplies
 *   unsigned by signed bytes, so x + 128 is used and 128 * rowsum taken off.
 *
 * Each path is compiled for what this CPU has (-march=native): AVX-512 (with VNNI for W8A8), AVX2, or plain C.
 * quant_w4a16.c and quant_w8a8.c hold the two formats' kernels; this header what they share. One library is built
 * from both (native.py).
 */
#ifndef OVERLAP_QUANT_LINEAR_H
#define OVERLAP_QUANT_LINEAR_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { ROW_TILE = 8, MAX_ROWS = 64, MAX_K = 65536 };

/* The weight is read once a step, front to back; each kernel asks for the bytes this far ahead of what it reads, as
 * linear_packed.c does: the hardware prefetchers alone left these kernels well short of the read bandwidth
 * (docs/engine.md, "Prefetching the weight"). A prefetch never faults, past the end included. */
enum { PREFETCH_AHEAD = 8192 };
#define PREFETCH_WEIGHT(p) __builtin_prefetch((const char *)(p) + PREFETCH_AHEAD, 0, 0)

#endif
