"""The served objective with a second engine model (planner/served.py, `also`): the search
maximises the smaller gain of the two, screens neighbours with the cheaper scorer without
losing one that could win, and aims moves at the bottleneck the simulation shows."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import numpy as np
import pytest
from planner_factories import counted, llama70b, make_cluster, measured_cost, work  # noqa: F401

from helixserve.planner import FlowNetwork, clock
from helixserve.planner.baselines import BASELINES, Ranges
from helixserve.planner.served import Objective, key, order_move, pressure_move, served_search


class Scorer:
    """A stand-in for one engine model: `weight` of a placement's score is its KV spread
    (layers evenly over machines), the rest how few machines it uses (a shorter route), so
    the two scorers below disagree on what is best. Reports each machine's layers over its
    cap as its pressure."""

    def __init__(self, net: FlowNetwork, weight: float, units: float) -> None:
        self.net, self.weight, self.units = net, weight, units
        self.calls: list[tuple[tuple[int, int, int], ...]] = []

    def value(self, r: Ranges) -> float:
        spread = 1e5 / sum((e - s) ** 2 for s, e in r.values())
        return self.weight * spread + (1 - self.weight) * 1e3 / len(r)

    def __call__(self, batch: Sequence[Ranges]) -> list[float]:
        out = []
        for r in batch:
            self.calls.append(key(r))
            clock.charge(self.units)
            out.append(self.value(r))
        return out

    def pressure(self, ranges: Ranges) -> dict[int, float]:
        return {i: (e - s) / self.net.max_layers[i] for i, (s, e) in ranges.items()}


@pytest.fixture
def net(llama70b, measured_cost):  # noqa: F811
    return FlowNetwork(make_cluster(a100=4, l4=8, t4=12, link_gbps=8.0), llama70b, measured_cost)


def starts_of(net: FlowNetwork) -> list[tuple[str, Ranges]]:
    return [(name, BASELINES[name](net)) for name in ("petals", "swarm")]


def test_objective_is_the_smaller_gain():
    obj = Objective(100.0, 10.0)
    assert obj(110.0, 9.5) == pytest.approx(0.95)
    assert obj(90.0, 12.0) == pytest.approx(0.9)
    assert obj.also_bound(11.0) == pytest.approx(1.1)
    assert Objective()(5.0, None) == 5.0  # one scorer: its score
    gm = Objective(100.0, 10.0, "geomean")
    assert gm(110.0, 9.5) == pytest.approx((1.1 * 0.95) ** 0.5)
    assert gm.also_bound(11.0, 1.05) == pytest.approx((1.1 * 1.05) ** 0.5)


def test_two_scorers_screen_and_climb(net, counted):  # noqa: F811
    runs = []
    for _ in range(2):
        main, cheap = Scorer(net, 0.9, 1.0), Scorer(net, 0.5, 0.2)
        out = served_search(net, starts_of(net), main, work(60), seed=2, also=cheap)
        runs.append((key(out.best.ranges), main.calls, cheap.calls))
    assert runs[0] == runs[1]  # deterministic on the work clock
    obj = out.objective
    assert obj is not None
    first = out.starts[0]
    # the first start sets the references: it is worth 1 in both
    assert first.value == pytest.approx(1.0)
    assert obj.primary_ref == first.served_tokens_per_s
    assert obj.also_ref == first.also_tokens_per_s
    # every placement is screened by the cheap scorer; the main one sees only those whose
    # cheap score could beat the placement current at the time, so fewer of them
    assert set(main.calls) <= set(cheap.calls)
    assert len(main.calls) < len(cheap.calls)
    assert out.also_evaluations == len(cheap.calls) and out.evaluations == len(main.calls)
    # it climbed, and the value is the smaller gain of the two scores
    assert out.steps and out.best.value > max(s.value for s in out.starts)
    b = out.best
    assert b.value == pytest.approx(min(b.served_tokens_per_s / obj.primary_ref,
                                        (b.also_tokens_per_s or 0) / (obj.also_ref or 1)))
    assert b.served_tokens_per_s > first.served_tokens_per_s
    assert (b.also_tokens_per_s or 0) > (first.also_tokens_per_s or 0)


def test_best_reference_is_the_best_start_in_each_model(net, counted):  # noqa: F811
    main, cheap = Scorer(net, 0.9, 1.0), Scorer(net, 0.5, 0.2)
    out = served_search(net, starts_of(net), main, work(60), seed=2, also=cheap,
                        reference="best")
    obj = out.objective
    assert obj is not None
    # each reference is the best score a start reached in that model (the second model's
    # over every start it screened), so no start is worth more than 1
    assert obj.primary_ref == max(s.served_tokens_per_s for s in out.starts)
    assert obj.also_ref == max(cheap.value(r) for _, r in starts_of(net))
    assert max(s.value for s in out.starts) <= 1.0 + 1e-12
    for s in out.starts:
        assert s.value == pytest.approx(obj(s.served_tokens_per_s, s.also_tokens_per_s))
    assert out.best.value >= max(s.value for s in out.starts)


def test_block_orders_move_each_kind_to_the_front_or_the_end():
    from helixserve.planner.served import block_orders

    kind = ["A", "A", "B", "C"]
    ranges = {0: (0, 2), 1: (2, 4), 2: (4, 6), 3: (6, 8)}  # blocks: A A | B | C
    got = block_orders(ranges, kind, 8)
    # every block to the end first, then to the front (A first, C last: as it is)
    assert got == [
        {2: (0, 2), 3: (2, 4), 0: (4, 6), 1: (6, 8)},  # A to the end
        {0: (0, 2), 1: (2, 4), 3: (4, 6), 2: (6, 8)},  # B to the end
        {2: (0, 2), 0: (2, 4), 1: (4, 6), 3: (6, 8)},  # B to the front
        {3: (0, 2), 0: (2, 4), 1: (4, 6), 2: (6, 8)},  # C to the front
    ]
    assert block_orders({0: (0, 8)}, kind, 8) == []  # one block
    assert block_orders({0: (0, 5), 1: (3, 8)}, kind, 8) == []  # not stage-structured


def test_pressure_move_aims_at_the_bottleneck():
    rng = random.Random(0)
    kmax = np.array([4, 4, 4, 4, 4])
    ranges = {0: (0, 4), 1: (4, 6), 2: (6, 8), 3: (0, 2)}
    pressure = {0: 0.95, 1: 0.2, 2: 0.3, 3: 0.1}
    seen = 0
    for _ in range(300):
        new = pressure_move(ranges, pressure, kmax, 8, rng)
        if new is None:
            continue
        seen += 1
        held = set()
        for i, (s, e) in new.items():
            assert e - s <= kmax[i]
            held |= set(range(s, e))
        assert held == set(range(8))
        changed = {i for i in new if new[i] != ranges.get(i)}
        # the pressed machine (0) gives layers away, or a light one (or the unused 4)
        # copies (part of) a pressed machine's range
        assert changed and (0 in changed or changed & {1, 2, 3, 4})
        if 0 in changed:
            assert new[0][1] - new[0][0] < 4
    assert seen > 30


def test_cli_second_engine_line(tmp_path, capsys):
    from helixserve.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "--example", "--work-limit", "3", "--serve-duration", "40",
                 "--jobs", "1", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "served (simulated, vllm engine, 40 s offline" in text
    assert ", helix-prototype engine " in text and "with helix-prototype, the screen" in text
    assert main(["plan", "--example", "--work-limit", "3", "--serve-duration", "40",
                 "--serve-also", "none", "--jobs", "1", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "helix-prototype" not in text
    assert json.loads(out.read_text())["planner"] == "milp"


def test_order_move_keeps_each_stage_and_moves_blocks():
    # four A100 singles of 10 layers, four L4 pairs of 6, four T4 triples of 4 (80 layers)
    ranges: Ranges = {}
    kind: list[str] = []
    start = 0
    for gpu, width, size in [("A100", 1, 10)] * 4 + [("L4", 2, 6)] * 4 + [("T4", 3, 4)] * 4:
        for _ in range(width):
            ranges[len(kind)] = (start, start + size)
            kind.append(gpu)
        start += size
    rng = random.Random(0)
    firsts = set()
    for _ in range(200):
        new = order_move(ranges, kind, 80, rng)
        if new is None:
            continue
        # every machine keeps its number of layers and its stage mates; layers all held
        assert all(new[i][1] - new[i][0] == e - s for i, (s, e) in ranges.items())
        for i, j in ((0, 0), (4, 5), (12, 14)):
            assert (new[i] == new[j]) and (ranges[i] == ranges[j])
        held = sorted({r for r in new.values()})
        assert held[0][0] == 0 and held[-1][1] == 80
        assert all(a[1] == b[0] for a, b in zip(held, held[1:], strict=False))
        firsts.add(kind[min(new, key=lambda i: new[i])])
    assert firsts == {"A100", "L4", "T4"}  # the T4 block can come first, as can the L4s
    assert order_move({0: (0, 80)}, ["A100"], 80, rng) is None


def test_a_leading_starts_block_orders_come_before_the_other_starts(net, counted):  # noqa: F811
    from helixserve.planner.served import block_orders

    # a stacked tiling: A100 pairs over 0-20, L4 pairs over 20-40, single T4s over 40-80
    tiling: Ranges = {i: (10 * (i // 2), 10 * (i // 2) + 10) for i in range(4)}
    tiling |= {4 + i: (20 + 5 * (i // 2), 25 + 5 * (i // 2)) for i in range(8)}
    tiling |= {12 + i: (40 + 4 * i, 44 + 4 * i) for i in range(10)}
    tiling |= {22: (40, 44), 23: (44, 48)}
    kind = [f"{x.gpu}x{x.num_gpus}" for x in net.cluster.nodes]
    orders = block_orders(tiling, kind, 80)
    assert len(orders) == 4  # A100s, L4s to the end; L4s, T4s to the front
    last = {i for i, (_, e) in orders[1].items() if e == 80}
    assert all(net.cluster.nodes[i].gpu == "L4" for i in last)  # the L4s at the end

    class OrderScorer:
        """Rewards the L4s at the end (2.0), then the tiling as it is (1.5)."""

        def __init__(self) -> None:
            self.calls: list[tuple[tuple[int, int, int], ...]] = []

        def __call__(self, batch: Sequence[Ranges]) -> list[float]:
            out = []
            for r in batch:
                self.calls.append(key(r))
                clock.charge(1.0)
                ends = {net.cluster.nodes[i].gpu for i, (_, e) in r.items() if e == 80}
                out.append(2.0 if ends == {"L4"} else 1.5 if key(r) == key(tiling) else 1.0)
            return out

    petals, swarm = BASELINES["petals"](net), BASELINES["swarm"](net)
    scorer = OrderScorer()
    starts = [("petals", petals), ("tiling", tiling), ("swarm", swarm)]
    out = served_search(net, starts, scorer, work(5.5), seed=0, max_stall=0)
    # the tiling leads after the first batch: its block orders (the end first) are scored
    # before swarm, which the budget then leaves out; the L4s-at-the-end order is kept
    assert scorer.calls == [key(petals), key(tiling)] + [key(r) for r in orders[:3]]
    assert out.best.source == "block order of tiling" and out.best.value == 2.0
    assert key(out.best.ranges) == key(orders[1])


def test_wall_clock_cap_stops_the_work_clock():
    import time

    with clock.wall_cap(time.time() + 3600), clock.work_clock():
        a = clock.now()
        assert clock.now() - a < 1.0 and not clock.capped()
    with clock.wall_cap(time.time() - 1.0), clock.work_clock():
        assert clock.now() >= clock.CAP_JUMP and clock.capped()
    assert not clock.capped()  # outside the cap's block
    with clock.work_clock():  # no cap: the counter alone
        assert clock.now() < 1.0 and not clock.capped()
        assert clock.wall_left() == float("inf")
        clock.stop_at_cap()  # no cap to stop at: nothing happens
        assert clock.now() < 1.0 and not clock.capped()
    with clock.wall_cap(time.time() + 3600), clock.work_clock():
        assert 3500 < clock.wall_left() <= 3600
        clock.stop_at_cap()  # as if the cap had passed
        assert clock.now() >= clock.CAP_JUMP and clock.capped()



def alternating_stages() -> Ranges:
    """20 stages of 4 layers of the `net` fixture's cluster: L4 and T4 alternating over the
    first 16, then T4s (16 blocks)."""
    alt: Ranges = {}
    l4, t4 = iter(range(4, 12)), iter(range(12, 24))
    for p in range(20):
        alt[next(l4) if p < 16 and p % 2 == 0 else next(t4)] = (4 * p, 4 * p + 4)
    return alt


def test_a_leader_of_many_blocks_keeps_its_orders_for_after_the_starts(net, counted):  # noqa: F811
    from helixserve.planner.served import EARLY_ORDER_BLOCKS, block_orders

    alt = alternating_stages()
    kind = [f"{x.gpu}x{x.num_gpus}" for x in net.cluster.nodes]
    orders = block_orders(alt, kind, 80)
    assert len(orders) > 2 * (EARLY_ORDER_BLOCKS - 1)
    petals, swarm = BASELINES["petals"](net), BASELINES["swarm"](net)

    class Prefers:
        def __init__(self) -> None:
            self.calls: list[tuple[tuple[int, int, int], ...]] = []

        def __call__(self, batch: Sequence[Ranges]) -> list[float]:
            self.calls += [key(r) for r in batch]
            clock.charge(len(batch))
            return [2.0 if key(r) == key(alt) else 1.0 for r in batch]

    scorer = Prefers()
    out = served_search(net, [("petals", petals), ("alt", alt), ("swarm", swarm)], scorer,
                        work(5.5), seed=0, max_stall=0)
    # every start first; then the leader's orders (the step after the starts)
    assert scorer.calls[:3] == [key(petals), key(alt), key(swarm)]
    assert scorer.calls[3:] == [key(r) for r in orders[: len(scorer.calls) - 3]]
    assert out.best.source == "alt"


def test_block_orders_the_budget_left_unscored_are_reported_so(net, counted):  # noqa: F811
    # the leader of many blocks above, with the budget spent by the starts: its orders are
    # reported left unscored, not "scored, none worth more"
    alt = alternating_stages()
    petals, swarm = BASELINES["petals"](net), BASELINES["swarm"](net)

    def scorer(batch: Sequence[Ranges]) -> list[float]:
        clock.charge(len(batch))
        return [2.0 if key(r) == key(alt) else 1.0 for r in batch]

    said: list[str] = []
    starts = [("petals", petals), ("alt", alt), ("swarm", swarm)]
    out = served_search(net, starts, scorer, work(3.0), seed=0, max_stall=0,
                        progress=said.append)
    assert out.best.source == "alt"
    assert any("block orders left unscored (budget)" in s for s in said), said
    assert not any("block orders scored" in s for s in said), said
