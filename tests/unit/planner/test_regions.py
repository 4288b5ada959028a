"""The region relaxation: a valid upper bound (>= brute force) that sees slow links."""

from __future__ import annotations

import random

import pytest
from planner_factories import tiny_model
from test_milp import brute_force

from helixserve.costmodel import CostModel
from helixserve.planner import FlowNetwork, plan
from helixserve.planner.bounds import layer_work_bound
from helixserve.planner.coverage import solve_coverage
from helixserve.planner.portfolio import StageReport
from helixserve.planner.regions import solve_regions
from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec


def random_geo_cluster(seed: int) -> ClusterSpec:
    """4 layers, 3 machines over 2-3 regions, random inter-region and coordinator links."""
    rng = random.Random(seed)
    model = tiny_model(num_layers=4)
    gb = model.layer_weight_bytes / 1e9 / 0.5  # memory per layer held (weights <= 50%)
    gpus = ["A100-40GB", "L4", "T4"]
    regions = ["r0", "r1", "r2"][: rng.choice((2, 3))]
    nodes = [NodeSpec(f"n{i}", rng.choice(gpus), region=rng.choice(regions),
                      memory_gb=rng.choice((1, 2, 3)) * gb + 0.01) for i in range(3)]
    between = {frozenset((a, b)): LinkSpec(rng.choice((0.005, 0.02, 0.1)), 50.0)
               for a in regions for b in regions if a < b}
    explicit = {("coordinator", nodes[0].name): LinkSpec(rng.choice((1e-5, 1.0)))}
    return ClusterSpec(f"geo-{seed}", nodes, coordinator_region="coord",
                       default_link=LinkSpec(1.0, 1.0), between_regions=between,
                       explicit=explicit)


@pytest.mark.parametrize("seed", range(6))
def test_region_bound_is_at_least_the_brute_force_optimum(seed):
    model = tiny_model(num_layers=4)
    net = FlowNetwork(random_geo_cluster(seed), model, CostModel(model))
    optimum = brute_force(net, True)
    result = solve_regions(net, 20.0)
    assert result.info.status == "optimal"
    assert result.info.bound is not None
    assert result.info.bound >= optimum * (1 - 1e-6)
    # its placement is a real placement: never above the optimum
    assert net.max_flow(result.ranges)[0] <= optimum * (1 + 1e-6)


def two_halves() -> tuple[FlowNetwork, float]:
    """Two machines in two regions, each holding at most half the model; one slow link."""
    model = tiny_model(num_layers=4)
    gb = model.layer_weight_bytes / 1e9 / 0.5
    nodes = [NodeSpec("east", "A100-40GB", region="east", memory_gb=2 * gb + 0.01),
             NodeSpec("west", "A100-40GB", region="west", memory_gb=2 * gb + 0.01)]
    slow = LinkSpec(0.01, 50.0)  # 1.25 MB/s: ~150 tokens/s of 8 KB activations
    cluster = ClusterSpec("halves", nodes, coordinator_region="coord",
                          default_link=LinkSpec(10.0, 1.0),
                          between_regions={frozenset(("east", "west")): slow})
    net = FlowNetwork(cluster, model, CostModel(model))
    return net, float(net.link_cap[0, 1])


def test_region_bound_is_tighter_than_the_old_bounds_when_a_slow_link_binds():
    net, link = two_halves()
    optimum = brute_force(net, True)
    assert optimum == pytest.approx(link, rel=1e-3)  # the route must cross the slow link
    old = min(layer_work_bound(net), solve_coverage(net, 10.0).info.bound or float("inf"))
    new = solve_regions(net, 10.0).info.bound
    assert new is not None
    assert new >= optimum * (1 - 1e-6)
    assert old > 10 * new  # the old bounds only see compute
    assert new == pytest.approx(optimum, rel=1e-3)


def test_milp_closes_the_gap_on_a_slow_link():
    net, link = two_halves()
    stages: list[StageReport] = []
    placement = plan("milp", net.cluster, net.model, net.cost, work_limit=10,
                     stages=stages)
    assert placement.throughput_tokens_per_s == pytest.approx(link, rel=1e-3)
    assert placement.upper_bound_tokens_per_s == pytest.approx(link, rel=1e-3)
    # the region relaxation ran inside `milp` and proved the link's capacity
    region = [s for s in stages if s.stage == "regions"]
    assert len(region) == 1 and region[0].ran
    assert region[0].bound_tokens_per_s == pytest.approx(link, rel=1e-3)
