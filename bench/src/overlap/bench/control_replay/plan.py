"""What every run of the comparison shares (`Setup`), what differs between runs (`RunPlan`), and the defaults."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from overlap.bench.traces import Trace
from overlap.operator.control.policy import ScalingPolicy
from overlap.operator.control.signals import DEFAULT_WINDOW_S

# static-N (any N) is a fixed fleet too; the baselines are in control_replay.baselines.
RUNS = ("static-min", "static-max", "watermark", "hpa-cpu", "keda-queue", "llmd-slo", "overlap")
# Every fixed fleet from min to max and overlap: the verdict's "dominated by none" needs every static size. The
# baselines (watermark, hpa-cpu, keda-queue, llmd-slo) run when named.
DEFAULT_RUNS = ("statics", "overlap")
QUICK_RUNS = ("static-max", "static-6", "keda-queue", "overlap")
DEFAULT_TRACE = "azure"
# The Azure hour replayed in ~58 s with prompts/outputs at 5% (mean ~58 prompt and ~11 output tokens): the peak
# minute then offers ~500 req/s, several times what one simulated replica serves.
AZURE_SCALE_RATE = 60.0
AZURE_SCALE_TOKENS = 0.05
DEFAULT_TIME_SCALE = 60.0  # the controller's CRD defaults (seconds) are divided by this
DEFAULT_SIM_COST = (5.0, 150.0)  # a step of N tokens: 5 ms + N x 150 us
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS = 1, 8
DEFAULT_COLD_START_S = 1.0  # a 60 s pod start (image pull, model load) at the default time scale
DEFAULT_SLO_S = 1.0  # P99 end-to-end latency objective, replayed seconds
# The SLO law's objectives (overlap's and llm-d's), P90, replayed seconds: a ~11-token answer within the 1 s above.
DEFAULT_TTFT_SLO_S = 0.5
DEFAULT_TPOT_SLO_S = 0.04
# The dynamic runs start with the fleet that serves the mean rate of the first START_WINDOWS signal windows at
# START_UTILIZATION of a replica's capacity: what a controller running before the trace would hold.
START_UTILIZATION = 0.9
START_WINDOWS = 5
DEFAULT_DRAIN_S = 10.0
QUICK_DRAIN_S = 3.0
CRD_SCALING = ScalingPolicy()  # the CRD's autoscaling defaults (seconds in operator time)
# The operator's latency queries look at the last minute (its --signal-window-s default), divided by --time-scale.
SIGNAL_WINDOW_S = DEFAULT_WINDOW_S
# autoscale+tune: the tuner may move these knobs inside these bounds (a knob without bounds is never tuned).
TUNING_BOUNDS = {"max_num_seqs": (8, 128), "max_num_batched_tokens": (256, 4096), "num_buffers": (1, 3)}
PROGRESS_EVERY_S = 5.0
# Load-profile periods of the shipped traces, replayed seconds (the diurnal trace's days last 40 s).
TRACE_PERIODS_S = {"diurnal": 40.0}


@dataclass(slots=True)
class RunPlan:
    """One run of the comparison: who scales, the first replica count, and what of decide() is on."""

    label: str
    controller: str  # static | decide (the operator's policy) | a baseline's name (control_replay.baselines)
    initial_replicas: int
    tune: bool = False
    predictive: bool = False
    slo_law: bool = False


@dataclass(slots=True)
class Setup:
    """Everything every run shares."""

    trace: Trace
    cost_ms_us: tuple[float, float]
    min_replicas: int
    max_replicas: int
    max_num_seqs: int
    time_scale: float
    interval_s: float
    cold_start_s: float
    slo_s: float
    drain_s: float
    up_watermark: float = CRD_SCALING.up_watermark
    down_watermark: float = CRD_SCALING.down_watermark
    start_replicas: int = 1  # the dynamic runs' first fleet
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    period_s: float = 86400.0  # the load profile's period, replayed seconds
    seed: int = 0
    progress: bool = True
    log: object = sys.stdout

    def scaling_policy(self, mode: str, predictive: bool = False, slo_law: bool = False) -> ScalingPolicy:
        """The operator's policy for this replay; with `predictive`, seeded with the cost model's capacity per
        replica at each batch limit the tuner can reach (what an offline profile, autoscaling.predictive's
        capacityPerReplica and capacityProfile, would give)."""
        crd = CRD_SCALING
        k = self.time_scale
        return ScalingPolicy(
            mode=mode,
            predictive=predictive,
            ttft_slo_s=self.ttft_slo_s if slo_law else None,
            tpot_slo_s=self.tpot_slo_s if slo_law else None,
            cold_start_s=crd.cold_start_s / k,
            period_s=self.period_s,
            target_utilization=crd.target_utilization,
            capacity_hints=self.capacity_profile() if predictive else {},
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            up_watermark=self.up_watermark,
            down_watermark=self.down_watermark,
            up_window_s=crd.up_window_s / k,
            down_window_s=crd.down_window_s / k,
            up_cooldown_s=crd.up_cooldown_s / k,
            down_cooldown_s=crd.down_cooldown_s / k,
            interval_s=self.interval_s,
        )

    def policy(self, plan: RunPlan):
        from overlap.operator.control.policy import Policy, TuningPolicy

        tuning = TuningPolicy(
            enabled=plan.tune,
            interval_s=TuningPolicy().interval_s / self.time_scale,
            signal_window_s=SIGNAL_WINDOW_S / self.time_scale,
            bounds=TUNING_BOUNDS if plan.tune else {},
            p99_slo_s=self.slo_s,
        )
        mode = "builtin" if plan.controller == "decide" else "off"
        return Policy(scaling=self.scaling_policy(mode, plan.predictive, plan.slo_law), tuning=tuning)

    def capacity_profile(self) -> dict[int, float]:
        """The cost model's capacity per replica at each batch limit the tuner can reach: what a load test per
        limit would give as autoscaling.predictive's capacityPerReplica and capacityProfile."""
        return {b: self.replica_capacity_rps(b) for b in self.reachable_max_num_seqs()}

    def reachable_max_num_seqs(self) -> list[int]:
        """The batch limits the tuner can reach from the start: it doubles and halves within TUNING_BOUNDS."""
        lo, hi = TUNING_BOUNDS["max_num_seqs"]
        limits, b = {self.max_num_seqs}, self.max_num_seqs
        while b < hi:
            b = min(2 * b, hi)
            limits.add(b)
        b = self.max_num_seqs
        while b > lo:
            b = max(round(b / 2), lo)
            limits.add(b)
        return sorted(limits)

    def replica_capacity_rps(self, max_num_seqs: int | None = None) -> float:
        """What one replica serves at most of this trace at sequence cap B (default: the start's): with B sequences
        decoding, a step of fixed + per_token x tokens, and each request's prompt + output tokens passing through
        once, throughput is B / (O x fixed + B x per_token x (P + O)) for mean prompt P and output O tokens."""
        fixed_s, per_token_s = self.cost_ms_us[0] / 1000, self.cost_ms_us[1] / 1e6
        prompts = [r.prompt_tokens or 1 for r in self.trace.requests]
        outputs = [r.max_tokens for r in self.trace.requests]
        p, o, b = float(np.mean(prompts)), float(np.mean(outputs)), max_num_seqs or self.max_num_seqs
        return b / (o * fixed_s + b * per_token_s * (p + o))

    def say(self, text: str) -> None:
        """A progress line, unless progress is off."""
        if self.progress:
            print(text, file=self.log, flush=True)

    def plans(self, names: list[str]) -> list[RunPlan]:
        start = self.start_replicas
        table = {
            "static-min": RunPlan("static-min", "static", self.min_replicas),
            "static-max": RunPlan("static-max", "static", self.max_replicas),
            "watermark": RunPlan("watermark", "decide", start),
            "overlap": RunPlan("overlap", "decide", start, tune=True, predictive=True, slo_law=True),
            **{name: RunPlan(name, name, start) for name in ("hpa-cpu", "keda-queue", "llmd-slo")},
        }
        return [table[name] if name in table else RunPlan(name, "static", static_size(name)) for name in names]


def static_size(name: str) -> int:
    """N of a static-N run name (ValueError if it is not one)."""
    prefix, _, size = name.partition("-")
    if prefix != "static" or not size.isdigit() or int(size) < 1:
        raise ValueError(name)
    return int(size)
