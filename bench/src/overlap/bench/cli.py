"""`overlap bench ...`: each benchmark module adds its own subcommand with `add_parser(subparsers)`.

Benchmark modules keep heavy imports (torch, the engine) inside their handlers, so `overlap --help` stays fast.
"""

from __future__ import annotations

import importlib

_BENCH_MODULES = (
    "overlap.bench.engine_bench",  # overlap bench engine
    "overlap.bench.overlap_bench",  # overlap bench overlap
    "overlap.bench.http_bench",  # overlap bench http
    "overlap.bench.replay",  # overlap bench replay
    "overlap.bench.advise",  # overlap bench advise
    "overlap.bench.control_replay",  # overlap bench control
    "overlap.bench.control_sweep",  # overlap bench control-sweep
    "overlap.bench.sampling_bench",  # overlap bench sampling
    "overlap.bench.routing",  # overlap bench routing
    "overlap.bench.quant_bench",  # overlap bench quantized
    "overlap.bench.moe_bench",  # overlap bench moe
    "overlap.bench.spec_bench",  # overlap bench spec
    "overlap.bench.lora_bench",  # overlap bench lora
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks and the scheduling analysis")
    bench_subparsers = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name in _BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a benchmark not written yet
            if exc.name != name:
                raise
            continue
        module.add_parser(bench_subparsers)
