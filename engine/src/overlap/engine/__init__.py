"""overlap.engine: request queues, scheduler, KV block manager, model runner and async executor.

This package imports nothing else from Overlap; the sidecar, operator and benchmarks import its public types.
"""

from overlap.engine import _malloc, _openmp  # noqa: F401  (before anything loads torch or starts a thread)
from overlap.engine.config import EngineConfig, LiveKnobs
from overlap.engine.core import Engine
from overlap.engine.errors import ConfigError, InvalidRequestError, ModelLoadError, OverlapError
from overlap.engine.types import FinishReason, RequestOutput, RequestSpec, RequestTimes, SamplingParams

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "InvalidRequestError",
    "LiveKnobs",
    "ModelLoadError",
    "OverlapError",
    "RequestOutput",
    "RequestSpec",
    "RequestTimes",
    "SamplingParams",
]
