"""Placement planners: which contiguous layer range each node holds (see docs/planner.md)."""

from helixserve.planner.flow import FlowNetwork, FlowResult, evaluate
from helixserve.planner.placement import COORDINATOR, Flow, NodeRange, Placement, load_placement
from helixserve.planner.registry import PLANNERS, PlanOutcome, plan

__all__ = [
    "COORDINATOR",
    "PLANNERS",
    "Flow",
    "FlowNetwork",
    "FlowResult",
    "NodeRange",
    "PlanOutcome",
    "Placement",
    "evaluate",
    "load_placement",
    "plan",
]
