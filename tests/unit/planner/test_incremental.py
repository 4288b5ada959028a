"""plan --from: re-plan from the running placement, moving as few machines as it can."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from planner_factories import make_cluster

from helixserve.cli import main
from helixserve.errors import UserError
from helixserve.planner import FlowNetwork, NodeRange, Placement
from helixserve.planner.incremental import changes, choose, incremental, replan


def _placement(ranges: dict[str, tuple[int, int]], num_layers: int = 80) -> Placement:
    return Placement("llama-2-70b", "test", num_layers, "given",
                     [NodeRange(n, s, e) for n, (s, e) in ranges.items()])


# 2 A100 (12 layers each) + 2 L4 (7) + 4 T4 (4): two pipelines of 40 layers
CURRENT = _placement({
    "a100-0": (0, 12), "a100-1": (12, 24), "l4-0": (24, 31), "l4-1": (31, 38),
    "t4-0": (38, 42), "t4-1": (42, 46), "t4-2": (46, 50), "t4-3": (50, 54),
})


# a full cover of 12 machines; t4-3 is the sole holder of layers 74-77
SOLE_HOLDER = _placement({
    "a100-0": (0, 12), "a100-1": (12, 24), "l4-0": (24, 31), "l4-1": (31, 38),
    "l4-2": (38, 45), "t4-0": (45, 49), "t4-1": (49, 53), "t4-2": (53, 57),
    "a100-2": (57, 69), "l4-3": (69, 74), "t4-3": (74, 78), "t4-4": (78, 80),
})


def _covers(ranges: dict[int, tuple[int, int]], num_layers: int) -> bool:
    return all(any(s <= layer < e for s, e in ranges.values()) for layer in range(num_layers))


def test_kept_machines_keep_their_range_and_new_ones_take_the_lost_layers(llama70b,
                                                                          measured_cost, counted):
    # t4-3 is gone, l4-2 is new; layers 54-79 had no holder at all
    net = FlowNetwork(make_cluster(a100=2, l4=3, t4=3), llama70b, measured_cost)
    inc = incremental(net, CURRENT, 0.3)
    assert inc.gone == ["t4-3"] and inc.new == ["l4-2"] and inc.freed == []
    for r in CURRENT.nodes:
        if r.name != "t4-3":
            assert inc.ranges[net.index[r.name]] == (r.start_layer, r.end_layer)
    assert sorted(inc.kept) == sorted(r.name for r in CURRENT.nodes if r.name != "t4-3")
    assert inc.throughput_tokens_per_s == pytest.approx(net.max_flow(inc.ranges)[0])


def test_a_range_that_no_longer_fits_is_freed(llama70b, measured_cost, counted):
    # t4-0 holds 8 layers: more than a T4's 4 for this model (say its GPU was swapped)
    current = _placement({**{r.name: (r.start_layer, r.end_layer) for r in CURRENT.nodes},
                          "t4-0": (36, 44)})
    net = FlowNetwork(make_cluster(a100=2, l4=2, t4=4), llama70b, measured_cost)
    inc = incremental(net, current, 0.3)
    assert inc.freed == ["t4-0"] and "t4-0" not in inc.kept
    s, e = inc.ranges[net.index["t4-0"]]
    assert e - s <= net.max_layers[net.index["t4-0"]]


def test_lost_sole_holder_without_a_new_machine_unpins_neighbours(llama70b, measured_cost, counted):
    # a full cover, then t4-3 (sole holder of 74-77) is lost and nothing replaces it; its
    # neighbours l4-3 (5 of 7 layers) and t4-4 (2 of 4) can grow into its layers
    current = SOLE_HOLDER
    cluster = make_cluster(a100=3, l4=4, t4=5)
    cluster = replace(cluster, nodes=[n for n in cluster.nodes if n.name != "t4-3"])
    net = FlowNetwork(cluster, llama70b, measured_cost)
    pinned_only = incremental(net, current, 0.5)
    assert pinned_only.throughput_tokens_per_s == 0.0  # nothing free: 74-77 stay uncovered
    inc = incremental(net, current, 0.5, target=1.0)
    assert inc.throughput_tokens_per_s > 0 and _covers(inc.ranges, 80)
    # the first rounds un-pin only the machines nearest layers 74-77: the chain's start stays
    assert {"a100-0", "a100-1", "l4-0"} <= set(inc.kept)


def test_changes_lists_moved_added_removed():
    new = _placement({"a100-0": (0, 12), "a100-1": (12, 24), "l4-0": (24, 30),
                      "l4-1": (31, 38), "t4-0": (38, 42), "t4-1": (42, 46),
                      "t4-2": (46, 50), "l4-2": (50, 57)})
    c = changes(CURRENT, new)
    assert c.moved == [("l4-0", (24, 31), (24, 30))]
    assert c.added == [("l4-2", (50, 57))] and c.removed == [("t4-3", (50, 54))]
    assert c.unchanged == 6
    assert c.summary().splitlines()[0] == "6 unchanged, 1 moved, 1 added, 1 removed"


def test_choose_and_input_errors(llama70b, measured_cost):
    # within max_loss and fewer machines moved; as good; moving as many is never kept
    assert choose(100.0, 95.0, 0.05, 10, 2) and not choose(100.0, 94.9, 0.05, 10, 2)
    assert choose(100.0, 100.0, 0.0, 10, 10)
    assert not choose(100.0, 99.0, 0.05, 10, 10)
    cluster = make_cluster(a100=2, l4=2, t4=4)
    with pytest.raises(UserError, match="--from: num_layers: 40, but the model has 80"):
        replan(cluster, llama70b, measured_cost, _placement({"a100-0": (0, 12)}, 40),
               work_limit=1.0)
    with pytest.raises(UserError, match="--max-loss: bad value 2"):
        replan(cluster, llama70b, measured_cost, CURRENT, work_limit=1.0, max_loss=2.0)


def test_cli_plan_from(tmp_path, capsys):
    current = tmp_path / "current.json"
    assert main(["plan", "--example", "--objective", "flow", "--work-limit", "1", "--quiet",
                 "--jobs", "1", "--out", str(current)]) == 0
    capsys.readouterr()
    out = tmp_path / "next.json"
    assert main(["plan", "--example", "--work-limit", "1", "--quiet", "--jobs", "1",
                 "--from", str(current), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # the cluster did not change: the incremental placement is the current one
    assert "6 machines kept as they were; gone: -; new: -" in text
    assert f"changes against {current}: 6 unchanged, 0 moved" in text
    assert main(["plan", "--example", "--quiet", "--from", str(current),
                 "--max-loss", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-loss: bad value -1" in err[0]


def _replan_twice(cluster, current, llama70b, measured_cost):
    """replan on the work clock with --jobs 1 and 2: the two answers (they must be equal)."""
    runs = []
    for jobs in (1, 2):
        out = replan(cluster, llama70b, measured_cost, current, work_limit=0.3, jobs=jobs)
        out.placement.solve_time_s = None  # wall clock: the one field that may differ
        # the declared stages ran, in order, after the full re-plan's own portfolio
        assert [s.stage for s in out.stages[-3:]] == ["full", "incremental",
                                                      "incremental-search"]
        runs.append(out)
    key = [(o.placement, o.full, o.incremental, o.kept_incremental,
            [(s.stage, s.note, s.best_tokens_per_s, s.seed_values) for s in o.stages])
           for o in runs]
    assert key[0] == key[1]
    return runs[0]


def test_replan_on_the_work_clock_is_the_same_whatever_jobs(llama70b, measured_cost):
    # 11 machines (above SMALL_NODES): the full re-plan's annealing runs two seeds, on one
    # core or two; t4-3 is gone, a100-2, a100-3, l4-2 and t4-4 are new
    cluster = make_cluster(a100=4, l4=3, t4=5)
    cluster = replace(cluster, nodes=[n for n in cluster.nodes if n.name != "t4-3"])
    out = _replan_twice(cluster, CURRENT, llama70b, measured_cost)
    assert any(len(s.seed_values) == 2 for s in out.stages), out.stages
    assert out.incremental.new == ["a100-2", "a100-3", "l4-2", "t4-4"]
    # the lost sole holder (above), through replan: kept machines are un-pinned in rounds
    cluster = make_cluster(a100=3, l4=4, t4=5)
    cluster = replace(cluster, nodes=[n for n in cluster.nodes if n.name != "t4-3"])
    out = _replan_twice(cluster, SOLE_HOLDER, llama70b, measured_cost)
    assert out.stages[-1].note != "1 of 5 rounds", out.stages[-1]
    # as good as the full re-plan, or within 5% of it, while moving fewer machines
    assert out.kept_incremental and out.placement.planner == "milp-incremental"
    assert out.placement.covers_all_layers()
    assert {"a100-0", "a100-1", "l4-0"} <= set(out.incremental.kept)


def test_cli_plan_from_work_limit_is_the_same_whatever_jobs(tmp_path, capsys):
    first = tmp_path / "first.json"
    assert main(["plan", "--example", "--work-limit", "1", "--quiet", "--jobs", "1",
                 "--out", str(first)]) == 0
    # the running placement lacks one machine: the incremental placement must place it
    data = json.loads(first.read_text())
    dropped = data["nodes"].pop()
    current = tmp_path / "current.json"
    current.write_text(json.dumps(data))
    capsys.readouterr()
    outs = []
    for jobs in ("1", "2", "1"):
        out = tmp_path / f"next{jobs}.json"
        assert main(["plan", "--example", "--work-limit", "1", "--quiet", "--jobs", jobs,
                     "--from", str(current), "--out", str(out)]) == 0
        text = capsys.readouterr().out.replace(str(out), "OUT")
        placed = json.loads(out.read_text())
        placed.pop("solve_time_s")  # wall clock: the one field that may differ
        outs.append((re.sub(r"solved in [0-9.]+s", "", text), placed))
    assert f"new: {dropped['name']}" in outs[0][0]
    assert outs[0] == outs[1] == outs[2]
