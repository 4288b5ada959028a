"""The `milp` planner's portfolio of searches, in one place and in its order.

Every search of the planner is a `Stage`: it reads the `Problem` (the flow network, the seed,
the cores) and the `Incumbent` (every candidate placement so far, the proven upper bounds),
runs within its share of the `Budget`, and adds what it finds: candidates (layer ranges, each
valued by the max-flow evaluator) and bounds. `PORTFOLIO` lists the stages in the order they
run; `run_portfolio` runs them, skips the rest once the best candidate meets the bound
(`Incumbent.closed`), and returns the best placement within the weight cap with the tightest
bound. docs/planner.md describes each stage; the shares of the time limit are stated here, by
each stage.

  stage            finds                                          time (of the limit T)
  baselines        petals, swarm, separate, uniform, replicas     -
                   and the layer-work bound
  tiling           stacked rows of equal ranges (tiling.py)       15%, and 10% per region
  coverage         the layer-coverage relaxation: bound + start   10% (> SMALL_NODES machines)
  coverage-capped  the same with T(k) capped just above the best  10% (<= CAPPED_COVER_NODES)
  regions          per-region coverage + inter-region links       10% (2+ regions)
  stages           stage-structured annealing (stages.py)         10%, 25% > DENSE_NODES
  pinned           strongest machines re-sized (pinned.py)        10%, 55% with 2+ regions
  search           local search on the real max flow (search.py)  55% (at most 70% left)
  lns, milp        the per-node MILP (milp.py): neighbourhoods,   what is left, if >= 8% of T
                   then whole, warm-started

Each stage runs on `--jobs` cores where it is an annealing search (one seed per core,
parallel.py); every candidate is valued by the same evaluator, so the answer is the best of
all of them. A candidate beyond the weight cap (separate's pipeline of a type that fits no
other way) is never searched from: it is compared at the end, and if it wins it is the answer
with no bound, since the bounds are over placements within the cap.

`plan --from` (incremental.py, `replan_stages`) runs through the same `run_pipeline`: the full
re-plan (this portfolio, or a baseline, by name) in 70% of the limit, then the incremental
placement around the running machines and its search in the rest; `replan` then chooses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from helixserve.planner import clock
from helixserve.planner.baselines import BASELINES, Ranges
from helixserve.planner.bounds import layer_work_bound
from helixserve.planner.coverage import (
    SECONDS_PER_NONZERO,
    machine_types,
    slot_nonzeros,
    solve_coverage,
)
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.milp import DENSE_NODES, build_milp, extract, lns, warm_start
from helixserve.planner.parallel import run_seeds, warm_up
from helixserve.planner.pinned import pinned_search
from helixserve.planner.regions import num_regions, region_types, solve_regions
from helixserve.planner.search import local_search
from helixserve.planner.solver import SolveInfo, quiet_pulp, solve
from helixserve.planner.stages import stage_search
from helixserve.planner.tiling import regional_tiling, tiling_search

Progress = Callable[[str], None]

#: up to this many nodes the per-node MILP is small: skip the coverage relaxation, and run
#: the searches on one core (extra processes would only cost their start)
SMALL_NODES = 8
#: shares of the time limit, per stage (module doc)
TILING_SHARE = 0.15
REGIONAL_TILING_SHARE = 0.1
RELAXATION_SHARE = 0.1
STAGE_SHARE = 0.1
STAGE_SHARE_DENSE = 0.25
#: re-sizing the strongest machines, and on clusters of two or more regions, where it
#: found the better placements (docs/planner.md)
PINNED_SHARE = 0.1
PINNED_SHARE_REGIONS = 0.55
SEARCH_SHARE = 0.55
#: the local search takes at most this fraction of the time left
SEARCH_SHARE_OF_LEFT = 0.7
#: the per-node MILP (LNS, then whole) runs only with at least this share of the limit left
MILP_MIN_SHARE = 0.08
#: up to this many machines the coverage relaxation is solved a second time with every
#: T(k) capped just above the best placement so far (coverage.py, "Capped"): on small
#: clusters it proves bounds the plain relaxation does not reach; on 24 machines and more
#: it does not finish within its share
CAPPED_COVER_NODES = 16
CAP_MARGIN = 0.005


@dataclass
class PlanOutcome:
    """What a planner returns: the layer ranges, and what it proved and did."""

    ranges: Ranges
    #: proven upper bound on the throughput (tokens/s), when the planner has one
    upper_bound_tokens_per_s: float | None = None
    #: one report per stage of the portfolio, in order (empty for the baselines)
    stages: list[StageReport] = field(default_factory=list)
    #: every candidate the portfolio valued, within the weight cap or not (empty for the
    #: baselines): the starts of the served objective (served.py)
    candidates: list[Candidate] = field(default_factory=list)


@dataclass(frozen=True)
class Problem:
    """What every stage reads: the flow network and how to search it."""

    net: FlowNetwork
    """Link capacities and node throughputs; every candidate is valued on it."""
    partial_inference: bool = True
    """A hop may run only the tail of its node's range (Helix's partial inference)."""
    seed: int = 0
    """Seed of the first annealing run; workers take seed + parallel.SEED_STRIDE * w."""
    jobs: int = 1
    """Processes for the annealing stages, one seed each."""
    seeds: int | None = None
    """On the work clock: seeds per annealing stage, whatever `jobs` (None: WORK_SEEDS)."""
    kept: Ranges = field(default_factory=dict)
    """`plan --from`: the ranges of the running placement that the incremental stages keep
    (incremental.py); empty for a fresh plan."""

    def value(self, ranges: Ranges) -> float:
        """Throughput of `ranges` by the max-flow evaluator (tokens/s); 0 for no ranges."""
        return self.net.max_flow(ranges, self.partial_inference)[0] if ranges else 0.0

    @property
    def num_nodes(self) -> int:
        return len(self.net.names)


@dataclass
class Budget:
    """The limit and the clock: stage shares are fractions of `time_limit_s`. On the work
    clock (`plan --work-limit`, clock.py) the "seconds" here are units of work."""

    time_limit_s: float
    started_s: float = field(default_factory=clock.now)

    @property
    def deadline_s(self) -> float:
        return self.started_s + self.time_limit_s

    def remaining_s(self) -> float:
        return max(0.0, self.deadline_s - clock.now())

    def elapsed_s(self) -> float:
        return clock.now() - self.started_s

    def share(self, fraction: float) -> float:
        """A deadline `fraction` of the limit from now."""
        return clock.now() + fraction * self.time_limit_s


@dataclass(frozen=True)
class Candidate:
    """One placement found by a stage, valued by the max-flow evaluator."""

    value_tokens_per_s: float
    source: str
    ranges: Ranges


@dataclass
class StageReport:
    """What one stage did: ran or skipped (and why), what it found and proved."""

    stage: str
    ran: bool
    note: str = ""
    """Why it was skipped, or the solver status of a relaxation."""
    best_tokens_per_s: float | None = None
    """Its best candidate's throughput (None: it found none)."""
    bound_tokens_per_s: float | None = None
    """The bound it proved (None: none)."""
    seed_values: tuple[float | None, ...] = ()
    """Per seed, when it ran on several cores (None: that worker failed)."""


