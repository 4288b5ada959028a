"""Stage-structured annealing: placements as pipeline stages, nodes as stage replicas.

The local search of search.py moves one node's range at a time. On large clusters of many
small machines (synthetic-50/100 with llama-30b) the best placements it can reach from the
baselines are SWARM's: S equal stages, each served by a set of replicas. One-node moves
cannot re-cut such a pipeline, because moving a single stage boundary means moving every
replica of two stages at once. This search works one level up:

State: stage boundaries 0 = b_0 < b_1 < ... < b_S = L and a stage (or none) per node; a node
in stage p holds [b_p, b_p+1), which must fit its memory (b_p+1 - b_p <= K_i), and every
stage keeps at least one node. Moves:
  * move a node to another stage it fits (or take it out, or bring an unused one in);
  * swap two nodes of different stages;
  * shift a boundary by 1-3 layers (both stages' replicas change size together);
  * split a stage at a random layer, its replicas dealt at random to the halves;
  * merge two adjacent stages (when every replica can hold the union).
Score: the real max flow of the placement (FlowNetwork.max_flow_value through
search.Scorer, which also rejects a move early when its min layer cover is below what the
annealing could accept). Simulated annealing with a temperature falling linearly from
TEMPERATURE x the starting flow to 0 at the deadline; the best state seen is returned.
The result feeds the node-level local search and the MILP as a start (milp.py).
"""

from __future__ import annotations

import math
import random

import numpy as np

from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.search import Scorer, to_ranges

#: starting temperature, as a fraction of the starting flow
TEMPERATURE = 0.003


def stage_form(ranges: Ranges, num_layers: int) -> tuple[list[int], dict[int, int]] | None:
    """(boundaries, node -> stage) when every range is exactly one stage of a partition of
    [0, L) into consecutive stages with at least one node each; otherwise None."""
    if not ranges:
        return None
    cuts = sorted({0, num_layers} | {a for a, _ in ranges.values()} | {b for _, b in ranges.values()})
    index = {b: p for p, b in enumerate(cuts)}
    stage_of: dict[int, int] = {}
    for i, (a, b) in ranges.items():
        p = index[a]
        if cuts[p + 1] != b:
            return None  # spans several segments: not a stage structure
        stage_of[i] = p
    if len(set(stage_of.values())) != len(cuts) - 1:
        return None  # a segment nobody holds
    return cuts, stage_of


def chain_start(net: FlowNetwork) -> Ranges:
    """A stage-structured start for any cluster that can hold the model: the largest nodes
    in a chain of stages as long as each can hold, the rest as replicas of the stage with the
    least throughput among those they can hold (unused when they fit none)."""
    L = net.model.num_layers
    order = sorted((i for i in range(len(net.names)) if net.max_layers[i] > 0),
                   key=lambda i: (-int(net.max_layers[i]), -net.node_cap(i, 1)))
    ranges: Ranges = {}
    start = 0
    rest = []
    for i in order:
        if start < L:
            size = min(int(net.max_layers[i]), L - start)
            ranges[i] = (start, start + size)
            start += size
        else:
            rest.append(i)
    if start < L:
        return {}  # the cluster cannot hold the model (the spec checks reject this earlier)
    stages = sorted(set(ranges.values()))
    load = {st: sum(net.node_cap(i, st[1] - st[0]) for i, r in ranges.items() if r == st)
            for st in stages}
    for i in rest:
        fits = [st for st in stages if st[1] - st[0] <= net.max_layers[i]]
        if fits:
            st = min(fits, key=lambda x: load[x])
            ranges[i] = st
            load[st] += net.node_cap(i, st[1] - st[0])
    return ranges


class State:
    def __init__(self, cuts: list[int], stage: np.ndarray) -> None:
        self.cuts = list(cuts)
        self.stage = stage.copy()  # -1: unused

    def copy(self) -> State:
        return State(self.cuts, self.stage)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        cuts = np.asarray(self.cuts)
        used = self.stage >= 0
        s = np.zeros(len(self.stage), dtype=np.int64)
        k = np.zeros(len(self.stage), dtype=np.int64)
        s[used] = cuts[self.stage[used]]
        k[used] = cuts[self.stage[used] + 1] - s[used]
        return s, k

    def members(self, p: int) -> np.ndarray:
        return np.flatnonzero(self.stage == p)

    def size(self, p: int) -> int:
        return self.cuts[p + 1] - self.cuts[p]


