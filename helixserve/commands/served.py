"""The served objective behind `helixserve plan` and `helixserve evaluate --served`: the
simulator as the planner's scorer (`SimScorer`), the requests a plan draws without a trace,
the engine models' configurations, and `plan_served`, the max-flow portfolio followed by the
search over simulated placements (planner/served.py). docs/planner.md, "The served objective".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

#: --serve-duration's horizon after the last arrival in replay mode when not given
REPLAY_HORIZON_S = 300.0
#: with the served objective: the max-flow portfolio's share of the budget; the
#: simulations (planner/served.py) get the rest
FLOW_SHARE = 0.2
#: portfolio candidates with less max flow than this share of the best are not simulated
MIN_FLOW_SHARE = 0.5
#: starts simulated at most, so that most of the budget goes to the climb
MAX_STARTS = 5
#: with a second engine model: the best stacked tilings (simulator/selection.py, ranked by
#: its analytic estimate) also tried as starts, after the others, each screened by the second
#: model (the cheaper one) before the first simulates it. On helix-single-24 one of them
#: (A100s 10 layers each, L4 pairs 6, T4 triples 4; the 11th with the conversation mix's
#: requests) serves 1.06x / 1.02x the max-flow answer (helix-prototype / vllm, 2,400 s)
TILING_STARTS = 12
#: the served objective's second engine model (--serve-also): the Helix authors' prototype
#: (docs/calibration.md): a fifth of the vllm model's events on helix-single-24, about half
#: on helix-mix-42
DEFAULT_ALSO = "helix-prototype"
#: --serve-also's choices (plan and evaluate --served): an engine model (simulator/presets.py) or none
ALSO_CHOICES = ("helix-prototype", "helix-host", "vllm", "reserve", "none")
#: `plan`'s default budget with the served objective (no --time-limit, no --work-limit):
#: units of work (the same placement on any machine), 20% of them for the max-flow
#: portfolio. With --jobs 2 on two free cores of the reference VM: 6.5 minutes on
#: helix-single-24, 8.3 on helix-mix-42 (issue 34: within 10 on 42 machines). 600 until
#: 2026-12-07: on helix-single-24 it ended before the climb, whose pick serves 1.18x / 1.22x
#: the authors' placement where the 600-unit one served 1.16x / 1.07x (docs/benchmarks.md)
DEFAULT_WORK_UNITS = 1000.0
#: the wall-clock cap behind the default work budget, a safety net (issue 34: a 42-machine
#: plan within 10 minutes on 2 cores): a loaded machine may reach it first, and the plan
#: then says so (its placement depends on the machine's speed and load)
DEFAULT_WALL_CAP_S = 600.0
#: --serve-reference: what each engine model's ratio is taken over (planner/served.py,
#: `served_search`'s `reference`: "first" is the max-flow answer, the first start)
REFERENCES = {"max-flow": "first", "best": "best"}
DEFAULT_REFERENCE = "max-flow"


#: units of the planner's work clock (clock.py: about a second of one core of the reference
#: 2-core VM) charged per event a served-objective simulation processes: 110,000 events/s
#: measured there under load (66,226 events in 1.23 s of process CPU time, a 120 s window of
#: helix-single-24)
SIM_EVENT_UNITS = 1 / 60_000
#: requests drawn for the served objective when no --serve-trace is given
WORKLOAD_REQUESTS = 4000


def workload_requests(mix: Any, seed: int = 0,
                      lengths: Sequence[tuple[int, int]] | None = None) -> list[Any]:
    """Requests for the served objective without a trace, WORKLOAD_REQUESTS of them, seeded:
    (prompt, output) pairs drawn uniformly with replacement from `lengths` (a --workload
    trace's own requests); without `lengths`, for the conversation mix (the default, and
    the decode-only `mix` None) from planner/lengths.py's table of the Azure conversation
    trace's held-out second half, and for any other mix (a "P:O" pair) exponential lengths
    with its means within the simulator's default length filter (4-2,048 prompt and
    4-1,024 output tokens)."""
    import random

    from helixserve.costmodel.workload import Workload
    from helixserve.planner.lengths import CONVERSATION_LENGTHS
    from helixserve.simulator.workload import LengthFilter, TraceRequest

    rng = random.Random(seed)
    mix = mix or Workload.conversation()
    if lengths is None and mix.source == "conversation":
        lengths = CONVERSATION_LENGTHS
    if lengths:
        pool = list(lengths)
        return [TraceRequest(f"w{i}", 0.0, *pool[rng.randrange(len(pool))])
                for i in range(WORKLOAD_REQUESTS)]
    bounds = LengthFilter()

    def draw(mean: float, most: int) -> int:
        return min(most, max(bounds.min_tokens, round(rng.expovariate(1.0 / mean))))

    return [TraceRequest(f"w{i}", 0.0, draw(mix.prompt_tokens, bounds.max_prompt_tokens),
                         draw(mix.output_tokens, bounds.max_output_tokens))
            for i in range(WORKLOAD_REQUESTS)]


def drawn_requests(workload_flag: str | None, mix: Any, seed: int = 0) -> tuple[list[Any], str]:
    """`plan`'s and `evaluate --served`'s requests without --serve-trace, and what they are
    (for the printed lines): drawn as `workload_requests` draws them, from the trace's own
    lengths when --workload (`workload_flag`) names a trace CSV."""
    from pathlib import Path

    from helixserve.planner.lengths import SAMPLE_SIZE

    if workload_flag and Path(workload_flag).is_file():
        from helixserve.simulator.workload import load_azure_trace, prepare_trace

        trace = prepare_trace(load_azure_trace(workload_flag))
        lengths = [(r.prompt_tokens, r.output_tokens) for r in trace]
        return (workload_requests(mix, seed, lengths),
                f"{WORKLOAD_REQUESTS:,} requests drawn from {Path(workload_flag).name}'s "
                f"lengths")
    requests = workload_requests(mix, seed)
    if mix is None or mix.source == "conversation":
        return requests, (f"{WORKLOAD_REQUESTS:,} requests drawn from the conversation mix "
                          f"(the Azure trace's held-out lengths, {SAMPLE_SIZE} pairs)")
    return requests, (f"{WORKLOAD_REQUESTS:,} requests drawn from {mix.describe()} "
                      f"(exponential lengths with its means)")


def _simulate(cluster: Any, model: Any, cost: Any, placement: Any, requests: list[Any],
              config: Any) -> Any:
    """simulator.selection.ScoredRun of `placement` under a SelectionConfig: offline after
    the warm-up (saturate), or over the trace replayed (replay); a worker function."""
    from helixserve.simulator.selection import simulate_pressure

    return simulate_pressure(cluster, model, cost, placement, requests, config)


class SimScorer:
    """The served objective's scorer (planner/served.py, `ServedScorer`): each placement
    simulated under `config`, a batch on up to `jobs` processes; charges the planner clock
    SIM_EVENT_UNITS per event, so `--work-limit` does not depend on the machine."""

    def __init__(self, net: Any, requests: list[Any], config: Any, jobs: int,
                 partial_inference: bool = True) -> None:
        self.net, self.requests, self.config = net, requests, config
        self.jobs, self.partial = jobs, partial_inference
        self.events = 0
        #: simulate with the router keeping requests inside their region (placement field)
        self.within_regions = False
        #: each node's pressure (node index -> share) in the run of each placement scored
        self.pressures: dict[Any, dict[int, float]] = {}

    def pressure(self, ranges: Any) -> dict[int, float] | None:
        """Node index -> pressure (simulator/selection.py's `node_pressure`) in the run of
        `ranges`, None when it was not simulated here."""
        from helixserve.planner.served import key

        return self.pressures.get(key(ranges))

    def placement(self, ranges: Any) -> Any:
        from helixserve.planner.registry import to_placement

        p = to_placement(self.net, "served", ranges, None, self.partial)
        p.route_within_regions = self.within_regions
        return p

    def __call__(self, batch: Any) -> list[float]:
        from helixserve.planner import clock
        from helixserve.planner.parallel import map_in_workers

        net = self.net
        placed = [self.placement(r) for r in batch]
        # a placement whose max flow is 0 (the links chain none of its stages) serves
        # nothing: the router needs flows to route over, so it scores 0 unsimulated
        runs = [p for p in placed if p.flows]
        calls = [(net.cluster, net.model, net.cost, p, self.requests, self.config)
                 for p in runs]
        from helixserve.planner.served import key

        results = dict(zip(map(id, runs), map_in_workers(_simulate, calls, self.jobs),
                           strict=True))
        for run in results.values():
            self.events += run.events
            clock.charge(run.events * SIM_EVENT_UNITS)
        for r, p in zip(batch, placed, strict=True):
            if id(p) in results:
                self.pressures[key(r)] = {net.index[name]: v for name, v
                                          in results[id(p)].pressure.items()}
        return [results[id(p)].tokens_per_s if id(p) in results else 0.0 for p in placed]


def served_configs(engine: str, also: str | None, duration_s: float | None,
                   mode: str = "saturate", seed: int = 0,
                   concurrency: int | None = None) -> tuple[Any, Any]:
    """The served objective's simulation settings (simulator.selection.SelectionConfig), for
    `engine` and for the second engine model `also` (None without one, or when it is
    `engine`): each placement in its own window (planner/window.py) when `duration_s` is
    None and `mode` is saturate, else `duration_s` seconds (the first quarter, at most
    300 s, not counted; in replay mode past the last arrival). `concurrency`: a closed loop
    of that many requests in flight instead of what the KV admits (SelectionConfig)."""
    from helixserve.planner.window import ScoringWindow
    from helixserve.simulator.presets import engine_config
    from helixserve.simulator.selection import SelectionConfig

    windowed = duration_s is None and mode == "saturate"
    fixed_s = REPLAY_HORIZON_S if duration_s is None else duration_s
    config = SelectionConfig.from_engine(
        engine_config(engine), duration_s=fixed_s, warmup_s=min(300.0, fixed_s / 4),
        seed=seed, mode=mode, window=ScoringWindow() if windowed else None,
        concurrency=concurrency).check()
    if also is None or also == engine:
        return config, None
    fields = SelectionConfig.from_engine(engine_config(also)).engine_fields()
    return config, replace(config, **fields)


def served_estimate(cluster: Any, model: Any, cost: Any, placement: Any, requests: list[Any],
                    *, engine: str = "vllm", also: str | None = DEFAULT_ALSO,
                    duration_s: float | None = None, seed: int = 0, jobs: int | None = 1,
                    partial: bool = True,
                    concurrency: int | None = None) -> tuple[float, float | None, Any]:
    """What the served objective's scorer gives `placement` (`plan_served`'s numbers, as
    `plan` prints them): decode tokens/s in `engine` and in `also` (None without one), with
    the same settings (`served_configs`), the placement's flows recomputed with `cost` (give
    the engine's memory, as `plan` does) and its `route_within_regions` kept; and the
    SelectionConfig used. `concurrency`: plan's --serve-concurrency (None: saturated)."""
    from helixserve.planner.flow import FlowNetwork
    from helixserve.planner.parallel import check_jobs

    config, also_config = served_configs(engine, also, duration_s, "saturate", seed,
                                         concurrency)
    net = FlowNetwork(cluster, model, cost)
    ranges = {net.index[r.name]: (r.start_layer, r.end_layer) for r in placement.nodes}
    scores: list[float | None] = []
    for cfg in (config, also_config):
        if cfg is None:
            scores.append(None)
            continue
        scorer = SimScorer(net, requests, cfg, check_jobs(jobs), partial)
        scorer.within_regions = placement.route_within_regions
        scores.append(scorer([ranges])[0])
    return float(scores[0] or 0.0), scores[1], config


