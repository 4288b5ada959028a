"""Local search over placements, scored by the real max-flow evaluator.

A fast way to a strong incumbent for the MILP (its warm start) and the answer on clusters
too large for the MILP to close. State: start s_i and size k_i per node (k_i = 0: unused).
Moves: shift a range, grow/shrink it at either end, re-place a node on the weakest window,
swap two nodes' ranges, drop or re-add a node. Simulated annealing on the max flow, with
ties broken by how evenly the layers are covered (sum over layers of min(cover_l, mean
cover), where cover_l is the summed T_i(k_i) of the nodes holding layer l): on a flat
max-flow plateau, that moves work toward the bottleneck layers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np

from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork


def to_arrays(net: FlowNetwork, ranges: Ranges) -> tuple[np.ndarray, np.ndarray]:
    n = len(net.names)
    s = np.zeros(n, dtype=np.int64)
    k = np.zeros(n, dtype=np.int64)
    for i, (a, b) in ranges.items():
        s[i], k[i] = a, b - a
    return s, k


def to_ranges(s: np.ndarray, k: np.ndarray) -> Ranges:
    return {int(i): (int(s[i]), int(s[i] + k[i])) for i in np.flatnonzero(k > 0)}


def covers(s: np.ndarray, k: np.ndarray, num_layers: int) -> bool:
    cover = np.zeros(num_layers + 1, dtype=np.int64)
    for i in np.flatnonzero(k > 0):
        cover[s[i]] += 1
        cover[s[i] + k[i]] -= 1
    return bool(np.all(np.cumsum(cover)[:num_layers] > 0))


class Scorer:
    def __init__(self, net: FlowNetwork, partial_inference: bool) -> None:
        self.net = net
        self.partial = partial_inference
        self.L = net.model.num_layers
        # T_i(k) as a dense table: throughput[i, k]
        kmax = int(max(net.max_layers.max(), 1))
        self.table = np.zeros((len(net.names), kmax + 1))
        for i in range(len(net.names)):
            for kk in range(1, int(net.max_layers[i]) + 1):
                self.table[i, kk] = net.node_cap(i, kk)
        self.evals = 0

    def score(self, s: np.ndarray, k: np.ndarray,
              floor: float | None = None) -> tuple[tuple[float, float], bool]:
        """((flow, evenness), exact). When min cover (an upper bound on the flow) is below
        `floor`, the max flow is skipped and (min cover, evenness) returned, exact=False."""
        caps = self.table[np.arange(len(k)), k]
        diff = np.zeros(self.L + 1)
        np.add.at(diff, s, caps)
        np.add.at(diff, s + k, -caps)
        cover = np.cumsum(diff)[: self.L]
        mean = cover.mean()
        even = float(np.minimum(cover, mean).sum()) / self.L if mean > 0 else 0.0
        upper = float(cover.min())
        if floor is not None and upper < floor:
            return (round(upper, 3), even), False
        self.evals += 1
        flow = self.net.max_flow_value(s, k, self.partial, caps=caps)
        return (round(flow, 3), even), True


def local_search(  # noqa: C901 - one annealing loop reads best in one piece
    net: FlowNetwork,
    starts: list[Ranges],
    deadline_s: float,
    seed: int = 0,
    partial_inference: bool = True,
    on_improve: Callable[[float], None] | None = None,
    max_stall: int = 4000,
    fixed: frozenset[int] = frozenset(),
) -> tuple[Ranges, float, int]:
    """Best placement found before `deadline_s` (planner clock, clock.py); returns (ranges, flow, evals).
    Nodes in `fixed` keep the range they have in the start (pinned.py uses this)."""
    rng = random.Random(seed)
    scorer = Scorer(net, partial_inference)
    L = scorer.L
    kmax = net.max_layers
    n = len(net.names)
    usable = [i for i in range(n) if kmax[i] > 0 and i not in fixed]
    best_s, best_k = to_arrays(net, starts[0])
    best = scorer.score(best_s, best_k)[0]
    for st in starts[1:]:
        s, k = to_arrays(net, st)
        sc = scorer.score(s, k)[0]
        if sc > best:
            best, best_s, best_k = sc, s, k
    cur_s, cur_k, cur = best_s.copy(), best_k.copy(), best
    stall = 0
    temp0 = 0.02
    t_start = clock.now()
    span = max(deadline_s - t_start, 1e-3)

    while clock.now() < deadline_s and usable:
        s, k = cur_s.copy(), cur_k.copy()
        i = rng.choice(usable)
        move = rng.random()
        if k[i] == 0 or move < 0.08:  # (re)place node i on the window with the least cover
            kk = int(k[i]) if k[i] > 0 else rng.randint(1, int(kmax[i]))
            if move < 0.04 and k[i] > 0:
                kk = rng.randint(1, int(kmax[i]))
            caps = scorer.table[np.arange(n), k]
            caps[i] = 0.0
            diff = np.zeros(L + 1)
            np.add.at(diff, s, caps)
            np.add.at(diff, s + k, -caps)
            cover = np.cumsum(diff)[:L]
            window = np.convolve(cover, np.ones(kk), mode="valid")  # sum over each window
            s[i], k[i] = int(np.argmin(window)), kk
        elif move < 0.40:  # shift
            delta = rng.choice((-3, -2, -1, -1, 1, 1, 2, 3))
            s[i] = min(max(0, s[i] + delta), L - k[i])
        elif move < 0.75:  # grow or shrink at one end
            delta = rng.choice((-2, -1, -1, 1, 1, 2))
            new_k = min(max(1, k[i] + delta), int(kmax[i]))
            if rng.random() < 0.5:  # keep the end fixed
                s[i] = max(0, s[i] + k[i] - new_k)
            k[i] = new_k
            s[i] = min(s[i], L - k[i])
        elif move < 0.95:  # swap with another node, if both fit the other's range
            j = rng.choice(usable)
            if j == i or k[j] == 0 or k[i] > kmax[j] or k[j] > kmax[i]:
                continue
            s[i], s[j] = s[j], s[i]
            k[i], k[j] = k[j], k[i]
        else:  # drop the node
            if sum(1 for x in k if x > 0) <= 1:
                continue
            k[i] = 0
        if not covers(s, k, L):
            continue
        progress = (clock.now() - t_start) / span
        temp = temp0 * max(0.0, 1.0 - progress) * max(cur[0], 1.0)
        # the worst flow this step may still accept; below it, min cover suffices to reject
        threshold = rng.random()
        floor = cur[0] + (temp * math.log(threshold) if temp > 0 and threshold > 0 else 0.0)
        sc, exact = scorer.score(s, k, floor=floor)
        if not exact:
            stall += 1
            continue
        accept = sc >= cur or (
            temp > 0 and threshold < math.exp((sc[0] - cur[0]) / temp)
        )
        if accept:
            cur_s, cur_k, cur = s, k, sc
        if sc > best:
            improved = sc[0] > best[0]
            best, best_s, best_k = sc, s.copy(), k.copy()
            stall = 0
            if improved and on_improve is not None:
                on_improve(best[0])
        else:
            stall += 1
            if stall >= max_stall:  # restart from the best, or stop when the search is small
                if n <= 8:
                    break
                cur_s, cur_k, cur = best_s.copy(), best_k.copy(), best
                stall = 0
    return to_ranges(best_s, best_k), best[0], scorer.evals
