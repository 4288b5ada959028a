"""The served objective: placements chosen by the decode throughput they serve, not by their
max flow (`plan --objective served`, the default; docs/planner.md, "The served objective").

Why. The max flow credits every node with T(k), the decode rate at the batch its own KV
allows (b(k) = 340-800 sequences for LLaMA-2-70B on the Helix clusters). A node inside a
pipeline batches only the requests in flight through it: a request holds KV on every node
of its route at once but sits in one node's batch at a time, so a node's batch is about
in_flight / depth, in_flight is capped by the tightest KV on the routes through the node,
and each route serves in_flight / round trip (Little's law). The round trip depends on the
whole route (its depth, its slow GPUs, the prompts that ride in its iterations), which no
per-node capacity of a max flow expresses: a per-node serving T(k) made the MILP build one
long chain (docs/planner.md, "Serving-aware capacity (tried, removed)"). So a placement is
scored whole, by a `ServedScorer` (the command's is the cluster simulator, offline and
saturated, with the serving engine's model: continuous batching of what is really in
flight, KV on every hop of a route, prompts chunked along it), and the search below looks
for the placement that scores best.

Window. Each placement is simulated in its own window (planner/window.py): a run starts
with a cold start (a KV's worth of prompts crossing the links and prefilling) and then
oscillates with a period of about a request's lifetime, so a fixed window scores different
phases of different placements (300 s scored helix-geo-24's max-flow placement in its
cold start, 4.9 decode tokens/s against 135 at steady state, and the search picked a
placement that serves a third of it). The window skips the cold start (estimated from the
placement's links, latencies, KV and prefill times) and the first wave, then counts whole
request lifetimes measured in the run; it is derived from the inputs and the seeded
simulation only, so the work clock keeps the answer machine-independent.

Two engine models. The scorer may come with a second one (`also`; the command's: the Helix
authors' prototype model, `--serve-also`): the engine models rank placements differently (on
helix-single-24 the max-flow answer serves 1.08x the authors' placement in the `vllm` model
and 1.01x in the prototype's, whose admission promise binds its A100 chain), and the target
is to serve more in both. The search then maximises the smaller of the two ratios to the
first start's scores (`Objective`; `reference="best"`: to the best score any start reached
in each model, set once the starts are scored), and since the second model is the cheaper (whole
prompts: a fraction of the events), it screens: a candidate is scored by the first only
when its second ratio alone could beat the placement it must beat.

Search (`served_search`), on the planner clock (clock.py: seconds, or counted work with
`--work-limit`, the scorer charging its own work):
  1. starts, in the caller's order of priority (the command's: the max flow's answer,
     petals' and swarm's, across regions the regional pipelines, with a second model the
     best stacked tilings, the portfolio's other answers; commands/served.py,
     `plan_served`), scored a batch at a time while the next batch fits in what is left
     (by the last batch's cost; then one at a time while one fits, by the last batch's mean,
     so the end of the budget is not left idle); duplicates once; whenever a start
     becomes the best and is stage-structured in at most EARLY_ORDER_BLOCKS blocks (a
     stacked tiling), its block orders (step 2) are queued right behind it, before the
     other starts (on helix-mix-42 the starts alone spend the default budget);
  2. block orders: when the best start is stage-structured, its stages in the orders that
     move one machine kind's block to the end or the front (`block_orders`), a batch at a
     time while the next fits, the best taken when it is worth MIN_GAIN more (a random
     draw reaches a given order late, and the order moves the prototype model by up to
     7% on helix-single-24 and 10% on helix-mix-42);
  3. climb: from there, draw `batch` distinct neighbours (with the scorer's
     per-node pressure in the current placement's simulation, half by bottleneck moves:
     a pressed machine hands layers to a light neighbour, or a light machine copies a
     pressed one's range; of the rest, half by stage annealing's moves when the placement
     is stage-structured: move or swap machines, shift a boundary, split or merge stages;
     the others by one-machine moves: shift, grow or shrink a range, or copy another
     machine's), score them together (the scorer may run them side by side), and move to
     the best of them when it is worth more than the current placement; stop at the
     deadline, before a batch that would not fit in what is left (by the last batch's
     cost), or after `max_stall` batches without a gain.
On the work clock the answer depends only on the inputs, the seed and the budget: the
proposals come from one seeded generator, a batch is scored whole whatever the scorer's
parallelism, and the scorer charges its work, not its time.

What is proven: nothing about the served throughput. The portfolio's bound is an upper bound
on the max flow of every placement within the weight cap (compute at each node's full-KV
batch); it stays what `plan` prints as the bound, and the served throughput of a placement
is far below it (2-12% of its own max flow for the served objective's answers on the Helix
clusters; docs/planner.md, "What the bound bounds").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.search import to_ranges
from helixserve.planner.stages import State, propose, stage_form

#: neighbours scored together per step of the climb (fixed, so the answer does not depend
#: on how many of them the scorer runs at once)
BATCH = 2
#: proposals drawn per neighbour wanted before a step gives up (most are rejected by rule)
DRAWS_PER_NEIGHBOUR = 200
#: a neighbour must serve this much more than the current placement to be taken: runs of
#: nearly equal placements differ by their event order, not by what they serve
MIN_GAIN = 0.002
#: share of a stage-structured placement's neighbours drawn by stage moves
STAGE_MOVES = 0.5
#: share of the neighbours drawn by bottleneck moves when the scorer reports each node's
#: pressure in its simulation (`pressure_move`)
PRESSURE_MOVES = 0.5
#: with `combine="geomean"`: the screen assumes a candidate's primary ratio at most this much
#: above the current placement's (or the best start's)
SCREEN_SLACK = 0.05
#: share of a stage-structured placement's other neighbours drawn by reordering its stages
ORDER_MOVES = 0.3
#: a leading start's block orders are queued before the other starts only when it has at
#: most this many blocks of stages (a stacked tiling: each kind's stages together; 3 on
#: helix-single-24, 7 on helix-mix-42, where the max-flow answer, stage-structured by the
#: stage annealing, has 18 blocks and 34 orders, which would spend the budget before the
#: tilings)
EARLY_ORDER_BLOCKS = 8


class ServedScorer(Protocol):
    """Decode tokens/s each placement serves, in the order given; deterministic for its
    ranges, and charging its work to the planner clock (`clock.charge`)."""

    def __call__(self, batch: Sequence[Ranges]) -> list[float]: ...


@dataclass(frozen=True)
class Scored:
    """One placement the search scored."""

    source: str
    ranges: Ranges
    #: what the scorer gives it (the primary engine model's decode tokens/s)
    served_tokens_per_s: float
    #: what the second scorer gives it (`served_search`'s `also`), None without one
    also_tokens_per_s: float | None = None
    #: the search's objective: `served_tokens_per_s`, or with a second scorer the smaller
    #: of the two scores over the first start's in each (`Objective`)
    value: float = 0.0


@dataclass
class ServedOutcome:
    """The best placement found and what was scored on the way."""

    best: Scored
    #: every start, scored, in the order given (duplicates once)
    starts: list[Scored] = field(default_factory=list)
    #: accepted steps of the climb, in order
    steps: list[Scored] = field(default_factory=list)
    #: placements the primary scorer scored
    evaluations: int = 0
    #: placements the second scorer scored (each climb neighbour first: the screen)
    also_evaluations: int = 0
    #: what `best` maximised (its references: the first start's scores)
    objective: Objective | None = None
    #: why the search ended: "budget", "stall" (max_stall batches without a gain) or
    #: "no neighbour"
    stopped_by: str = "budget"


@dataclass(frozen=True)
class Objective:
    """The value the search maximises. One scorer: its score. Two: the smaller of the two
    scores, each over the first start's (the command's: the max-flow answer's), so a
    placement is worth as much as it gains in the engine model where it gains least (one
    that serves 1.1x in one and 0.95x in the other is worth 0.95, where a mean would call
    it 1.025). `combine="geomean"`: the geometric mean of the two ratios instead (an
    experiment, `plan --serve-combine`; it does not depend on the reference)."""

    primary_ref: float = 1.0
    also_ref: float | None = None
    combine: str = "min"

    def ratios(self, primary: float, also: float) -> tuple[float, float]:
        return (primary / max(self.primary_ref, 1e-9),
                also / max(self.also_ref or 1.0, 1e-9))

    def __call__(self, primary: float, also: float | None) -> float:
        if self.also_ref is None or also is None:
            return primary
        p, a = self.ratios(primary, also)
        return min(p, a) if self.combine == "min" else float(np.sqrt(max(0.0, p * a)))

    def also_bound(self, also: float, primary_cap: float = float("inf")) -> float:
        """The most a placement whose second score is `also` can be worth (to screen it
        before the primary scorer runs): exact for "min"; for "geomean" with its primary
        ratio assumed at most `primary_cap`."""
        if self.also_ref is None:
            return float("inf")
        a = also / max(self.also_ref, 1e-9)
        return a if self.combine == "min" else float(np.sqrt(max(0.0, a * primary_cap)))


def key(ranges: Ranges) -> tuple[tuple[int, int, int], ...]:
    """A placement's identity: its (node, start, end) triples, sorted."""
    return tuple(sorted((i, s, e) for i, (s, e) in ranges.items()))


