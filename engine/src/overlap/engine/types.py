"""Public types of the engine: what callers (sidecar, benchmarks) send in and get back, and the contract
between the scheduler and the model runner. Plain data, no torch import at module level."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Protocol

from overlap.engine.errors import ConfigError, InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


GREEDY_TEMPERATURE = 1e-5  # a temperature below this samples greedily


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log_softmax of the raw logits, before temperature,
    top-k/top-p), and the `logprobs` most likely tokens as (token id, log-probability), most likely first."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens reached (or the model's context)
    ABORT = "abort"  # the caller aborted it (client went away)
    TIMEOUT = "timeout"  # its deadline passed while it was queued
    ERROR = "error"  # a failure inside a step; the message says what


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; top_k 0 and top_p 1 mean "off"."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Log-probabilities of each sampled token and of the `logprobs` most likely ones (0..MAX_LOGPROBS); None: off.
    logprobs: int | None = None
    # The same for every prompt token after the first (what evaluation harnesses score); such a request computes its
    # whole prompt (no prefix-cache reuse) and gets them with its first output.
    prompt_logprobs: int | None = None
    # Logits controls (OpenAI's and vLLM's), applied to the raw logits before temperature, in this order: bias,
    # min_tokens and bad words (banned tokens get -inf), then the repetition, frequency and presence penalties.
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens were generated
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from every token the output already holds
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: logits of prompt and output tokens divided (if > 0) or multiplied by it
    # Structured output: an llguidance grammar (JSON schema, regex, choice or Lark, as llguidance.grammar_from
    # writes it); the sampler masks every token the grammar does not allow next.
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        self.logit_bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(not math.isfinite(b) or not -100 <= b <= 100 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
        self.bad_words_ids = tuple(tuple(int(t) for t in word) for word in self.bad_words_ids)
        if any(not word for word in self.bad_words_ids):
            raise InvalidRequestError("bad_words must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {value!r}")

    @property
    def has_logits_controls(self) -> bool:
        """Whether the sampler must change this request's logits before picking (plain requests skip it all)."""
        return bool(
            self.logit_bias or self.min_tokens or self.bad_words_ids or self.presence_penalty
            or self.frequency_penalty or self.repetition_penalty != 1.0 or self.grammar
        )  # fmt: skip

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the tokens generated so far (penalties, multi-token bad words)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or any(len(w) > 1 for w in self.bad_words_ids)
        )  # fmt: skip

    @property
    def is_greedy(self) -> bool:
        # below GREEDY_TEMPERATURE, dividing the logits by it overflows them (vLLM draws the same line)
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclass(slots=True)
class RequestSpec:
    """One request as a caller hands it to the engine: the one record that `Engine.add_request`, `Engine.generate`,
    `EngineClient.submit` and the wire (`protocol.AddRequest`, generated from it) carry. A field added here reaches
    the engine's `Request` (`request.spec`) on every path. The engine checks the values when it takes the request
    (InvalidRequestError); the record itself holds them as given. The wire sends the fields by position: a new one
    goes at the end, with a default."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 1  # 0 is the highest
    timeout_s: float | None = None  # queued longer -> finished with reason TIMEOUT; None: the engine's default
    arrival_time: float | None = None  # time.monotonic() in the sender (system-wide on Linux); None: when added
    # The id of an earlier request with the same prompt (one of a request's `n` sequences): this one then reuses
    # that request's computed prompt blocks instead of computing the prompt again.
    share_prompt_with: str | None = None
    lora_name: str | None = None  # a LoRA adapter loaded in the engine (`Engine.loras`); None: the base model


@dataclass(slots=True)
class RequestTimes:
    """The five timestamps field report 2 asks for, in `time.monotonic()` seconds (system-wide on Linux, so
    comparable across the engine and sidecar processes). None until the event happens."""

    arrived: float
    queued: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request: the tokens sampled since the last output."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including new_token_ids
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    times: RequestTimes | None = None  # set on the finishing output
    error: str | None = None  # set when finish_reason is ERROR
    logprobs: list[TokenLogprob] | None = None  # one per new token, for a request that asked for them
    # one per prompt token, the first None (nothing predicts it); on the first output of a request that asked
    prompt_logprobs: list[TokenLogprob | None] | None = None


# A decode step's input token that the host does not know yet: the token this sequence sampled in its latest
# step, still on the device. The executor fills it in on the device side before the forward
# (overlap.engine.execution).
PLACEHOLDER_TOKEN = -1

# What a runner hands back for a sequence whose logits held a NaN or an infinity: nothing can be sampled from them,
# so the scheduler fails that request (and only that one) instead of emitting a garbage token.
NONFINITE_TOKEN = -2


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: the scheduler -> model runner contract.

    The runner writes K/V for `token_ids` at positions `start_pos .. start_pos + len(token_ids) - 1` into the
    slots given by `block_table` (slot = block_table[pos // block_size] * block_size + pos % block_size), attends
    over positions 0 .. start_pos + len(token_ids) - 1, and samples one token if `do_sample`.
    """

    request_id: str
    token_ids: list[int]  # a prefill chunk, or the one token of a decode step
    start_pos: int  # absolute position of token_ids[0]; tokens before it are already in the KV pool
    block_table: list[int]  # KV block ids covering at least positions 0 .. start_pos + len(token_ids) - 1
    do_sample: bool  # last chunk of the prompt, or a decode step
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_generated: int = 0  # tokens generated so far; with `sampling.seed` it makes sampling reproducible
    # The whole prompt, only for a request whose repetition penalty needs it (prefix-cached chunks never reach the
    # runner); the live list of the request, never copied.
    prompt_token_ids: list[int] | None = None
    # Speculative decoding: the last this many of `token_ids` are proposals, the one before them the sequence's last
    # token. The runner samples at each of those num_draft_tokens + 1 positions, accepts the longest prefix of
    # proposals its samples agree with, and hands back those plus the token it sampled after them
    # (`RunnerOutput.spec_tokens`; `accept_proposals` is the rule).
    num_draft_tokens: int = 0
    # A model that mixes sliding and full layers: its sliding layers' blocks, in a pool of their own, as `block_table`
    # (0, the null block, where a block fell out of the window); the live list of the request. Empty: block b of
    # `block_table` is block b + 1 there (callers that free nothing by window: runner-level tests, benchmarks).
    window_block_table: list[int] = field(default_factory=list)
    lora_slot: int = -1  # the device slot of the sequence's LoRA adapter (-1: the base model)