@dataclass
class Incumbent:
    """The best so far and the proven bound, carried through the portfolio."""

    candidates: list[Candidate] = field(default_factory=list)
    """Placements within the weight cap: searched from, compared at the end."""
    beyond_cap: list[Candidate] = field(default_factory=list)
    """Placements beyond the weight cap: only compared at the end."""
    bounds: list[float] = field(default_factory=list)
    """Every proven upper bound (tokens/s); the tightest is `bound()`."""
    reports: list[StageReport] = field(default_factory=list)
    target_tokens_per_s: float = 0.0
    """`plan --from`: the throughput the incremental search aims at (1 - max_loss of the
    full re-plan's); it un-pins kept machines only while below it (incremental.py)."""

    def best(self) -> Candidate:
        return max(self.candidates, key=lambda c: c.value_tokens_per_s)

    def bound(self) -> float:
        return min(self.bounds)

    def closed(self) -> bool:
        """The best candidate meets the bound: nothing better exists within the cap."""
        return self.best().value_tokens_per_s >= self.bound() * (1 - 1e-6)

    def add(self, problem: Problem, source: str, ranges: Ranges,
            value: float | None = None) -> Candidate:
        c = Candidate(problem.value(ranges) if value is None else value, source, ranges)
        self.candidates.append(c)
        return c

    def ranked_starts(self) -> list[Ranges]:
        return [c.ranges for c in sorted(self.candidates, key=lambda c: -c.value_tokens_per_s)]


