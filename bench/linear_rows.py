"""The projections of a whole decode step, native decode-size kernel (`linear_packed.c`) against oneDNN's linear on
the very same packed weights, at R rows: every projection of a real shape's layers (each layer its own weights, so
they stream from memory as in a step) and the LM head, the best of 5 passes each, the two taking turns, the machine's
torch threads (2 unless told). It is how the kernel's row limits (`PackedLinearKernel.ROWS_*`) were chosen;
docs/engine.md ("Real sizes") has a run.

    .venv/bin/python -m bench.linear_rows qwen2.5-0.5b bfloat16 1,16,64    # from the repository root
    .venv/bin/python -m bench.linear_rows qwen2.5-0.5b float32 1,16 avx2   # both as on an AVX2-only CPU

`avx2`: the kernel's AVX2 build against oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), what an AVX2-only machine
runs, measured on this one.
"""

from __future__ import annotations

import sys
import time


def main(shape: str, dtype_name: str, row_counts: list[int], avx2: bool = False, threads: int = 2) -> None:
    import os

    if avx2:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read by oneDNN at its first use, below
    import torch

    from overlap.engine.model import native
    from overlap.engine.model.shapes import shape_config

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    kernel = native.packed_linear_kernel("x86-64-v3" if avx2 else None)
    if kernel is None or dtype not in kernel.dtypes:
        sys.exit(f"no native {dtype_name} kernel {'built for AVX2 ' if avx2 else ''}on this CPU ({native.cpu_isa()})")
    config = shape_config(shape)
    mats = [*decoder_projections(config), ("lm_head", config["vocab_size"], config["hidden_size"], 1)]
    onednn = torch.ops.mkldnn._linear_pointwise
    totals = {(rows, who): 0.0 for rows in row_counts for who in ("oneDNN", "native")}
    isa = f"{kernel.isa} kernel" + (", oneDNN limited to AVX2" if avx2 else "")
    print(f"{shape} {dtype_name}, {threads} threads, CPU {native.cpu_isa()}, {isa}: the projections of one decode step")
    for name, n, k, copies in mats:
        packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(dtype), 32) for _ in range(copies)]
        addresses = [torch.ops.mkldnn.data_ptr(w) for w in packed]
        for rows in row_counts:
            x = torch.randn(rows, k).to(dtype)
            theirs, ours = _best_alternating(
                lambda x=x, packed=packed: [onednn(x, w, None, "none", [], "") for w in packed],
                lambda x=x, addresses=addresses, n=n, k=k: [kernel(x, a, n, k, None, False) for a in addresses],
            )
            totals[rows, "oneDNN"] += theirs
            totals[rows, "native"] += ours
        print(f"  {name}: {copies} x [{n}, {k}] done", file=sys.stderr)
    print("rows | oneDNN ms | native ms | native / oneDNN")
    for rows in row_counts:
        ours, theirs = totals[rows, "native"], totals[rows, "oneDNN"]
        print(f"{rows:4d} | {1000 * theirs:9.1f} | {1000 * ours:9.1f} | {ours / theirs:.2f}")


def decoder_projections(config: dict) -> list[tuple[str, int, int, int]]:
    """(name, outputs, inputs, how many: one a layer) of each projection of a shape's decoder layers."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    return [(name, n, k, layers) for name, (n, k) in per_layer.items()]


def _best_alternating(*runs, passes: int = 5) -> list[float]:
    """The fastest of `passes` passes of each run, in seconds, the runs taking turns (which goes first alternates too)
    so that a slow spell of a shared host falls on both."""
    best = [float("inf")] * len(runs)
    for p in range(passes):
        for i in range(len(runs)) if p % 2 == 0 else reversed(range(len(runs))):
            start = time.perf_counter()
            runs[i]()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[1] in ("-h", "--help") or sys.argv[4:] not in ([], ["avx2"]):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    main(sys.argv[1], sys.argv[2], [int(r) for r in sys.argv[3].split(",")], avx2=sys.argv[4:] == ["avx2"])