@dataclass
class ServedPlan:
    """What `plan_served` found: the placement and how it got there."""

    placement: Any
    """The chosen placement (planner "milp"; its flows and max flow by the evaluator; the
    portfolio's bound when it is within the weight cap)."""
    flow: Any
    """The max-flow portfolio's answer (what `--objective flow` returns with its budget)."""
    outcome: Any
    """planner.served.ServedOutcome: the starts and the climb, with what each serves."""
    config: Any
    """The simulator.selection.SelectionConfig every placement was scored with."""
    served_tokens_per_s: float
    """What the placement serves in that simulation (with its `route_within_regions`)."""
    also: str | None = None
    """The second engine model every placement was also simulated with (None: none)."""
    also_tokens_per_s: float | None = None
    """What the placement serves in it."""
    sim_units: float = 0.0
    """Work units the simulations cost (SIM_EVENT_UNITS an event, on either clock: what
    `--work-limit` would charge them)."""
    capped: bool = False
    """The wall-clock cap (`plan_served`'s `wall_cap_s`) stopped the search before its work
    budget did: the placement depends on the machine's speed and load."""


def plan_served(cluster: Any, model: Any, cost: Any, requests: list[Any], *,
                engine: str = "vllm", also: str | None = DEFAULT_ALSO, combine: str = "min",
                reference: str = DEFAULT_REFERENCE,
                duration_s: float | None = None,
                mode: str = "saturate", concurrency: int | None = None,
                time_limit_s: float = 300.0, work_limit: float | None = None, seed: int = 0,
                jobs: int | None = None, partial: bool = True, progress: Any = None,
                started: float | None = None, wall_cap_s: float | None = None) -> ServedPlan:
    """The served objective (planner/served.py): the max-flow portfolio in FLOW_SHARE of the
    budget (`time_limit_s` seconds from `started`, or `work_limit` units), then its answers
    and their neighbours scored by simulating `requests` on `engine` in the rest: each in its
    own window (planner/window.py) when `duration_s` is None, else for `duration_s` (the
    first quarter, at most 300 s, not counted; in replay mode, past the last arrival).
    `concurrency`: the load stated, requests in flight (None: what each placement's KV
    admits; SelectionConfig.concurrency).
    `also`: a second engine model each placement is simulated with the same way (the
    search then maximises planner/served.py's `Objective` of the two). `wall_cap_s`: with
    `work_limit`, a wall-clock cap from `started` behind it (clock.wall_cap; the plan's
    `capped` says whether it stopped the search)."""
    with clock_cap(wall_cap_s if work_limit is not None else None, started):
        return _plan_served(cluster, model, cost, requests, engine=engine, also=also,
                            combine=combine, reference=reference, duration_s=duration_s,
                            mode=mode, concurrency=concurrency,
                            time_limit_s=time_limit_s, work_limit=work_limit,
                            seed=seed, jobs=jobs, partial=partial, progress=progress,
                            started=started)


