"""The engine's one configuration object, validated at construction."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from overlap.engine.errors import ConfigError

CPU_STEP_PLANS = ("auto", "halves", "whole")  # EngineConfig.cpu_step_plan
# EngineConfig.quantization (vLLM's names); model/quant/formats.py reads each
QUANTIZATION_METHODS = ("compressed-tensors", "fp8", "gptq", "awq", "mxfp4")
# EngineConfig.speculative_config: the methods (vLLM's names) this engine runs, and those it refuses by name.
SPECULATIVE_METHODS = ("ngram", "draft_model")
_NEXT_STEP = "not implemented (docs/engine.md, 'Next: EAGLE-3 and MTP', describes the checkpoint format); use "
_NEXT_STEP += "method ngram or draft_model"
REFUSED_SPECULATIVE_METHODS = {
    "eagle": "EAGLE heads are " + _NEXT_STEP,
    "eagle3": "EAGLE-3 heads are " + _NEXT_STEP,
    "medusa": "Medusa heads are not implemented; use method ngram or draft_model",
    "mlp_speculator": "MLP speculators are not implemented; use method ngram or draft_model",
    "mtp": "multi-token-prediction layers are " + _NEXT_STEP,
    "deepseek_mtp": "multi-token-prediction layers are " + _NEXT_STEP,
    "suffix": "suffix decoding is not implemented; use method ngram or draft_model",
}
MAX_SPECULATIVE_TOKENS = 16


def camel_case(name: str) -> str:
    """A snake_case field's name in the CRD and the operator's status: camelCase, a trailing `_s` spelled
    `Seconds` as Kubernetes APIs spell units (aging_s -> agingSeconds)."""
    name = re.sub(r"_s$", "_seconds", name)
    return re.sub(r"_([a-z])", lambda m: m[1].upper(), name)


@dataclass(frozen=True, slots=True)
class LiveKnobs:
    """What may change while an engine runs, applied at a step boundary: the one definition the operator's control
    loop decides, its status stores (camelCased by `camel_case`), the admin PUT and the engine wire carry, and
    `Engine.reconfigure` takes. EngineConfig holds the same fields (the start values, and what the ConfigMap's
    engine file holds) and checks them here."""

    max_num_seqs: int  # the "max batch size"
    max_num_batched_tokens: int  # per-step token budget
    num_buffers: int  # steps in flight: 1 = synchronous, 2 = double buffering (1..4)
    aging_s: float  # a request waiting longer than this moves up one priority level
    default_timeout_s: float | None  # queued longer than this -> finished with reason "timeout"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_buffers"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        for name in ("aging_s", "default_timeout_s"):
            value = getattr(self, name)
            if type(value) not in (int, float) and not (value is None and name == "default_timeout_s"):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if not 1 <= self.num_buffers <= 4:
            raise ConfigError(f"num_buffers must be in 1..4, got {self.num_buffers}")
        if self.aging_s <= 0:
            raise ConfigError(f"aging_s must be > 0, got {self.aging_s}")
        if self.default_timeout_s is not None and self.default_timeout_s <= 0:
            raise ConfigError("default_timeout_s must be > 0")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, fields: Mapping | EngineConfig) -> LiveKnobs:
        """The live knobs of an EngineConfig, or of a mapping of its fields (other keys ignored)."""
        if isinstance(fields, EngineConfig):
            return cls(**{name: getattr(fields, name) for name in cls.names()})
        return cls(**{name: fields[name] for name in cls.names()})

    def replace(self, **changes) -> LiveKnobs:
        """A checked copy with `changes` applied; ConfigError names an unknown knob."""
        unknown = set(changes) - set(self.names())
        if unknown:
            raise ConfigError(f"not live knobs: {', '.join(sorted(unknown))}; choose from {', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_camel(self) -> dict:
        """camelCase names (camel_case), unset values left out: status.liveKnobs (a merge patch cannot store null)."""
        return {camel_case(name): value for name, value in self.to_dict().items() if value is not None}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, parsed from vLLM's `--speculative-config` JSON (EngineConfig.speculative_config).

    ngram (prompt lookup): the last n tokens of a sequence, n from prompt_lookup_max down to prompt_lookup_min, are
    looked up earlier in its prompt + output; the num_speculative_tokens tokens that followed the latest earlier
    occurrence are proposed. draft_model: `model`, a smaller model folder with the target's vocabulary, proposes its
    greedy continuation. Either way the target model verifies them all in one step (docs/engine.md)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model only: the draft's local folder
    # the batch at which speculation stops (below it, proposals fill the step up to this many rows); None: the
    # device's compute-bound rows (batching/speculative.py, COMPUTE_BOUND_ROWS)
    disable_by_batch_size: int | None = None

    def to_dict(self) -> dict:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


def parse_speculative_config(raw) -> SpeculativeConfig | None:
    """vLLM's speculative_config dict (or its JSON text) -> SpeculativeConfig; None for None or {}. vLLM's defaults:
    without prompt_lookup_min/max both are 5, with one of them the other takes its value. ConfigError for what this
    engine does not run (other methods are refused by name) or a value out of range."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
    if isinstance(raw, SpeculativeConfig):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"speculative_config must be a JSON object, got {raw!r}")
    if not raw:
        return None
    known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "disable_by_batch_size"}  # fmt: skip
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"speculative_config: unsupported keys {', '.join(sorted(unknown))} (known: "
                          f"{', '.join(sorted(known))})")  # fmt: skip
    method = raw.get("method")
    model = raw.get("model")
    if method is None and model in ("ngram", "[ngram]"):  # vLLM's older spelling: the method in `model`
        method = "ngram"
    if method == "[ngram]":
        method = "ngram"
    if method in REFUSED_SPECULATIVE_METHODS:
        raise ConfigError(f"speculative_config method {method!r}: {REFUSED_SPECULATIVE_METHODS[method]}")
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    k = raw.get("num_speculative_tokens")
    if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        limit = MAX_SPECULATIVE_TOKENS
        raise ConfigError(f"speculative_config num_speculative_tokens must be an integer in 1..{limit}, got {k!r}")
    stop_at = raw.get("disable_by_batch_size")
    if stop_at is not None and (type(stop_at) is not int or stop_at < 1):
        raise ConfigError(f"speculative_config disable_by_batch_size must be an integer >= 1, got {stop_at!r}")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ConfigError("speculative_config: method draft_model needs `model`, the draft model's local folder")
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(raw))
        if lookup:
            raise ConfigError(f"speculative_config: {', '.join(lookup)} belong to method ngram, not draft_model")
        return SpeculativeConfig("draft_model", k, model=model, disable_by_batch_size=stop_at)
    if model not in (None, "ngram", "[ngram]"):
        raise ConfigError(f"speculative_config: method ngram takes no model, got {model!r}")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if type(value) is not int or value < 1:
            raise ConfigError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
    if lo > hi:
        raise ConfigError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    return SpeculativeConfig("ngram", k, lo, hi, disable_by_batch_size=stop_at)


