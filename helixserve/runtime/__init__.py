"""The distributed runtime: gRPC workers around engines, the coordinator, the wire transport.

    from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest, TokenEvent

Names are imported lazily so that `python -m helixserve.runtime.gen_proto` does not need torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helixserve.runtime.coordinator import Coordinator as Coordinator
    from helixserve.runtime.coordinator import CoordinatorConfig as CoordinatorConfig
    from helixserve.runtime.coordinator import GenerationRequest as GenerationRequest
    from helixserve.runtime.coordinator import NoRouteError as NoRouteError
    from helixserve.runtime.coordinator import QueueFullError as QueueFullError
    from helixserve.runtime.coordinator import RequestFailedError as RequestFailedError
    from helixserve.runtime.coordinator import TokenEvent as TokenEvent

_EXPORTS = {
    "Coordinator",
    "CoordinatorConfig",
    "GenerationRequest",
    "NoRouteError",
    "QueueFullError",
    "RequestFailedError",
    "TokenEvent",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        from helixserve.runtime import coordinator

        return getattr(coordinator, name)
    raise AttributeError(f"module 'helixserve.runtime' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
