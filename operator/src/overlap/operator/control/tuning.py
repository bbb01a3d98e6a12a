"""The tuning rules: which engine knob a decision moves, and how far.

Engine knobs follow what the device is doing, one knob per decision so that the next tick measures its effect.
Readings are averaged over the last tuning interval, and the table's thresholds leave a dead band between
"mostly queueing" and "mostly execution":

| reading (interval average) | what it means | move |
|---|---|---|
| KV cache almost full | sequences get preempted and recomputed | max_num_seqs / 2 |
| latency over the SLO, > 60% of it queueing | too little concurrency | max_num_seqs x 2 |
| latency over the SLO, < 30% of it queueing | steps too large | max_num_seqs / 2, then max_num_batched_tokens / 2 |
| device often idle while requests queue (*) | the host cannot feed the device | num_buffers + 1, max_num_seqs x 2 |

(*) device busy averaged over the readings whose whole interval had requests waiting (a queue at the reading before
and at this one), not the whole interval: on bursty load that mixes idle lulls with saturated bursts, and a burst
that arrives at the end of an idle interval has a queue but found the device idle.

A larger max_num_seqs in the table is made only where the capacity profile expects a replica to finish BATCH_GAIN
more at the larger limit, or knows nothing of it (more sequences per step cost every request latency). Every move
stays inside `tuning.bounds`; a knob without bounds is never tuned. After any move (its own or a
scale) the tuner waits a whole interval and at least the latency signals' window (the PromQL's one minute), so
it judges the move on readings taken after it; it does not undo its own last move of a knob within three such
waits.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

from overlap.engine.config import LiveKnobs
from overlap.operator.control.policy import RETUNE, Current, Decision, History, Signals, TuningPolicy, seconds_since

# Thresholds of the tuning table above (shares and ratios, 0..1).
KV_PRESSURE = 0.90  # KV usage above this: preemptions are near
QUEUEING_SHARE = 0.6  # queue time above this share of end-to-end latency: latency is mostly waiting
EXECUTION_SHARE = 0.3  # queue time below this share: latency is mostly execution (in between: hold)
UNDO_AFTER_INTERVALS = 3  # a knob's last move may be reversed only after this many tuning intervals
DEVICE_IDLE = 0.70  # device busy below this while requests wait: the host is the bottleneck
# Tune before scale: the batch is this full (sequences per replica / max_num_seqs) and the KV cache under this.
BATCH_FULL = 0.9
KV_HEADROOM = 0.7
BUSY_FLEET = 0.7  # forecast load above this share of the fleet: the tuner makes no move that costs throughput
# A larger max_num_seqs costs every request latency (more sequences share each step): the table raises it only
# where the capacity profile expects a replica to finish at least this much more at the larger limit (a memory-bound
# GPU decode: far more; a compute-bound device: a few percent); unknown, it is tried. Tune before scale is not held
# to it: there a larger batch replaces a replica, whatever it adds is capacity the fleet was short of.
BATCH_GAIN = 0.1


def _move(engine: LiveKnobs, knob: str, policy: TuningPolicy, factor: float, step: int = 0) -> LiveKnobs | None:
    """The engine with `knob` scaled by `factor` (or stepped by `step`) inside its bounds; None if it can't move."""
    if knob not in policy.bounds:
        return None
    lo, hi = policy.bounds[knob]
    old = getattr(engine, knob)
    new = int(min(max(old + step if step else round(old * factor), lo), hi))
    return None if new == old else replace(engine, **{knob: new})


def _batch_pays(history: History, engine: LiveKnobs, moved: LiveKnobs) -> bool:
    """False for a larger max_num_seqs the capacity profile expects to finish less than BATCH_GAIN more."""
    old, new = engine.max_num_seqs, moved.max_num_seqs
    if new <= old:
        return True
    gain = history.capacity.gain(old, new)
    return gain is None or gain >= BATCH_GAIN


def _undoes(history: History, knob: str, engine: LiveKnobs, moved: LiveKnobs, now: float, settle_s: float) -> bool:
    """Would this reverse the knob's own last move, made less than UNDO_AFTER_INTERVALS waits ago?"""
    when, direction = history.last_moves.get(knob, (None, 0))
    recent = seconds_since(when, now) < UNDO_AFTER_INTERVALS * settle_s
    return recent and (getattr(moved, knob) - getattr(engine, knob)) * direction < 0


def tune_before_scale(
    signals: Signals, current: Current, history: History, policy: TuningPolicy, why: str
) -> Decision | None:
    """A larger batch instead of a replica, while the batch is full, the KV cache has room and the knob can rise."""
    if not policy.enabled:
        return None
    engine = current.engine
    # Full when either reading says so: the running count dips for a step whenever a sequence finishes (one such
    # reading would add a replica where a larger batch was the answer), and the mean batch of the engines' recent
    # steps lags a batch that has just filled.
    seqs, kv, replicas = engine.max_num_seqs, signals.kv_cache_usage, signals.seen_replicas()
    readings = [signals.batch_size]
    if signals.running is not None and replicas > 0:
        readings.append(signals.running / replicas)
    batch = max((r for r in readings if r is not None), default=None)
    if kv is None or batch is None:
        return None
    if kv >= KV_HEADROOM or batch < BATCH_FULL * seqs:
        return None
    moved = _move(engine, "max_num_seqs", policy, 2)
    settle_s = policy.settle_s
    if moved is None or _undoes(history, "max_num_seqs", engine, moved, signals.time, settle_s):
        return None
    text = f"tune before scale ({why}; batch full, KV {kv:.0%}): max_num_seqs {seqs:g} -> {moved.max_num_seqs:g}"
    return Decision(RETUNE, text, current.replicas, moved, {"max_num_seqs": (seqs, moved.max_num_seqs)})