@dataclass(slots=True)
class ModelInput:
    """Everything the runner needs for one forward pass. Prefill chunks come first, then decodes."""

    seqs: list[ScheduledSeq]
    # LoRA adapters to put into device slots before this step: (slot, adapter name, its folder)
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class RunnerOutput:
    """What one step of a runner produced: a token per sequence with `do_sample` (in order), when the device was busy
    with it, and the logprobs its requests asked for."""

    token_ids: list[int]
    busy: tuple[float, float]  # (start, end) of the step's device work, in time.perf_counter() seconds
    logprobs: list[TokenLogprob | None] | None = None  # per sampled sequence, when some request asked
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] | None = None  # request id -> (first position, ...)
    # Speculative decoding: request id -> every token a sequence with proposals appends this step (its accepted
    # proposals, then the target's own next token), and their logprobs when asked; `token_ids` holds the last one.
    spec_tokens: dict[str, list[int]] | None = None
    spec_logprobs: dict[str, list[TokenLogprob | None]] | None = None

    @property
    def busy_s(self) -> float:
        return self.busy[1] - self.busy[0]


def accept_proposals(sampled: list[int], proposals: list[int]) -> list[int]:
    """Speculative decoding's verification rule: `sampled[j]` is the token the target sampled at the j-th scored
    position (after the sequence's last token, then after each proposal), from its distribution given the
    proposals before it. A proposal is accepted while it equals the target's sample there; the tokens a step
    appends are the accepted proposals and then the target's sample at the first disagreement (or after the last
    proposal). Comparing an independent sample with a proposal drawn deterministically is rejection sampling with a
    one-hot draft distribution: proposal t is accepted with probability p(t), and otherwise the sample is
    distributed as p without t, renormalised; so every appended token is distributed as the target's (greedy: is
    its argmax)."""
    n = 0
    while n < len(proposals) and sampled[n] == proposals[n]:
        n += 1
    return sampled[: n + 1]


# How the executor drives a runner: `thread` calls `execute` (on a worker thread with 2+ buffers), `launch` calls
# `launch` then `wait` (a device on its own clock: the simulated GPU), `cuda` uses the CUDA streams (execution.cuda).
StepMode = Literal["thread", "launch", "cuda"]


class Runner(Protocol):
    """The engine's model runner contract: what the engine reads once, and one step. Runners subclass it to take the
    defaults (no grammars, no per-request state, nothing to close)."""

    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()  # every EOS id the model declares, the primary one first
    sampling_defaults: Mapping[str, float] = MappingProxyType({})  # generation_config.json's, for requests
    model_dir: Path | None = None
    kernels: str = "n/a"  # what runs the step's work, for start-up logs and benchmarks
    step_mode: StepMode = "thread"
    supports_speculation: bool = False  # verifies ScheduledSeq.num_draft_tokens (speculative decoding)
    # A model mixing sliding and full layers: the sliding layers' pool (model.devices.KvPoolSplit); `num_kv_blocks` is
    # then the full layers' pool.
    kv_split: object | None = None

    def execute(self, batch: ModelInput) -> RunnerOutput:
        """Run one step."""
        ...

    def add_grammar(self, request_id: str, grammar: str) -> None:
        """Compile a request's structured-output grammar before it is scheduled (InvalidRequestError if bad)."""
        raise InvalidRequestError("structured output needs the model runner (this runner has no grammars)")

    def read_lora(self, name: str, path: str) -> int:
        """Read and check a LoRA adapter's folder against the model (ModelLoadError if it does not fit); its rank."""
        raise ConfigError("LoRA adapters need the model runner (this runner has no model to adapt)")

    def stage_lora(self, name: str, path: str) -> bool | str:
        """Whether a LoRA adapter is ready to fill a device slot: True; False while it is being read (off the
        caller's thread, started by this call: ask again); the reason where it cannot be read."""
        return True

    def forget_request(self, request_id: str) -> None:
        """A finished request's per-request state goes (called once no step in flight holds it)."""

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` from another thread if a part of the runner outside this process dies (a
        tensor-parallel rank). The engine server exits on it; runners with no such part never call it."""

    def close(self) -> None:
        """Release threads and device memory the runner holds."""