class _Cache:
    """Scores by placement, so a placement met twice is scored (and charged) once."""

    def __init__(self, scorer: ServedScorer) -> None:
        self.scorer = scorer
        self.values: dict[tuple[tuple[int, int, int], ...], float] = {}
        self.evaluations = 0

    def score(self, batch: Sequence[Ranges]) -> list[float]:
        todo: list[Ranges] = []
        seen: set[tuple[tuple[int, int, int], ...]] = set()
        for r in batch:
            k = key(r)
            if k not in self.values and k not in seen:
                todo.append(r)
                seen.add(k)
        if todo:
            for r, v in zip(todo, self.scorer(todo), strict=True):
                self.values[key(r)] = v
            self.evaluations += len(todo)
        return [self.values[key(r)] for r in batch]


def _state(ranges: Ranges, n: int, num_layers: int) -> State | None:
    form = stage_form(ranges, num_layers)
    if form is None:
        return None
    cuts, stage_of = form
    stage = np.full(n, -1, dtype=np.int64)
    for i, p in stage_of.items():
        stage[i] = p
    return State(cuts, stage)


def node_move(ranges: Ranges, kmax: np.ndarray, num_layers: int,
              rng: random.Random) -> Ranges | None:
    """A random one-machine change of `ranges` that keeps every layer held and every
    machine within its cap, or None when the drawn move does not apply: shift a range by
    1-3 layers, grow or shrink one end by 1-2, or give a machine another machine's range
    (a replica there)."""
    held = sorted(ranges)
    if not held:
        return None
    i = held[rng.randrange(len(held))]
    s, e = ranges[i]
    move = rng.random()
    if move < 0.3:
        d = rng.choice((-3, -2, -1, 1, 2, 3))
        s, e = s + d, e + d
    elif move < 0.55:
        if rng.random() < 0.5:
            e += rng.choice((1, 2))
        else:
            s -= rng.choice((1, 2))
    elif move < 0.8:
        if rng.random() < 0.5:
            e -= rng.choice((1, 2))
        else:
            s += rng.choice((1, 2))
    else:
        j = held[rng.randrange(len(held))]
        s, e = ranges[j]
    if not (0 <= s < e <= num_layers) or e - s > kmax[i] or (s, e) == ranges[i]:
        return None
    new = dict(ranges)
    new[i] = (s, e)
    return new if _covers(new, num_layers) else None


