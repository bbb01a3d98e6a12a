"""Helpers for CPU-cheap engine tests: a fake runner that keeps a paged "KV pool" of token ids, and factories.

`FakeRunner` honours the ScheduledSeq contract literally: it writes each scheduled token into the slot its block
table names, and reads the whole prefix back from the pool before "sampling". The sampled token is a hash of the
sequence it read, so any scheduler or block-manager bug that feeds a wrong token, a wrong position, or a block
that another request has overwritten changes the tokens versus `reference_tokens()`, the same function computed
serially on the plain token list.
"""

from __future__ import annotations

import itertools
import random
import time

from overlap.engine.batching.block_manager import BlockManager
from overlap.engine.batching.scheduler import Scheduler
from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.execution import Step
from overlap.engine.requests.request import Request
from overlap.engine.types import (
    ModelInput,
    RequestSpec,
    RequestTimes,
    Runner,
    RunnerOutput,
    SamplingParams,
    ScheduledSeq,
    accept_proposals,
)

VOCAB = 64
EOS = 1


def next_token(sequence: tuple[int, ...], vocab_size: int = VOCAB) -> int:
    """The fake model: a deterministic function of the whole sequence so far."""
    return hash(sequence) % vocab_size


def copying_token(sequence: tuple[int, ...], vocab_size: int = VOCAB) -> int:
    """A fake model that mostly quotes (speculative decoding's tests): four times in five the token that followed
    the latest earlier occurrence of the last token, else (or with none) `next_token`. Still a deterministic
    function of the whole sequence."""
    h = hash(sequence)
    if h % 5:
        last = sequence[-1]
        for i in range(len(sequence) - 2, -1, -1):
            if sequence[i] == last:
                return sequence[i + 1]
    return h % vocab_size


def reference_tokens(prompt: list[int], sampling: SamplingParams, eos: int | None = EOS, model=next_token) -> list[int]:
    """What a correct engine must produce for `prompt` with the fake model (greedy, serial, no KV)."""
    sequence = list(prompt)
    out: list[int] = []
    while len(out) < sampling.max_tokens:
        token = model(tuple(sequence))
        out.append(token)
        sequence.append(token)
        if (not sampling.ignore_eos and token == eos) or token in sampling.stop_token_ids:
            break
    return out


