"""`helixserve plan`: choose which layers each machine holds (max-flow placement)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from helixserve.commands.args import finite_float
from helixserve.commands.costs import add_cost_args
from helixserve.commands.served import (
    ALSO_CHOICES,
    DEFAULT_ALSO,
    DEFAULT_REFERENCE,
    DEFAULT_WALL_CAP_S,
    DEFAULT_WORK_UNITS,
    FLOW_SHARE,
    REFERENCES,
    REPLAY_HORIZON_S,
    drawn_requests,
    plan_served,
)

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "data" / "example"
#: what milp maximises (--objective)
OBJECTIVES = ("served", "flow")
#: defaults of --time-limit and --serve-duration per objective (None: each placement in its
#: own window, planner/window.py; with --serve-mode replay, 300 s past the last arrival).
#: With neither --time-limit nor --work-limit the served objective's budget is work, not
#: time (commands/served.py: DEFAULT_WORK_UNITS, capped at DEFAULT_WALL_CAP_S)
DEFAULT_TIME_LIMIT_S = {"served": DEFAULT_WALL_CAP_S, "flow": 60.0}
DEFAULT_SERVE_DURATION_S: dict[str, float | None] = {"served": None, "flow": 1200.0}


def add_input_args(p: argparse.ArgumentParser, *, example: bool = False) -> None:
    """--cluster/--model/--model-name and the cost flags (commands/costs.py), shared with
    `evaluate`."""
    p.add_argument("--cluster", help="cluster YAML (format: docs/formats.md)")
    p.add_argument("--model", help="model config.json, or a directory holding one")
    p.add_argument("--model-name", help="model name used to look up profiles "
                   "(default: the model directory's name)")
    add_cost_args(p)
    p.add_argument("--no-partial-inference", action="store_true",
                   help="edges only where one node's range ends exactly where the next starts")
    if example:
        p.add_argument("--example", action="store_true",
                       help="use the bundled example: 6 mixed machines, LLaMA-2-70B, Helix's "
                       "measured profiles (overrides --cluster/--model/--profiles)")


def bundled_models() -> list[Path]:
    """Model configs shipped with helixserve (data/example/*/config.json)."""
    return sorted(d for d in EXAMPLE_DIR.iterdir() if (d / "config.json").is_file())


def check_model_path(model: str) -> None:
    """--model names a directory (or a file) that does not exist: point to the bundled
    example models, by name when it is one of them (`--model llama-2-70b`)."""
    from helixserve.errors import UserError

    if Path(model).exists():
        return
    bundled = bundled_models()
    match = next((d for d in bundled if d.name == Path(model).name.lower()), None)
    if match is not None:
        raise UserError(f"--model: no directory {model!r} here; helixserve bundles the config "
                        f"of {match.name}: --model {match} (or --example for the whole example)")
    known = ", ".join(str(d) for d in bundled) or "none"
    raise UserError(f"--model: no such directory {model!r}; give a Hugging Face model directory "
                    f"(config.json is enough to plan); bundled: {known}")


def load_inputs(args: argparse.Namespace, engine: str | None = None) -> tuple[Any, Any, Any]:
    """(cluster, model, cost model) from the parsed flags; UserError on bad input. `engine`:
    without --gpu-reserve-gb, the memory that engine model keeps outside weights and KV
    (simulator/presets.py) instead of the cost model's default."""
    from helixserve.commands.costs import build_cost_model, read_cost_flags
    from helixserve.errors import UserError
    from helixserve.spec import load_cluster, load_model

    if getattr(args, "example", False):
        args.cluster = str(EXAMPLE_DIR / "mixed-6.yaml")
        args.model = str(EXAMPLE_DIR / "llama-2-70b")
        args.profiles = str(EXAMPLE_DIR / "helix-measured.csv")
    if not args.cluster or not args.model:
        raise UserError("--cluster and --model are required"
                        + (" (or --example)" if hasattr(args, "example") else ""))
    flags = read_cost_flags(args)  # bad flags and cost files fail before the inputs are read
    cluster = load_cluster(args.cluster, catalog=flags.catalog)
    check_model_path(args.model)
    model = load_model(args.model, name=args.model_name)
    reserve = None
    if engine is not None and flags.reserved_gb_per_gpu is None:
        from helixserve.simulator.presets import engine_gpu_reserve_gb

        reserve = engine_gpu_reserve_gb(engine)
    return cluster, model, build_cost_model(flags, model, cluster, reserved_gb_per_gpu=reserve)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="place layer ranges on the machines of a cluster (max-flow MILP)",
        description="Choose the contiguous range of layers each machine holds so that the "
        "cluster's token throughput (max flow from the coordinator through the machines) is "
        "as high as possible. Prints a per-node table; writes the placement JSON with --out. "
        "File formats (cluster YAML, profiles CSV, placement JSON, trace CSV): docs/formats.md; "
        "example inputs: examples/ of the repository.",
    )
    add_input_args(p, example=True)
    p.add_argument("--planner", default="milp",
                   help="milp (default), petals, swarm, separate or uniform")
    p.add_argument("--objective", default="served", choices=OBJECTIVES,
                   help="what milp maximises: served (default) the decode tokens/s a "
                   "placement serves in the cluster simulator (--serve-engine, the trace of "
                   "--serve-trace or the --workload mix, --serve-duration), over the max-flow "
                   "portfolio's candidates and their neighbours; flow the max flow alone (the "
                   "planner before issue 34; its bound is printed either way). "
                   "docs/planner.md, 'The served objective'")
    p.add_argument("--time-limit", type=finite_float, default=None, metavar="SECONDS",
                   help="wall-clock budget of the milp planner (default with the served "
                   f"objective: none, a work budget of {DEFAULT_WORK_UNITS:.0f} units capped at "
                   f"{DEFAULT_WALL_CAP_S:.0f} s, see --work-limit; {FLOW_SHARE * 100:.0f}%% of "
                   "it for the max-flow portfolio; 60 with --objective flow). With the served "
                   "objective and --work-limit: a wall-clock cap behind the work budget")
    p.add_argument("--work-limit", type=finite_float, default=None, metavar="UNITS",
                   help="plan to a budget of work instead of time: every search stops after "
                   "this many units of counted work (a unit is about one second of one core of "
                   "the reference 2-core VM; docs/planner.md), so the same command "
                   "gives the same placement on any machine, under any load and with any "
                   "--jobs (which then only runs the seeds side by side). Overrides "
                   "--time-limit, which with the served objective stays as a wall-clock cap. "
                   f"Default with the served objective: {DEFAULT_WORK_UNITS:.0f}, capped at "
                   f"{DEFAULT_WALL_CAP_S:.0f} s (the output says when the cap stopped it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the local search")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="processes for milp's annealing searches, each with its own seed, "
                   "the best kept, and for the served objective's and --serve-trace's "
                   "simulations (default: the cores this process may use, at most 8; 1: one "
                   "process, the serial planner)")
    p.add_argument("--from", dest="from_placement", metavar="CURRENT.json",
                   help="the placement the cluster runs now: also build one that keeps every "
                   "machine of it that is still in the cluster and still fits as it is, "
                   "placing only new machines and the layers of lost ones (and, if that is "
                   "not within --max-loss of the full re-plan, moving a few neighbours; "
                   "30%% of the time), and keep it unless the full re-plan is more than "
                   "--max-loss better; prints which machines change range (each one restarts and "
                   "reloads its layers)")
    p.add_argument("--max-loss", type=finite_float, default=0.05, metavar="FRACTION",
                   help="with --from: throughput the incremental placement may lose against "
                   "the full re-plan and still be kept (default 0.05; 0: only if as good)")
    p.add_argument("--out", help="write the placement JSON here")
    p.add_argument("--plot", help="write a PNG of the flow graph here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--serve-trace", metavar="TRACE.csv",
                   help="the trace the served objective simulates (default: requests drawn "
                   "from the --workload mix); with --objective flow, then pick the placement "
                   "by simulated serving: the planned one, the cluster's best stacked tilings "
                   "and, across regions, regional pipelines (docs/simulator.md, "
                   "'Serving-aware selection')")
    p.add_argument("--serve-engine", default="vllm", choices=("vllm", "reserve"),
                   help="engine model of the served objective's and --serve-trace's "
                   "simulations (default vllm: on-demand KV, chunked prefill of 512 tokens; "
                   "see `helixserve simulate --engine`). The served objective plans with "
                   "its memory (vllm: 4.5 GB per GPU outside weights and KV) unless "
                   "--gpu-reserve-gb is given; with --objective flow the memory is the "
                   "plan's: pass --gpu-reserve-gb 4.5 to plan and select with vLLM's")
    p.add_argument("--serve-also", default=DEFAULT_ALSO,
                   choices=ALSO_CHOICES,
                   help="with the served objective: a second engine model every placement is "
                   "also simulated with (default helix-prototype, the Helix authors' "
                   "prototype: admission on prompt + 240 promised tokens, whole prompts, a "
                   "per-layer cost; docs/calibration.md), with the plan's memory; the search "
                   "then maximises the smaller of the two scores, each over the max-flow "
                   "answer's, and simulates every other placement with it first (it is the "
                   "cheaper one); docs/planner.md, 'Two engine models'. none: --serve-engine "
                   "alone")
    p.add_argument("--serve-combine", default="min", choices=("min", "geomean"),
                   help="with --serve-also: how the two models' ratios to the max-flow "
                   "answer make one value: min (default) the smaller; geomean their "
                   "geometric mean (an experiment; its screen assumes a candidate gains at "
                   "most 5%% over the current placement in --serve-engine)")
    p.add_argument("--serve-reference", default=DEFAULT_REFERENCE, choices=REFERENCES,
                   help="with --serve-also: what each model's score is taken over: max-flow "
                   "the max-flow answer's score in that model; best the best score any start "
                   "reached in that model (so the best in each model is 1.0 in each); "
                   f"default {DEFAULT_REFERENCE}; docs/planner.md, 'Two engine models'")
    p.add_argument("--serve-duration", type=finite_float, default=None, metavar="SECONDS",
                   help="simulated seconds per candidate, the first quarter (at most 300 s) "
                   "not counted (default with the served objective: each placement's own "
                   "window, its cold start estimated from its links, KV and prefill, then "
                   "whole request lifetimes, docs/planner.md 'The scoring window'; 1200 for "
                   "--objective flow --serve-trace); with --serve-mode replay, the horizon "
                   "after the trace's last arrival (default 300)")
    p.add_argument("--serve-mode", default="saturate", choices=("saturate", "replay"),
                   help="how --serve-trace scores a candidate: saturate (default) keeps the "
                   "queue full (the cluster's capacity under the trace's mix); replay serves "
                   "the trace as recorded, arrivals included, and scores decode tokens over "
                   "its makespan: for a light or bursty load, where a route's per-token "
                   "latency bounds throughput; the swarm, separate and petals placements "
                   "then compete too")
    p.add_argument("--serve-concurrency", type=int, default=None, metavar="N",
                   help="the load the placement is planned for: N requests in flight (a closed "
                   "loop: each finished request replaced by the trace's next), as a user "
                   "whose cluster sees about N requests at once states it; default: as many "
                   "as each placement's KV admits (saturated, Helix's offline setting). "
                   "Placements rank differently at the two loads (docs/planner.md, 'Planning "
                   "for a stated load')")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from helixserve.commands.args import Output, check_image, check_output, write_outputs
    from helixserve.errors import UserError
    from helixserve.planner import evaluate, load_placement, plan
    from helixserve.planner.report import format_table, node_rows, plot_placement

    served = args.objective == "served" and args.planner == "milp" and not args.from_placement
    objective = "served" if served else "flow"
    # the served objective's budget: work (the same placement anywhere) with a wall-clock
    # cap as a safety net; --time-limit alone keeps a wall-clock budget
    args.wall_cap = None
    args.default_budget = False
    if served and args.work_limit is None and args.time_limit is None:
        args.work_limit, args.wall_cap = DEFAULT_WORK_UNITS, DEFAULT_WALL_CAP_S
        args.default_budget = True
    elif served and args.work_limit is not None:
        args.wall_cap = args.time_limit
    if args.time_limit is None:
        args.time_limit = DEFAULT_TIME_LIMIT_S[objective]
    if args.serve_duration is None:
        args.serve_duration = DEFAULT_SERVE_DURATION_S[objective]
    if args.time_limit <= 0:
        raise UserError(f"--time-limit: bad value {args.time_limit!r}; must be > 0")
    if args.work_limit is not None and args.work_limit <= 0:
        raise UserError(f"--work-limit: bad value {args.work_limit!r}; must be > 0")
    if args.serve_duration is None and (objective == "flow" or args.serve_mode == "replay"):
        args.serve_duration = REPLAY_HORIZON_S
    if args.serve_duration is not None and args.serve_duration <= 0:
        raise UserError(f"--serve-duration: bad value {args.serve_duration!r}; must be > 0")
    if args.serve_concurrency is not None:
        from helixserve.simulator.selection import check_stated_load

        check_stated_load(args.serve_concurrency, args.serve_mode)
        if not served and not args.serve_trace:
            raise UserError(f"--serve-concurrency: {args.serve_concurrency} needs a served "
                            "score: the served objective (the default with --planner milp) "
                            "or --serve-trace")
    if not 0.0 <= args.max_loss <= 1.0:
        raise UserError(f"--max-loss: bad value {args.max_loss}; must be a fraction in [0, 1]")
    # before the work: a path that cannot be written fails now, not after the solve
    out_path = check_output("--out", args.out) if args.out else None
    plot_path = check_image("--plot", args.plot) if args.plot else None
    requests = _serve_requests(args.serve_trace) if args.serve_trace else None
    # the served objective simulates the engine that will serve: plan with its memory
    cluster, model, cost = load_inputs(args, engine=args.serve_engine if served else None)
    started = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    partial = not args.no_partial_inference
    current = None
    served_line = None
    if args.from_placement:
        current = load_placement(args.from_placement)
        placement = _replan(args, cluster, model, cost, current, progress, partial)
    elif served:
        if requests is None:
            requests, _ = drawn_requests(args.workload, cost.workload, args.seed)
        placement, served_line = _plan_served(args, cluster, model, cost, requests, progress,
                                              partial, started)
    else:
        placement = plan(args.planner, cluster, model, cost, time_limit_s=args.time_limit,
                         seed=args.seed, progress=progress, partial_inference=partial,
                         jobs=args.jobs, work_limit=args.work_limit)
    if requests is not None and not served:
        placement = _select_by_serving(args, cluster, model, cost, placement, requests, progress)
        # the chosen candidate came out of the planning and the selection together
        placement.solve_time_s = time.perf_counter() - started
    if requests is not None or served:
        placement.served_concurrency = args.serve_concurrency
    result = evaluate(cluster, model, cost, placement, partial_inference=partial)
    held = {r.name for r in placement.nodes}
    unused = [n.name for n in cluster.nodes if n.name not in held]
    print(f"cluster {cluster.name}: {len(cluster.nodes)} nodes; model {model.name}: "
          f"{model.num_layers} layers; planner {placement.planner}")
    print(format_table(node_rows(cluster, cost, placement, result.flows), unused))
    if served_line is not None:
        print(served_line)
    print(summary_line(result.throughput_tokens_per_s, placement.upper_bound_tokens_per_s,
                       placement.solve_time_s, cost.workload))
    if current is not None:
        from helixserve.planner.incremental import changes

        print(f"changes against {args.from_placement}: "
              f"{changes(current, placement).summary()}")
    outputs = []
    if out_path is not None:
        outputs.append(Output("--out", out_path, placement.save))
    if plot_path is not None:
        outputs.append(Output("--plot", plot_path, lambda path: plot_placement(
            cluster, placement, result.flows, path)))
    for path in write_outputs(outputs):
        print(f"wrote {path}")
    return 0


def throughput_text(throughput: float, mix: Any) -> str:
    """'2,344.3 decode tokens/s = 10.09 requests/s of conversation (prompt 763, ...)', or
    without a workload '7,211.5 decode tokens/s (decode-only flow: prompts not counted)'."""
    if mix is None:
        return f"{throughput:,.1f} decode tokens/s (decode-only flow: prompts not counted)"
    return (f"{throughput:,.1f} decode tokens/s = {mix.requests_per_s(throughput):,.2f} "
            f"requests/s of {mix.describe()}")


def summary_line(throughput: float, bound: float | None, solve_time_s: float | None,
                 mix: Any = None) -> str:
    """Throughput (decode tokens/s and, with a workload, requests/s), the proven upper bound
    and the gap between them. The gap says how far the optimum can be above this placement,
    at most; a large gap may be a weak bound as much as a weak placement (docs/planner.md,
    "Bounds and gaps"). Both are max flows: the bound is on the max flow of every placement
    within the weight cap, not on what a placement serves (docs/planner.md, "What the bound
    bounds")."""
    line = f"throughput (max flow) {throughput_text(throughput, mix)}"
    if bound:
        gap = 1 - throughput / bound
        line += (f"; proven upper bound on the max flow {bound:,.1f} (gap {gap:.1%}; "
                 f"not a bound on served throughput)")
    else:
        line += "; no proven upper bound for this placement"
    return line + f"; solved in {solve_time_s or 0:.1f}s"


def machines(n: int) -> str:
    """'1 machine', '3 machines'."""
    return f"{n} machine{'' if n == 1 else 's'}"


def _replan(args: argparse.Namespace, cluster: Any, model: Any, cost: Any, current: Any,
            progress: Any, partial: bool) -> Any:
    """--from: the incremental placement or the full re-plan (planner/incremental.py)."""
    from helixserve.planner.incremental import changes, check_current, replan

    check_current(current, model.num_layers, args.from_placement)  # names the file
    out = replan(cluster, model, cost, current, args.planner, args.time_limit, args.seed,
                 progress, partial, args.jobs, args.max_loss, work_limit=args.work_limit)
    inc, full = out.incremental, out.full
    full_value = full.throughput_tokens_per_s or 0.0
    share = inc.throughput_tokens_per_s / full_value if full_value else 1.0
    names = ", ".join
    print(f"from {args.from_placement}: {machines(len(inc.kept))} kept as they were; "
          f"gone: {names(inc.gone) or '-'}; new: {names(inc.new) or '-'}; "
          f"no longer fit: {names(inc.freed) or '-'}")
    print(f"incremental {inc.throughput_tokens_per_s:,.1f} tokens/s, moving "
          f"{machines(changes(current, out.incremental_placement).moves)}; full re-plan "
          f"{full_value:,.1f} tokens/s, moving {changes(current, full).moves} "
          f"(the incremental one has {share:.1%} of it); kept: "
          f"{'incremental' if out.kept_incremental else 'full re-plan'} "
          f"(--max-loss {args.max_loss:g})")
    return out.placement


def _serve_requests(path: str) -> list[Any]:
    from helixserve.errors import UserError
    from helixserve.simulator.workload import load_azure_trace, prepare_trace

    requests = prepare_trace(load_azure_trace(path))
    if not requests:
        raise UserError(f"--serve-trace: {path}: no requests")
    return requests


def _select_by_serving(args: argparse.Namespace, cluster: Any, model: Any, cost: Any,
                       planned: Any, requests: list[Any], progress: Any) -> Any:
    """The planned placement, a stacked tiling or regional pipelines (each, across regions,
    also routed within regions), whichever serves `requests` best."""
    from helixserve.planner.report import format_selection
    from helixserve.simulator.presets import engine_config
    from helixserve.simulator.selection import SelectionConfig, load_text, select_placement

    config = SelectionConfig.from_engine(
        engine_config(args.serve_engine),
        duration_s=args.serve_duration,
        warmup_s=min(300.0, args.serve_duration / 4),
        seed=args.seed,
        mode=args.serve_mode,
        concurrency=args.serve_concurrency,
    ).check()
    progress(f"serving selection: simulating the {planned.planner} placement and the "
             f"other candidates, {config.duration_s:.0f} s each")
    chosen, report = select_placement(cluster, model, cost, [planned], requests, config,
                                      name=f"{planned.planner}-serving",
                                      jobs=args.jobs)
    if config.mode == "replay":
        print(f"serving selection ({args.serve_engine} engine, the trace replayed to its "
              f"end, decode tokens over its makespan; * = kept):")
    else:
        load = "" if config.concurrency is None else f", {load_text(config.concurrency)}"
        print(f"serving selection ({args.serve_engine} engine, {config.duration_s:.0f} s "
              f"offline{load}, the first {config.warmup_s:.0f} s not counted; * = kept):")
    print(format_selection(report))
    return chosen


def _plan_served(args: argparse.Namespace, cluster: Any, model: Any, cost: Any,
                 requests: list[Any], progress: Any, partial: bool,
                 started: float) -> tuple[Any, str]:
    """`plan_served` from the flags: the placement and the line that says what it serves."""
    from helixserve.simulator.selection import load_text

    out = plan_served(cluster, model, cost, requests, engine=args.serve_engine,
                      also=None if args.serve_also == "none" else args.serve_also,
                      combine=args.serve_combine, reference=args.serve_reference,
                      duration_s=args.serve_duration, mode=args.serve_mode,
                      concurrency=args.serve_concurrency,
                      time_limit_s=args.time_limit, work_limit=args.work_limit,
                      seed=args.seed, jobs=args.jobs, partial=partial, progress=progress,
                      started=started, wall_cap_s=args.wall_cap)
    config, outcome = out.config, out.outcome
    window = (f"the trace replayed, {config.duration_s:.0f} s past its last arrival"
              if config.mode == "replay" else
              "offline, in its own window: its cold start and first wave not counted, then "
              "whole request lifetimes" if config.window is not None else
              f"{config.duration_s:.0f} s offline, the first {config.warmup_s:.0f} s not "
              f"counted")
    if config.mode != "replay":
        window += f", {load_text(config.concurrency)}"
    first = outcome.starts[0]
    both = out.also is not None and out.also_tokens_per_s is not None
    line = (f"served (simulated, {args.serve_engine} engine, {window}): "
            f"{out.served_tokens_per_s:,.1f} decode tokens/s"
            + (f", {out.also} engine {out.also_tokens_per_s:,.1f}" if both else "")
            + f" from {outcome.best.source}"
            f"{', routed within regions' if out.placement.route_within_regions else ''}; "
            f"the max-flow answer {first.served_tokens_per_s:,.1f}"
            + (f" and {first.also_tokens_per_s or 0.0:,.1f}" if both else "")
            + f"; {outcome.evaluations} placements simulated"
            + (f" ({outcome.also_evaluations} with {out.also}, the screen)" if both else "")
            + f", {out.sim_units:,.0f} work units of simulation")
    line += "\n" + budget_line(args.work_limit, args.time_limit, args.wall_cap,
                                args.default_budget, out.capped, outcome.stopped_by)
    return out.placement, line


def budget_line(work_limit: float | None, time_limit_s: float, wall_cap_s: float | None,
                default: bool, capped: bool, stopped_by: str) -> str:
    """What budget the served objective had and what ended its search."""
    ended = {"stall": "the climb found no gain in 50 steps",
             "no neighbour": "no neighbour left to try"}.get(stopped_by, "")
    if work_limit is None:
        return (f"budget: {time_limit_s:g} s of wall clock (--time-limit); the placement "
                "depends on this machine's speed and load; "
                + (ended or "the time limit stopped it"))
    what = (f"budget: {work_limit:g} work units" + (" (the default)" if default else "")
            + (f", capped at {wall_cap_s:g} s of wall clock" if wall_cap_s is not None else ""))
    if capped:
        return (f"{what}; the wall-clock cap stopped it before the work budget: this "
                f"placement depends on this machine's speed and load (--work-limit "
                f"{work_limit:g} without a cap gives the same placement on any machine)")
    return (f"{what}; {ended or 'the work budget stopped it'}: the same placement on any "
            f"machine (--work-limit {work_limit:g})")
