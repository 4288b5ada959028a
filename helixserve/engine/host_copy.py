"""One device-to-host copy per step: the engine's outputs leave the device in one go.

On CUDA a step's hidden states (middle stages) or its sampled tokens (last stage) are
copied into pinned host memory with one non-blocking copy, then the engine thread waits on
the stream once: the only host sync of the step, and it happens on the engine thread, never
on the worker's asyncio loop (which then only reads host memory). On CPU there is nothing
to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory (pinned when it came from CUDA); waits for the copy."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
              device: torch.device,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `values` on `device`. On CUDA through pinned memory with a non-blocking
    copy: `torch.tensor(values, device=cuda)` copies from pageable memory and waits for the
    stream, a host sync per small index tensor."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def from_host(values: Sequence[int] | Sequence[Sequence[int]],
              device: torch.device) -> torch.Tensor:
    """int64 tensor of `values` on `device` (`to_device`)."""
    return to_device(values, device)
