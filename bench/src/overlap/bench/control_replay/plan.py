"""What every run of the comparison shares (`Setup`), what differs between runs (`RunPlan`), and the defaults."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from overlap.bench.traces import Trace
from overlap.operator.control.policy import ScalingPolicy
from overlap.operator.control.signals import DEFAULT_WINDOW_S

RUNS = ("static-min", "static-max", "autoscale", "autoscale+tune")
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
DEFAULT_DRAIN_S = 10.0
QUICK_DRAIN_S = 3.0
CRD_SCALING = ScalingPolicy()  # the CRD's autoscaling defaults (seconds in operator time)
# The operator's latency queries look at the last minute (its --signal-window-s default), divided by --time-scale.
SIGNAL_WINDOW_S = DEFAULT_WINDOW_S
# autoscale+tune: the tuner may move these knobs inside these bounds (a knob without bounds is never tuned).
TUNING_BOUNDS = {"max_num_seqs": (8, 128), "max_num_batched_tokens": (256, 4096), "num_buffers": (1, 3)}
PROGRESS_EVERY_S = 5.0


@dataclass(slots=True)
class RunPlan:
    """One run of the comparison: the scaling mode, the first replica count, and whether tuning is on."""

    label: str
    mode: str  # builtin | off
    initial_replicas: int
    tune: bool


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
    seed: int = 0
    progress: bool = True
    log: object = sys.stdout

    def scaling_policy(self, mode: str) -> ScalingPolicy:
        crd = CRD_SCALING
        k = self.time_scale
        return ScalingPolicy(
            mode=mode,
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
        return Policy(scaling=self.scaling_policy(plan.mode), tuning=tuning)

    def say(self, text: str) -> None:
        """A progress line, unless progress is off."""
        if self.progress:
            print(text, file=self.log, flush=True)

    def plans(self, names: list[str]) -> list[RunPlan]:
        table = {
            "static-min": RunPlan("static-min", "off", self.min_replicas, False),
            "static-max": RunPlan("static-max", "off", self.max_replicas, False),
            "autoscale": RunPlan("autoscale", "builtin", self.min_replicas, False),
            "autoscale+tune": RunPlan("autoscale+tune", "builtin", self.min_replicas, True),
        }
        return [table[name] for name in names]