def clock_cap(wall_cap_s: float | None, started: float | None) -> Any:
    """clock.wall_cap at `wall_cap_s` seconds after `started` (a perf_counter reading; now
    when None), or no cap when `wall_cap_s` is None."""
    from helixserve.planner import clock

    if wall_cap_s is None:
        return clock.wall_cap(None)
    since = 0.0 if started is None else time.perf_counter() - started
    return clock.wall_cap(time.time() + wall_cap_s - since)


def _plan_served(cluster: Any, model: Any, cost: Any, requests: list[Any], *, engine: str,
                 also: str | None, combine: str, reference: str, duration_s: float | None,
                 mode: str, concurrency: int | None, time_limit_s: float,
                 work_limit: float | None, seed: int,
                 jobs: int | None, partial: bool, progress: Any,
                 started: float | None) -> ServedPlan:
    from contextlib import nullcontext

    from helixserve.planner import clock
    from helixserve.planner.flow import FlowNetwork
    from helixserve.planner.parallel import check_jobs
    from helixserve.planner.portfolio import Candidate
    from helixserve.planner.registry import plan, to_placement
    from helixserve.planner.served import MIN_GAIN, Objective, served_search
    from helixserve.simulator.selection import load_text, regional_pipelines

    say = progress or (lambda msg: None)
    started = time.perf_counter() if started is None else started
    counting = work_limit is not None
    budget = work_limit if work_limit is not None else time_limit_s
    candidates: list[Candidate] = []
    flow = plan("milp", cluster, model, cost, time_limit_s=FLOW_SHARE * time_limit_s,
                seed=seed, progress=say, partial_inference=partial, jobs=jobs,
                work_limit=FLOW_SHARE * work_limit if work_limit is not None else None,
                candidates=candidates)
    net = FlowNetwork(cluster, model, cost)
    config, also_config = served_configs(engine, also, duration_s, mode, seed, concurrency)
    windowed = config.window is not None
    scorer = SimScorer(net, requests, config, check_jobs(jobs), partial)
    also_scorer = (None if also_config is None else
                   SimScorer(net, requests, also_config, check_jobs(jobs), partial))

    def ranges_of(p: Any) -> dict[int, tuple[int, int]]:
        return {net.index[r.name]: (r.start_layer, r.end_layer) for r in p.nodes}

    with clock.work_clock() if counting else nullcontext():
        t0 = clock.now()
        end = t0 + (1 - FLOW_SHARE) * budget if counting else started + time_limit_s
        # in the order they are simulated while the budget lasts: the max flow's answer,
        # the baselines petals' and swarm's (the best served starts on helix-mix-42:
        # 1,032 and 991 decode tokens/s against the max flow's 762), the regional
        # pipelines, with a second engine model the best TILING_STARTS stacked tilings
        # (screened by it: cheap), then the portfolio's other answers by max flow,
        # MAX_STARTS in all but the tilings; none whose max flow is under MIN_FLOW_SHARE of
        # the best (they serve far less: uniform, separate beyond the cap)
        best_of: dict[str, Candidate] = {}
        for c in candidates:
            if c.ranges and (c.source not in best_of
                             or c.value_tokens_per_s > best_of[c.source].value_tokens_per_s):
                best_of[c.source] = c
        floor = MIN_FLOW_SHARE * (flow.throughput_tokens_per_s or 0.0)
        others = [c for c in sorted(best_of.values(), key=lambda c: -c.value_tokens_per_s)
                  if c.value_tokens_per_s >= floor]
        first = ("petals", "swarm")
        starts = [("max flow", ranges_of(flow))]
        starts += [(f"max flow: {c.source}", c.ranges) for name in first for c in others
                   if c.source == name]
        regional = regional_pipelines(cluster, model, cost)
        if regional is not None:
            starts.append(("regional pipelines", ranges_of(regional)))
        starts = starts[:MAX_STARTS]
        rest = [(f"max flow: {c.source}", c.ranges) for c in others
                if c.source not in first][: MAX_STARTS - len(starts)]
        if also_scorer is not None:
            from helixserve.simulator.selection import stacked_tilings

            prompt_tokens = sum(q.prompt_tokens for q in requests)
            output_tokens = max(1, sum(q.output_tokens for q in requests))
            tilings = stacked_tilings(cluster, model, cost, prompt_tokens / output_tokens)
            starts += [(f"stacked tiling {i + 1}", ranges_of(p))
                       for i, (_, p) in enumerate(tilings[:TILING_STARTS])]
        starts += rest
        load = load_text(concurrency)
        say(f"served objective: {len(starts)} starts, simulated "
            f"{'each in its own window' if windowed else f'{config.duration_s:.0f} s each'} "
            f"({engine} engine{f' and {also}' if also_scorer is not None else ''}; {load})")
        outcome = served_search(net, starts, scorer, end, seed, progress=say,
                                also=also_scorer, combine=combine,
                                reference=REFERENCES[reference])
        best = outcome.best
        served, served_also = best.served_tokens_per_s, best.also_tokens_per_s
        regions = len({n.region for n in cluster.nodes}) > 1
        if regions:
            # across regions, the answer once more with the router keeping each request in
            # its region where the flow continues there (simulator/selection.py's variant)
            scorer.within_regions = True
            kept_in = scorer([best.ranges])[0]
            kept_also = None
            if also_scorer is not None:
                also_scorer.within_regions = True
                kept_also = also_scorer([best.ranges])[0]
            say(f"served: the answer routed within regions serves {kept_in:,.1f}"
                + ("" if kept_also is None else f" ({kept_also:,.1f} in {also})"))
            objective = outcome.objective or Objective()
            regions = objective(kept_in, kept_also) > best.value * (1 + MIN_GAIN)
            if regions:
                served, served_also = kept_in, kept_also
    held_within_cap = all(e - s <= net.max_layers[i] for i, (s, e) in best.ranges.items())
    bound = flow.upper_bound_tokens_per_s if held_within_cap else None
    placement = to_placement(net, "milp", best.ranges, bound, partial)
    placement.route_within_regions = regions
    placement.solve_time_s = time.perf_counter() - started
    events = scorer.events + (also_scorer.events if also_scorer is not None else 0)
    return ServedPlan(placement, flow, outcome, config, served,
                      also if also_scorer is not None else None,
                      served_also, events * SIM_EVENT_UNITS, clock.capped())
