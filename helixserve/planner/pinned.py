"""Re-size the strongest machines together, re-optimize the rest around them (pinned search).

The node-level local search (search.py) and the stage annealing (stages.py) change one node
or one stage at a time. Some better placements are out of their reach because they need the
strongest machines *and* everything downstream of them to change at once. On
helix-geo-24 (llama-2-70b) both searches stop at 5,666.7 tokens/s: the 4 A100s in a chain
of 4 x 12 layers, whose `T(12)` is exactly 5,666.7. With 11 layers each, `T(11)` = 6,182,
but then the 20 L4s and T4s must cover 36 layers instead of 32 and receive the chain's
output across the slow inter-region links on more machines; a one-node move from the
12-layer chain only uncovers a layer, so the search never goes there.

This step does that move as a large-neighbourhood search:
  1. the group: machines with the same `T(k)` curve (same GPU, count and memory), the one
     with the largest total layer work `sum_i max_k k T_i(k)` (the A100s above);
  2. for d in (-1, +1): every member of the group in the best placement so far gets
     `k + d` layers, k the largest size among them; members that formed a chain (one
     starts where the previous ends) are laid out again as a chain from the same start,
     the others keep their start; the other machines move with the member whose old end
     is the last at or before their start, so the receivers of the group's output still
     start where it ends;
  3. layers left uncovered are filled by growing the neighbouring ranges of the other
     machines where their memory allows, else by moving a machine whose layers stay
     covered without it;
  4. the local search runs with the group pinned (`local_search(fixed=...)`): only the
     other machines move.
The results are candidates for the (unpinned) local search and the MILP that follow in
milp.py, so a variant that does not pay off costs only its time.
"""

from __future__ import annotations

import numpy as np

from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.search import local_search
from helixserve.spec import group_machines, machine_type

#: size changes tried for the group, in this order
DELTAS = (-1, 1)
#: their shares of the time when both apply: a smaller size is what the searches cannot
#: reach by themselves (a larger one they can, by growing ranges one at a time)
WEIGHTS = {-1: 2.0, 1: 1.0}
#: local-search restarts from the best after this many evaluations per machine without gain
STALL = 200


def strongest_group(net: FlowNetwork, ranges: Ranges) -> list[int]:
    """Held machines of the `T(k)` class with the most total layer work, by start layer."""
    nodes = net.cluster.nodes
    classes = group_machines(nodes, lambda i: machine_type(nodes[i]), ranges)
    if not classes:
        return []

    def work(i: int) -> float:
        return max(k * t for k, t in enumerate(net.throughput[i]))

    members = max(classes.values(), key=lambda ms: sum(work(i) for i in ms))
    return sorted(members, key=lambda i: ranges[i])


def resize(ranges: Ranges, group: list[int], delta: int, kmax: np.ndarray,
           num_layers: int) -> Ranges | None:
    """`ranges` with every member of `group` (sorted by start) at the group's largest size
    plus `delta` layers (a chain runs at its slowest member's `T(k)`, so the members get one
    size); chains stay chains from the same start. The other machines move with the group
    member whose old end is the last at or before their start (the receivers of a chain's
    output keep starting where it ends). None when no member can change size."""
    out = dict(ranges)
    changed = False
    moved_ends: dict[int, int] = {}  # old end -> new end of group members
    prev_old_end = prev_new_end = None
    size = max(ranges[i][1] - ranges[i][0] for i in group) + delta
    for i in group:
        s, e = ranges[i]
        k = min(max(1, size), int(kmax[i]))
        changed |= k != e - s
        start = prev_new_end if s == prev_old_end and prev_new_end is not None else s
        start = max(0, min(start, num_layers - k))
        out[i] = (start, start + k)
        moved_ends[e] = start + k
        prev_old_end, prev_new_end = e, start + k
    if not changed:
        return None
    members = set(group)
    for j, (s, e) in ranges.items():
        before = [old for old in moved_ends if old <= s]
        if j in members or not before:
            continue
        shift = moved_ends[max(before)] - max(before)
        start = max(0, min(s + shift, num_layers - (e - s)))
        out[j] = (start, start + e - s)
    return out


