"""Typed errors an engine raises from `step`, one class per way a step can fail.

The worker maps each class to a wire status (runtime/worker.py, `engine_error_status`), so
the coordinator can tell a full KV cache (preempt by recompute) from an item the engine
refuses (fail the request) and from anything else (an engine bug: fail the request). Every
engine (torch, vllm, emulated) raises these and nothing else on purpose; an exception of
another class is an internal error. Torch-free.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """A step the engine could not run; nothing of it was applied."""

    #: name of the gRPC status code the worker reports this as (runtime/transport.py)
    status = "INTERNAL"


class KvExhaustedError(EngineError):
    """Not enough free KV blocks for a step; nothing was allocated. The coordinator
    preempts the request (on-demand KV) and recomputes it later."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, needed_blocks: int = 0, free_blocks: int = 0) -> None:
        super().__init__(message)
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class InvalidWorkError(EngineError, ValueError):
    """An item this engine refuses: layers outside its range, a skipped position, hidden
    states of the wrong shape, the last layer without sampling parameters. A ValueError
    too, as the engines raised before these classes existed."""

    status = "INVALID_ARGUMENT"


class PrefixMissError(EngineError):
    """A work item's `prefix_token_ids` name blocks this engine's prefix cache does not hold
    (evicted since its last report, or caching is off); nothing was changed. The coordinator
    drops the names from its index and runs the request again from token 0."""

    status = "FAILED_PRECONDITION"

    def __init__(self, request_id: str, missing: list[bytes]) -> None:
        super().__init__(f"prefix miss: request {request_id!r}: {len(missing)} prefix "
                         "block(s) not cached here")
        self.request_id = request_id
        self.missing = list(missing)