def _covers(ranges: Ranges, num_layers: int) -> bool:
    """Every layer of [0, num_layers) is held by some machine."""
    cover = np.zeros(num_layers + 1, dtype=np.int64)
    for a, b in ranges.values():
        cover[a] += 1
        cover[b] -= 1
    return bool(np.all(np.cumsum(cover)[:num_layers] > 0))


def pressure_move(ranges: Ranges, pressure: dict[int, float], kmax: np.ndarray,
                  num_layers: int, rng: random.Random) -> Ranges | None:
    """A change aimed at the placement's bottleneck, as its simulation showed it (`pressure`:
    node -> max(busy share, KV use over what admission may fill)): one of the three most
    pressed machines either hands one or two layers at an end of its range to the least
    pressed machine whose range meets that end (a lighter range holds more KV a layer and
    computes less), or one of the three least pressed machines (or an unused one) takes a
    copy of its range, cut to its own cap (a replica: more KV and compute for those
    layers). None when the drawn move does not apply."""
    held = sorted(ranges)
    if not held:
        return None
    by_load = sorted(held, key=lambda i: (-pressure.get(i, 0.0), i))
    hot = by_load[rng.randrange(min(3, len(by_load)))]
    s, e = ranges[hot]
    new = dict(ranges)
    if rng.random() < 0.5:
        d = rng.choice((1, 2))
        if e - s <= d:
            return None
        if rng.random() < 0.5:  # give [s, s + d) to a machine whose range ends at s
            new[hot] = (s + d, e)
            takers = [j for j in held if j != hot and ranges[j][1] == s
                      and s + d - ranges[j][0] <= kmax[j]]
            if not takers:
                return None
            j = min(takers, key=lambda j: (pressure.get(j, 0.0), j))
            new[j] = (ranges[j][0], s + d)
        else:  # give [e - d, e) to a machine whose range starts at e
            new[hot] = (s, e - d)
            takers = [j for j in held if j != hot and ranges[j][0] == e
                      and ranges[j][1] - (e - d) <= kmax[j]]
            if not takers:
                return None
            j = min(takers, key=lambda j: (pressure.get(j, 0.0), j))
            new[j] = (e - d, ranges[j][1])
    else:
        unused = [i for i in range(len(kmax)) if i not in ranges and kmax[i] > 0]
        cold = [i for i in reversed(by_load) if i != hot][:3] + unused[:1]
        if not cold:
            return None
        j = cold[rng.randrange(len(cold))]
        k = min(e - s, int(kmax[j]))
        start = s if rng.random() < 0.5 else e - k
        new[j] = (start, start + k)
    if new == ranges or not _covers(new, num_layers):
        return None
    return new