@dataclass(slots=True)
class EngineConfig:
    model: str = ""  # a local Hugging Face model folder; "" means the tiny default model (built on first use)
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's own; bf16 for fp32 on CUDA)
    device: str = "cpu"  # cpu | cuda | auto
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    # auto | triton | native | torch. auto: one Triton kernel per layer on CUDA, the native decode kernel on CPU.
    attention_backend: str = "auto"
    # CUDA graphs for decode steps (with Triton attention on CUDA); false runs every step eagerly (vLLM's enforce_eager)
    cuda_graphs: bool = True
    # How a CPU step uses its threads: halves (the batch cut in two, each half a whole forward on its own thread:
    # no barrier per op, but every weight read twice), whole (one forward, each op on all threads), or auto (halves
    # only for models whose weights are small enough that reading them twice costs less than the barriers).
    cpu_step_plan: str = "auto"
    # Ranks of one model split by tensor parallelism: a process each (NCCL on CUDA, gloo on CPU), rank 0 the engine.
    tensor_parallel_size: int = 1
    # The checkpoint's quantization format as vLLM names it (compressed-tensors | fp8 | gptq | awq | mxfp4): None reads
    # it from config.json; a name refuses a checkpoint of another format (or of float weights).
    quantization: str | None = None
    seed: int = 0

    # KV pool: allocated once at start-up. On CUDA sized from kv_cache_ratio of free device memory; on CPU
    # (or when set) num_kv_blocks wins.
    block_size: int = 16
    kv_cache_ratio: float = 0.7
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    # Batch assembly (layer 2).
    max_seq_len: int = 2048  # prompt + output; capped by the model's max_position_embeddings
    max_num_seqs: int = 64  # the "max batch size"
    max_num_batched_tokens: int = 2048  # per-step token budget
    enable_chunked_prefill: bool = True

    # Batching policy (overlap.engine.batching.policies): continuous (default) | serial | fixed_window | dynamic,
    # with its arguments, e.g. {"window_ms": 50} or {"max_batch": 8, "max_wait_ms": 150}.
    batching: str = "continuous"
    batching_args: dict[str, float] = field(default_factory=dict)

    # Request management (layer 1).
    queue_policy: str = "priority"  # priority (levels + aging) | fifo
    num_priority_levels: int = 3  # 0 is the highest
    aging_s: float = 5.0  # a request waiting longer than this moves up one level
    default_timeout_s: float | None = None  # queued longer than this -> finished with reason "timeout"

    # Execution (layer 3).
    # Steps in flight: 1 = synchronous, 2 = double buffering (1..4). None: the engine picks 2 where the device is
    # hardware of its own (CUDA, the simulated device) and 1 on a CPU, whose forward runs on the host's own cores: a
    # second step there only takes the forward's time, speculative decoding's proposer included (docs/overlap.md,
    # "On a CPU").
    num_buffers: int | None = None

    # A simulated device instead of the model's forward: {"fixed_s": ..., "per_token_s": ...} (a cost profile,
    # overlap.engine.model.sim_runner.CostModel). The model folder still gives the tokenizer, vocabulary, EOS ids
    # and context length; steps take the profile's time without using the CPU, so replicas on one small machine
    # add capacity as they would on their own GPUs. For load and control tests; None serves the real model.
    simulated_device: dict[str, float] | None = None

    # Speculative decoding, vLLM's `--speculative-config` JSON: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", "model": folder,
    # "num_speculative_tokens": k}; None (or {}) is off. Kept as the dict with vLLM's defaults
    # filled in; `speculative` is the parsed SpeculativeConfig.
    speculative_config: dict | None = None

    # LoRA adapters (vLLM's flags; docs/lora.md): `max_loras` device slots of rank up to `max_lora_rank`, and up to
    # `max_cpu_loras` adapters kept read in host memory. `lora_modules`: adapter name -> PEFT folder, loaded at start.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_modules: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        check(
            self.dtype in ("float32", "bfloat16", "float16", "auto"),
            f"dtype must be float32|bfloat16|float16|auto, got {self.dtype!r}",
        )
        check(self.device in ("cpu", "cuda", "auto"), f"device must be cpu|cuda|auto, got {self.device!r}")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        check(self.quantization in (None, *QUANTIZATION_METHODS),
              f"quantization must be {'|'.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")  # fmt: skip
        check(self.tensor_parallel_size in (1, 2, 4, 8),
              f"tensor_parallel_size must be 1, 2, 4 or 8, got {self.tensor_parallel_size!r}")  # fmt: skip
        check(
            self.attention_backend in ("auto", "triton", "native", "torch"),
            f"attention_backend must be auto|triton|native|torch, got {self.attention_backend!r}",
        )
        check(
            self.cpu_step_plan in CPU_STEP_PLANS,
            f"cpu_step_plan must be auto|halves|whole, got {self.cpu_step_plan!r}",
        )
        check(
            self.block_size in (8, 16, 32, 64, 128),
            f"block_size must be a power of two in 8..128, got {self.block_size}",
        )
        check(0 < self.kv_cache_ratio <= 0.95, f"kv_cache_ratio must be in (0, 0.95], got {self.kv_cache_ratio}")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        check(self.max_seq_len >= 2, f"max_seq_len must be >= 2, got {self.max_seq_len}")
        # checks the live knobs' start values (num_buffers None: the engine's pick, `Engine`, which is 1 or 2)
        start = {name: getattr(self, name) for name in LiveKnobs.names()}
        LiveKnobs.of(start if self.num_buffers is not None else start | {"num_buffers": 1})
        check(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_seq_len,
            "without chunked prefill, max_num_batched_tokens must be >= max_seq_len (a prompt must fit one step)",
        )
        check(
            self.batching in ("continuous", "serial", "fixed_window", "dynamic"),
            f"batching must be continuous|serial|fixed_window|dynamic, got {self.batching!r}",
        )
        check(
            self.queue_policy in ("priority", "fifo"),
            f"queue_policy must be priority|fifo, got {self.queue_policy!r}",
        )
        check(1 <= self.num_priority_levels <= 8, "num_priority_levels must be in 1..8")
        check(isinstance(self.cuda_graphs, bool), "cuda_graphs must be true or false")
        check(isinstance(self.enable_lora, bool), "enable_lora must be true or false")
        check(type(self.max_loras) is int and self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras!r}")
        check(type(self.max_lora_rank) is int and self.max_lora_rank >= 1,
              f"max_lora_rank must be >= 1, got {self.max_lora_rank!r}")  # fmt: skip
        check(self.max_cpu_loras is None or (type(self.max_cpu_loras) is int and self.max_cpu_loras >= self.max_loras),
              f"max_cpu_loras must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")  # fmt: skip
        check(not self.lora_modules or self.enable_lora, "lora_modules needs enable_lora")
        spec = parse_speculative_config(self.speculative_config)
        self.speculative_config = None if spec is None else spec.to_dict()
        if self.simulated_device is not None:
            sim = self.simulated_device
            check(
                isinstance(sim, dict)
                and set(sim) == {"fixed_s", "per_token_s"}
                and all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in sim.values()),
                f"simulated_device must be {{fixed_s: seconds >= 0, per_token_s: seconds >= 0}}, got {sim!r}",
            )

    @property
    def num_cpu_loras(self) -> int:
        """LoRA adapters kept read in host memory: max_cpu_loras, by default max_loras."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (None: no speculation)."""
        return parse_speculative_config(self.speculative_config)

    def replace(self, **changes) -> EngineConfig:
        """A validated copy with `changes` applied."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown engine config keys: {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    @property
    def live(self) -> LiveKnobs:
        """The knobs that may change while the engine runs (an engine's config: num_buffers None is its pick)."""
        if self.num_buffers is None:
            raise ConfigError("num_buffers is None: the engine picks it at start-up (Engine.config holds the pick)")
        return LiveKnobs.of(self)

    def with_live(self, knobs: LiveKnobs) -> EngineConfig:
        """A validated copy running `knobs`."""
        return self.replace(**knobs.to_dict())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- the flags vLLM users type, mapped onto EngineConfig -----------------------------------------------------------
# (flag, EngineConfig field, type, help). A flag given on the command line overrides the --config file.
def _json_object(text: str) -> dict:
    """argparse type of a JSON-object flag."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ENGINE_FLAGS = (
    ("--dtype", "dtype", str, "auto | float32 | bfloat16 | float16 (auto: the checkpoint's, bf16 for fp32 on CUDA)"),
    ("--device", "device", str, "auto | cpu | cuda (auto: CUDA when torch sees a GPU)"),
    ("--max-model-len", "max_seq_len", int, "prompt + output tokens per request (capped by the model's context)"),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences in one step (the batch size)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    ("--gpu-memory-utilization", "kv_cache_ratio", float,
     "on CUDA, the share of free device memory (after the weights) the KV pool takes"),
    ("--block-size", "block_size", int, "tokens per KV block (8..128, a power of two)"),
    ("--seed", "seed", int, "seed of the sampling generator"),
    ("--quantization", "quantization", str,
     "compressed-tensors | fp8 | gptq | awq | mxfp4: the checkpoint's format, refusing one that does not match "
     "(default: read from config.json)"),
    ("--tensor-parallel-size", "tensor_parallel_size", int,
     "ranks the model is split across (1, 2, 4, 8): one process each, NCCL on CUDA, gloo on CPU"),
    ("--attention-backend", "attention_backend", str,
     "auto | triton | native | torch (auto: Triton on CUDA, the native kernel on CPU)"),
    ("--cpu-step-plan", "cpu_step_plan", str,
     "auto | halves | whole: a CPU step as two half-batch forwards on two threads, or one forward on all threads"),
    ("--speculative-config", "speculative_config", _json_object,
     'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
     "(method ngram: prompt_lookup_min/max default to 5; method draft_model: \"model\", a smaller model folder with "
     "the same vocabulary; disable_by_batch_size: the batch at which it stops, default 16 on a CPU and 256 on CUDA; "
     "eagle, eagle3, mtp and others are refused by name)"),
    ("--max-loras", "max_loras", int, "LoRA adapters on the device at once (slots; with --enable-lora)"),
    ("--max-lora-rank", "max_lora_rank", int, "the highest rank of a LoRA adapter that loads"),
    ("--max-cpu-loras", "max_cpu_loras", int, "LoRA adapters kept read in host memory (>= --max-loras)"),
)  # fmt: skip


def _lora_module(text: str) -> tuple[str, str]:
    """argparse type of one --lora-modules entry: name=path (vLLM's form)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be name=path, got {text!r}")
    return name, path


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The vLLM-style engine flags; each defaults to None, i.e. "not given" (the config file or default holds)."""
    group = parser.add_argument_group("engine (vLLM-style flags; each overrides --config)")
    for flag, dest, kind, help_text in ENGINE_FLAGS:
        group.add_argument(flag, dest=f"engine_{dest}", type=kind, default=None, help=help_text)
    group.add_argument(
        "--enable-prefix-caching",
        dest="engine_enable_prefix_caching",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="reuse the KV of shared prompt prefixes (default on)",
    )
    group.add_argument("--enable-lora", dest="engine_enable_lora", default=None, action="store_true",
                       help="serve LoRA adapters (PEFT folders) on the base model; docs/lora.md")  # fmt: skip
    group.add_argument("--lora-modules", dest="engine_lora_modules", type=_lora_module, nargs="+", default=None,
                       metavar="NAME=PATH", help="LoRA adapters loaded at start, served as model NAME")  # fmt: skip


def engine_overrides(args: argparse.Namespace) -> dict:
    """The EngineConfig fields the engine flags in `args` set (only the flags given)."""
    fields = [dest for _, dest, _, _ in ENGINE_FLAGS] + ["enable_prefix_caching", "enable_lora", "lora_modules"]
    changes = {f: getattr(args, f"engine_{f}") for f in fields if getattr(args, f"engine_{f}", None) is not None}
    if "lora_modules" in changes:
        changes["lora_modules"] = dict(changes["lora_modules"])
    if "dtype" in changes:
        changes["dtype"] = _DTYPE_ALIASES.get(changes["dtype"], changes["dtype"])
    return changes


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given in `args`, as command-line arguments again (for a child `overlap engine`)."""
    argv = []
    for flag, dest, _, _ in ENGINE_FLAGS:
        value = getattr(args, f"engine_{dest}", None)
        if value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    caching = getattr(args, "engine_enable_prefix_caching", None)
    if caching is not None:
        argv.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    if getattr(args, "engine_enable_lora", None):
        argv.append("--enable-lora")
    modules = getattr(args, "engine_lora_modules", None)
    if modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in modules)]
    return argv