def propose(st: State, kmax: np.ndarray, rng: random.Random) -> State | None:  # noqa: C901
    """A random neighbour of `st`, or None when the drawn move does not apply."""
    new = st.copy()
    S = len(st.cuts) - 1
    n = len(st.stage)
    move = rng.random()
    if move < 0.40:  # move a node to another stage (or in / out of the placement)
        i = rng.randrange(n)
        p = int(st.stage[i])
        if p >= 0 and len(st.members(p)) == 1:
            return None
        fits = [q for q in range(S) if q != p and st.size(q) <= kmax[i]]
        if p >= 0 and rng.random() < 0.05:
            new.stage[i] = -1
        elif fits:
            new.stage[i] = rng.choice(fits)
        else:
            return None
    elif move < 0.65:  # swap two nodes of different stages
        i, j = rng.randrange(n), rng.randrange(n)
        p, q = int(st.stage[i]), int(st.stage[j])
        if p == q or p < 0 or q < 0 or st.size(q) > kmax[i] or st.size(p) > kmax[j]:
            return None
        new.stage[i], new.stage[j] = q, p
    elif move < 0.88:  # shift a boundary
        if S < 2:
            return None
        b = rng.randrange(1, S)
        cut = st.cuts[b] + rng.choice((-3, -2, -1, -1, 1, 1, 2, 3))
        if not st.cuts[b - 1] < cut < st.cuts[b + 1]:
            return None
        left, right = cut - st.cuts[b - 1], st.cuts[b + 1] - cut
        if (left > kmax[st.members(b - 1)].min(initial=10**9)
                or right > kmax[st.members(b)].min(initial=10**9)):
            return None
        new.cuts[b] = cut
    elif move < 0.94:  # split a stage
        p = rng.randrange(S)
        mem = list(st.members(p))
        if len(mem) < 2 or st.size(p) < 2:
            return None
        cut = rng.randint(st.cuts[p] + 1, st.cuts[p + 1] - 1)
        rng.shuffle(mem)
        half = rng.randint(1, len(mem) - 1)
        new.cuts.insert(p + 1, cut)
        new.stage[new.stage > p] += 1
        for i in mem[half:]:
            new.stage[i] = p + 1
    else:  # merge stages p and p + 1
        if S < 2:
            return None
        p = rng.randrange(S - 1)
        both = np.concatenate([st.members(p), st.members(p + 1)])
        if st.cuts[p + 2] - st.cuts[p] > kmax[both].min():
            return None
        del new.cuts[p + 1]
        new.stage[new.stage == p + 1] = p
        new.stage[new.stage > p + 1] -= 1
    return new


def stage_search(net: FlowNetwork, starts: list[Ranges], deadline_s: float, seed: int = 0,
                 partial_inference: bool = True) -> tuple[Ranges, float] | None:
    """Best stage-structured placement found by `deadline_s` (planner clock), annealing from
    the best of `starts` that is stage-structured, or from `chain_start`; None when the
    cluster cannot hold the model."""
    L = net.model.num_layers
    n = len(net.names)
    kmax = np.asarray(net.max_layers, dtype=np.int64)
    scorer = Scorer(net, partial_inference)
    best: State | None = None
    best_value = -1.0
    for ranges in [*starts, chain_start(net)]:
        form = stage_form(ranges, L)
        if form is None:
            continue
        cuts, stage_of = form
        stage = np.full(n, -1, dtype=np.int64)
        for i, p in stage_of.items():
            stage[i] = p
        st = State(cuts, stage)
        value = scorer.score(*st.arrays())[0][0]
        if value > best_value:
            best, best_value = st, value
    if best is None:
        return None
    rng = random.Random(seed)
    cur, cur_value = best, best_value
    t0 = clock.now()
    span = max(deadline_s - t0, 1e-3)
    temp0 = TEMPERATURE * max(best_value, 1.0)
    while (now := clock.now()) < deadline_s:
        cand = propose(cur, kmax, rng)
        if cand is None:
            continue
        temp = temp0 * max(0.0, 1.0 - (now - t0) / span)
        u = rng.random()
        # below this flow the move is rejected anyway: min cover can decide it cheaply
        floor = cur_value + (temp * math.log(u) if temp > 0 and u > 0 else 0.0)
        (value, _even), exact = scorer.score(*cand.arrays(), floor=floor)
        if not exact:
            continue
        if value >= cur_value or (temp > 0 and u < math.exp((value - cur_value) / temp)):
            cur, cur_value = cand, value
            if value > best_value:
                best, best_value = cand, value
    return to_ranges(*best.arrays()), best_value