def order_move(ranges: Ranges, kind: Sequence[str], num_layers: int,
               rng: random.Random) -> Ranges | None:
    """The stages of a stage-structured placement in another order, each keeping its
    machines and its number of layers: half the time a block (the longest run of
    consecutive stages whose machines are of one `kind`, e.g. the T4 triples) moved to
    another place in the order, else two stages swapped. The order matters where prompts
    are prefilled whole at every hop (the helix-prototype model: on helix-single-24 the
    T4 triples before the A100 chain serve 1.07x the same stages after the L4 pairs). None
    when `ranges` is not stage-structured or has one stage."""
    form = stage_form(ranges, num_layers)
    if form is None:
        return None
    cuts, stage_of = form
    n = len(cuts) - 1
    if n < 2:
        return None
    members: list[list[int]] = [[] for _ in range(n)]
    for i, p in stage_of.items():
        members[p].append(i)
    order = list(range(n))
    if rng.random() < 0.5:
        blocks = _kind_blocks(members, kind)
        if len(blocks) < 2:
            return None
        b = rng.randrange(len(blocks))
        rest = [blk for j, blk in enumerate(blocks) if j != b]
        at = rng.randrange(len(rest) + 1)
        if at == b:
            return None
        order = [p for blk in rest[:at] + [blocks[b]] + rest[at:] for p in blk]
    else:
        a, c = rng.sample(range(n), 2)
        order[a], order[c] = order[c], order[a]
    new: Ranges = {}
    start = 0
    for p in order:
        size = cuts[p + 1] - cuts[p]
        for i in members[p]:
            new[i] = (start, start + size)
        start += size
    return None if new == ranges else new


