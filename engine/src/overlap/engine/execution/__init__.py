"""Execution (docs/design.md, layer 3): the N-buffered pipeline of model steps and what measures it.

`base.Executor` runs steps synchronously or on a worker thread (CPU runners); `launch.AsyncExecutor` drives a
runner that launches steps itself (the simulated device); `cuda.CudaExecutor` uses CUDA streams and events.
`busy` accounts for device-busy time.
"""

from __future__ import annotations

import os

from overlap.engine.execution.base import MAX_BUFFERS, Executor, Step
from overlap.engine.execution.busy import BusyTracker
from overlap.engine.execution.launch import AsyncExecutor
from overlap.engine.types import Runner

__all__ = ["MAX_BUFFERS", "AsyncExecutor", "Executor", "Step", "default_num_buffers", "make_executor"]


def make_executor(runner: Runner, num_buffers: int = 2, busy: BusyTracker | None = None) -> Executor:
    """By the runner's `step_mode`: the CUDA pipeline for a runner on a CUDA device (`OVERLAP_CUDA_PIPELINE=0` opts
    out), the launch/wait one for a runner that launches asynchronously (the simulated GPU), else the threaded one."""
    if runner.step_mode == "cuda" and os.environ.get("OVERLAP_CUDA_PIPELINE", "1") != "0":
        from overlap.engine.execution.cuda import CudaExecutor

        return CudaExecutor(runner, num_buffers, busy)
    if runner.step_mode == "launch":
        return AsyncExecutor(runner, num_buffers, busy)
    return Executor(runner, num_buffers, busy)


def default_num_buffers(runner: Runner) -> int:
    """What an engine runs when its config leaves `num_buffers` out: 1 where the forward runs on the host's own
    cores (a model runner on a CPU), since a second step in flight there only takes the forward's time, speculative
    decoding's proposer included (docs/overlap.md, "On a CPU: one buffer by default"); 2 where the device is
    hardware of its own (CUDA, the simulated device), whose idle time the second step fills."""
    return 1 if getattr(getattr(runner, "device", None), "type", None) == "cpu" else 2