class FakeRunner(Runner):
    supports_speculation = True  # a sequence's proposals are verified against `model` at each position

    def __init__(self, num_kv_blocks: int = 256, block_size: int = 4, max_model_len: int = 512, model=next_token):
        self.model = model  # the sequence so far -> the next token
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = VOCAB
        self.eos_token_ids = (EOS,)
        self.max_model_len = max_model_len
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id)
        self.fail_on: set[str] = set()  # request ids whose presence makes execute() raise
        self.fail_calls: dict[int, BaseException] = {}  # execute() call number (from 0) -> what that call raises
        self.calls = 0
        self.failed_requests: set[str] = set()  # the requests of every step that fail_calls made raise
        self.batches: list[ModelInput] = []  # every input seen (tests inspect order and sizes)
        self.keep_batches = True
        self.delay_s = 0.0  # simulated forward time (sleeps, releasing the GIL as a real forward does)

    def execute(self, model_input: ModelInput) -> RunnerOutput:
        start = time.perf_counter()
        if self.keep_batches:
            self.batches.append(model_input)
        if self.delay_s:
            time.sleep(self.delay_s)
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail_calls:
            self.failed_requests.update(s.request_id for s in model_input.seqs)
            raise self.fail_calls[call]
        bad = self.fail_on.intersection(s.request_id for s in model_input.seqs)
        if bad:
            raise RuntimeError(f"injected failure for {sorted(bad)}")
        bs = self.block_size
        sampled = []
        spec_tokens = {}
        for seq in model_input.seqs:
            end = seq.start_pos + len(seq.token_ids)
            assert len(seq.block_table) * bs >= end, f"{seq.request_id}: block table too short for {end} tokens"
            assert all(0 <= b < self.num_kv_blocks for b in seq.block_table), "block id outside the pool"
            for offset, token in enumerate(seq.token_ids):
                pos = seq.start_pos + offset
                self.kv[seq.block_table[pos // bs] * bs + pos % bs] = (pos, token)
            sequence = []
            for pos in range(end):
                stored_pos, token = self.kv.get(seq.block_table[pos // bs] * bs + pos % bs, (-1, -1))
                sequence.append(token if stored_pos == pos else -1)  # -1: a slot overwritten by someone else
            if seq.do_sample and seq.num_draft_tokens:  # the token after each prefix ending at a scored position
                k = seq.num_draft_tokens
                scored = [self.model(tuple(sequence[: end - k + j])) for j in range(k + 1)]
                spec_tokens[seq.request_id] = accept_proposals(scored, list(seq.token_ids[-k:]))
                sampled.append(spec_tokens[seq.request_id][-1])
            elif seq.do_sample:
                sampled.append(self.model(tuple(sequence)))
        return RunnerOutput(sampled, (start, time.perf_counter()), spec_tokens=spec_tokens or None)


class ConstantRunner(Runner):
    """No KV bookkeeping at all: for measuring the scheduler's own CPU time."""

    def __init__(self, num_kv_blocks: int = 4096, block_size: int = 16, max_model_len: int = 2048) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = VOCAB
        self.eos_token_ids = (EOS,)
        self.max_model_len = max_model_len

    def execute(self, model_input: ModelInput) -> RunnerOutput:
        now = time.perf_counter()
        return RunnerOutput([7 for s in model_input.seqs if s.do_sample], (now, now))


_ids = itertools.count()


def create_requests(
    num_requests: int,
    prompt_len: int = 10,
    max_tokens: int = 8,
    priority: int = 1,
    ignore_eos: bool = True,
    arrived: float | None = None,
    deadline: float | None = None,
    same_prompt: bool = False,
) -> list[Request]:
    requests = []
    for i in range(num_requests):
        rid = f"req-{next(_ids)}"
        prompt = [(7 * j + (0 if same_prompt else 13 * i)) % (VOCAB - 2) + 2 for j in range(prompt_len)]
        requests.append(
            Request(
                RequestSpec(
                    rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos), priority
                ),
                times=RequestTimes(arrived=time.monotonic() if arrived is None else arrived),
                deadline=deadline,
            )
        )
    return requests


def create_scheduler(
    num_blocks: int = 256, block_size: int = 4, max_seq_len: int = 512, **config
) -> tuple[Scheduler, FakeRunner]:
    config.setdefault("max_seq_len", max_seq_len)
    cfg = EngineConfig(**config)
    runner = FakeRunner(num_blocks, block_size, max_seq_len)
    bm = BlockManager(num_blocks, block_size, cfg.enable_prefix_caching)
    return Scheduler(cfg, bm, max_seq_len, frozenset({EOS})), runner


def run_step(scheduler: Scheduler, runner: FakeRunner, now: float):
    """One schedule -> execute -> postprocess round; returns (batch, updated requests)."""
    batch = scheduler.schedule(now)
    if batch.is_empty:
        return batch, []
    output = runner.execute(batch.model_input)
    return batch, scheduler.postprocess(batch, output, now)


def execute_now(engine: Engine, batch) -> Step:
    """Run a scheduled batch on the engine's runner in this thread, bypassing the executor (CPU-time measurements of
    the scheduler); a failure comes back in the step, as from the executor."""
    step = Step(0, batch.model_input)
    try:
        return step.done(engine.runner.execute(batch.model_input))
    except Exception as exc:
        return step.done(error=exc)


def create_engine(
    num_blocks: int = 256, block_size: int = 4, max_model_len: int = 512, clock=time.monotonic, model=next_token,
    **config,
) -> Engine:  # fmt: skip
    config.setdefault("max_seq_len", max_model_len)
    runner = FakeRunner(num_blocks, block_size, max_model_len, model)
    return Engine(EngineConfig(**config), runner=runner, clock=clock)


def run_to_completion(engine: Engine, max_steps: int = 100_000) -> dict[str, list]:
    """Step until nothing is unfinished; returns request id -> list of its outputs."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def add_and_run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Add every (prompt, sampling) request, then step until all have finished."""
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(RequestSpec(rid, prompt, sampling))
    return run_to_completion(engine)


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


# ---- a model runner's greedy tokens ----------------------------------------------------------------------------
_GREEDY = SamplingParams(temperature=0, max_tokens=64)


def scattered_tables(lengths: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)  # every table a scatter of blocks
    tables, at = [], 0
    for length in lengths:
        need = -(-length // block_size)
        tables.append(ids[at : at + need])
        at += need
    return tables


def greedy_tokens(runner, prompts: list[list[int]], n: int, chunk: int) -> list[list[int]]:
    """Prefill every prompt in chunks of `chunk` tokens, batched, then decode all together: n tokens each."""
    tables = scattered_tables([len(p) + n for p in prompts], runner.block_size, runner.num_kv_blocks, seed=1)
    done, outs = [0] * len(prompts), [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        seqs = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                m = min(chunk, len(p) - done[i])
                seqs.append(ScheduledSeq(f"r{i}", p[done[i] : done[i] + m], done[i], tables[i],
                                         done[i] + m == len(p), _GREEDY))  # fmt: skip
                done[i] += m
        sampled = runner.execute(ModelInput(seqs)).token_ids
        for seq, token in zip([s for s in seqs if s.do_sample], sampled, strict=True):
            outs[int(seq.request_id[1:])].append(token)
    for step in range(1, n):
        seqs = [ScheduledSeq(f"r{i}", [o[-1]], len(p) + step - 1, tables[i], True, _GREEDY, step)
                for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]  # fmt: skip
        for o, token in zip(outs, runner.execute(ModelInput(seqs)).token_ids, strict=True):
            o.append(token)
    return outs
