"""`overlap bench control`: the operator's control loop, closed, on a trace replayed against simulated replicas.

A fleet of replicas, each a real Engine (scheduler, request queue, KV block manager) on the simulated device
(`SimRunner`, asynchronous: the device runs steps on its own clock and the engine thread waits without the GIL),
each driven by its own thread. A router in front sends every arrival to the ready replica with the fewest
outstanding requests (join-shortest-queue). Every tick the loop reads the fleet's signals with the meaning of the
operator's Prometheus queries, calls the operator's own `decide()` (overlap.operator.control.decide) and carries the
decision out: a new replica serves only after a cold start; a removed one stops receiving, finishes what it holds,
then goes, so nothing accepted is lost; a retune goes to every replica through `Engine.reconfigure`.

Time is compressed: the trace's arrival times by `--scale-rate` (a rate scale divides them), the controller's
windows, cooldowns and intervals (the CRD defaults) by `--time-scale`. Every flag in seconds is in replayed seconds.
"""

from overlap.bench.control_replay.cli import add_parser, compare, setup_from_args
from overlap.bench.control_replay.fleet import Replica
from overlap.bench.control_replay.loop import ControlRun, run_control
from overlap.bench.control_replay.plan import RunPlan, Setup
from overlap.bench.control_replay.summary import summarize_run

__all__ = [
    "ControlRun",
    "Replica",
    "RunPlan",
    "Setup",
    "add_parser",
    "compare",
    "run_control",
    "setup_from_args",
    "summarize_run",
]
