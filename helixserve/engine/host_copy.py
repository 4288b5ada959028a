"""One device-to-host copy per step: the engine's outputs leave the device in one go.

On CUDA a step's hidden states (middle stages) or its sampled tokens (last stage) are
copied into pinned host memory with one non-blocking copy, then the engine thread waits on
the stream once: the only host sync of the step, and it happens on the engine thread, never
on the worker's asyncio loop (which then only reads host memory). On CPU there is nothing
to copy.
"""

from __future__ import annotations

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory (pinned when it came from CUDA); waits for the copy."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def from_host(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of `values` on `device`: one (pinned, non-blocking) host-to-device copy."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.long)
    host = torch.tensor(values, dtype=torch.long).pin_memory()
    return host.to(device, non_blocking=True)
