"""The served objective's search (planner/served.py), with a scorer in code: deterministic,
bounded by counted work, and it finds what the scorer rewards."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import numpy as np
import pytest
from planner_factories import counted, llama70b, make_cluster, measured_cost, work  # noqa: F401

from helixserve.planner import FlowNetwork, clock
from helixserve.planner.baselines import BASELINES, Ranges
from helixserve.planner.served import (
    key,
    neighbours,
    node_move,
    served_search,
)

#: work units one fake scoring charges (as the simulator's scorer charges its events)
UNITS = 0.5


class KVScorer:
    """A stand-in for the simulator: rewards layers spread evenly over the machines (more KV
    per request on the machines that would hold the most), so neither the max flow's answer
    nor a baseline is its optimum."""

    def __init__(self, net: FlowNetwork) -> None:
        self.net = net
        self.calls: list[tuple[tuple[int, int, int], ...]] = []

    def __call__(self, batch: Sequence[Ranges]) -> list[float]:
        out = []
        for r in batch:
            self.calls.append(key(r))
            clock.charge(UNITS)
            out.append(1e5 / sum((e - s) ** 2 for s, e in r.values()))
        return out


@pytest.fixture
def net(llama70b, measured_cost):  # noqa: F811
    return FlowNetwork(make_cluster(a100=4, l4=8, t4=12, link_gbps=8.0), llama70b, measured_cost)


def starts_of(net: FlowNetwork) -> list[tuple[str, Ranges]]:
    # petals fills the A100s to their cap: the scorer rewards moving layers off them
    return [(name, BASELINES[name](net)) for name in ("petals", "swarm")]


def test_search_beats_its_starts_and_is_deterministic(net, counted):  # noqa: F811
    results = []
    for _ in range(2):
        scorer = KVScorer(net)
        out = served_search(net, starts_of(net), scorer, work(40 * UNITS), seed=3)
        results.append((key(out.best.ranges), out.best.served_tokens_per_s, scorer.calls))
    assert results[0] == results[1]
    best_start = max(s.served_tokens_per_s for s in out.starts)
    assert out.best.served_tokens_per_s > best_start
    assert out.steps and out.best.source == "climb"
    # every placement scored once, and each holds every layer within every machine's cap
    calls = results[0][2]
    assert len(calls) == len(set(calls)) == out.evaluations
    for placed in calls:
        cover = np.zeros(net.model.num_layers + 1, dtype=int)
        for i, s, e in placed:
            assert 0 <= s < e <= net.model.num_layers and e - s <= net.max_layers[i]
            cover[s] += 1
            cover[e] -= 1
        assert np.all(np.cumsum(cover)[:-1] > 0)


def test_budget_bounds_the_scorings(net, counted):  # noqa: F811
    small, large = KVScorer(net), KVScorer(net)
    served_search(net, starts_of(net), small, work(6 * UNITS), seed=0)
    served_search(net, starts_of(net), large, work(30 * UNITS), seed=0)
    # a batch starts only while it fits in what is left (the starts' first batch always)
    assert 2 <= len(small.calls) <= 6
    assert len(small.calls) < len(large.calls) <= 30
    # the larger budget repeats the smaller one's path first: same seed, same proposals
    assert large.calls[: len(small.calls)] == small.calls


def test_starts_are_scored_in_order_until_the_budget(net, counted):  # noqa: F811
    scorer = KVScorer(net)
    petals = BASELINES["petals"](net)
    rng, kmax, L = random.Random(1), np.asarray(net.max_layers), net.model.num_layers
    other = neighbours(petals, kmax, L, rng, 1, {key(petals)})[0]
    third = neighbours(other, kmax, L, rng, 1, {key(petals), key(other)})[0]
    assert len({key(petals), key(other), key(third)}) == 3
    starts = [("petals", petals), ("again", petals), ("uniform", other), ("chain", third)]
    out = served_search(net, starts, scorer, work(2 * UNITS), seed=0, max_stall=0)
    # duplicates scored once; the first batch (two placements) fills the budget
    assert [s.source for s in out.starts] == ["petals", "uniform"]
    assert scorer.calls == [key(petals), key(other)]


def test_the_budget_left_after_the_last_batch_scores_one_more(net, counted):  # noqa: F811
    scorer = KVScorer(net)
    petals = BASELINES["petals"](net)
    rng, kmax, L = random.Random(1), np.asarray(net.max_layers), net.model.num_layers
    other = neighbours(petals, kmax, L, rng, 1, {key(petals)})[0]
    third = neighbours(other, kmax, L, rng, 1, {key(petals), key(other)})[0]
    fourth = neighbours(third, kmax, L, rng, 1, {key(petals), key(other), key(third)})[0]
    starts = [("a", petals), ("b", other), ("c", third), ("d", fourth)]
    # 3.5 placements' work: the first batch (two) leaves room for one, not for a batch of
    # two, so one more start is scored, alone, and the last is left unscored
    out = served_search(net, starts, scorer, work(3.5 * UNITS), seed=0, max_stall=0)
    assert [s.source for s in out.starts] == ["a", "b", "c"]
    assert scorer.calls == [key(petals), key(other), key(third)]


def test_node_move_keeps_layers_held_and_caps():
    rng = random.Random(0)
    kmax = np.array([3, 3, 2])
    ranges = {0: (0, 3), 1: (3, 6), 2: (5, 7)}
    seen = 0
    for _ in range(500):
        new = node_move(ranges, kmax, 7, rng)
        if new is None:
            continue
        seen += 1
        assert sum(a != b for a, b in zip(sorted(new.items()), sorted(ranges.items()),
                                          strict=True)) == 1
        held = set()
        for i, (s, e) in new.items():
            assert e - s <= kmax[i]
            held |= set(range(s, e))
        assert held == set(range(7))
    assert seen > 10  # most draws break the cover or a cap here
    assert neighbours(ranges, kmax, 7, rng, 3, {key(ranges)})


def test_cli_flow_objective_keeps_the_old_planner(tmp_path, capsys):
    from helixserve.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "--example", "--objective", "flow", "--work-limit", "1", "--jobs", "1",
                 "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "served (simulated" not in text
    assert "proven upper bound on the max flow" in text
    assert json.loads(out.read_text())["planner"] == "milp"


def test_cli_served_objective_same_placement_whatever_jobs(tmp_path, capsys):
    from helixserve.cli import main

    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"p{jobs}.json"
        assert main(["plan", "--example", "--work-limit", "3", "--serve-duration", "40",
                     "--jobs", jobs, "--quiet", "--out", str(out)]) == 0
        placed = json.loads(out.read_text())
        placed.pop("solve_time_s")
        outs.append(placed)
    text = capsys.readouterr().out
    assert "served (simulated, vllm engine, 40 s offline" in text
    assert "not a bound on served throughput" in text
    assert outs[0] == outs[1]


def test_cli_says_what_budget_stopped_the_search(tmp_path, capsys):
    from helixserve.cli import main

    out = tmp_path / "p.json"
    args = ["plan", "--example", "--work-limit", "3", "--serve-duration", "40", "--jobs", "1",
            "--quiet", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "budget: 3 work units; " in text and "(--work-limit 3)" in text
    assert "cap" not in text.split("budget:")[1]
    # --time-limit with --work-limit: a wall-clock cap behind the work budget; one already
    # passed stops every search at its first look (the first start is still scored)
    assert main(args + ["--time-limit", "0.001"]) == 0
    text = capsys.readouterr().out
    assert "budget: 3 work units, capped at 0.001 s of wall clock; the wall-clock cap " \
           "stopped it before the work budget" in text
    assert json.loads(out.read_text())["planner"] == "milp"
    # --time-limit alone: a wall-clock budget, as before
    assert main(args[:2] + ["--time-limit", "5"] + args[4:]) == 0
    assert "budget: 5 s of wall clock (--time-limit)" in capsys.readouterr().out


class SlowScorer(KVScorer):
    """KVScorer that takes `seconds` of wall clock a placement, as a simulation takes half a
    minute or more on a 42-machine cluster."""

    def __init__(self, net: FlowNetwork, seconds: float) -> None:
        super().__init__(net)
        self.seconds = seconds

    def __call__(self, batch: Sequence[Ranges]) -> list[float]:
        import time

        time.sleep(self.seconds * len(batch))
        return super().__call__(batch)


def test_a_batch_that_would_end_past_the_wall_clock_cap_is_not_started(net):
    """The cap stops the search before a batch that the last batch's wall time says would
    end past it (not at the batch's end, a whole batch late), and `capped()` says so; without
    a cap the same budget scores more. No wall time is asserted: the first batch (two starts)
    sleeps 0.8 s and the cap is 1 s away, so on any machine neither a batch nor one
    placement more (0.4 s) fits before it (on a very slow one the cap passes first, and the
    search stops as well)."""
    import time

    with clock.work_clock():
        free = SlowScorer(net, 0.0)
        served_search(net, starts_of(net), free, work(40 * UNITS), seed=3)
        assert len(free.calls) > 2 and not clock.capped()
    with clock.wall_cap(time.time() + 1.0), clock.work_clock():
        slow = SlowScorer(net, 0.4)
        out = served_search(net, starts_of(net), slow, work(40 * UNITS), seed=3)
        assert clock.capped()
    # the first batch always runs (the two starts); nothing after it
    assert slow.calls == free.calls[:2] and out.evaluations == 2
    assert out.stopped_by == "budget"
