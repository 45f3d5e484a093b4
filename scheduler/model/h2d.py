"""Host values onto the device without the launching thread waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and torch then
synchronises the stream: the launching thread waits until every kernel queued before it has
run, which turns a launch into a wait for the device and, in overlap mode, the launch of
round N into a wait for round N-1. Copies from pinned memory, non-blocking, are queued
like kernels; torch's pinned-memory cache keeps the host buffer until its copy has run.
On the CPU the host tensor is the device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=dtype), device)
