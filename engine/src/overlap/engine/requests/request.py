"""One request's state inside the engine: its tokens, where its KV lives, and its life cycle."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from overlap.engine.types import FinishReason, RequestOutput, RequestSpec, RequestTimes, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the RequestQueue, never scheduled yet
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    PREEMPTED = "preempted"  # back in the RequestQueue (recompute): KV freed, generated tokens kept
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_TIMEOUT = "finished_timeout"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED_"))
FINISH_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.TIMEOUT: RequestStatus.FINISHED_TIMEOUT,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}

# Breaks ties between requests that arrived at the same instant, so ordering is total and stable.
_arrival_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    spec: RequestSpec  # what the caller asked for, as checked by the engine (id, prompt, sampling, priority, ...)
    times: RequestTimes
    deadline: float | None = None  # monotonic time; queued past it -> finished with reason TIMEOUT

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when sampling asks
    prompt_logprobs: list | None = None  # TokenLogprob per prompt position (index 0 stays None), when asked
    prompt_logprobs_emitted: bool = False
    # Several sequences of one prompt (`n`, `best_of`): this one starts only once `share_prompt_of` has computed and
    # published the prompt's full blocks, then takes them from the prefix cache by reference (only the last partial
    # block's tokens are computed again).
    share_prompt_of: Request | None = None
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step for cheap slicing
    num_computed_tokens: int = 0  # tokens whose K/V is (or is being) written to the pool
    block_ids: list[int] = field(default_factory=list)  # KV blocks covering positions 0 .. num_tokens - 1
    block_hashes: list = field(default_factory=list)  # prefix-cache keys over full blocks (prefix_hash.BlockKey)
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    claim_end: int = 0  # blocks block_ids[-1] + 1 .. claim_end - 1 are kept free for this request's growth
    # A model that mixes sliding and full layers: the sliding layers' blocks (batching/window_blocks.py; 0 where a
    # block fell out of the window) and how many of them are published to the prefix cache.
    window_block_ids: list[int] = field(default_factory=list)
    num_window_registered: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_emitted_tokens: int = 0  # output tokens already returned to the caller
    queue_level: int = 0  # current level in the priority queue (aging moves it towards 0)
    level_entered: float = 0.0  # when it entered queue_level (aging clock)
    # Overlapped execution: tokens sampled by steps still in flight (their inputs were placeholders on the host),
    # and an epoch that a preemption bumps so that tokens of steps scheduled before it are dropped.
    num_placeholders: int = 0
    epoch: int = 0
    # Speculative decoding (batching/scheduler.py): a step verifying this request's proposals is in flight (it is not
    # scheduled again until that step is back); plain decodes to run before it tries to speculate again, and the
    # current back-off (doubled by each try that gains nothing, 0 after one that does); the average of proposals
    # accepted per try, which sets how many it proposes (batching/speculative.py, num_to_propose); whether the
    # current try sat a step out for its token in flight (it must then win that step back to gain).
    spec_in_flight: bool = False
    spec_skip: int = 0
    spec_backoff: int = 0
    spec_accepted_avg: float | None = None
    spec_waited: bool = False
    # LoRA: the adapter's folder (kept with the request: an unloaded adapter's requests still finish), and its device
    # slot while the request runs (-1: none; batching/lora_slots.py)
    lora_path: str | None = None
    lora_slot: int = -1
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    # ---- the spec's fields the scheduler and runner read -------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.spec.prompt_token_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.spec.sampling

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def lora_name(self) -> str | None:
        return self.spec.lora_name

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order among running requests: priority first, then arrival. The victim of a preemption is
        the one with the largest key (lowest priority, latest arrival)."""
        return (self.priority, self.times.arrived, self.arrival_seq)

    # ---- transitions -------------------------------------------------------------------------------------------
    def append_output_token(self, token_id: int, logprob=None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.sampling.logprobs is not None:
            self.output_logprobs.append(logprob)

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> None:
        self.status = FINISH_STATUS[reason]
        self.finish_reason = reason
        self.error = error
        self.times.finished = now

    def take_output(self) -> RequestOutput:
        """What the caller has not seen yet: new output tokens (with their logprobs when asked for), the prompt's
        logprobs once, and the finish; marks them returned."""
        start = self.num_emitted_tokens
        self.num_emitted_tokens = len(self.output_token_ids)
        new_tokens = self.output_token_ids[start:]
        prompt_logprobs = None
        wants_prompt_logprobs = self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_emitted
        if wants_prompt_logprobs and (new_tokens or self.is_finished):
            prompt_logprobs = self.prompt_logprobs or [None] * self.num_prompt_tokens
            self.prompt_logprobs_emitted = True
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_tokens,
            logprobs=self.output_logprobs[start:] if self.sampling.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            times=self.times if self.is_finished else None,
            error=self.error,
        )
