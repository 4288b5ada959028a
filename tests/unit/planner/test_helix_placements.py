"""The Helix authors' own Gurobi placements (converted in benchmarks/helix-placements/),
scored by our evaluator, against our tiling heuristic on the same cluster."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helixserve.planner import FlowNetwork, evaluate, load_placement
from helixserve.planner.milp import layer_work_bound
from helixserve.spec import load_cluster

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared" / "data"


@pytest.mark.parametrize("cluster_name", ["helix-single-24", "helix-geo-24"])
def test_helix_placements_load_and_cover(cluster_name, llama70b, measured_cost):
    cluster = load_cluster(SHARED / "clusters" / f"{cluster_name}.yaml")
    placement = load_placement(REPO / "benchmarks" / "helix-placements"
                               / f"{cluster_name}-llama-2-70b.json")
    assert placement.covers_all_layers() and len(placement.nodes) == 24
    result = evaluate(cluster, llama70b, measured_cost, placement)
    assert 0 < result.throughput_tokens_per_s < layer_work_bound(
        FlowNetwork(cluster, llama70b, measured_cost))


def test_tiling_beats_helix_gurobi_on_single_24(llama70b, measured_cost):
    from helixserve.planner.tiling import tiling_search

    cluster = load_cluster(SHARED / "clusters" / "helix-single-24.yaml")
    helix = evaluate(cluster, llama70b, measured_cost, load_placement(
        REPO / "benchmarks" / "helix-placements" / "helix-single-24-llama-2-70b.json"))
    net = FlowNetwork(cluster, llama70b, measured_cost)
    found = tiling_search(net, 0.0, layer_work_bound(net), time.perf_counter() + 20)
    assert found is not None
    assert found[1] > 1.5 * helix.throughput_tokens_per_s  # 7,212 vs 4,167 when measured
