"""Interim: best baseline (the MILP lands next)."""

from __future__ import annotations

from helixserve.planner.baselines import BASELINES
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.registry import PlanOutcome, Progress


def solve_milp(net: FlowNetwork, time_limit_s: float, seed: int,
               progress: Progress | None) -> PlanOutcome:
    best = max((fn(net) for fn in BASELINES.values()), key=lambda r: net.max_flow(r)[0])
    return PlanOutcome(best)
