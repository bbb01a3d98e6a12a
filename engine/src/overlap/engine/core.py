"""The public Engine: validate requests, then step = schedule -> execute -> postprocess.

Execution goes through the executor's N-buffered pipeline (overlap.engine.execution, `config.num_buffers`): `step()`
schedules and submits steps while a buffer is free, then postprocesses the oldest one, so with 2 buffers step
N+1 is scheduled while step N runs; with 1 it is plain synchronous execution.

Callers (sidecar engine server, benchmarks, tests) may call `add_request`, `abort`, `reconfigure` and `stats` from
any thread; those only validate and queue a message. `step()` runs on one thread at a time: it applies the queued
messages at the step boundary, then does one step. `generate()` drives `step()` from a background thread for
in-process asyncio use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from overlap.engine.batching.block_manager import BlockManager
from overlap.engine.batching.lora_slots import LoraRegistry
from overlap.engine.batching.scheduler import ScheduledBatch, Scheduler
from overlap.engine.batching.speculative import compute_bound_rows
from overlap.engine.batching.window_blocks import WindowBlocks
from overlap.engine.config import EngineConfig, LiveKnobs
from overlap.engine.errors import ConfigError, InvalidRequestError, ModelLoadError, RankLost
from overlap.engine.execution import Step, default_num_buffers, make_executor
from overlap.engine.requests.request import Request
from overlap.engine.types import FinishReason, RequestOutput, RequestSpec, RequestTimes, Runner, SamplingParams

_WINDOW_STEPS = 128  # sliding window for the step-time, batch-size and busy-ratio averages


def _load_runner(config: EngineConfig, model_dir: Path) -> Runner:
    if config.simulated_device is not None:
        from overlap.engine.model.sim_runner import SimRunner

        return SimRunner.for_model(config, model_dir)
    from overlap.engine.model.runner import ModelRunner

    return ModelRunner(config, model_dir)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: Runner | None = None,
        model_dir: Path | str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`runner` (tests, simulated devices) replaces the model runner: any `Runner` (overlap.engine.types).
        `clock` is what arrivals, deadlines and aging are timed by (a test's own clock replays hours of aging in a
        moment)."""
        self.config = config
        self.clock = clock
        owns_runner = runner is None
        if runner is None:
            if model_dir is None:
                if config.model:
                    model_dir = Path(config.model)
                else:
                    from overlap.engine.model.builder import ensure_default_model

                    model_dir = ensure_default_model()
            model_dir = Path(model_dir)
            if not model_dir.is_dir():
                raise ModelLoadError(f"model folder {str(model_dir)!r} does not exist (config.model)")
            runner = _load_runner(config, model_dir)
        self.runner = runner
        if config.num_buffers is None:
            self.config = config = dataclasses.replace(config, num_buffers=default_num_buffers(runner))
        if config.speculative is not None and not getattr(runner, "supports_speculation", False):
            if owns_runner:
                runner.close()
            raise ConfigError(f"speculative_config: {type(runner).__name__} cannot verify proposals (the model runner "
                              "can; a simulated device cannot)")  # fmt: skip
        if model_dir is None:  # an injected runner: it may know its folder
            model_dir = runner.model_dir or config.model or "."
        self.model_dir = Path(model_dir)
        self.max_model_len = min(config.max_seq_len, int(runner.max_model_len))
        self.vocab_size = int(runner.vocab_size)
        # Every EOS id the model declares stops a request (Llama 3 Instruct: <|end_of_text|> and <|eot_id|>).
        self.eos_token_id = runner.eos_token_ids[0] if runner.eos_token_ids else None
        self.eos_token_ids = frozenset(runner.eos_token_ids)
        # generation_config.json's temperature/top_p/top_k, for callers that fill in what a request leaves out
        self.sampling_defaults = dict(runner.sampling_defaults)
        quant = getattr(getattr(runner, "spec", None), "quantization", None)
        self.quantization = "" if quant is None else quant.name  # the checkpoint's format, for /v1/models
        split = getattr(runner, "kv_split", None)  # the sliding layers' own pool (a model mixing layer types)
        window = None if split is None else WindowBlocks(split.num_window_blocks, runner.block_size, split.window)
        self.block_manager = BlockManager(runner.num_kv_blocks, runner.block_size, config.enable_prefix_caching,
                                          window)  # fmt: skip
        device = getattr(getattr(runner, "device", None), "type", "cpu")
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, self.eos_token_ids,
                                   getattr(runner, "draft", None), compute_bound_rows(device),
                                   getattr(runner, "stage_lora", None))  # fmt: skip

        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._lock = threading.Lock()  # guards the inbox, the live-id set and the pending config
        self._inbox: list[tuple[str, object]] = []  # ("add", Request) | ("abort", request_id), in call order
        self._live_ids: set[str] = set()  # ids accepted and not yet finished (duplicate check)
        self._pending_config: EngineConfig | None = None
        self._step_lock = threading.Lock()

        self._num_steps_total = 0
        self.fatal: BaseException | None = None  # a failure the engine cannot step past (a lost rank): exit
        self._finished_by_reason: Counter[str] = Counter()
        # (step start, wall seconds, forward seconds, batch size, schedule cpu seconds) per executed step
        self._window: deque[tuple[float, float, float, int, float]] = deque(maxlen=_WINDOW_STEPS)
        # Layer 3: the N-buffered pipeline, and the handles of the steps in flight (same order as its deque).
        self.executor = make_executor(runner, config.num_buffers)
        self._in_flight: deque[ScheduledBatch] = deque()

        self._driver: threading.Thread | None = None
        self._driver_wakeup = threading.Event()
        self._closing = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # LoRA adapter name -> PEFT folder: the names requests may give (`RequestSpec.lora_name`)
        self.loras = LoraRegistry(config.enable_lora, runner.read_lora)
        for name, path in config.lora_modules.items():
            self.loras.add(name, path)

    # ---- requests in ---------------------------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        """Validate and queue a request; it enters the scheduler at the next step. Raises InvalidRequestError."""
        request = self._validate(spec, self.clock())
        request_id = request.request_id
        with self._lock:
            if request_id in self._live_ids:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
        if request.sampling.grammar is not None:
            try:
                self.runner.add_grammar(
                    request_id, request.sampling.grammar
                )  # here, not in a step: it never stalls one
            except BaseException:
                with self._lock:
                    self._live_ids.discard(request_id)
                raise
        with self._lock:
            self._inbox.append(("add", request))
        self._driver_wakeup.set()

    def _validate(self, spec: RequestSpec, now: float) -> Request:
        if not isinstance(spec, RequestSpec):
            raise InvalidRequestError(f"a request must be a RequestSpec, got {type(spec).__name__}")
        request_id, sampling, priority, timeout_s = spec.request_id, spec.sampling, spec.priority, spec.timeout_s
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        try:
            prompt = list(spec.prompt_token_ids)
        except TypeError:
            raise InvalidRequestError("prompt_token_ids must be a list of token ids") from None
        if not prompt:
            raise InvalidRequestError("empty prompt: prompt_token_ids must hold at least one token id")
        if not all(type(t) is int for t in prompt):
            bad = next(t for t in prompt if type(t) is not int)
            raise InvalidRequestError(f"token ids must be integers, got {bad!r}")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        max_len = self.max_model_len
        if len(prompt) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; max_seq_len is {max_len}, so it must be at most {max_len - 1}"
            )
        if len(prompt) + sampling.max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds max_seq_len {max_len}"
            )
        blocks = self.block_manager.num_blocks_for(len(prompt) + sampling.max_tokens)
        if blocks > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {blocks} KV blocks but the pool holds {self.block_manager.num_blocks}"
            )
        levels = self.config.num_priority_levels
        if type(priority) is not int or not 0 <= priority < levels:
            raise InvalidRequestError(
                f"priority must be an integer in 0..{levels - 1} (0 is highest), got {priority!r}"
            )
        if timeout_s is not None and (not isinstance(timeout_s, int | float) or not timeout_s > 0):
            raise InvalidRequestError(f"timeout_s must be > 0, got {timeout_s!r}")
        arrived = now if spec.arrival_time is None else float(spec.arrival_time)
        if timeout_s is None:
            timeout_s = self.config.default_timeout_s
        if spec.lora_name is not None and not isinstance(spec.lora_name, str):
            raise InvalidRequestError(f"lora_name must be a string, got {spec.lora_name!r}")
        # the engine's own copy of the prompt: a caller reusing its list cannot change a request in flight
        return Request(
            spec=dataclasses.replace(spec, prompt_token_ids=prompt),
            times=RequestTimes(arrived=arrived),
            deadline=None if timeout_s is None else arrived + timeout_s,
            lora_path=None if spec.lora_name is None else self.loras.path_of(spec.lora_name),
        )

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason ABORT; its final output comes from the next step. False if unknown or
        already finished."""
        with self._lock:
            if request_id not in self._live_ids:
                return False
            self._inbox.append(("abort", request_id))
        self._driver_wakeup.set()
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live_ids)

    # ---- one step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: apply queued input, then schedule -> execute -> postprocess through the executor: it
        schedules and submits steps while one of `num_buffers` is free, then this postprocesses the oldest step in
        flight (waiting for it if needed). Returns [] at once when nothing can run."""
        with self._step_lock:
            outputs = self._process_input(self.clock())

            def schedule():
                batch = self.schedule()
                outputs.extend(self._outputs_for(batch.finished))  # timeouts, reported now
                batch.finished = []
                if batch.is_empty:
                    return None
                self._in_flight.append(batch)
                return batch.model_input

            result = self.executor.step(schedule)
            if result is not None:
                outputs += self._apply_result(result)
            return outputs

    def _apply_result(self, result: Step) -> list[RequestOutput]:
        """Postprocess the oldest step in flight."""
        batch = self._in_flight.popleft()
        assert batch.model_input is result.model_input, "the executor returned steps out of order"
        start = time.perf_counter()
        outputs = self.postprocess(batch, result)
        postprocess_s = time.perf_counter() - start
        self.executor.busy.record_host("postprocess", postprocess_s)
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Postprocess every step still in flight, oldest first."""
        outputs = []
        while self.executor.num_in_flight:
            outputs += self._apply_result(self.executor.collect())
        return outputs

    def schedule(self) -> ScheduledBatch:
        """Decide the next step's work (the handle postprocess applies the result to)."""
        cpu0 = time.thread_time()
        wall0 = time.perf_counter()
        batch = self.scheduler.schedule(self.clock())
        batch.schedule_cpu_s = time.thread_time() - cpu0
        batch.schedule_wall_s = time.perf_counter() - wall0
        return batch

    def postprocess(self, batch: ScheduledBatch, result: Step | None) -> list[RequestOutput]:
        """Apply a step's result to the requests in `batch`; also reports what finished while scheduling. A failed
        step finishes its requests with ERROR (the step wrote only at or past each sequence's computed length: never
        into a block that is shared or published to the prefix cache, so the cache stays valid)."""
        now = self.clock()
        outputs = self._outputs_for(batch.finished)
        if result is None:
            return outputs
        if result.error is not None:
            error = f"{type(result.error).__name__}: {result.error}"
            outputs += self._outputs_for(self.scheduler.fail(batch, error, now))
            if isinstance(result.error, RankLost):
                self.fatal = result.error
        else:
            for request_id, (first, entries) in (result.output.prompt_logprobs or {}).items():
                request = self._requests.get(request_id)
                if request is not None:  # by position: a recomputed chunk overwrites the same entries
                    if request.prompt_logprobs is None:
                        request.prompt_logprobs = [None] * request.num_prompt_tokens
                    request.prompt_logprobs[first : first + len(entries)] = entries
            updated = self.scheduler.postprocess(batch, result.output, now)
            outputs += self._outputs_for(updated)
        self._num_steps_total += 1
        wall = now - batch.scheduled_at
        self._window.append((batch.scheduled_at, wall, result.busy_s, len(batch.requests), batch.schedule_cpu_s))
        return outputs

    def _process_input(self, now: float) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            pending, self._pending_config = self._pending_config, None
        if pending is not None:
            self._apply_config(pending)
        aborted = []
        for kind, item in inbox:
            if kind == "add":
                if item.spec.share_prompt_with is not None:  # the sibling itself, if it is still around
                    sibling = self._requests.get(item.spec.share_prompt_with)
                    same = sibling is not None and sibling.prompt_token_ids == item.prompt_token_ids
                    item.share_prompt_of = sibling if same and self.config.enable_prefix_caching else None
                self._requests[item.request_id] = item
                self.scheduler.add_request(item, now)
            else:
                request = self.scheduler.abort(item, now)
                if request is not None:
                    aborted.append(request)
        return self._outputs_for(aborted)

    def _outputs_for(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = []
        finished_ids = []
        for request in requests:
            outputs.append(request.take_output())
            if request.is_finished:
                finished_ids.append(request.request_id)
                self._finished_by_reason[request.finish_reason.value] += 1
                self._requests.pop(request.request_id, None)
        if finished_ids:
            self.executor.forget(finished_ids)
            with self._lock:
                self._live_ids.difference_update(finished_ids)
        return outputs

    # ---- live configuration ------------------------------------------------------------------------------------
    def reconfigure(self, knobs: LiveKnobs) -> LiveKnobs:
        """Run `knobs` from the next step boundary on. Returns the knobs that will run: max_num_seqs bounded by the
        KV pool (every running sequence holds at least one block) and by the sliding layers' pool where the model
        has one. ConfigError for knobs the rest of the config refuses (a token budget below max_seq_len without
        chunked prefill)."""
        with self._lock:
            new = (self._pending_config or self.config).with_live(knobs)
            if new.max_num_seqs > self.block_manager.num_blocks:
                new = new.replace(max_num_seqs=self.block_manager.num_blocks)
            most = self._most_seqs_the_window_pool_holds(new.max_num_batched_tokens)
            if new.max_num_seqs > most:
                new = new.replace(max_num_seqs=most)
            self._pending_config = new
        # Between steps already? Then this is the boundary.
        if self._step_lock.acquire(blocking=False):
            try:
                with self._lock:
                    pending, self._pending_config = self._pending_config, None
                if pending is not None:
                    self._apply_config(pending)
            finally:
                self._step_lock.release()
        return new.live

    def _most_seqs_the_window_pool_holds(self, max_num_batched_tokens: int) -> int:
        """How many sequences the sliding layers' pool (a model mixing layer types) holds at once, each with its
        window, beside a step of `max_num_batched_tokens`: the rule that sized the pool at start-up
        (`split_kv_pool`). More would leave running prefills waiting on that pool with nothing to preempt. Without
        one, the full pool's blocks."""
        window = self.block_manager.window
        return self.block_manager.num_blocks if window is None else window.most_seqs(max_num_batched_tokens)

    def _apply_config(self, config: EngineConfig) -> None:
        self.config = config
        self.scheduler.reconfigure(config.live)
        # Steps already in flight finish in order; fewer buffers keep the deque "full" until enough have.
        self.executor.set_num_buffers(config.num_buffers)

    # ---- stats -------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """A flat, JSON-serialisable snapshot; safe to call from any thread (counters only, no iteration over the
        scheduler's live collections)."""
        scheduler = self.scheduler
        with self._lock:
            num_incoming = sum(1 for kind, _ in self._inbox if kind == "add")
        bm = self.block_manager
        window = list(self._window)
        busy = self.executor.busy.snapshot(now=time.perf_counter())  # device busy intervals, measured where run
        last = window[-1] if window else (0.0, 0.0, 0.0, 0, 0.0)
        n = max(len(window), 1)
        return {
            "num_waiting": len(scheduler.waiting) + num_incoming,
            "num_running": len(scheduler.running),
            "num_preempted": scheduler.num_preempted,
            "num_waiting_by_priority": scheduler.waiting.num_by_priority(),
            "num_running_by_priority": scheduler.num_running_by_priority(),
            "kv_usage": bm.usage,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            # the sliding layers' own pool, for a model that mixes them with full layers (0: none)
            "num_window_kv_blocks": bm.window.num_blocks if bm.window else 0,
            "num_free_window_kv_blocks": bm.window.num_free_blocks if bm.window else 0,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queries_total": bm.prefix_cache_queries,
            "prefix_cache_hits_total": bm.prefix_cache_hits,
            "num_preemptions_total": scheduler.num_preemptions_total,
            "num_prompt_tokens_total": scheduler.num_prompt_tokens_total,
            "num_generation_tokens_total": scheduler.num_generation_tokens_total,
            **scheduler.spec_counters.stats(),  # speculative decoding, as vLLM counts it
            "num_steps_total": self._num_steps_total,
            "last_step_time_s": last[1],
            "avg_step_time_s": sum(w[1] for w in window) / n,
            "last_batch_size": last[3],
            "avg_batch_size": sum(w[3] for w in window) / n,
            "schedule_time_s_avg": sum(w[4] for w in window) / n,
            "device_busy_ratio": busy.busy_ratio,
            "device_kernel_busy_ratio": busy.kernel_busy_ratio,  # None until a step was profiled (CUDA)
            "device_busy_window_s": busy.window_s,
            "device_idle_gap_ms": busy.idle_gap_ms,
            "host_ms_per_step": busy.host_ms_per_step,
            "num_buffers": self.executor.num_buffers,
            "num_steps_in_flight": self.executor.num_in_flight,
            "requests_finished_total": {
                reason.value: self._finished_by_reason[reason.value] for reason in FinishReason
            },
            "config": self.config.to_dict(),
            # vLLM's lora_requests_info: the adapters of running and waiting requests (max_lora is config's max_loras)
            "lora_running": scheduler.lora_slots.info[0],
            "lora_waiting": scheduler.lora_slots.info[1],
        }

    # ---- asyncio convenience -----------------------------------------------------------------------------------
    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. A background thread drives `step()` while any generate() is active (do not
        call step() yourself meanwhile). Leaving the iterator early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = spec.request_id
        self._streams[request_id] = (loop, queue)
        try:
            self.add_request(spec)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._ensure_driver()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _ensure_driver(self) -> None:
        with self._lock:
            if self._driver is None or not self._driver.is_alive():
                self._closing = False
                self._driver = threading.Thread(target=self._drive, name="overlap-engine-step", daemon=True)
                self._driver.start()

    def _drive(self) -> None:
        while not self._closing:
            self._driver_wakeup.clear()
            if not self.has_unfinished() and not self.executor.num_in_flight:
                self._driver_wakeup.wait(timeout=0.5)
                continue
            try:
                outputs = self.step()
            except Exception as exc:  # an engine bug: tell every waiting stream instead of hanging it
                for loop, queue in list(self._streams.values()):
                    self._deliver(loop, queue, RuntimeError(f"engine step failed: {exc!r}"))
                time.sleep(0.01)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    self._deliver(*stream, output)
            if not outputs and not self.scheduler.running:
                time.sleep(0.001)  # requests wait on the batching policy or a full pool: do not spin

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
        with contextlib.suppress(RuntimeError):  # that event loop is closed; its generator is gone
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def close(self) -> None:
        """Stop the generate() driver thread, finish the steps still in flight and stop the executor's worker thread
        (a later step() starts it again)."""
        self._closing = True
        self._driver_wakeup.set()
        if self._driver is not None and self._driver is not threading.current_thread():
            self._driver.join(timeout=5)
        self._driver = None
        with self._step_lock:
            outputs = self._drain()
            self.executor.close()
        for output in outputs:  # to whoever still listens
            stream = self._streams.get(output.request_id)
            if stream is not None:
                self._deliver(*stream, output)