@dataclass(frozen=True)
class Stage:
    """One search of the portfolio. `run` adds candidates and bounds to the incumbent and
    returns its report; it is called only while the incumbent is not closed, except for
    stages with `always=True` (the baselines, which make the first incumbent)."""

    name: str
    run: Callable[[Problem, Budget, Incumbent, Progress], StageReport]
    always: bool = False


def over_seeds(results: list[tuple[Ranges, float] | None]) -> str:
    """' (best of 2 seeds: 5,914.3 / 5,666.7)' when a search ran on several cores."""
    if len(results) <= 1:
        return ""
    values = " / ".join(f"{r[1]:,.1f}" if r is not None else "-" for r in results)
    return f" (best of {len(results)} seeds: {values})"


def _seed_values(results: list[tuple[Ranges, float] | None]) -> tuple[float | None, ...]:
    return tuple(None if r is None else r[1] for r in results) if len(results) > 1 else ()


# ---- the stages, in portfolio order -------------------------------------------------------


def whole_replicas(net: FlowNetwork) -> Ranges:
    """Every machine that loads the whole model holds all of it, beyond the weight cap or
    not: what serves when the links chain no machines (none between them, or too slow)."""
    L = net.model.num_layers
    return {i: (0, L) for i in range(len(net.names))
            if net.loadable[i] >= L and net.node_cap(i, L) > 0}


#: candidates besides the baselines, compared like them (searched from only within the cap)
EXTRA_CANDIDATES: dict[str, Callable[[FlowNetwork], Ranges]] = {"replicas": whole_replicas}