def fill_gaps(net: FlowNetwork, ranges: Ranges, fixed: set[int]) -> Ranges:
    """Grow free machines next to uncovered layers (end at the gap: grow the end; start
    right after it: grow the start); where none can, move a free machine whose layers stay
    covered without it, the one best linked to the machines on both sides of the gap.
    Stops when every layer is covered or nothing can change."""
    kmax, num_layers = net.max_layers, net.model.num_layers
    out = dict(ranges)
    while True:
        diff = np.zeros(num_layers + 1, dtype=int)
        for s, e in out.values():
            diff[s] += 1
            diff[e] -= 1
        held = np.cumsum(diff)[:num_layers]  # machines holding each layer
        gaps = np.flatnonzero(held == 0)
        if len(gaps) == 0:
            return out
        a = b = int(gaps[0])  # the first uncovered run [a, b]
        while b + 1 < num_layers and held[b + 1] == 0:
            b += 1
        grown = False
        for i, (s, e) in sorted(out.items(), key=lambda it: it[1][1] - it[1][0]):
            if i in fixed or e - s >= kmax[i]:
                continue
            if e == a:
                out[i] = (s, e + 1)
            elif s == b + 1:
                out[i] = (s - 1, e)
            else:
                continue
            grown = True
            break
        if not grown:  # move a free machine whose layers all stay covered without it
            spare = [i for i, (s, e) in out.items() if i not in fixed and held[s:e].min() > 1]
            if not spare:
                return out  # the local search's re-place move may still cover it
            i = max(spare, key=lambda j: (_linked(net, out, j, a, b),
                                          held[out[j][0]:out[j][1]].min()))
            k = out[i][1] - out[i][0]
            start = max(0, min(a, num_layers - k))
            out[i] = (start, start + k)


def _linked(net: FlowNetwork, ranges: Ranges, j: int, a: int, b: int) -> float:
    """Link capacity into machine j from the holders of layer a - 1 (or the coordinator)
    and out of it to the holders of layer b + 1 (or the coordinator), the smaller."""
    into = (net.source_cap[j] if a == 0 else
            sum(net.link_cap[h, j] for h, (s, e) in ranges.items() if s <= a - 1 < e and h != j))
    out_of = (net.sink_cap[j] if b + 1 >= net.model.num_layers else
              sum(net.link_cap[j, q] for q, (s, e) in ranges.items() if s <= b + 1 < e and q != j))
    return float(min(into, out_of))


def pinned_search(net: FlowNetwork, best: Ranges, deadline_s: float, seed: int = 0,
                  partial_inference: bool = True,
                  heaviest_only: bool = False) -> list[tuple[Ranges, float]]:
    """Each size variant of the strongest group, searched with the group pinned until its
    share of `deadline_s`; returns (ranges, max flow) per variant that found a flow.
    `heaviest_only`: only the variant of the largest weight, for all the time (what the
    extra processes of --jobs run, while the first one runs them all: parallel.py)."""
    L = net.model.num_layers
    group = strongest_group(net, best)
    variants = [(WEIGHTS[d], r) for d in DELTAS
                if (r := resize(best, group, d, net.max_layers, L)) is not None]
    if heaviest_only and variants:
        variants = [max(variants, key=lambda v: v[0])]
    found: list[tuple[Ranges, float]] = []
    for n, (weight, start) in enumerate(variants):
        now = clock.now()
        share = (deadline_s - now) * weight / sum(w for w, _ in variants[n:])
        if share <= 0.2:
            break
        start = fill_gaps(net, start, set(group))
        ranges, value, _ = local_search(net, [start], now + share, seed=seed + n,
                                        partial_inference=partial_inference,
                                        max_stall=STALL * len(net.names),
                                        fixed=frozenset(group))
        if value > 0:
            found.append((ranges, float(value)))
    return found
