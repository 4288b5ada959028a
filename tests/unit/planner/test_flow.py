"""Max flow on hand-made graphs with known answers, and against an independent networkx build."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import numpy as np
import pytest
from planner_factories import make_cluster, tiny_model

from helixserve.costmodel import CostModel
from helixserve.planner import FlowNetwork, NodeRange, Placement, evaluate, load_placement
from helixserve.spec.cluster import COORDINATOR


def hand_network(caps: list[float], link: float = 1e9) -> FlowNetwork:
    """A network over make_cluster nodes with node capacities set by hand (same for every k,
    no head on the last stage)."""
    model = tiny_model(num_layers=4)
    cluster = make_cluster(l4=len(caps))
    net = FlowNetwork(cluster, model, CostModel(model))
    net.max_layers = np.full(len(caps), 4)
    net.throughput = [[0.0] + [c] * 4 for c in caps]
    net.throughput_last = net.throughput
    net.link_cap[:] = link
    np.fill_diagonal(net.link_cap, 0.0)
    return net


def test_two_stage_pipeline_known_answer():
    #   A [0,2) cap 10 --+--> C [2,4) cap 8
    #   B [0,2) cap 5  --+--> D [2,4) cap 20       every link 1e9: stage sums decide
    net = hand_network([10, 5, 8, 20])
    ranges = {0: (0, 2), 1: (0, 2), 2: (2, 4), 3: (2, 4)}
    assert net.max_flow(ranges)[0] == pytest.approx(15)  # min(10 + 5, 8 + 20)
    net.link_cap[:] = 0
    net.link_cap[0, 2] = 3  # only A->C (3) and B->D (4)
    net.link_cap[1, 3] = 4
    assert net.max_flow(ranges)[0] == pytest.approx(7)


def test_partial_inference_edges():
    # A holds [0,3), B holds [2,4): B can run just layer 3 after A (start_B <= end_A < end_B)
    net = hand_network([6, 9])
    ranges = {0: (0, 3), 1: (2, 4)}
    value, flows = net.max_flow(ranges, partial_inference=True, with_flows=True)
    assert value == pytest.approx(6)
    assert {(f.src, f.dst) for f in flows} == {
        (COORDINATOR, "l4-0"), ("l4-0", "l4-1"), ("l4-1", COORDINATOR)}
    assert net.max_flow(ranges, partial_inference=False)[0] == 0.0
    # swapped: node 1 [0,3) cap 9 feeds node 0 [2,4) cap 6; the reverse edge would need
    # end 4 < end 3, so it does not exist and the flow is node 0's capacity
    assert net.max_flow({0: (2, 4), 1: (0, 3)}, partial_inference=True)[0] == pytest.approx(6)


def test_node_capacity_splits_in_and_out():
    # one node on the only path; its capacity, not the links, is the bottleneck
    net = hand_network([4, 100, 100])
    assert net.max_flow({0: (0, 2), 1: (2, 4), 2: (2, 4)})[0] == pytest.approx(4)


def reference_max_flow(net: FlowNetwork, ranges, partial: bool) -> float:
    g = nx.DiGraph()
    L = net.model.num_layers
    for i, (s, e) in ranges.items():
        # the stage holding the last layer runs the head too (flow.py)
        g.add_edge(("in", i), ("out", i), capacity=net.node_cap(i, e - s, e == L))
        if s == 0:
            g.add_edge("src", ("in", i), capacity=net.source_cap[i])
        if e == L:
            g.add_edge(("out", i), "snk", capacity=net.sink_cap[i])
        for j, (s2, e2) in ranges.items():
            ok = (s2 <= e < e2) if partial else (s2 == e)
            if j != i and ok and net.link_cap[i, j] > 0:
                g.add_edge(("out", i), ("in", j), capacity=net.link_cap[i, j])
    if "src" not in g or "snk" not in g:
        return 0.0
    return nx.maximum_flow_value(g, "src", "snk")


@pytest.mark.parametrize("seed", range(6))
def test_matches_networkx_on_random_placements(seed):
    rng = random.Random(seed)
    model = tiny_model(num_layers=6)
    cluster = make_cluster(a100=2, l4=2, t4=2, link_gbps=0.05)  # links bind
    net = FlowNetwork(cluster, model, CostModel(model))
    for i, j in itertools.permutations(range(6), 2):
        net.link_cap[i, j] *= rng.choice([0.0, 0.3, 1.0, 3.0])
    for _ in range(5):
        ranges = {}
        for i in range(6):
            k = rng.randint(1, min(6, int(net.max_layers[i])))
            s = rng.randint(0, 6 - k)
            ranges[i] = (s, s + k)
        for partial in (True, False):
            got = net.max_flow(ranges, partial)[0]
            ref = reference_max_flow(net, ranges, partial)
            assert got == pytest.approx(ref, rel=1e-4, abs=0.01)
            s_arr = np.array([ranges[i][0] for i in range(6)])
            k_arr = np.array([ranges[i][1] - ranges[i][0] for i in range(6)])
            assert net.max_flow_value(s_arr, k_arr, partial) == pytest.approx(got, rel=1e-6)


def test_flows_conserve_and_json_round_trip(tmp_path, llama70b, measured_cost):
    cluster = make_cluster(a100=4, l4=4, t4=8)
    placement = Placement(
        model=llama70b.name, cluster=cluster.name, num_layers=80, planner="hand",
        nodes=[NodeRange("a100-0", 0, 12), NodeRange("a100-1", 12, 24), NodeRange("l4-0", 24, 31),
               NodeRange("l4-1", 31, 38), NodeRange("a100-2", 38, 50), NodeRange("t4-0", 50, 54),
               NodeRange("t4-1", 50, 54), NodeRange("a100-3", 54, 66), NodeRange("l4-2", 66, 73),
               NodeRange("l4-3", 73, 80)])
    result = evaluate(cluster, llama70b, measured_cost, placement)
    assert result.throughput_tokens_per_s > 0
    balance: dict[str, float] = {}
    for f in result.flows:
        balance[f.src] = balance.get(f.src, 0.0) - f.tokens_per_s
        balance[f.dst] = balance.get(f.dst, 0.0) + f.tokens_per_s
    for name, b in balance.items():
        assert abs(b) < 1e-6 * result.throughput_tokens_per_s, name
    placement.flows = result.flows
    placement.throughput_tokens_per_s = result.throughput_tokens_per_s
    path = tmp_path / "placement.json"
    placement.save(path)
    again = load_placement(path)
    assert again.nodes == placement.nodes
    assert again.throughput_tokens_per_s == pytest.approx(result.throughput_tokens_per_s)
    assert evaluate(cluster, llama70b, measured_cost, again).throughput_tokens_per_s == \
        pytest.approx(result.throughput_tokens_per_s)


def test_evaluate_rejects_ranges_that_do_not_fit(llama70b, measured_cost):
    from helixserve.errors import UserError

    cluster = make_cluster(t4=2)
    placement = Placement(llama70b.name, "x", 80, "hand", [NodeRange("t4-0", 0, 40),
                                                          NodeRange("t4-1", 40, 80)])
    with pytest.raises(UserError, match=r"holds 40 layers .* at most 8 \(planners give it "
                                        r"at most 4, keeping weights within 50% of it\)"):
        evaluate(cluster, llama70b, measured_cost, placement)


def test_route_within_regions_is_an_optional_placement_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from helixserve.errors import UserError
    from helixserve.planner import load_placement

    p = Placement("m", "c", 8, "hand", [NodeRange("a", 0, 8)])
    assert "route_within_regions" not in p.to_dict()  # absent unless set: old readers agree
    p.route_within_regions = True
    path = tmp_path / "p.json"
    p.save(path)
    assert load_placement(path).route_within_regions is True
    data = p.to_dict() | {"route_within_regions": "yes"}
    with pytest.raises(UserError, match="route_within_regions: expected true or false, got 'yes'"):
        Placement.from_dict(data)
