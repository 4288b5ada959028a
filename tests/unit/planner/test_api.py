from __future__ import annotations

import pytest
from planner_factories import make_cluster

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import PLANNERS, evaluate, plan


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_covers_all_layers(name, llama70b, measured_cost):
    cluster = make_cluster(a100=3, l4=4, t4=6)
    placement = plan(name, cluster, llama70b, measured_cost, work_limit=0.5)
    assert placement.covers_all_layers()
    assert placement.throughput_tokens_per_s and placement.throughput_tokens_per_s > 0
    again = evaluate(cluster, llama70b, measured_cost, placement)
    assert again.throughput_tokens_per_s == pytest.approx(placement.throughput_tokens_per_s)
    out = sum(f.tokens_per_s for f in again.flows if f.src == "coordinator")
    assert out == pytest.approx(again.throughput_tokens_per_s, rel=1e-6)


def test_unknown_planner_lists_known(llama70b):
    with pytest.raises(UserError, match="known: milp"):
        plan("gurobi", make_cluster(a100=8), llama70b, CostModel(llama70b))
