"""Placement planners: which contiguous layer range each node holds (see docs/planner.md)."""

from helixserve.planner.placement import COORDINATOR, Flow, NodeRange, Placement, load_placement

__all__ = ["COORDINATOR", "Flow", "NodeRange", "Placement", "load_placement"]