def tune(
    signals: Signals, current: Current, history: History, policy: TuningPolicy, load: float | None = None
) -> Decision | None:
    """The tuning table's move, if any. `load`: the recent peak of the forecast load in replicas, when the floor has
    one; while it is above BUSY_FLEET of the fleet, no move shrinks the batch or the step budget (they cost
    throughput)."""
    now = signals.time
    settle_s = policy.settle_s
    if seconds_since(history.last_move(), now) < settle_s:
        return None  # the last move's effect is not in the readings yet
    engine = current.engine
    samples = [*history.window(now, policy.interval_s), signals]
    signals = _averaged(samples)

    def retune(candidates: list[tuple[str, float, int]], why: str) -> Decision | None:
        for knob, factor, step in candidates:
            moved = _move(engine, knob, policy, factor, step)
            if moved is None or _undoes(history, knob, engine, moved, now, settle_s):
                continue
            old, new = getattr(engine, knob), getattr(moved, knob)
            shrinks = knob in ("max_num_seqs", "max_num_batched_tokens") and new < old
            if shrinks and load is not None and load > BUSY_FLEET * current.replicas:
                continue  # a smaller batch or step costs throughput the forecast load needs
            if not _batch_pays(history, engine, moved):
                continue
            text = f"{why}: {knob} {old:g} -> {new:g}"
            return Decision(RETUNE, text, current.replicas, moved, {knob: (old, new)})
        return None

    kv, share = signals.kv_cache_usage, signals.queue_time_share
    if kv is not None and kv > KV_PRESSURE:
        return retune([("max_num_seqs", 0.5, 0)], f"KV cache {kv:.0%} full (> {KV_PRESSURE:.0%})")
    over = _over_slo(signals, policy)
    if over is not None:
        if share is not None and share > QUEUEING_SHARE:
            return retune([("max_num_seqs", 2, 0)], f"{over}, {share:.0%} of it queueing")
        if share is not None and share < EXECUTION_SHARE:
            candidates = [("max_num_seqs", 0.5, 0), ("max_num_batched_tokens", 0.5, 0)]
            return retune(candidates, f"{over}, {1 - share:.0%} of it execution")
    busy = _busy_while_waiting(history, samples, now - policy.interval_s)
    if busy is not None and busy < DEVICE_IDLE:
        candidates = [("num_buffers", 1, 1), ("max_num_seqs", 2, 0)]
        return retune(candidates, f"device busy {busy:.0%} (< {DEVICE_IDLE:.0%}) while requests wait")
    return None


def _busy_while_waiting(history: History, samples: list[Signals], since: float) -> float | None:
    """(*) in the table: device busy over the readings whose whole interval had requests waiting (a queue at the
    reading before and at this one), `samples` the readings since `since`. The queue is read at an instant and busy
    over the interval: a burst that arrives at the end of an idle interval is not a starved device. The very first
    reading counts on its own."""
    before = next((s for s in reversed(history.samples) if s.time < since), None)
    chain = [before, *samples] if before is not None else samples
    pairs = list(pairwise(chain)) if len(chain) > 1 else [(chain[0], chain[0])]
    busy = [s.device_busy for prev, s in pairs if s.device_busy is not None and _waits(prev) and _waits(s)]
    return sum(busy) / len(busy) if busy else None


def _waits(signals: Signals) -> bool:
    return (signals.queue_depth or 0) > 0


def _averaged(samples: list[Signals]) -> Signals:
    """The last sample with each signal replaced by its mean over `samples` (missing readings left out)."""

    def mean(name: str) -> float | None:
        values = [v for s in samples if (v := getattr(s, name)) is not None]
        return sum(values) / len(values) if values else None

    names = ("queue_depth", "device_busy", "queue_time_share", "p99_latency_s", "ttft_p99_s", "kv_cache_usage")
    return replace(samples[-1], **{name: mean(name) for name in names})


def _over_slo(signals: Signals, policy: TuningPolicy) -> str | None:
    if policy.p99_slo_s is not None and signals.p99_latency_s is not None and signals.p99_latency_s > policy.p99_slo_s:
        return f"P99 {signals.p99_latency_s:.2f} s > SLO {policy.p99_slo_s:g} s"
    if policy.ttft_slo_s is not None and signals.ttft_p99_s is not None and signals.ttft_p99_s > policy.ttft_slo_s:
        return f"TTFT P99 {signals.ttft_p99_s:.2f} s > SLO {policy.ttft_slo_s:g} s"
    return None
