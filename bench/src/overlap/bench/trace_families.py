"""Families of load for the control loop's benchmark: `--trace FAMILY:SEED`, one generator per family.

Every family is an hour of operator time with the Azure conversation hour's token mix, like `bursts:SEED`, so the
control replay plays it with the Azure defaults (rate x60, tokens x0.05). Rates are in units of that hour's mean
rate (`azure_mean_rps()`, ~5.5 req/s): the control bench's fleet of 1..8 replicas serves up to about twice it.
The seed draws the family's parameters and its arrivals; the same seed gives the same trace.

`split_seeds` gives each split its own seeds (train 1..n, test 1001..1000+n), so rules set on `train` are judged
on traces they never saw.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from overlap.bench.trace_generators import poisson_arrivals, shipped_azure, with_azure_mix
from overlap.bench.traces import Trace, TraceError, TraceRequest, check_positive, resolve_trace

HOUR_S = 3600.0
TEST_SEED_OFFSET = 1000  # test seeds are 1001.. : disjoint from train's 1..1000
SPLITS = ("train", "test")


def azure_mean_rps() -> float:
    azure = shipped_azure()
    return len(azure.requests) / azure.duration_s


def _arrivals(rng: np.random.Generator, rates: np.ndarray, bin_s: float = 1.0) -> np.ndarray:
    """Non-homogeneous Poisson arrivals for a rate (req/s) held constant over each `bin_s` bin."""
    counts = rng.poisson(np.maximum(rates, 0.0) * bin_s)
    starts = np.repeat(np.arange(len(rates)) * bin_s, counts)
    return np.sort(starts + rng.random(len(starts)) * bin_s)


def _trace(rng_seed: int, arrivals: np.ndarray, name: str, note: str) -> Trace:
    requests = tuple(TraceRequest(arrival_s=float(t), prompt_tokens=1, max_tokens=1) for t in arrivals)
    if not requests:
        raise TraceError(f"trace {name}: the generator drew no arrivals")
    trace = with_azure_mix(Trace(requests, name), scale=1.0, seed=rng_seed)
    return Trace(trace.requests, trace.name, (*trace.transforms, f"generated: {note}"))


def _pareto(rng: np.random.Generator, alpha: float, low: float, high: float) -> float:
    """A Pareto draw with shape `alpha` and minimum `low`, capped at `high` (heavy-tailed lengths)."""
    return float(min(low * (1.0 + rng.pareto(alpha)), high))


def random_bursts(
    base_rate: float,
    factor: float,
    duration_s: float,
    burst_s: tuple[float, float] = (5.0, 30.0),
    mean_gap_s: float = 180.0,
    seed: int = 0,
) -> Trace:
    """Poisson arrivals at `base_rate`, and bursts at `factor` x it: each lasts a uniform draw from `burst_s`
    seconds and starts an exponential gap (mean `mean_gap_s`) after the previous one ends. Token counts are 1 (give
    them a mix, e.g. with_azure_mix)."""
    check_positive(base_rate=base_rate, factor=factor, duration_s=duration_s, mean_gap_s=mean_gap_s)
    if not 0 < burst_s[0] <= burst_s[1]:
        raise TraceError(f"burst_s must be (low, high) with 0 < low <= high, got {burst_s}")
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while t < duration_s:
        quiet_end = min(t + rng.exponential(mean_gap_s), duration_s)
        arrivals += poisson_arrivals(rng, base_rate, t, quiet_end)
        burst_end = min(quiet_end + rng.uniform(*burst_s), duration_s)
        arrivals += poisson_arrivals(rng, base_rate * factor, quiet_end, burst_end)
        t = burst_end
    requests = [TraceRequest(arrival_s=float(a), prompt_tokens=1, max_tokens=1) for a in arrivals]
    return Trace(tuple(requests), f"bursts-x{factor:g}-seed{seed}")


def azure_bursts(seed: int) -> Trace:
    """`bursts:SEED`: an hour at 30% of the Azure conversation hour's mean rate with x10 bursts of 5-30 s every ~3
    minutes (about half its mean overall; each burst about twice its peak minute), with its token mix."""
    azure = shipped_azure()
    base = 0.3 * len(azure.requests) / azure.duration_s
    trace = with_azure_mix(random_bursts(base, 10.0, 3600.0, seed=seed), scale=1.0, seed=seed)
    return Trace(trace.requests, trace.name, (*trace.transforms, "generated: x10 bursts of 5-30 s, gaps ~exp(180 s)"))


def pareto_bursts(seed: int) -> Trace:
    """On/off bursts with heavy-tailed lengths: bursts last Pareto(1.5, >= 10 s) at 1.2-2.2x the Azure mean rate,
    gaps Pareto(1.5, >= 60 s) at 0.2-0.5x it."""
    rng = np.random.default_rng(seed)
    m = azure_mean_rps()
    off = m * rng.uniform(0.2, 0.5)
    rates, t = np.full(int(HOUR_S), off), 0.0
    while t < HOUR_S:
        t += _pareto(rng, 1.5, 60.0, 1200.0)
        length = _pareto(rng, 1.5, 10.0, 600.0)
        rates[int(t) : int(t + length)] = m * rng.uniform(1.2, 2.2)
        t += length
    return _trace(seed, _arrivals(rng, rates), f"pareto-seed{seed}", "Pareto on/off bursts")


def flash_crowds(seed: int) -> Trace:
    """One or two flash crowds: the rate steps to 5-20x its base and decays back (time constant 2-10 min). The
    peak is 1.5-2.5x the Azure mean rate, so the base is that over the step."""
    rng = np.random.default_rng(seed)
    m = azure_mean_rps()
    step = rng.uniform(5, 20)
    base = m * rng.uniform(1.5, 2.5) / step
    t = np.arange(int(HOUR_S), dtype=float)
    rates = np.full_like(t, base)
    for at in np.sort(rng.uniform(300, 3000, size=rng.integers(1, 3))):
        tau = rng.uniform(120, 600)
        rates += np.where(t >= at, base * (step - 1) * np.exp(-(t - at) / tau), 0.0)
    return _trace(seed, _arrivals(rng, rates), f"flash-seed{seed}", f"flash crowds x{step:.1f}")


def noisy_diurnal(seed: int) -> Trace:
    """A day compressed to the hour (trough at the start and end, peak at half-time, 0.3-0.5x to 1.4-1.9x the
    Azure mean rate) times minute-to-minute noise: a log-normal AR(1) with sigma 0.15-0.3."""
    rng = np.random.default_rng(seed)
    m = azure_mean_rps()
    low, high = m * rng.uniform(0.3, 0.5), m * rng.uniform(1.4, 1.9)
    t = np.arange(int(HOUR_S), dtype=float)
    shape = low + (high - low) * (1 - np.cos(2 * np.pi * t / HOUR_S)) / 2
    sigma, noise = rng.uniform(0.15, 0.3), np.zeros(int(HOUR_S / 60) + 1)
    for i in range(1, len(noise)):
        noise[i] = 0.7 * noise[i - 1] + np.sqrt(1 - 0.7**2) * rng.normal(0, sigma)
    rates = shape * np.exp(noise[(t // 60).astype(int)] - sigma**2 / 2)
    return _trace(seed, _arrivals(rng, rates), f"wave-seed{seed}", f"diurnal with noise (sigma {sigma:.2f})")


def self_similar(seed: int, sources: int = 12, alpha: float = 1.4) -> Trace:
    """Self-similar arrivals: the sum of `sources` on/off sources whose on and off periods are Pareto(`alpha`,
    >= 20 s) (Willinger-Taqqu: Hurst parameter (3 - alpha) / 2 = 0.8), the whole at 0.6-1.2x the Azure mean rate."""
    rng = np.random.default_rng(seed)
    level = azure_mean_rps() * rng.uniform(0.6, 1.2)
    on = np.zeros(int(HOUR_S))
    for _ in range(sources):
        t, active = -rng.uniform(0, 200), bool(rng.integers(2))
        while t < HOUR_S:
            length = _pareto(rng, alpha, 20.0, 3 * HOUR_S)
            if active:
                on[max(int(t), 0) : max(int(t + length), 0)] += 1
            t, active = t + length, not active
    rates = level * on / max(on.mean(), 1e-9)
    return _trace(seed, _arrivals(rng, rates), f"selfsim-seed{seed}", f"self-similar, {sources} Pareto sources")


def conversation(seed: int) -> Trace:
    """The shipped conversation hour compressed by 0.6-1.3 (its rate times that) with token counts at 0.6-1.5x."""
    rng = np.random.default_rng(seed)
    rate, tokens = rng.uniform(0.6, 1.3), rng.uniform(0.6, 1.5)
    azure = shipped_azure()
    requests = tuple(
        TraceRequest(
            arrival_s=r.arrival_s / rate,
            prompt_tokens=max(1, round((r.prompt_tokens or 1) * tokens)),
            max_tokens=max(1, round(r.max_tokens * tokens)),
        )
        for r in azure.requests
    )
    return Trace(requests, f"conv-seed{seed}", (f"Azure conversation hour, rate x{rate:.2f}, tokens x{tokens:.2f}",))


# family name -> generator; `--trace NAME:SEED`.
FAMILIES = {
    "bursts": azure_bursts,
    "pareto": pareto_bursts,
    "flash": flash_crowds,
    "wave": noisy_diurnal,
    "selfsim": self_similar,
    "conv": conversation,
}


def is_family_trace(name: str) -> bool:
    family, sep, _ = name.partition(":")
    return bool(sep) and family in FAMILIES


def resolve(name_or_path: str) -> Trace:
    """`FAMILY:SEED` (generated), else a built-in trace or a file (traces.resolve_trace)."""
    if is_family_trace(name_or_path) and not Path(name_or_path).is_file():
        return family_trace(name_or_path)
    return resolve_trace(name_or_path)


def family_trace(name: str) -> Trace:
    """The trace `FAMILY:SEED` names; TraceError with the families for anything else."""
    family, _, seed = name.partition(":")
    if family not in FAMILIES:
        raise TraceError(f"trace {name!r}: unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if not seed.isdigit():
        raise TraceError(f"trace {name!r}: {family}:SEED takes a whole number, e.g. {family}:1")
    return FAMILIES[family](int(seed))


def split_seeds(split: str, count: int) -> list[int]:
    """The seeds of a split: train 1..count, test 1001..1000+count (count at most 1000)."""
    if split not in SPLITS:
        raise TraceError(f"split {split!r}: choose train or test")
    if not 1 <= count <= TEST_SEED_OFFSET:
        raise TraceError(f"seeds per family must be within 1..{TEST_SEED_OFFSET}, got {count}")
    first = 1 if split == "train" else TEST_SEED_OFFSET + 1
    return list(range(first, first + count))
