"""benchmarks/helix_sim.py's stand-in for Helix's simulator (our simulator routed by a given
flow) and benchmarks/helix_proxy_search.py's boundary moves; Helix's own code (their max
flow) is not here, so a placement's own flows stand in for theirs."""

from __future__ import annotations

import json

import pytest

from benchmarks import helix_proxy_search as search
from benchmarks import helix_sim

AUTHORS_SINGLE = helix_sim.REPO / helix_sim.AUTHORS_PLACEMENTS["helix-single-24"]
#: a placement with its max flow's links (today's default pick of helix-single-24)
PICK_SINGLE = (helix_sim.REPO / "benchmarks/results/planner_served_work1000_placements"
               / "helix-single-24-milp.json")


def test_with_flows_routes_by_the_given_flow_and_refuses_none() -> None:
    placement = json.loads(AUTHORS_SINGLE.read_text())
    edges = [{"src": "coordinator", "dst": "n0", "tokens_per_s": 5.0}]
    routed = helix_sim.with_flows(placement, {"edges": edges, "flow_tokens_per_s": 5.0})
    assert routed["flows"] == edges and routed["throughput_tokens_per_s"] == 5.0
    assert routed["nodes"] == placement["nodes"]
    with pytest.raises(ValueError, match="no edges"):
        helix_sim.with_flows(placement, {"edges": [], "flow_tokens_per_s": 0.0})


def test_the_routed_simulation_follows_the_flow_it_is_given() -> None:
    """The proxy's simulator run (PROXY_FLAGS: Helix's rules and router) on a
    helix-single-24 placement: routed by its own flows it serves; routed by a flow through
    one chain of nodes, plus a side edge of 3% of the coordinator's outflow, only the chain
    runs: Helix's router never leaves the flow and masks edges under 5% of their vertex's
    outflow (our default router masks at 1%)."""
    placement = json.loads(PICK_SINGLE.read_text())
    full = helix_sim.simulate_routed("helix-single-24", placement, (5.0, 20.0))
    assert "error" not in full, full
    assert full["decode_throughput_tokens_per_s"] > 0
    # one chain: from the coordinator along the flow's heaviest edge out of each node
    out: dict[str, list[dict]] = {}
    for e in placement["flows"]:
        out.setdefault(e["src"], []).append(e)
    chain, at = [], "coordinator"
    while True:
        e = max(out[at], key=lambda e: e["tokens_per_s"])
        chain.append(e | {"tokens_per_s": 100.0})
        at = e["dst"]
        if at == "coordinator":
            break
    on_chain = {e["dst"] for e in chain} - {"coordinator"}
    ranges = {n["name"]: (n["start_layer"], n["end_layer"]) for n in placement["nodes"]}
    first, second = chain[0]["dst"], chain[1]["dst"]
    side = next(n for n, r in ranges.items() if r == ranges[first] and n != first)
    side_edges = [{"src": "coordinator", "dst": side, "tokens_per_s": 3.0},
                  {"src": side, "dst": second, "tokens_per_s": 3.0}]
    narrow = helix_sim.simulate_routed(
        "helix-single-24", helix_sim.with_flows(
            placement, {"edges": chain + side_edges, "flow_tokens_per_s": 103.0}), (5.0, 20.0))
    assert "error" not in narrow, narrow
    busy = {n["name"] for n in narrow["nodes"] if n["iterations"] > 0}
    assert busy == on_chain
    assert len(on_chain) < len(placement["nodes"])


def test_a_boundary_move_shifts_every_node_at_it_and_keeps_ranges_non_empty() -> None:
    nodes = [{"name": "a", "start_layer": 0, "end_layer": 3},
             {"name": "b", "start_layer": 0, "end_layer": 3},
             {"name": "c", "start_layer": 3, "end_layer": 4},
             {"name": "d", "start_layer": 4, "end_layer": 8}]
    assert search.boundaries(nodes) == [3, 4]
    moved = search.shifted(nodes, 3, 1)
    assert moved is None  # c would hold no layer
    moved = search.shifted(nodes, 3, -1)
    assert moved is not None
    assert [(n["start_layer"], n["end_layer"]) for n in moved] == [(0, 2), (0, 2), (2, 4), (4, 8)]
    assert [n["name"] for n in moved] == ["a", "b", "c", "d"]


def test_the_objective_is_the_weakest_of_the_three_ratios() -> None:
    base = {"proxy": 100.0, "vllm": 100.0, "helix-prototype": 50.0}
    est = {"vllm": 121.0, "helix-prototype": 66.0}
    assert search.objective(est, 90.0, base) == pytest.approx(0.9)
    assert search.objective(est, 130.0, base) == pytest.approx(1.1)
    assert search.objective({"vllm": 110.0, "helix-prototype": 66.0}, 130.0, base) == \
        pytest.approx(1.0)
    assert search.objective(None, 130.0, base) == 0.0
    assert search.objective(est, None, base) == 0.0


def test_the_climb_keeps_each_improving_move_and_stops_when_none_is_left(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's loop with a stand-in scorer (Helix's code is not here): the score rises
    as node n0's range ends nearer layer `target`; the climb walks that boundary there one
    layer a move, writes the placement it reached and every evaluation, and stops after a
    sweep without an improvement."""
    start = json.loads(AUTHORS_SINGLE.read_text())
    n0 = next(n for n in start["nodes"] if n["name"] == "n0")
    target = n0["end_layer"] + 2

    def fake_score(args, placement, tmp, base):
        end = next(n["end_layer"] for n in placement["nodes"] if n["name"] == "n0")
        out = {"estimate": {"vllm": 100.0, "helix-prototype": 50.0}, "proxy": 80.0}
        if base is not None:
            out["objective"] = 1.0 - abs(end - target) / 10
        return out

    monkeypatch.setattr(search, "score", fake_score)
    out = tmp_path / "out"
    assert search.main(["--cluster", "helix-single-24", "--start", str(AUTHORS_SINGLE),
                        "--helix-artifact", str(tmp_path), "--evals", "200",
                        "--out", str(out)]) == 0
    log = json.loads((out / "log.json").read_text())
    best = json.loads((out / "best" / "helix-single-24-milp.json").read_text())
    assert next(n["end_layer"] for n in best["nodes"] if n["name"] == "n0") == target
    assert log["best"]["objective"] == 1.0
    assert log["accepted"] == [[target - 2, 1], [target - 1, 1]]
    assert "moves: boundary" in best["planner"]
    # the last sweep tried every move left and found none better
    assert len(log["evaluations"]) < 200
    assert all(e["objective"] <= 1.0 for e in log["evaluations"])
