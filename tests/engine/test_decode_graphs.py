"""CUDA graphs for decode steps, their host side on a CPU: the capture seam runs each bucket's forward eagerly, so
buckets, padding, the spare block and the static buffers run with the real Triton kernel (interpreted) and are
compared with eager steps; the buckets reach the largest max_num_seqs the pool allows."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError
from overlap.engine.model.graphs import GRAPH_BATCH_LIMIT, DecodeGraphs, decode_buckets
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq
from tests.support.hf_models import VOCAB, save_variant

pytest.importorskip("triton")
GREEDY = SamplingParams(temperature=0, max_tokens=64)
NUM_BLOCKS = 40


def eager_capture(fn):
    """The seam's CPU side: 'capturing' runs fn once, as the CUDA warm-up does; a replay runs it again."""
    fn()
    return fn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small Llama with grouped-query attention (the interpreter runs a program per KV head and sequence)."""
    return save_variant("llama", tmp_path_factory.mktemp("llama"))


def make_runner(model_dir, graphs: bool, **config) -> ModelRunner:
    config = EngineConfig(**{"num_kv_blocks": NUM_BLOCKS, "max_seq_len": 256, "attention_backend": "triton", **config})
    runner = ModelRunner(config, model_dir, cpu_paths=False)
    if graphs:
        runner.enable_decode_graphs(eager_capture, limit=8)
    return runner


@pytest.fixture(scope="module")
def runners(model_dir):
    return make_runner(model_dir, graphs=False), make_runner(model_dir, graphs=True)


def test_buckets_reach_the_limit_and_stop_at_the_cap():
    assert decode_buckets(1) == [1]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(100_000)[-1] == GRAPH_BATCH_LIMIT


def test_the_tensors_a_captured_graph_reads_live_as_long_as_the_graphs():
    """A CUDA graph reads its inputs by address and keeps no reference to them: DecodeGraphs must (the first GPU run
    replayed freed memory as sample rows and failed an index assertion)."""
    made = []

    def make_inputs(buffer, bucket):
        rows = torch.arange(bucket)
        made.append(weakref.ref(rows))
        return rows

    def cuda_like_capture(fn):
        fn()
        return lambda: None  # holds nothing of fn, as torch.cuda.CUDAGraph.replay

    graphs = DecodeGraphs([1, 2, 4], 4, 7, 16, VOCAB, torch.device("cpu"), torch.float32, make_inputs,
                          lambda rows: torch.zeros(len(rows), VOCAB), cuda_like_capture)  # fmt: skip
    gc.collect()
    assert len(made) == 3 and all(ref() is not None for ref in made)
    del graphs
    gc.collect()
    assert all(ref() is None for ref in made)


def test_graphs_default_to_the_largest_batch_the_pool_allows(model_dir):
    """Engine.reconfigure bounds max_num_seqs by the pool's blocks: the default limit covers any value it allows."""
    runner = make_runner(model_dir, graphs=False, num_kv_blocks=20, max_num_seqs=2)
    runner.enable_decode_graphs(eager_capture)
    assert runner.packer.graphs.buckets == [1, 2, 4, 8, 16, 20]


def test_graphs_need_the_triton_backend(model_dir):
    runner = make_runner(model_dir, graphs=False, attention_backend="torch")
    with pytest.raises(ConfigError, match="Triton"):
        runner.enable_decode_graphs(eager_capture)


def _steps(batch: int, seed: int):
    """A prefill of `batch` prompts over fragmented tables, then three decode steps (by their logits)."""
    rng = random.Random(seed)
    blocks = list(range(NUM_BLOCKS))
    rng.shuffle(blocks)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(batch)]
    tables = [blocks[3 * i : 3 * i + 3] for i in range(batch)]
    yield ModelInput([ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY) for i, (p, t) in
                      enumerate(zip(prompts, tables, strict=True))])  # fmt: skip
    for step in range(3):
        yield ModelInput([ScheduledSeq(f"r{i}", [7 + i + step], len(p) + step, t, True, GREEDY, step + 1)
                          for i, (p, t) in enumerate(zip(prompts, tables, strict=True))])  # fmt: skip


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_padded_graph_step_equals_the_eager_step(runners, batch):
    eager, graphed = runners
    before = graphed.graph_steps
    for n, step in enumerate(_steps(batch, seed=batch)):
        want, got = eager.compute_logits(step), graphed.compute_logits(step)
        assert got.shape == want.shape == (batch, eager.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {n}")
    assert graphed.graph_steps - before == 3  # every decode step replayed a graph; the prefill ran eagerly


def test_past_the_largest_bucket_the_step_runs_eagerly(runners):
    eager, graphed = runners
    before = graphed.graph_steps
    for step in _steps(9, seed=5):
        torch.testing.assert_close(graphed.compute_logits(step), eager.compute_logits(step), atol=1e-4, rtol=1e-4)
    assert graphed.graph_steps == before


def test_graph_steps_sample_what_eager_steps_sample(runners):
    eager, graphed = runners
    for step in _steps(5, seed=9):
        assert graphed.execute(step).token_ids == eager.execute(step).token_ids


def test_the_engine_on_the_gpu_path_with_graphs_serves_what_transformers_generates(model_dir):
    """The whole engine (scheduler, chunked prefill, prefix-cache hits, two steps in flight with placeholders) on the
    paths CUDA takes, decode steps through the graphs' host side: every request's greedy tokens are transformers'."""
    from transformers import AutoModelForCausalLM

    from overlap.engine.core import Engine
    from tests.support.engine import add_and_run, tokens_of

    config = EngineConfig(model=str(model_dir), num_kv_blocks=NUM_BLOCKS, max_seq_len=256, attention_backend="triton",
                          max_num_batched_tokens=32, num_buffers=2)  # fmt: skip
    runner = ModelRunner(config, model_dir, cpu_paths=False)
    runner.enable_decode_graphs(eager_capture, limit=8)
    engine = Engine(config, runner=runner)
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]  # a whole block and more: the second wave hits it
    waves = [[shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
             for _ in range(2)]  # fmt: skip
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for wave, prompts in enumerate(waves):
        outputs = add_and_run(engine, {f"w{wave}-{i}": (p, sampling) for i, p in enumerate(prompts)})
        for i, prompt in enumerate(prompts):
            with torch.inference_mode():
                out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
            assert tokens_of(outputs[f"w{wave}-{i}"]) == out[0, len(prompt) :].tolist(), (wave, i)
    assert runner.graph_steps > 0 and engine.stats()["prefix_cache_hits_total"] > 0
    engine.close()