def _kind_blocks(members: list[list[int]], kind: Sequence[str]) -> list[list[int]]:
    """The stages (indices into `members`, each stage's machines) in blocks: longest runs
    of consecutive stages whose machines are of the same kinds."""
    label = [tuple(sorted({kind[i] for i in m})) for m in members]
    blocks: list[list[int]] = []
    for p in range(len(members)):
        if blocks and label[blocks[-1][-1]] == label[p]:
            blocks[-1].append(p)
        else:
            blocks.append([p])
    return blocks


def block_orders(ranges: Ranges, kind: Sequence[str], num_layers: int) -> list[Ranges]:
    """The stage orders of a stage-structured placement that move one block of stages (a
    longest run of consecutive stages of one machine `kind`, e.g. the T4 triples) to the
    front or to the end, each stage keeping its machines and its number of layers: at most
    2 (blocks - 1) placements, none equal to `ranges`, in a fixed order (every block to the
    end, then every block to the front: on helix-mix-42 the best of its pick's 12 orders,
    the single T4s moved to the end, is then the second, where front-first made it the
    eighth). Empty when `ranges` is not stage-structured or has one block."""
    form = stage_form(ranges, num_layers)
    if form is None:
        return []
    cuts, stage_of = form
    n = len(cuts) - 1
    members: list[list[int]] = [[] for _ in range(n)]
    for i, p in stage_of.items():
        members[p].append(i)
    blocks = _kind_blocks(members, kind)
    out: list[Ranges] = []
    seen = {key(ranges)}
    for to_front in (False, True):
        for b in range(len(blocks)):
            rest = [blk for j, blk in enumerate(blocks) if j != b]
            moved = [blocks[b]] + rest if to_front else rest + [blocks[b]]
            new: Ranges = {}
            start = 0
            for p in (p for blk in moved for p in blk):
                size = cuts[p + 1] - cuts[p]
                for i in members[p]:
                    new[i] = (start, start + size)
                start += size
            if key(new) not in seen:
                seen.add(key(new))
                out.append(new)
    return out


def neighbours(ranges: Ranges, kmax: np.ndarray, num_layers: int, rng: random.Random,
               count: int, exclude: set[tuple[tuple[int, int, int], ...]],
               pressure: dict[int, float] | None = None,
               kind: Sequence[str] | None = None) -> list[Ranges]:
    """Up to `count` distinct neighbours of `ranges`, none of them in `exclude` (placements
    already scored): with the placement's `pressure` (its simulation's), a share
    PRESSURE_MOVES of bottleneck moves (`pressure_move`); of the rest, when `ranges` is
    stage-structured, a share ORDER_MOVES of stage orders (`order_move`, with each
    machine's `kind`) and half of what remains stage moves (stages.py); one-machine moves
    (`node_move`) otherwise."""
    out: list[Ranges] = []
    keys = set(exclude)
    st = _state(ranges, len(kmax), num_layers)
    for _ in range(DRAWS_PER_NEIGHBOUR * count):
        if len(out) >= count:
            break
        cand: Ranges | None
        if pressure is not None and rng.random() < PRESSURE_MOVES:
            cand = pressure_move(ranges, pressure, kmax, num_layers, rng)
        elif st is not None and kind is not None and rng.random() < ORDER_MOVES:
            cand = order_move(ranges, kind, num_layers, rng)
        elif st is not None and rng.random() < STAGE_MOVES:
            moved = propose(st, kmax, rng)
            cand = None if moved is None else to_ranges(*moved.arrays())
        else:
            cand = node_move(ranges, kmax, num_layers, rng)
        if not cand:
            continue
        k = key(cand)
        if k in keys:
            continue
        keys.add(k)
        out.append(cand)
    return out


