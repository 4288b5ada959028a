"""Pinned search: the strongest machines re-sized together, the others searched around them."""

from __future__ import annotations

import numpy as np
import pytest
from planner_factories import make_cluster, tiny_model, work

from helixserve.planner import FlowNetwork
from helixserve.planner.pinned import fill_gaps, pinned_search, resize, strongest_group
from helixserve.planner.search import local_search


def _covers(ranges: dict[int, tuple[int, int]], num_layers: int) -> bool:
    return all(any(a <= layer < b for a, b in ranges.values()) for layer in range(num_layers))


def test_resize_keeps_chains_and_starts():
    kmax = np.array([12, 12, 12, 12, 4])
    chain = {0: (0, 12), 1: (12, 24), 2: (24, 36), 3: (40, 50), 4: (36, 40)}
    shrunk = resize(chain, [0, 1, 2, 3], -1, kmax, 80)
    # every member gets the largest size minus one (11); 0-1-2 are a chain and stay one
    # from layer 0; 3 did not touch 2 and keeps its start; 4 started where 2 ended and
    # still does
    assert shrunk == {0: (0, 11), 1: (11, 22), 2: (22, 33), 3: (40, 51), 4: (33, 37)}
    grown = resize(shrunk, [0, 1, 2, 3], 1, kmax, 80)
    assert grown == {0: (0, 12), 1: (12, 24), 2: (24, 36), 3: (40, 52), 4: (36, 40)}
    # every member already at its memory's limit: nothing to try
    assert resize(chain, [0, 1, 2], 1, kmax, 80) is None
    # a smaller member is brought up to the group's size
    assert resize({0: (0, 12), 1: (12, 22)}, [0, 1], 1, kmax, 80) == {0: (0, 12), 1: (12, 24)}
    # a range pushed past the last layer is moved back inside
    assert resize({0: (70, 80)}, [0], 1, kmax, 80) == {0: (69, 80)}


def _small_net(num_layers: int, measured_cost) -> FlowNetwork:
    net = FlowNetwork(make_cluster(t4=4), tiny_model(num_layers), measured_cost)
    net.max_layers = np.array([4, 4, 4, 4])  # as if each T4 held at most 4 of these layers
    return net


def test_fill_gaps_grows_neighbours_then_moves_spares(measured_cost):
    net = _small_net(8, measured_cost)
    # layer 4 uncovered: node 0 is at its limit, node 1 starts right after and can grow
    out = fill_gaps(net, {0: (0, 4), 1: (5, 8), 2: (5, 8)}, set())
    assert out[0] == (0, 4) and out[1] == (4, 8) and _covers(out, 8)
    net = _small_net(10, measured_cost)
    # layers 4-5 uncovered, node 0 pinned, node 1 at its limit: a spare moves there
    ranges = {0: (0, 4), 1: (6, 10), 2: (6, 10)}
    out = fill_gaps(net, ranges, {0})
    assert _covers(out, 10) and out[0] == (0, 4)
    assert ranges == {0: (0, 4), 1: (6, 10), 2: (6, 10)}  # the input is not modified
    # nothing free to grow or move: returned as it is (still uncovered)
    stuck = {0: (0, 4), 1: (6, 10)}
    assert fill_gaps(net, stuck, set()) == stuck


def test_resize_moves_the_receivers_with_the_chain():
    kmax = np.array([12, 12, 4, 4, 7])
    ranges = {0: (0, 12), 1: (12, 24), 2: (24, 28), 3: (24, 28), 4: (28, 35)}
    out = resize(ranges, [0, 1], -1, kmax, 35)
    # the chain ends at 22 now: what started at or after its old end moves back 2 layers
    assert out == {0: (0, 11), 1: (11, 22), 2: (22, 26), 3: (22, 26), 4: (26, 33)}


def test_local_search_keeps_fixed_nodes(llama70b, measured_cost, counted):
    net = FlowNetwork(make_cluster(a100=2, l4=4, t4=8), llama70b, measured_cost)
    start = {0: (0, 11), 1: (11, 22)}
    pos = 22
    for i in range(2, len(net.names)):
        k = int(net.max_layers[i])
        start[i] = (min(pos, 80 - k), min(pos, 80 - k) + k)
        pos += k
    assert _covers(start, 80)
    ranges, value, _ = local_search(net, [start], work(1.5), seed=0,
                                    fixed=frozenset({0, 1}))
    assert ranges[0] == (0, 11) and ranges[1] == (11, 22)
    assert value == pytest.approx(net.max_flow(ranges)[0])


def test_pinned_search_returns_valid_resized_placements(llama70b, measured_cost, counted):
    net = FlowNetwork(make_cluster(a100=4, l4=8, t4=12), llama70b, measured_cost)
    best = {i: (12 * i, 12 * i + 12) for i in range(4)}  # the A100 chain of 4 x 12 layers
    pos = 48
    for i in range(4, len(net.names)):
        k = min(int(net.max_layers[i]), 80 - pos) if pos < 80 else int(net.max_layers[i])
        start = pos if pos < 80 else 80 - k
        best[i] = (start, start + k)
        pos += k
    assert strongest_group(net, best) == [0, 1, 2, 3]
    found = pinned_search(net, best, work(3), seed=0)
    assert len(found) == 1  # the A100s are at their limit: only the 11-layer variant
    ranges, value = found[0]
    assert [ranges[i] for i in range(4)] == [(0, 11), (11, 22), (22, 33), (33, 44)]
    assert _covers(ranges, 80)
    assert all(b - a <= net.max_layers[i] for i, (a, b) in ranges.items())
    assert value == pytest.approx(net.max_flow(ranges)[0])
    assert value > 0