def run_baselines(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    net = p.net
    for name, fn in {**BASELINES, **EXTRA_CANDIDATES}.items():
        r = fn(net)
        if not r and name in EXTRA_CANDIDATES:
            continue  # e.g. no machine loads the whole model
        within = all(e - s <= net.max_layers[i] for i, (s, e) in r.items())
        c = Candidate(p.value(r), name, r)
        (inc.candidates if within else inc.beyond_cap).append(c)
    best = max(inc.candidates + inc.beyond_cap, key=lambda c: c.value_tokens_per_s)
    inc.bounds.append(layer_work_bound(net))
    say(f"baselines: best {best.source} {best.value_tokens_per_s:,.1f} tokens/s; "
        f"layer-work bound {inc.bounds[0]:,.1f}")
    return StageReport("baselines", True, best.source, best.value_tokens_per_s, inc.bounds[0])


def run_tiling(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    base = max(inc.candidates + inc.beyond_cap, key=lambda c: c.value_tokens_per_s)
    tiled = tiling_search(p.net, base.value_tokens_per_s, inc.bound(),
                          budget.share(TILING_SHARE), p.partial_inference)
    found: list[float] = []
    if tiled is not None:
        inc.add(p, "tiling", tiled[0], tiled[1])
        found.append(tiled[1])
        say(f"tiling: {tiled[1]:,.1f} tokens/s")
    regional = regional_tiling(p.net, budget.share(REGIONAL_TILING_SHARE), p.partial_inference)
    if regional is not None:
        inc.add(p, "tiling-regions", regional[0], regional[1])
        found.append(regional[1])
        say(f"tiling per region: {regional[1]:,.1f} tokens/s")
    return StageReport("tiling", True, best_tokens_per_s=max(found, default=None))


#: nonzeros of a whole relaxation per nonzero of its cover rows (`slot_nonzeros`), measured
#: on the bundled example (coverage 53,090 / 24,900; regions 178,925 / 32,390)
MODEL_PER_COVER_NONZERO = {"coverage relaxation": 2.1, "region relaxation": 5.5}
#: the PuLP name of each relaxation's model (clock.NODE_COSTS)
MODEL_NAME = {"coverage relaxation": "coverage", "region relaxation": "regions"}


def _estimate_s(what: str, cover_nonzeros: int) -> float:
    """What building and solving a relaxation costs before its limit can stop it: seconds on
    the wall clock (building, presolve), units up to its root node on the work clock, where
    no node limit shortens the root (clock.py)."""
    if clock.counting():
        return clock.root_units(MODEL_NAME[what],
                                int(cover_nonzeros * MODEL_PER_COVER_NONZERO[what]))
    return cover_nonzeros * SECONDS_PER_NONZERO


def _buildable(p: Problem, budget: Budget, what: str, curves: list[tuple[float, ...]],
               say: Progress) -> str:
    """'' when a relaxation over `curves` can be built within its share, else why not: the
    solver's limit does not bound building the model, nor HiGHS's presolve (nor, on the work
    clock, the root node)."""
    relax_s = RELAXATION_SHARE * budget.time_limit_s
    nonzeros = slot_nonzeros(curves, p.net.model.num_layers)
    estimate = _estimate_s(what, nonzeros)
    if estimate <= relax_s:
        return ""
    why = f"{nonzeros:,} nonzeros would take about {estimate:.1f}s of its {relax_s:.1f}s"
    say(f"{what} skipped: {why}")
    return why


def run_coverage(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    why = _buildable(p, budget, "coverage relaxation", list(machine_types(p.net)), say)
    if why:
        return StageReport("coverage", False, why)
    if p.num_nodes <= SMALL_NODES:
        return StageReport("coverage", False, f"at most {SMALL_NODES} machines: the MILP is small")
    cov = solve_coverage(p.net, RELAXATION_SHARE * budget.time_limit_s, hint=inc.best().ranges)
    if cov.info.bound is not None:
        inc.bounds.append(cov.info.bound)
    value = None
    if cov.ranges:
        value = inc.add(p, "coverage", cov.ranges).value_tokens_per_s
    say(f"coverage relaxation [{cov.info.status}]: placement "
        f"{inc.candidates[-1].value_tokens_per_s:,.1f}, bound {inc.bound():,.1f} tokens/s")
    return StageReport("coverage", True, cov.info.status, value, cov.info.bound)


def run_capped_coverage(p: Problem, budget: Budget, inc: Incumbent,
                        say: Progress) -> StageReport:
    name = "coverage-capped"
    if p.num_nodes > CAPPED_COVER_NODES:
        return StageReport(name, False, f"more than {CAPPED_COVER_NODES} machines")
    # the coverage stage's size check, repeated without a second message
    nonzeros = slot_nonzeros(list(machine_types(p.net)), p.net.model.num_layers)
    if _estimate_s("coverage relaxation", nonzeros) > RELAXATION_SHARE * budget.time_limit_s:
        return StageReport(name, False, "too large to build within its share")
    best = inc.best()
    if best.value_tokens_per_s <= 0:
        # a cap of 0, when nothing found serves yet, would prove nothing
        return StageReport(name, False, "no serving placement to cap at")
    cap = best.value_tokens_per_s * (1 + CAP_MARGIN)
    capped = solve_coverage(p.net, RELAXATION_SHARE * budget.time_limit_s, hint=best.ranges,
                            cap=cap)
    bound = None
    if capped.info.bound is not None and capped.info.bound < cap * (1 - 1e-9):
        bound = capped.info.bound  # valid: see coverage.py, "Capped"
        inc.bounds.append(bound)
    value = None
    if capped.ranges:
        value = inc.add(p, name, capped.ranges).value_tokens_per_s
    say(f"coverage capped at {cap:,.1f} [{capped.info.status}]: "
        f"bound {inc.bound():,.1f} tokens/s")
    return StageReport(name, True, capped.info.status, value, bound)


def run_regions(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    if num_regions(p.net) < 2:
        return StageReport("regions", False, "one region")
    if p.num_nodes > DENSE_NODES:
        return StageReport("regions", False, f"more than {DENSE_NODES} machines")
    why = _buildable(p, budget, "region relaxation", [c for _, c in region_types(p.net)], say)
    if why:
        return StageReport("regions", False, why)
    reg = solve_regions(p.net, RELAXATION_SHARE * budget.time_limit_s)
    if reg.info.bound is not None:
        inc.bounds.append(reg.info.bound)
    value = None
    if reg.ranges:
        value = inc.add(p, "regions", reg.ranges).value_tokens_per_s
    say(f"region relaxation [{reg.info.status}]: bound {inc.bound():,.1f} tokens/s")
    return StageReport("regions", True, reg.info.status, value, reg.info.bound)


def run_stages(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    share = STAGE_SHARE_DENSE if p.num_nodes > DENSE_NODES else STAGE_SHARE
    results = run_seeds(stage_search, (p.net, [c.ranges for c in inc.candidates]),
                        {"partial_inference": p.partial_inference}, budget.share(share),
                        p.seed, p.jobs, say, seeds=p.seeds)
    staged = max((r for r in results if r is not None), key=lambda r: r[1], default=None)
    value = None
    if staged is not None:
        value = inc.add(p, "stages", staged[0]).value_tokens_per_s
        say(f"stage annealing: {value:,.1f} tokens/s{over_seeds(results)}")
    return StageReport("stages", True, best_tokens_per_s=value, seed_values=_seed_values(results))


def run_pinned(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    multi = num_regions(p.net) >= 2 and p.num_nodes <= DENSE_NODES
    share = PINNED_SHARE_REGIONS if multi else PINNED_SHARE
    values: list[float] = []
    for found in run_seeds(pinned_search, (p.net, inc.best().ranges),
                           {"partial_inference": p.partial_inference}, budget.share(share),
                           p.seed, p.jobs, say, worker_kwargs={"heaviest_only": True},
                           seeds=p.seeds):
        for r, _ in found:
            values.append(inc.add(p, "pinned", r).value_tokens_per_s)
            say(f"pinned search: {values[-1]:,.1f} tokens/s")
    return StageReport("pinned", True, best_tokens_per_s=max(values, default=None))


def run_search(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    def on_improve(v: float) -> None:
        say(f"search: {v:,.1f} tokens/s ({budget.elapsed_s():.0f}s)")

    deadline = clock.now() + min(SEARCH_SHARE * budget.time_limit_s,
                                         budget.remaining_s() * SEARCH_SHARE_OF_LEFT)
    searched = run_seeds(local_search, (p.net, inc.ranked_starts()),
                         {"partial_inference": p.partial_inference, "on_improve": on_improve,
                          "max_stall": 200 * p.num_nodes},
                         deadline, p.seed, p.jobs, say, seeds=p.seeds)
    ranges = max(searched, key=lambda r: r[1])[0]
    value = inc.add(p, "search", ranges).value_tokens_per_s
    per_seed = [(r, v) for r, v, _ in searched]
    if len(searched) > 1:
        say(f"search: {value:,.1f} tokens/s{over_seeds(list(per_seed))}")
    return StageReport("search", True, best_tokens_per_s=value,
                       seed_values=_seed_values(list(per_seed)))


def run_milp(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    """The per-node MILP (milp.py): LNS over neighbourhoods of 3-6 nodes on large clusters
    (half of what is left), then the whole model warm-started from the best so far."""
    if budget.remaining_s() <= MILP_MIN_SHARE * budget.time_limit_s:
        # building the per-node MILP takes seconds on large clusters: only with time to use it
        return StageReport("milp", False, f"less than {MILP_MIN_SHARE:.0%} of the limit left")
    net = p.net
    best = inc.best()
    best_value, best_ranges = best.value_tokens_per_s, best.ranges
    prob, v, pruned = build_milp(net, inc.bound(), p.partial_inference)
    if p.num_nodes > SMALL_NODES:
        say(f"lns: re-solving {len(v['s'])}-node MILP neighbourhoods of 3-6 nodes")
        best_ranges, best_value = lns(
            net, prob, v, best_ranges, clock.now() + 0.5 * budget.remaining_s(),
            p.seed, p.partial_inference,
            on_improve=lambda x: say(f"lns: {x:,.1f} tokens/s ({budget.elapsed_s():.0f}s)"))
        inc.add(p, "lns", best_ranges, best_value)
    with quiet_pulp():
        warm_start(net, v, best_ranges, p.partial_inference)
    say(f"milp: {len(prob.variables())} variables, {prob.numConstraints()} constraints, "
        f"warm start {best_value:,.1f} tokens/s")

    def on_progress(t: float, incumbent: float | None, bnd: float | None) -> None:
        gap = "" if incumbent is None or not bnd else f" gap {max(0.0, 1 - incumbent / bnd):.1%}"
        say(f"milp {t:.0f}s: incumbent {incumbent or 0:,.1f} bound "
            f"{(bnd or 0) + pruned:,.1f}{gap}")

    # leave time to read the solution back and evaluate it within the limit
    solve_s = budget.remaining_s() - 0.02 * budget.time_limit_s - 0.2
    if solve_s < 0.3:
        return StageReport("milp", True, "no time left to solve", best_value)
    info: SolveInfo = solve(prob, solve_s, warm_start=True, progress=on_progress)
    bound = None
    if info.bound is not None:
        # pruned links' capacity added back: the bound stays an upper bound
        bound = info.bound + pruned
        inc.bounds.append(bound)
    value = None
    if info.objective is not None:
        r = extract(net, v)
        if r:
            value = inc.add(p, "milp", r).value_tokens_per_s
    say(f"milp [{info.status}]: {inc.candidates[-1].value_tokens_per_s:,.1f} tokens/s")
    return StageReport("milp", True, info.status, value, bound)


#: the portfolio, in the order it runs (module doc)
PORTFOLIO: tuple[Stage, ...] = (
    Stage("baselines", run_baselines, always=True),
    Stage("tiling", run_tiling),
    Stage("coverage", run_coverage),
    Stage("coverage-capped", run_capped_coverage),
    Stage("regions", run_regions),
    Stage("stages", run_stages),
    Stage("pinned", run_pinned),
    Stage("search", run_search),
    Stage("milp", run_milp),
)


def run_pipeline(stages: tuple[Stage, ...], problem: Problem, budget: Budget, inc: Incumbent,
               say: Progress) -> Incumbent:
    """Run `stages` in order on `inc` (each reads what the ones before found); a stage
    without `always` is skipped once the incumbent is closed. Returns `inc`, with one
    report per stage appended."""
    for stage in stages:
        if not stage.always and inc.closed():
            inc.reports.append(StageReport(stage.name, False, "closed: best meets the bound"))
            continue
        inc.reports.append(stage.run(problem, budget, inc, say))
    return inc


def run_portfolio(net: FlowNetwork, time_limit_s: float, seed: int = 0,
                  progress: Progress | None = None, partial_inference: bool = True,
                  jobs: int = 1) -> PlanOutcome:
    """Run `PORTFOLIO` on `net` within `time_limit_s`; the best placement and its bound."""
    budget = Budget(time_limit_s)
    say = progress or (lambda msg: None)
    # on a few machines the per-node MILP is solved exactly and the searches stall in
    # moments: extra processes would only cost their start
    small = len(net.names) <= SMALL_NODES
    jobs = 1 if small else jobs
    warm_up(jobs)
    problem = Problem(net, partial_inference, seed, jobs, seeds=1 if small else None)
    inc = run_pipeline(PORTFOLIO, problem, budget, Incumbent(), say)
    best = inc.best()
    outside = max(inc.beyond_cap, key=lambda c: c.value_tokens_per_s, default=None)
    if outside is not None and outside.value_tokens_per_s > best.value_tokens_per_s:
        # the bounds are over placements within the cap: none holds for this one
        say(f"best: {outside.value_tokens_per_s:,.1f} tokens/s from {outside.source}, beyond "
            f"the weight cap (within it: {best.value_tokens_per_s:,.1f}, bound "
            f"{inc.bound():,.1f})")
        return PlanOutcome(outside.ranges, None, inc.reports, inc.candidates + inc.beyond_cap)
    bound = max(inc.bound(), best.value_tokens_per_s)
    gap = 1 - best.value_tokens_per_s / bound if bound else 0.0
    say(f"best: {best.value_tokens_per_s:,.1f} tokens/s from {best.source}; bound {bound:,.1f} "
        f"(gap {gap:.1%})")
    return PlanOutcome(best.ranges, bound, inc.reports, inc.candidates + inc.beyond_cap)
