"""`overlap bench advise --rate R --slo-ms S`: pick `dynamic` batching arguments from the arrival rate and the SLO.

Field report 2's rule: filling a batch of B requests at an arrival rate of R requests/s takes about B / R seconds,
and that wait should stay under half the latency SLO (the other half is for computing). So the largest batch that
fits is B = floor(R * SLO / 2), capped by the engine's sequence cap, and `max_wait_ms` is the time it takes to fill
it (never more than SLO / 2), so a lull in arrivals cannot hold a partial batch past the budget.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Advice:
    rate: float
    slo_ms: float
    wait_budget_ms: float
    max_batch: int
    max_wait_ms: float
    fill_time_ms: float
    arithmetic: list[str]

    @property
    def policy_args(self) -> str:
        return f"max_batch={self.max_batch},max_wait_ms={self.max_wait_ms:g}"


def advise(rate: float, slo_ms: float, max_batch_cap: int = 64) -> Advice:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"--rate must be a positive number of requests per second, got {rate}")
    if not (slo_ms > 0 and math.isfinite(slo_ms)):
        raise ValueError(f"--slo-ms must be a positive number of milliseconds, got {slo_ms}")
    if max_batch_cap < 1:
        raise ValueError(f"--max-batch-cap must be >= 1, got {max_batch_cap}")
    budget_ms = slo_ms / 2
    fits = rate * budget_ms / 1000
    max_batch = max(1, min(max_batch_cap, math.floor(fits)))
    fill_ms = max_batch / rate * 1000
    max_wait_ms = round(min(fill_ms, budget_ms), 1)
    lines = [
        f"wait budget = SLO / 2 = {slo_ms:g} / 2 = {budget_ms:g} ms",
        f"requests arriving within the budget = rate x budget = {rate:g}/s x {budget_ms / 1000:g} s = {fits:.2f}",
    ]
    if fits < 1:
        lines.append(
            "fewer than one request arrives within the budget: batching by waiting cannot pay off; max_batch = 1 "
            "(continuous batching batches without waiting)"
        )
    elif math.floor(fits) > max_batch_cap:
        lines.append(f"max_batch = min(floor({fits:.2f}), cap {max_batch_cap}) = {max_batch}")
    else:
        lines.append(f"max_batch = floor({fits:.2f}) = {max_batch}")
    lines += [
        f"time to fill it = max_batch / rate = {max_batch} / {rate:g} = {fill_ms:.1f} ms",
        f"max_wait_ms = min(fill time, budget) = min({fill_ms:.1f}, {budget_ms:g}) = {max_wait_ms:g} ms",
    ]
    return Advice(rate, slo_ms, budget_ms, max_batch, max_wait_ms, fill_ms, lines)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "advise",
        help="recommend dynamic batching arguments (max_batch, max_wait_ms) for an arrival rate and a latency SLO",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--rate", type=float, required=True, help="arrival rate in requests per second")
    parser.add_argument("--slo-ms", type=float, required=True, help="end-to-end latency SLO in milliseconds")
    parser.add_argument("--max-batch-cap", type=int, default=64, help="the engine's max_num_seqs (default 64)")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from overlap.engine.errors import ConfigError

    try:
        advice = advise(args.rate, args.slo_ms, args.max_batch_cap)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.json:
        print(json.dumps({**asdict(advice), "policy_args": advice.policy_args}, indent=2))
        return 0
    print(f"Dynamic batching for {args.rate:g} requests/s under a {args.slo_ms:g} ms SLO")
    for line in advice.arithmetic:
        print("  " + line)
    print(f"Recommendation: --policy dynamic --policy-args {advice.policy_args}")
    return 0
