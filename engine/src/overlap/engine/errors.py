"""Errors the engine raises for the caller's mistakes, and the one it cannot go on after. Invariants are asserts,
not errors."""


class OverlapError(Exception):
    """Base of every error that is the caller's fault and deserves a clear message, not a traceback."""


class InvalidRequestError(OverlapError, ValueError):
    """A request that can never be served as asked (empty prompt, too long, bad sampling values, ...)."""


class UnknownAdapterError(InvalidRequestError):
    """A request naming a LoRA adapter the engine does not hold (never loaded, or unloaded before it arrived)."""


class ConfigError(OverlapError, ValueError):
    """An engine configuration that is out of range or inconsistent."""


# How the engine refuses a LoRA adapter whose folder has no config (yet): the operator reads it as "not fetched yet"
# and tries the load again soon (operator/adapter_sync.py).
ADAPTER_NOT_FOUND = "no adapter_config.json in"


class ModelLoadError(OverlapError):
    """A model folder that cannot be loaded (missing files, unsupported architecture)."""


class RankLost(OverlapError):
    """A tensor-parallel rank died or stopped answering: the step fails its requests and the engine must exit (its
    pod restarts), since the ranks can no longer step together."""
