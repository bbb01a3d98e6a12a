"""The GPU check's speculative case (bench/gpu/check.sh, case `speculative`): what a step that verifies k proposals
costs at the ~8B shape, batch 1, against the plain decode step and the streaming floor, and how many tokens it
appends.

Three measurements on one bf16 runner with random weights (`speculative_config` ngram, k = 4):
- plain: greedy decode steps of one sequence (one row each), the step time against the floor;
- verify: the same sequence again, each step carrying the next k tokens of the plain run's greedy output as its
  proposals (an oracle proposer: the upper bound of a quoting workload), the step time of k + 1 rows against the
  floor, and the tokens each step appends (k + 1 when the k + 1 rows' bf16 argmax agrees with the one-row steps');
- ngram: the engine end to end with prompt lookup on a repeating prompt, the tokens per step it reaches (random
  weights seldom quote the prompt, so this is the cost of trying: proposals, back-off, the pause at 2 buffers).
Step times are the wall time of one synchronous step (host work and read-back included), the median over the run,
for plain and verifying steps alike; the floor is the decode case's (weights + K/V over the copy bandwidth).
"""

from __future__ import annotations

import time

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def case_speculative(check) -> None:
    from overlap.bench.floor import decode_floor_bytes
    from overlap.engine import Engine, RequestSpec, SamplingParams
    from overlap.engine.model.runner import ModelRunner
    from overlap.engine.types import ModelInput, ScheduledSeq

    name = list(check.shapes)[-1]  # llama-8b (llama-dry-b in a dry run)
    steps = check.steps
    prompt = [(17 * i) % 500 + 3 for i in range(check.prompt_len)]
    context = len(prompt) + steps * (K + 1)
    blocks_per_seq = -(-(context + 2 * K) // 16)
    # (a dry run checks the script: torch attention there, not Triton's slow interpreter)
    config = check.engine_config(interpret=False, dtype="bfloat16", num_kv_blocks=4 * blocks_per_seq + 64,
                                 max_num_seqs=4, max_seq_len=2048, speculative_config=NGRAM)  # fmt: skip
    runner = ModelRunner(config, check.model_dir(name), random_weights=True, cpu_paths=not check.dry)
    greedy = SamplingParams(temperature=0, max_tokens=context)
    try:

        def run(rid: str, tokens: list[int], start: int, table: list[int], drafts: int = 0) -> tuple[list[int], float]:
            seq = ScheduledSeq(rid, tokens, start, table, True, greedy, num_draft_tokens=drafts)
            started = time.perf_counter()
            out = runner.execute(ModelInput([seq]))  # reads its tokens back: the step is done
            elapsed = time.perf_counter() - started
            return (out.spec_tokens[rid] if drafts else out.token_ids), elapsed

        # plain: one row a step; its greedy tokens are the oracle's proposals below
        table = list(range(blocks_per_seq))
        (token,), _ = run("plain", prompt, 0, table)
        tokens, plain_s = [token], []
        for _ in range((K + 1) * steps):
            (token,), elapsed = run("plain", [tokens[-1]], len(prompt) + len(tokens) - 1, table)
            tokens.append(token)
            plain_s.append(elapsed)
        # verify: k + 1 rows a step, proposals from the plain run
        table = list(range(blocks_per_seq, 2 * blocks_per_seq))
        (first,), _ = run("verify", prompt, 0, table)
        known, verify_s, appended = [first], [], []
        for _ in range(steps):
            proposals = tokens[len(known) : len(known) + K]
            if len(proposals) < K or known[-1] != tokens[len(known) - 1]:
                break  # past the oracle's tokens, or the runs parted (bf16 rows can round apart)
            new, elapsed = run("verify", [known[-1], *proposals], len(prompt) + len(known) - 1, table, K)
            known += new
            verify_s.append(elapsed)
            appended.append(len(new))
        floor_s = decode_floor_bytes(runner, 1, len(prompt) + steps) / check.bandwidth if check.bandwidth else None
        plain_ms, verify_ms = 1000 * _median(plain_s[3:]), 1000 * _median(verify_s[3:] or verify_s)
        for rid in ("plain", "verify"):
            runner.forget_request(rid)

        # ngram through the engine: what prompt lookup reaches on this model
        engine = Engine(config, runner=runner)
        repeating = prompt[:8] * (len(prompt) // 8)
        sampling = SamplingParams(max_tokens=steps * 2, temperature=0, ignore_eos=True)
        engine.add_request(RequestSpec("ngram", repeating, sampling))
        num_steps = 0
        while engine.has_unfinished():
            engine.step()
            num_steps += 1
        stats = engine.stats()
        engine.close()
    finally:
        runner.close()
    check.emit("speculative", model=name, dtype="bfloat16", batch=1, k=K, plain_step_ms=plain_ms,
               verify_step_ms=verify_ms, floor_ms=None if floor_s is None else 1000 * floor_s,
               plain_over_floor=None if floor_s is None else plain_ms / 1000 / floor_s,
               verify_over_floor=None if floor_s is None else verify_ms / 1000 / floor_s,
               verify_tokens_per_step=sum(appended) / max(1, len(appended)), verify_steps=len(appended),
               oracle_speedup=(sum(appended) / max(1, len(appended))) * plain_ms / verify_ms,
               ngram_tokens_per_step=steps * 2 / max(1, num_steps),
               ngram_drafts=stats["spec_decode_num_drafts_total"],
               ngram_accepted=stats["spec_decode_num_accepted_tokens_total"],
               ngram_proposed=stats["spec_decode_num_draft_tokens_total"])  # fmt: skip


def _format_row(r: dict) -> str:
    floor = "-" if r["floor_ms"] is None else f"{r['floor_ms']:.2f} ms floor"
    ratios = "" if r["floor_ms"] is None else f" ({r['plain_over_floor']:.2f}x / {r['verify_over_floor']:.2f}x)"
    return (f"speculative {r['model']} batch 1, k {r['k']}: plain step {r['plain_step_ms']:.2f} ms, verifying step "
            f"{r['verify_step_ms']:.2f} ms, {floor}{ratios}; {r['verify_tokens_per_step']:.2f} tokens a verifying "
            f"step with oracle proposals ({r['oracle_speedup']:.2f}x a plain step's rate); ngram on random weights "
            f"{r['ngram_tokens_per_step']:.2f} tokens a step, {r['ngram_accepted']} of {r['ngram_proposed']} "
            "proposals accepted")  # fmt: skip


def format_rows(rows: list[dict]) -> list[str]:
    """The speculative case's lines of the report."""
    return [_format_row(r) for r in rows if r["case"] == "speculative"]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")