def _pressure(ranges: Ranges, *scorers: ServedScorer | None) -> dict[int, float] | None:
    """Each node's largest pressure in the runs of `ranges` by the scorers that report one
    (an optional `pressure(ranges)` method); None when none does."""
    out: dict[int, float] | None = None
    for sc in scorers:
        got = getattr(sc, "pressure", None)
        p = got(ranges) if got is not None else None
        if p is not None:
            out = dict(p) if out is None else {i: max(v, out.get(i, 0.0))
                                               for i, v in (out | p).items()}
    return out


@dataclass
class _LastBatch:
    """The served search's last batch of simulations, which `fits()` sizes the next one by:
    its work units, its placements (at least 1) and its wall seconds."""

    cost: float = 0.0
    size: int = 1
    wall: float = 0.0
    _started: tuple[float, float] = (0.0, 0.0)

    def start(self) -> None:
        self._started = (clock.now(), time.time())

    def end(self, size: int) -> None:
        work, wall = self._started
        self.cost, self.size, self.wall = clock.now() - work, max(1, size), time.time() - wall


def served_search(net: FlowNetwork, starts: Sequence[tuple[str, Ranges]], scorer: ServedScorer,
                  deadline_s: float, seed: int = 0, batch: int = BATCH,
                  max_stall: int = 50,
                  progress: Callable[[str], None] | None = None,
                  also: ServedScorer | None = None, combine: str = "min",
                  reference: str = "first", order_step: bool = True) -> ServedOutcome:
    """The placement of `starts` and their neighbourhoods that scores highest, found by
    `deadline_s` (planner clock); see the module doc. With `also` (a second scorer, cheaper
    than `scorer`: the command's helix-prototype model), every placement is scored by both
    and the `Objective` of the two is maximised: a climb neighbour is scored by `also`
    first and by `scorer` only when its `also` score alone could make it better than the
    current placement (the screen loses nothing: the objective is at most that ratio).
    `reference`: "first" (each model's ratio over the first start's score) or "best" (over
    the best any start reached in that model). `order_step`: score the best start's block
    orders before the climb. `starts` must not be empty."""
    if not starts:
        raise ValueError("served_search: no start")
    if reference not in ("first", "best"):
        raise ValueError(f"served_search: reference {reference!r}; known: first, best")
    say = progress or (lambda msg: None)
    L = net.model.num_layers
    cache = _Cache(scorer)
    also_cache = _Cache(also) if also is not None else None
    unique: list[tuple[str, Ranges]] = []
    seen: set[tuple[tuple[int, int, int], ...]] = set()
    for source, ranges in starts:
        if ranges and key(ranges) not in seen:
            seen.add(key(ranges))
            unique.append((source, ranges))
    objective = Objective(combine=combine)
    refs_set = also_cache is None

    def score(items: Sequence[tuple[str, Ranges]], threshold: float,
              primary_cap: float = float("inf")) -> list[Scored | None]:
        """The candidates scored, a batch per scorer: with `also`, by it first, then by
        `scorer` those whose `also` score could make them worth more than `threshold` (the
        others None). The first call's first candidate is always scored by both and sets
        the objective's references."""
        nonlocal objective, refs_set
        cands = [r for _, r in items]
        if also_cache is None:
            return [Scored(src, r, v, None, v)
                    for (src, r), v in zip(items, cache.score(cands), strict=True)]
        screen = also_cache.score(cands)
        first = not refs_set
        kept = [i for i, a in enumerate(screen)
                if (first and i == 0) or objective.also_bound(a, primary_cap) > threshold]
        vals = dict(zip(kept, cache.score([cands[i] for i in kept]), strict=True))
        if first:
            objective = Objective(vals[0] if vals[0] > 0 else 1.0,
                                  screen[0] if screen[0] > 0 else 1.0, combine)
            refs_set = True
        return [Scored(src, r, vals[i], screen[i], objective(vals[i], screen[i]))
                if i in vals else None for i, (src, r) in enumerate(items)]

    # the starts in the order given (the caller's priority), a batch at a time, while the
    # next batch fits in what is left; at least the first. With `also` the first start,
    # scored by both, sets the objective's references, and the others are screened
    # against the best start so far
    scored: list[Scored] = []
    last = _LastBatch()

    def fits() -> int:
        """Candidates the next batch may hold: `batch` while a batch costing the last one's
        fits in what is left, else 1 while one costing the last batch's mean fits (the end of
        the budget is not left idle: on helix-mix-42 a batch costs up to 290 units), else 0.
        A wall-clock cap (`plan`'s default) is read by the last batch's wall time a
        placement: a batch cannot stop halfway, and on a VM slower than the reference one
        started just before the cap ran helix-mix-42's default plan 61 s past its 600 s; a
        batch that would end past the cap is not started, and the search stops as the cap
        stops it."""
        left = deadline_s - clock.now()
        take = batch if last.cost <= left else 1 if last.cost / last.size <= left else 0
        wall, each = clock.wall_left(), last.wall / last.size
        if take == batch and batch * each > wall:
            take = 1
        if take == 1 and each > wall:
            clock.stop_at_cap()
            take = 0
        return take

    kind = [f"{x.gpu}x{x.num_gpus}" for x in net.cluster.nodes]
    # starts whose block orders were queued, and each queued order's bar: its start's value
    # and MIN_GAIN more (an order is a step from its start, not a start of its own)
    ordered: set[tuple[tuple[int, int, int], ...]] = set()
    order_bar: dict[tuple[tuple[int, int, int], ...], float] = {}
    b = 0
    while b < len(unique):
        take = fits() if scored else batch
        if not take:
            say(f"served: {len(unique) - b} starts left unscored (budget)")
            break
        last.start()
        chunk = unique[b : b + take]
        b += len(chunk)
        best_value = max((c.value for c in scored), default=-1.0)
        cap = (1 + SCREEN_SLACK) * max((objective.ratios(c.served_tokens_per_s,
                                                         c.also_tokens_per_s or 0.0)[0]
                                        for c in scored), default=1.0)
        # a queued block order must beat its start by MIN_GAIN (`order_bar`), so its screen too
        bar = min(order_bar.get(key(r), best_value) for _, r in chunk)
        for (source, ranges), c in zip(chunk, score(chunk, bar, cap), strict=True):
            if c is not None and c.value <= order_bar.get(key(ranges), -1.0):
                say(f"served: {source}: {c.value:.3f}, not worth {MIN_GAIN:.1%} more")
            elif c is not None:
                scored.append(c)
                say(f"served: {source} serves {c.served_tokens_per_s:,.1f} decode tokens/s"
                    + ("" if c.also_tokens_per_s is None else
                       f", {c.also_tokens_per_s:,.1f} in the second engine model (value "
                       f"{c.value:.3f})"))
            elif also_cache is not None:
                say(f"served: {source} serves {also_cache.values[key(ranges)]:,.1f} in the "
                    "second engine model: screened out")
        last.end(len(chunk))
        # a new best start that is stage-structured: its block orders next, before the
        # other starts (on helix-mix-42 the starts spend the default budget, and one block
        # order of stacked tiling 1 serves 1.23x / 1.14x the authors' placement where the
        # tiling serves 1.17x / 1.05x)
        lead = max(scored, key=lambda c: c.value) if scored else None
        if (order_step and lead is not None and key(lead.ranges) not in ordered
                and key(lead.ranges) not in order_bar):
            orders = block_orders(lead.ranges, kind, L)
            if len(orders) > 2 * (EARLY_ORDER_BLOCKS - 1):
                orders = []  # too many blocks: left to the step after the starts
            else:
                ordered.add(key(lead.ranges))
            queued = [(f"block order of {lead.source}", r) for r in orders
                      if key(r) not in seen]
            for _, r in queued:
                seen.add(key(r))
                order_bar[key(r)] = lead.value * (1 + MIN_GAIN)
            unique[b:b] = queued
            if queued:
                say(f"served: {lead.source} leads; its {len(queued)} block orders next")
    if reference == "best" and also_cache is not None:
        # each model's reference: the best any start reached in it (screened-out starts
        # count in the second model), so the best placement in each model is 1.0 in it
        objective = Objective(
            max((c.served_tokens_per_s for c in scored), default=1.0) or 1.0,
            max((also_cache.values[key(r)] for _, r in unique if key(r) in also_cache.values),
                default=1.0) or 1.0, combine)
        scored = [Scored(c.source, c.ranges, c.served_tokens_per_s, c.also_tokens_per_s,
                         objective(c.served_tokens_per_s, c.also_tokens_per_s))
                  for c in scored]
    best = max(scored, key=lambda c: c.value)
    out = ServedOutcome(best, scored, objective=objective)
    cur = best
    kmax = np.asarray(net.max_layers, dtype=np.int64)
    rng = random.Random(seed)
    stall = climbed = 0
    # first, the best start's block orders (`block_orders`), a batch at a time while the
    # next fits, unless they were queued among the starts: where prompts prefill whole at
    # every hop the order of the stages matters (the T4 triples first on helix-single-24),
    # and a random draw reaches them late
    orders = (block_orders(cur.ranges, kind, L)
              if order_step and key(cur.ranges) not in ordered else [])
    threshold = cur.value * (1 + MIN_GAIN)
    top: Scored | None = None
    tried = 0
    while tried < len(orders):
        take = fits()
        if not take:
            break
        chunk_orders = orders[tried : tried + take]
        tried += len(chunk_orders)
        last.start()
        cap = (1 + SCREEN_SLACK) * objective.ratios(cur.served_tokens_per_s,
                                                    cur.also_tokens_per_s or 0.0)[0]
        for c in score([("block order", r) for r in chunk_orders], threshold, cap):
            if c is not None and c.value > (threshold if top is None else top.value):
                top = c
        last.end(len(chunk_orders))
    if top is not None:
        cur = top
        out.steps.append(cur)
        say(f"served block order: {top.served_tokens_per_s:,.1f} decode tokens/s"
            + ("" if top.also_tokens_per_s is None else
               f", {top.also_tokens_per_s:,.1f} in the second (value {top.value:.3f})"))
    elif orders and not tried:
        say(f"served: the best placement's {len(orders)} block orders left unscored (budget)")
    elif orders:
        say(f"served: {tried} of the best placement's {len(orders)} block orders scored, none "
            f"worth {MIN_GAIN:.1%} more")
    while stall < max_stall and (take := fits()):
        last.start()
        cands = neighbours(cur.ranges, kmax, L, rng, take,
                           set(cache.values) | (set(also_cache.values) if also_cache else set()),
                           _pressure(cur.ranges, scorer, also), kind)
        if not cands:
            break
        climbed += len(cands)
        threshold = cur.value * (1 + MIN_GAIN)
        cap = (1 + SCREEN_SLACK) * objective.ratios(cur.served_tokens_per_s,
                                                    cur.also_tokens_per_s or 0.0)[0]
        found = [c for c in score([("climb", r) for r in cands], threshold, cap)
                 if c is not None]
        last.end(len(cands))
        top = max(found, key=lambda c: c.value, default=None)
        if top is not None and top.value > threshold:
            cur = top
            out.steps.append(cur)
            stall = 0
            say(f"served climb: {top.served_tokens_per_s:,.1f} decode tokens/s"
                + ("" if top.also_tokens_per_s is None else
                   f", {top.also_tokens_per_s:,.1f} in the second (value {top.value:.3f})")
                + f" ({cache.evaluations} placements scored)")
        else:
            stall += 1
    out.stopped_by = ("stall" if stall >= max_stall else "budget" if not fits()
                      else "no neighbour")
    say(f"served: the climb ended after {climbed} neighbours"
        + {"stall": f" ({stall} batches without a gain)", "budget": " (budget)",
           "no neighbour": " (no neighbour left)"}[out.stopped_by])
    if cur.value > out.best.value:
        out.best = cur
    out.evaluations = cache.evaluations
    out.also_evaluations = also_cache.evaluations if also_cache is not None else 0
    return out
