"""The quantized projections of a whole decode step at R rows, each native path against the alternative, on the very
same weights: W4A16's row kernel and its tiles (`quant_w4a16.c`; the tiles with bf16 x on AVX512-BF16) against the
weight dequantized into oneDNN's matmul, and W8A8's kernel (`quant_w8a8.c`) against oneDNN's u8 x s8 matmul on a copy
of the weight prepacked here (x quantized per token, its scales applied after, as `NativeW8A8` does where oneDNN keeps
a copy: AMX, or no VNNI). Every decoder projection of a real shape's layers (each layer its own random codes, so
they stream from memory as in a step; the LM head stays bf16 in these checkpoints and is left out), bf16 x, the best
of 5 passes each, all of them taking turns, 2 torch threads, glibc's malloc set as the engine sets it once a model
is loaded. It is how the W4A16 row limits (`NATIVE_W4A16_ROWS`, `W4A16_ROW_KERNEL_ROWS`, `W4A16_TILES_ROWS`) were
chosen; docs/engine.md ("Prefetching the weight", "W4A16's tiles", "One packed copy of the W8A8 weight") has runs.

    .venv/bin/python -m bench.quant_rows qwen2.5-3b w4a16 4,6,8,16,64,256    # from the repository root
    .venv/bin/python -m bench.quant_rows qwen2.5-3b w8a8 1,4,16,64
    .venv/bin/python -m bench.quant_rows qwen2.5-0.5b w8a8 1,16,64,256 avx2   # as on a CPU with AVX2 alone

`avx2` (W8A8): the kernel's AVX2 build against oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), what a CPU without
AVX-512 runs, timed on this one: how `_keeps_onednn` was chosen.
"""

from __future__ import annotations

import os
import sys

from bench.linear_rows import _best_alternating, decoder_projections

SCHEMES = ("w4a16", "w8a8")


def main(shape: str, scheme: str, row_counts: list[int], avx2: bool = False, threads: int = 2) -> None:
    if avx2:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read by oneDNN at its first use, below
    import torch
    import torch.nn.functional as F

    from overlap.engine import _malloc
    from overlap.engine.model import native
    from overlap.engine.model.quant.kernels import NativeW4A16, NativeW8A8, onednn_int8, signed_int8
    from overlap.engine.model.quant.weight import QuantizedWeight
    from overlap.engine.model.shapes import shape_config

    torch.set_num_threads(threads)
    _malloc.keep_freed_memory()  # as after a load: a step's freed buffers are reused, not faulted in again
    if native.quant_linear_kernel() is None:
        sys.exit("no native quantized kernels (no C compiler)")
    bits, group, act_bits, method = (4, 128, None, NativeW4A16) if scheme == "w4a16" else (8, None, 8, NativeW8A8)
    methods = []
    for name, n, k, copies in decoder_projections(shape_config(shape)):
        g = group or k
        for _ in range(copies):
            codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
            weight = QuantizedWeight(codes, torch.rand(n, k // g) * 0.01, torch.full((n, k // g), 2.0 ** (bits - 1)),
                                     bits, g, name, act_bits=act_bits)  # fmt: skip
            quantized = method(weight, torch.bfloat16)
            if scheme == "w8a8":  # what it is measured against: the same weight prepacked for oneDNN
                quantized.onednn = onednn_int8(signed_int8(codes))
            methods.append((quantized, k))
        print(f"  {name}: {copies} x [{n}, {k}] made", file=sys.stderr)
    kernel = native.quant_linear_kernel("x86-64-v3") if avx2 else methods[0][0].kernel
    for m, _ in methods:  # x quantized and scaled by the same build as the matmul
        m.kernel = kernel
    mb = sum(m.nbytes for m, _ in methods) / 1e6
    print(f"{shape} {scheme}, {mb:.0f} MB of codes and scales, {threads} threads, CPU {native.cpu_isa()}, "
          f"{kernel.isa} kernels{', oneDNN limited to AVX2' if avx2 else ''}")  # fmt: skip

    def dequantized(x: dict) -> None:
        for m, k in methods:
            F.linear(x[k], kernel.w4a16_dequantize(m.codes, m.scale, m.offset, m.bias, m.group, torch.bfloat16))

    def row_kernel(x: dict) -> None:
        for m, k in methods:
            kernel.w4a16(x[k], m.codes, m.scale, m.offset, m.group)

    def tiles(x: dict) -> None:
        for m, k in methods:
            kernel.w4a16_tiles(x[k], m.codes, m.scale, m.offset, m.group)

    def onednn(x: dict) -> None:
        for m, k in methods:
            m.onednn_matmul(x[k], torch.bfloat16)

    def w8a8(x: dict) -> None:
        for m, k in methods:
            kernel.w8a8(x[k], m.packed, m.rowsum, m.scale, torch.bfloat16)

    if scheme == "w8a8":
        runs = {"oneDNN u8 x s8": onednn, "native": w8a8}
    else:
        runs = {"dequantized": dequantized, "row kernel": row_kernel}
        if methods[0][0].tiles:
            runs["tiles"] = tiles
    names = list(runs)
    print("rows | " + " | ".join(f"{name} ms" for name in names) + " | " + " | ".join(
        f"{name} / {names[0]}" for name in names[1:]))  # fmt: skip
    for rows in row_counts:
        x = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in methods}}
        # the row kernel takes at most 64 rows
        chosen = [name for name in names if name != "row kernel" or rows <= kernel.MAX_ROWS]
        best = dict(zip(chosen, _best_alternating(*[lambda f=runs[name], x=x: f(x) for name in chosen]), strict=True))
        cells = [f"{1000 * best[name]:.1f}" if name in best else "-" for name in names]
        ratios = [f"{best[name] / best[names[0]]:.2f}" if name in best else "-" for name in names[1:]]
        print(f"{rows:4d} | " + " | ".join(cells) + " | " + " | ".join(ratios))


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[2] not in SCHEMES or sys.argv[4:] not in ([], ["avx2"]):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    if sys.argv[4:] and sys.argv[2] != "w8a8":
        sys.exit("avx2: W8A8 only (W4A16's AVX2 path is its row kernel and the dequantized matmul, as before)")
    main(sys.argv[1], sys.argv[2], [int(r) for r in sys.argv[3].split(",")], avx2=sys.argv[4:] == ["avx2"])
