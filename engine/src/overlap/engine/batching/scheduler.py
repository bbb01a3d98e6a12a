"""Batch assembly (layer 2): which requests run in the next step, and with how many tokens each.

The scheduler owns the `waiting` RequestQueue and the `running` list (kept sorted by priority, then arrival), and
talks to the BlockManager. `schedule()` returns a `ScheduledBatch`, the handle of "what was scheduled", and
`postprocess(batch, sampled)` applies that step's sampled tokens later; nothing in between depends on the step
having finished, so an executor can keep several batches in flight.

Overlap (overlap.engine.execution): a running request whose last sampled token is still in flight is scheduled for its
next decode anyway, with `PLACEHOLDER_TOKEN` as input (the executor feeds the real token on the device side);
`num_placeholders` counts such tokens. `max_tokens` and `max_seq_len` are respected at schedule time by counting
them; EOS and stop ids are only seen when the token is read back, one step late: the request finishes then, its
blocks are freed, and the token its already-scheduled extra step samples is dropped. Freeing those blocks at once
is safe because steps run on the device in submission order: whatever later step gets them writes after the
extra step, and the extra step writes only a position of a block that is not yet published to the prefix cache.
A preemption bumps the request's `epoch`, so tokens of steps scheduled before it are dropped as well.

Speculative decoding (EngineConfig.speculative_config; docs/engine.md, "Speculative decoding", has the rule whole): a
decode may carry proposals (`ScheduledSeq.num_draft_tokens`), which the runner verifies in the same step. A proposer
needs every token on the host, so a request proposes only with no step of its own in flight (with 2+ buffers one that
is due sits out a step, if `Proposer.probe` expects a proposal), and is not scheduled again until its verifying step
is back. k follows its recent acceptance, a try that gains nothing backs off (batching/speculative.py), grammars never
speculate, and proposals fill a step only up to `spec_max_rows` rows. Postprocess appends the accepted tokens one by
one with the usual stop checks, rolls the computed length back and frees the blocks past it (`BlockManager.trim`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from overlap.engine.batching import speculative
from overlap.engine.batching.block_manager import BlockManager
from overlap.engine.batching.lora_slots import LoraSlots
from overlap.engine.batching.policies import make_batching_policy
from overlap.engine.config import EngineConfig, LiveKnobs
from overlap.engine.requests.queue import make_request_queue
from overlap.engine.requests.request import Request, RequestStatus
from overlap.engine.types import (
    NONFINITE_TOKEN,
    PLACEHOLDER_TOKEN,
    FinishReason,
    ModelInput,
    RunnerOutput,
    ScheduledSeq,
)

NONFINITE_ERROR = "the model's logits for this sequence held a NaN or an infinity; nothing could be sampled"


def _priority_key(request: Request) -> tuple[int, float, int]:
    return request.sort_key


def _arrival_key(request: Request) -> tuple[int, float, int]:
    return (0, request.times.arrived, request.arrival_seq)


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: the runner's input plus what postprocess needs to apply its result."""

    model_input: ModelInput
    requests: list[Request]  # parallel to model_input.seqs
    num_computed_after: list[int]  # each request's computed length once this step has run
    finished: list[Request] = field(default_factory=list)  # finished while scheduling (timeouts)
    preempted: list[Request] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # each request's epoch when scheduled (see postprocess)
    scheduled_at: float = 0.0  # time.monotonic() when it was scheduled
    schedule_cpu_s: float = 0.0  # CPU time the scheduling decision took (set by the engine)
    schedule_wall_s: float = 0.0  # wall time it took on the engine thread (set by the engine)

    @property
    def is_empty(self) -> bool:
        return not self.model_input.seqs


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_seq_len: int,
                 eos_token_ids: frozenset[int], proposer: speculative.Proposer | None = None,
                 spec_max_rows: int = speculative.COMPUTE_BOUND_ROWS["cpu"],
                 stage_lora: Callable[[str, str], bool | str] | None = None) -> None:  # fmt: skip
        """`proposer`: the draft model's (model/draft.py) under method draft_model; ngram's is made here.
        `spec_max_rows`: the rows (decodes plus proposals) a step holds before proposals stop (COMPUTE_BOUND_ROWS).
        `stage_lora`: the runner's (`Runner.stage_lora`), asked before a request brings its adapter to a slot."""
        self.block_manager = block_manager
        self.max_seq_len = max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = make_request_queue(config.queue_policy, config.num_priority_levels, config.aging_s)
        self.running: list[Request] = []
        # Under FIFO priorities are ignored: the preemption victim is simply the latest arrival, and nobody is
        # preempted to admit someone else.
        self.use_priorities = config.queue_policy == "priority"
        self._running_key = _priority_key if self.use_priorities else _arrival_key
        self.num_priority_levels = config.num_priority_levels
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.policy = make_batching_policy(config.batching, config.batching_args)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_preemptions_total = 0
        self.num_preempted = 0  # preempted requests now waiting to resume
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        spec = config.speculative
        if proposer is None and spec is not None:
            assert spec.method == "ngram", f"method {spec.method} needs its proposer passed in"
            proposer = speculative.NgramProposer(spec)
        self.proposer = proposer
        self.spec_max_rows = (spec and spec.disable_by_batch_size) or spec_max_rows
        self.spec_counters = speculative.SpecDecodeCounters([0] * (spec.num_speculative_tokens if spec else 0))
        self.lora_slots = LoraSlots(config.max_loras if config.enable_lora else 0, stage_lora)

    def reconfigure(self, knobs: LiveKnobs) -> None:
        """The live knobs the scheduler reads; called between steps."""
        self.max_num_seqs = knobs.max_num_seqs
        self.max_num_batched_tokens = knobs.max_num_batched_tokens
        self.waiting.aging_s = knobs.aging_s if self.waiting.aging_s is not None else None

    # ---- requests in and out -----------------------------------------------------------------------------------
    def add_request(self, request: Request, now: float) -> None:
        request.status = RequestStatus.WAITING
        request.times.queued = now
        self.waiting.add(request, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        """Finish a queued or running request with reason ABORT; None if it is neither."""
        request = self.waiting.remove(request_id)
        if request is None:
            request = next((r for r in self.running if r.request_id == request_id), None)
            if request is None:
                return None
            self._finish(request, FinishReason.ABORT, now)
            return request
        if request.status is RequestStatus.PREEMPTED:
            self.num_preempted -= 1
        request.finish(FinishReason.ABORT, now)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> ScheduledBatch:
        # The scheduling rule:
        # 1. Queued requests whose deadline has passed finish with `timeout`; aging promotes long waiters.
        # 2. Running requests go first, in (priority, arrival) order, under the token budget and the KV pool:
        #    a. decodes, one token each. A decode whose next block cannot be had preempts the lowest-priority,
        #       latest running request (possibly itself; recompute: its blocks are freed, its generated tokens
        #       kept, and it goes back to the front of its queue level) until the block can be had;
        #    b. then the next chunk of each partially prefilled prompt (its blocks were reserved at admission; a model
        #       with sliding layers takes theirs per chunk: a chunk gets what their pool holds now, or waits).
        # 3. Then admission, as many as the batching policy allows: the queue's head (highest level first, FIFO
        #    within a level) starts while the sequence cap and the token budget have room and the KV pool can
        #    hold its whole prompt (prefix-cache hits reused); those blocks are reserved now. Without chunked
        #    prefill its prompt must fit the remaining budget whole. If only the pool is in the way and running
        #    requests of strictly lower priority hold enough blocks, the lowest-priority, latest of them are
        #    preempted for it. A head through a LoRA adapter also needs a device slot for it (the adapter's own, or
        #    one no running request uses) and, for a slot to fill, the adapter in the runner's host memory (read off
        #    this thread; an adapter that cannot be read fails its waiting requests). The first head that cannot
        #    start ends admission: nothing jumps the queue.
        # The runner gets prefill chunks first, then decodes.
        bm = self.block_manager
        running = self.running
        finished = self.waiting.pop_expired(now)
        for request in finished:
            request.finish(FinishReason.TIMEOUT, now)
        self.waiting.update(now)

        budget = self.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}  # request id -> (request, num tokens)
        proposals: dict[str, list[int]] = {}  # request id -> the tokens proposed for it (speculative decoding)
        preempted: list[Request] = []

        # 2a. decodes
        spec_room = self.spec_max_rows - len(running)  # rows left for proposals before the step is compute-bound
        if self.proposer is not None:
            speculative.prepare(self.proposer, running, budget, spec_room, self.max_seq_len)
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.num_tokens + request.num_placeholders - request.num_computed_tokens != 1 or (
                request.num_placeholders and self._has_all_tokens_in_flight(request)
            ):
                i += 1
                continue
            if self.proposer is not None:
                drafts = speculative.proposals_for(request, self.proposer, min(budget, spec_room + 1), self.max_seq_len)
                if drafts is None:  # due to speculate: waits for its token in flight
                    i += 1
                    continue
                if drafts and bm.append_slots(request, 1 + len(drafts)):
                    scheduled[request.request_id] = (request, 1 + len(drafts))
                    proposals[request.request_id] = drafts
                    budget -= 1 + len(drafts)
                    spec_room -= len(drafts)
                    i += 1
                    continue
            while not bm.append_slots(request, 1):
                victim = running[-1]
                self._preempt(victim, now)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = (request, 1)
                budget -= 1
                i += 1

        # 2b. chunks of partially prefilled prompts
        for request in running:
            if budget <= 0:
                break
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:
                n = min(remaining, budget)
                if n < remaining and not self.enable_chunked_prefill:
                    continue
                if not bm.append_slots(request, n):  # the sliding layers' pool is short (the full layers' is reserved)
                    n = bm.window.num_tokens_fit(request, n)  # the part of the chunk it holds now
                    if n < 1 or not bm.append_slots(request, n):
                        continue
                scheduled[request.request_id] = (request, n)
                budget -= n

        # 3. admission
        waiting = self.waiting
        if waiting and budget > 0 and len(running) < self.max_num_seqs:
            num_to_admit = self.policy.num_to_admit(now, waiting.arrival_times(), len(running))
            while num_to_admit > 0 and waiting and budget > 0 and len(running) < self.max_num_seqs:
                request = waiting.peek()
                if not self.enable_chunked_prefill and request.num_tokens > budget:
                    break
                if not self._prompt_ready(request):
                    break  # its sibling is still computing the shared prompt; nothing jumps the queue
                if not self.lora_slots.can_acquire(request):
                    break  # every adapter slot serves running requests
                staged = self.lora_slots.staged(request)
                if staged is False:
                    break  # its adapter is being read from its folder, off this thread
                if staged is not True:
                    finished += self._fail_waiting_for_adapter(request, staged, now)
                    continue
                num_cached = bm.allocate(request, budget)
                if num_cached is None:
                    victims = self._victims_for(request)
                    if not victims:
                        break
                    for victim in victims:
                        # back to its own priority's level, so it cannot sit ahead of `request` after aging
                        victim.queue_level = victim.priority
                        self._preempt(victim, now)
                        preempted.append(victim)
                        if victim.request_id in scheduled:
                            budget += scheduled.pop(victim.request_id)[1]
                    continue  # retry the head: the victims went back behind it (their own, lower level)
                waiting.pop()
                num_to_admit -= 1
                self._start(request, num_cached, now)
                remaining = request.num_tokens - request.num_computed_tokens
                n = min(remaining, budget)
                scheduled[request.request_id] = (request, n)
                budget -= n

        batch = self._build_batch(scheduled, finished, preempted, proposals)
        batch.scheduled_at = now
        self.lora_slots.observe(waiting)
        return batch

    def _build_batch(
        self,
        scheduled: dict[str, tuple[Request, int]],
        finished: list[Request],
        preempted: list[Request],
        proposals: dict[str, list[int]] | None = None,
    ) -> ScheduledBatch:
        prefills: list[tuple[Request, ScheduledSeq, int]] = []
        decodes: list[tuple[Request, ScheduledSeq, int]] = []
        for request, n in scheduled.values():
            start = request.num_computed_tokens
            end = start + n
            drafts = proposals.get(request.request_id) if proposals else None
            if drafts:  # the sequence's last token (start == num_tokens - 1), then its proposals
                seq = ScheduledSeq(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start:] + drafts,
                    start_pos=start,
                    block_table=request.block_ids,
                    window_block_table=request.window_block_ids,
                    do_sample=True,
                    sampling=request.sampling,
                    num_generated=request.num_output_tokens,
                    prompt_token_ids=request.prompt_token_ids if _needs_prompt(request.sampling) else None,
                    num_draft_tokens=len(drafts),
                    lora_slot=request.lora_slot,
                )
                request.num_computed_tokens = end  # until postprocess rolls it back to the accepted proposals
                request.spec_in_flight = True
                decodes.append((request, seq, end))
                continue
            placeholders = request.num_placeholders
            seq = ScheduledSeq(
                request_id=request.request_id,
                # a decode whose input token is still in flight gets a placeholder (start == num_tokens then)
                token_ids=request.all_token_ids[start:end] if start < request.num_tokens else [PLACEHOLDER_TOKEN],
                start_pos=start,
                # the live list: block ids are only ever appended to it, and free() replaces it, so a runner that
                # reads it while later steps are scheduled sees this step's table unchanged
                block_table=request.block_ids,
                window_block_table=request.window_block_ids,
                do_sample=end == request.num_tokens + placeholders,
                sampling=request.sampling,
                num_generated=request.num_output_tokens + placeholders,
                prompt_token_ids=request.prompt_token_ids if _needs_prompt(request.sampling) else None,
                lora_slot=request.lora_slot,
            )
            request.num_computed_tokens = end
            if seq.do_sample:
                request.num_placeholders += 1
            is_decode = n == 1 and (request.num_output_tokens or placeholders)
            (decodes if is_decode else prefills).append((request, seq, end))
        items = prefills + decodes
        return ScheduledBatch(
            model_input=ModelInput(seqs=[seq for _, seq, _ in items], lora_loads=self.lora_slots.take_loads()),
            requests=[request for request, _, _ in items],
            num_computed_after=[end for _, _, end in items],
            finished=finished,
            preempted=preempted,
            epochs=[request.epoch for request, _, _ in items],
        )

    def _has_all_tokens_in_flight(self, request: Request) -> bool:
        """Every token the request may still produce is already being sampled by a step in flight."""
        produced = request.num_output_tokens + request.num_placeholders
        return (
            produced >= request.sampling.max_tokens or request.num_tokens + request.num_placeholders >= self.max_seq_len
        )

    def _prompt_ready(self, request: Request) -> bool:
        """A request sharing a sibling's prompt starts once the sibling has published the prompt's full blocks to
        the prefix cache (or has finished or been preempted: then it computes the prompt itself)."""
        sibling = request.share_prompt_of
        if sibling is None or sibling.status is not RequestStatus.RUNNING:
            return True
        return sibling.num_registered_blocks >= request.num_prompt_tokens // self.block_manager.block_size

    def _start(self, request: Request, num_cached: int, now: float) -> None:
        request.share_prompt_of = None  # started: the sibling is no longer needed (nor kept alive)
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now
            request.num_cached_tokens = num_cached
            self.num_prompt_tokens_total += request.num_prompt_tokens
        if request.status is RequestStatus.PREEMPTED:
            self.num_preempted -= 1
        request.status = RequestStatus.RUNNING
        self.lora_slots.acquire(request)
        bisect.insort(self.running, request, key=self._running_key)

    def _victims_for(self, request: Request) -> list[Request]:
        """Running requests of strictly lower priority to preempt, lowest and latest first, so that `request`'s
        blocks fit; [] if even all of them would not make room (or priorities are off)."""
        if not self.use_priorities:
            return []
        needed = self.block_manager.num_blocks_for(request.num_tokens) - self.block_manager.num_free_blocks
        victims = []
        for victim in reversed(self.running):
            if needed <= 0 or victim.priority <= request.priority:
                break
            victims.append(victim)
            needed -= sum(1 for b in victim.block_ids if self.block_manager.ref_counts[b] == 1)
        return victims if needed <= 0 else []

    def _preempt(self, request: Request, now: float) -> None:
        """Recompute-style preemption: free the KV, keep the generated tokens, requeue at the front."""
        self.running.remove(request)
        self.block_manager.free(request)
        self.lora_slots.release(request)
        request.num_placeholders = 0
        request.spec_in_flight = False
        request.epoch += 1  # tokens of its steps still in flight are dropped
        request.status = RequestStatus.PREEMPTED
        self.num_preempted += 1
        request.times.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_front(request, now)

    def preempt(self, request_id: str, now: float) -> bool:
        """Preempt a running request on purpose (tests, operators draining load)."""
        request = next((r for r in self.running if r.request_id == request_id), None)
        if request is None:
            return False
        self._preempt(request, now)
        return True

    # ---- after the step ----------------------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput, now: float) -> list[Request]:
        """Apply one step's sampled tokens (one per seq with do_sample, in order, with their logprobs where asked
        for; what sequences with proposals append, by request id); returns the requests that got a token, finished
        ones included."""
        bm = self.block_manager
        updated = []
        samples = iter(output.token_ids)
        token_logprobs = iter(output.logprobs) if output.logprobs is not None else None
        epochs = batch.epochs or [request.epoch for request in batch.requests]
        for request, seq, computed, epoch in zip(
            batch.requests, batch.model_input.seqs, batch.num_computed_after, epochs, strict=True
        ):
            token = next(samples) if seq.do_sample else None
            logprob = next(token_logprobs) if token_logprobs is not None and seq.do_sample else None
            if request.status is not RequestStatus.RUNNING or request.epoch != epoch:
                continue  # finished (EOS one step late, abort) or preempted after it was scheduled: dropped
            if seq.num_draft_tokens:
                self._apply_verified(request, seq, token, logprob, output, now)
                updated.append(request)
                continue
            bm.register_computed_blocks(request, computed)
            if token is None:
                continue
            if token == NONFINITE_TOKEN:
                self._finish(request, FinishReason.ERROR, now, error=NONFINITE_ERROR)
                updated.append(request)
                continue
            request.num_placeholders -= 1
            request.append_output_token(token, logprob)
            self.num_generation_tokens_total += 1
            if request.times.first_token is None:
                request.times.first_token = now
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
            updated.append(request)
        return updated

    def _apply_verified(self, request: Request, seq: ScheduledSeq, token: int, logprob, output: RunnerOutput,
                        now: float) -> None:  # fmt: skip
        """A speculative step's result: append the accepted proposals and the target's next token, stopping at the
        first stop condition as single tokens would; roll the computed length back to the accepted proposals and
        free the blocks that held only rejected ones."""
        request.spec_in_flight = False
        if token == NONFINITE_TOKEN:
            self._finish(request, FinishReason.ERROR, now, error=NONFINITE_ERROR)
            return
        rid = request.request_id
        tokens = output.spec_tokens.get(rid) if output.spec_tokens else None
        if tokens is None:  # a runner that returned only its first token: no proposal accepted
            tokens = [token]
        logprobs = output.spec_logprobs.get(rid) if output.spec_logprobs else None
        if logprobs is None:
            logprobs = [logprob] + [None] * (len(tokens) - 1)
        num_drafts = seq.num_draft_tokens
        accepted = len(tokens) - 1
        assert 0 <= accepted <= num_drafts, f"{rid}: {len(tokens)} tokens back for {num_drafts} proposals"
        self.spec_counters.record(num_drafts, accepted)
        speculative.record_acceptance(request, accepted)
        if request.times.first_token is None:
            request.times.first_token = now
        reason = None
        for new_token, new_logprob in zip(tokens, logprobs, strict=True):
            request.append_output_token(new_token, new_logprob)
            self.num_generation_tokens_total += 1
            reason = self._stop_reason(request, new_token)
            if reason is not None:
                break
        # K/V is valid for the last token and the accepted proposals: positions up to start_pos + accepted
        request.num_computed_tokens = min(seq.start_pos + 1 + accepted, request.num_tokens)
        self.block_manager.register_computed_blocks(request, request.num_computed_tokens)
        if reason is not None:
            self._finish(request, reason, now)
        else:
            self.block_manager.trim(request, request.num_tokens)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        sampling = request.sampling
        if not sampling.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in sampling.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= sampling.max_tokens or request.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def fail(self, batch: ScheduledBatch, message: str, now: float) -> list[Request]:
        """A step failed: finish its requests with ERROR and release their blocks (and the adapter slots it was to
        fill)."""
        self.lora_slots.forget(batch.model_input.lora_loads)
        failed = []
        epochs = batch.epochs or [request.epoch for request in batch.requests]
        for request, epoch in zip(batch.requests, epochs, strict=True):
            if request.status is RequestStatus.RUNNING and request.epoch == epoch:
                self._finish(request, FinishReason.ERROR, now, error=message)
                failed.append(request)
        return failed

    def _fail_waiting_for_adapter(self, head: Request, why: str, now: float) -> list[Request]:
        """The adapter of `head` cannot be read: it and every waiting request through that adapter (the same folder)
        finish with ERROR saying why; others wait on."""
        key = (head.lora_name, head.lora_path)
        failed = [r for r in self.waiting if (r.lora_name, r.lora_path) == key]
        for request in failed:
            self.waiting.remove(request.request_id)
            if request.status is RequestStatus.PREEMPTED:
                self.num_preempted -= 1
            request.finish(FinishReason.ERROR, now, error=f"LoRA adapter {head.lora_name!r} cannot be read: {why}")
        return failed

    def _finish(self, request: Request, reason: FinishReason, now: float, error: str | None = None) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        self.lora_slots.release(request)
        request.finish(reason, now, error)

    # ---- inspection --------------------------------------------------------------------------------------------
    def num_running_by_priority(self) -> list[int]:
        counts = [0] * self.num_priority_levels
        for request in self.running:
            counts[min(request.priority, self.num_priority_levels - 1)] += 1
        return counts


def _needs_prompt(sampling) -> bool:
    """Whether the runner must see the whole prompt: a repetition penalty, or prompt logprobs (their targets)."""
    return sampling.repetition_penalty != 1.0 or sampling.prompt_logprobs is not None
