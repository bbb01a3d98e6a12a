"""`overlap bench moe` on a small mixture of experts: a batch-1 step runs top-k experts a layer, a larger batch more,
and the floor counts the experts that ran, at the bytes each format stores them in (the real-width run lives in
`make bench`)."""

from __future__ import annotations

import argparse
import json

from overlap.bench import moe_bench
from overlap.engine.model import shapes


def test_the_floor_counts_the_experts_each_batch_runs(monkeypatch, capsys):
    small = {**shapes.SHAPES["qwen3-30b-a3b"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": 16, "num_experts_per_tok": 2}  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "test-moe", small)
    args = argparse.Namespace(model_shape="test-moe", layers=2, batch_sizes="1,32", rounds=1, steps=2, context=8,
                              threads=2, json=True, schemes="none,w8a8")  # fmt: skip
    assert moe_bench.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["scheme"], r["batch"]): r for r in result["rows"]}
    for scheme in ("none", "w8a8"):
        one, many = rows[scheme, 1], rows[scheme, 32]
        assert one["active_experts_per_layer"] == 2  # one token: its top-2
        # at most all 16, or twice that where the step runs as two half-batch forwards (the tiny widths' plan)
        assert 2 < many["active_experts_per_layer"] <= 2 * 16
        assert 0 < one["read_gb"] < many["read_gb"]
    assert rows["w8a8", 1]["read_gb"] < rows["none", 1]["read_gb"]  # the experts in int8, not bf16
    assert "experts: W8A8" in result["kernels"]["w8a8"] and rows["w8a8", 1]["over_bf16"] > 0
    assert all(r["step_ms"] > 0 and r["memory_floor_ms"] > 0 and r["compute_floor_ms"] > 0 for r in result["rows"])
