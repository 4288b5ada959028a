"""Placement planners: which contiguous layer range each node holds (see docs/planner.md).

`Placement`, `NodeRange` and `Flow` (placement.py) are plain data that the scheduler, the
runtime and the deploy renderer read; importing them must not load the solvers (scipy, pulp),
so the names below are imported when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helixserve.planner.flow import FlowNetwork as FlowNetwork
    from helixserve.planner.flow import FlowResult as FlowResult
    from helixserve.planner.flow import evaluate as evaluate
    from helixserve.planner.placement import Flow as Flow
    from helixserve.planner.placement import NodeRange as NodeRange
    from helixserve.planner.placement import Placement as Placement
    from helixserve.planner.placement import load_placement as load_placement
    from helixserve.planner.portfolio import PlanOutcome as PlanOutcome
    from helixserve.planner.registry import PLANNERS as PLANNERS
    from helixserve.planner.registry import plan as plan
    from helixserve.spec.cluster import COORDINATOR as COORDINATOR

_EXPORTS = {
    "FlowNetwork": "helixserve.planner.flow",
    "FlowResult": "helixserve.planner.flow",
    "evaluate": "helixserve.planner.flow",
    "Flow": "helixserve.planner.placement",
    "NodeRange": "helixserve.planner.placement",
    "Placement": "helixserve.planner.placement",
    "load_placement": "helixserve.planner.placement",
    "PLANNERS": "helixserve.planner.registry",
    "PlanOutcome": "helixserve.planner.portfolio",
    "plan": "helixserve.planner.registry",
    "COORDINATOR": "helixserve.spec.cluster",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'helixserve.planner' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
