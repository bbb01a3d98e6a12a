"""Host lists to device tensors without making the host wait: on CUDA one pinned buffer and one non-blocking copy.

A `torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until the copy is done,
and the copy queues behind the running step: with steps in flight, the next step's launch would stall on the one
before it. Everything the step path sends to the device goes through `to_device`.
"""

from __future__ import annotations

import torch


def to_device(device: torch.device, *lists, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, ...]:
    """One tensor of `dtype` per list, on `device`; on CUDA they are views of one buffer copied in one go."""
    if device.type != "cuda":
        return tuple(torch.tensor(values, dtype=dtype).to(device) for values in lists)
    host = torch.tensor([v for values in lists for v in values], dtype=dtype)
    return stage(host, device).split([len(values) for values in lists])


def stage(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory, copied without blocking the host."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
