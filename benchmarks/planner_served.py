"""Plans that serve (issue 34 item 3): milp, the Helix authors' placement and helixserve's
baselines on Helix's clusters, each scored several ways, so that no one scorer flatters a plan.

    python -m benchmarks.planner_served --work-limit 60 --helix-artifact PATH \\
        --json benchmarks/results/planner_served.json

Clusters: helix-single-24 and helix-geo-24 (`examples/clusters/`) and helix-mix-42
(`benchmarks/helix-clusters/`), LLaMA-2-70B with Helix's measured profiles. Placements:

- `milp`: `helixserve plan` with its defaults and `--work-limit` / `--time-limit` (run in
  `--planner-repo`, default this checkout, so another branch's planner can be scored), or
  `DIR/<cluster>-milp.json` with `--placements DIR`;
- `authors`: the Helix authors' Gurobi placement (`benchmarks/helix-placements/`);
- `swarm`, `separate`, `petals`: helixserve's baselines, `helixserve plan --planner P`.

Scorers, each a decode tokens/s:

- `evaluator`: the max flow, as `helixserve evaluate` prints it (the plan's own objective);
- `estimate-vllm`, `estimate-helix-prototype`: the served objective's own estimate, what
  `helixserve evaluate --served` prints and `plan` prints for its pick (its scorer: the
  plan's 4,000 requests drawn from the conversation mix, each placement in its own window,
  the vllm engine's memory); printed with the milp / authors ratio it predicts against the
  simulated one in that model (and the evaluator's);
- `vllm`, `helix-prototype`: `helixserve simulate --offline --engine E` on the Azure
  conversation trace, maxflow routing, each engine's memory; windows as docs/calibration.md
  (600 s with 60 s warmup, and the prototype's 300 s with 60 s), `--vllm-window`,
  `--prototype-window`; the trace from its start, or with `--trace-start F` only its
  requests from that fraction of them on (cycled): another sample of the day's requests;
- `helix-sim`: Helix's own simulator from the public artifact, run as its authors run
  Helix's placement (`benchmarks/helix_sim.py`; needs `--helix-artifact PATH`, else the
  column is skipped with a note);
- `rehearsal` (only with `--rehearse`): `helixserve rehearse` of the placement on the real
  runtime with emulated GPUs (`benchmarks/full_size.py`'s run, offline; expensive).

Printed per cluster: placement x scorer, then per scorer milp / authors and milp / the best
of swarm, separate and petals, and the placement pairs that two scorers rank in opposite
orders (every one, not hidden). `--json OUT` writes it all, with the placements used.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from itertools import combinations
from pathlib import Path
from typing import Any

from benchmarks import full_size, helix_sim
from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import Placement, evaluate, load_placement
from helixserve.simulator.config import closed_loop
from helixserve.simulator.metrics import summarize
from helixserve.simulator.presets import engine_config, engine_gpu_reserve_gb
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import TraceRequest, load_azure_trace, prepare_trace
from helixserve.spec import (
    ClusterSpec,
    ModelSpec,
    ProfileTable,
    load_cluster,
    load_model,
    load_profiles,
)

REPO = full_size.REPO
#: our short name -> (cluster YAML, the authors' placement JSON), shared with the rehearsal
CLUSTERS = full_size.CLUSTERS
PLANS = ["milp", "authors", "swarm", "separate", "petals"]
BASELINES = ["swarm", "separate", "petals"]
SCORERS = ["evaluator", "estimate-vllm", "estimate-helix-prototype", "vllm", "helix-prototype",
           "helix-sim", "rehearsal"]
#: the served objective's own estimate (`helixserve evaluate --served`, what `plan` prints):
#: scorer -> the engine model it estimates, the simulated scorer it predicts
ESTIMATES = {"estimate-vllm": "vllm", "estimate-helix-prototype": "helix-prototype"}
#: --estimate-lengths: where the served estimate's 4,000 requests' lengths come from
ESTIMATE_LENGTHS = {
    "held-out": "plan's draw: the conversation mix from the trace's second half",
    "scored-part": "the same sample of the trace's first half, which the simulator scorers run",
    "exponential": "exponential with the conversation mix's means, plan's draw before 2026-12-06",
}
#: (duration s, warmup s) of each simulated engine, as docs/calibration.md runs them
WINDOWS = {"vllm": (600.0, 60.0), "helix-prototype": (300.0, 60.0)}
#: the scorers that run the trace (`--trace-start`)
SIMULATED = set(WINDOWS)
FORMAT = "helixserve.benchmarks.planner_served/v1"


class Scoring:
    """The model, profiles, trace and clusters every scorer shares."""

    def __init__(self, estimate_lengths: str = "held-out",
                 concurrency: int | None = None, trace_start: float = 0.0) -> None:
        #: ESTIMATE_LENGTHS: the lengths the served estimate draws its requests from
        self.estimate_lengths = estimate_lengths
        #: --serve-concurrency: requests in flight in every simulated scorer (None: saturated)
        self.concurrency = concurrency
        self.model: ModelSpec = load_model(full_size.MODEL)
        self.profiles: ProfileTable = load_profiles(full_size.PROFILES)
        self.trace: list[TraceRequest] = prepare_trace(load_azure_trace(full_size.TRACE))
        #: --trace-start: the simulated scorers run the trace's requests from this fraction
        #: of them on, cycled (0: all, from the start). A cut, not a rotation: the simulator
        #: takes requests in arrival order, so the ones before the cut would come first again
        self.scored_trace = self.trace[int(trace_start * len(self.trace)):]
        self.clusters: dict[str, ClusterSpec] = {}
        #: (cluster, id of the placement) -> engine -> the served estimate's details
        self.estimates: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}

    def cluster(self, key: str) -> ClusterSpec:
        if key not in self.clusters:
            self.clusters[key] = load_cluster(CLUSTERS[key][0])
        return self.clusters[key]

    def evaluator(self, key: str, placement: Placement) -> dict[str, Any]:
        """`helixserve evaluate`: the max flow under the cost model's defaults."""
        cost = CostModel(self.model, self.profiles)
        flow = evaluate(self.cluster(key), self.model, cost, placement)
        return {"decode_tokens_per_s": round(flow.throughput_tokens_per_s, 1)}

    def simulate(self, key: str, placement: Placement, engine: str,
                 window: tuple[float, float]) -> dict[str, Any]:
        """`helixserve simulate --offline --engine ENGINE --duration D --warmup W` with the
        trace: the engine's memory; the file's flows as the router's weights when it has
        them, else the max flow under that memory (as the command does)."""
        cluster = self.cluster(key)
        cost = CostModel(self.model, self.profiles,
                         reserved_gb_per_gpu=engine_gpu_reserve_gb(engine))
        p = copy.deepcopy(placement)
        res = evaluate(cluster, self.model, cost, p)
        if not p.flows:
            p.flows = res.flows
        p.throughput_tokens_per_s = res.throughput_tokens_per_s
        if not p.flows:
            return {"error": "serves 0 tokens/s (no chain of linked nodes holds every layer)"}
        options = engine_config(engine)
        if self.concurrency is not None:
            options.update(closed_loop(self.concurrency))
        config = SimConfig(duration_s=window[0], warmup_s=window[1], offline=True,
                           scheduler="maxflow", seed=0, **options)
        s = summarize(Simulation(cluster, self.model, cost, p, self.scored_trace,
                                 config).run())
        return {"decode_tokens_per_s": round(s["decode_throughput_tokens_per_s"], 1),
                "tpot_mean_s": round(s["tpot_s"]["mean"], 3),
                "in_flight_end": s["requests_in_flight"], "wall_s": round(s["wall_s"], 1)}


    def estimate(self, key: str, placement: Placement, engine: str,
                 reserve_gb: float | None) -> dict[str, Any]:
        """`helixserve evaluate --served` (the served objective's scorer, as `plan` scores
        its picks): `engine` and the other model of the pair simulated on the plan's own
        requests (drawn from the conversation mix, seed 0), each in its own window, with
        `reserve_gb` a GPU (None: the vllm engine's memory, as plan's). Both models in one
        call, kept for the other column."""
        memo = self.estimates.setdefault((key, id(placement)), {})
        if engine not in memo:
            from helixserve.commands.served import served_estimate

            cost = CostModel(self.model, self.profiles, reserved_gb_per_gpu=(
                engine_gpu_reserve_gb("vllm") if reserve_gb is None else reserve_gb))
            started = time.perf_counter()
            try:
                primary, also, _ = served_estimate(
                    self.cluster(key), self.model, cost, placement, self.estimate_requests(),
                    engine="vllm", also="helix-prototype", jobs=1,
                    concurrency=self.concurrency)
            except UserError as exc:
                return {"error": str(exc)}
            wall = round(time.perf_counter() - started, 1)
            for name, value in (("vllm", primary), ("helix-prototype", also)):
                memo[name] = {"decode_tokens_per_s": None if value is None else round(value, 1),
                              "window": "its own (planner/window.py)",
                              "requests": f"4,000 drawn, seed 0: {self.estimate_lengths} "
                                          f"({ESTIMATE_LENGTHS[self.estimate_lengths]})",
                              "wall_s_both": wall}
        return memo[engine]


    def estimate_requests(self) -> list[TraceRequest]:
        """The served estimate's requests: plan's (`held-out`, the conversation mix drawn
        from the trace's second half, planner/lengths.py), or for comparison the same sample
        of the part of the trace the simulator scorers run (`scored-part`, its first half:
        the long windows use fewer requests than it holds), or the draw before 2026-12-06
        (`exponential`, the conversation mix's means)."""
        from helixserve.commands.served import workload_requests
        from helixserve.costmodel.workload import Workload
        from helixserve.planner.lengths import SAMPLE_SIZE, systematic_sample

        if self.estimate_lengths == "scored-part":
            first = self.trace[: len(self.trace) // 2]
            pairs = [(r.prompt_tokens, r.output_tokens) for r in first]
            return workload_requests(None, 0, systematic_sample(pairs, SAMPLE_SIZE))
        if self.estimate_lengths == "exponential":
            conv = Workload.conversation()
            return workload_requests(Workload(conv.prompt_tokens, conv.output_tokens,
                                              "conversation means"), 0)
        return workload_requests(None, 0)


def predictions(case: dict[str, Any]) -> dict[str, Any]:
    """milp / authors as each estimate predicts it (the served estimate in each engine model,
    and the evaluator's max flow) against the simulated ratio in each model, with how far
    apart they are (predicted / simulated - 1)."""
    out: dict[str, Any] = {}
    for scorer, engine in ESTIMATES.items():
        for predictor in (scorer, "evaluator"):
            pred = case["ratios"].get(predictor, {}).get("milp_over_authors")
            sim = case["ratios"].get(engine, {}).get("milp_over_authors")
            if pred is None or sim is None:
                continue
            out[f"{predictor} vs {engine}"] = {"predicted": pred, "simulated": sim,
                                               "off_by": round(pred / sim - 1, 3)}
    return out


def git_describe(repo: Path) -> str:
    """`<short rev>` of a checkout, `+dirty` when its tracked files differ."""
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty.strip() else "")


def plan_placement(key: str, planner: str, args: argparse.Namespace,
                   out: Path) -> dict[str, Any]:
    """`helixserve plan --planner P` (milp with the given budget) in `--planner-repo`."""
    flags = ["--cluster", str(CLUSTERS[key][0]), "--model", str(full_size.MODEL),
             "--profiles", str(full_size.PROFILES), "--planner", planner]
    if args.gpu_reserve_gb is not None:
        flags += ["--gpu-reserve-gb", f"{args.gpu_reserve_gb:g}"]
    if planner == "milp":
        if args.work_limit is not None:
            flags += ["--work-limit", f"{args.work_limit:g}"]
        elif args.time_limit is not None:
            flags += ["--time-limit", f"{args.time_limit:g}"]
        if args.jobs is not None:
            flags += ["--jobs", str(args.jobs)]
    cmd = [sys.executable, "-m", "helixserve", "plan", *flags, "--out", str(out), "--quiet"]
    shown = shlex.join(["helixserve", "plan",
                        *(full_size.rel(Path(f)) if f.startswith("/") else f for f in flags)])
    print(f"planning {key} with {planner}: {shown}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=args.planner_repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"planner_served: plan failed ({proc.returncode}): "
                         f"{proc.stderr.strip()}")
    return {"plan_command": shown, "plan_wall_s": round(time.perf_counter() - t0, 1)}


def placements_for(key: str, args: argparse.Namespace, tmp: Path) -> dict[str, tuple[Placement, dict[str, Any]]]:
    """Every wanted placement of cluster `key`, with where it came from."""
    name = load_cluster(CLUSTERS[key][0]).name
    out: dict[str, tuple[Placement, dict[str, Any]]] = {}
    for plan in args.plans:
        if plan == "authors":
            path = CLUSTERS[key][1]
            out[plan] = (load_placement(path), {"source": full_size.rel(path)})
            continue
        given = args.placements / f"{name}-{plan}.json" if args.placements else None
        if given is not None and not given.exists() and plan == "milp":
            given = args.placements / f"{name}.json"
        if given is not None and given.exists():
            out[plan] = (load_placement(given), {"source": str(given)})
            continue
        path = tmp / f"{name}-{plan}.json"
        meta = plan_placement(key, plan, args, path)
        meta["planner_repo"] = str(args.planner_repo)
        meta["planner_rev"] = git_describe(args.planner_repo)
        out[plan] = (load_placement(path), meta)
    if args.save_placements:
        args.save_placements.mkdir(parents=True, exist_ok=True)
        for plan, (p, _) in out.items():
            if plan != "authors":
                p.save(args.save_placements / f"{name}-{plan}.json")
    return out


def rehearse_args(args: argparse.Namespace) -> argparse.Namespace:
    """benchmarks/full_size.py's options for `--rehearse`: its defaults (offline), with this
    script's window and time scale."""
    load = [] if args.serve_concurrency is None else [
        "--concurrency", str(args.serve_concurrency)]
    return full_size.parser().parse_args(
        ["--duration", f"{args.rehearse_duration:g}", "--warmup", f"{args.rehearse_warmup:g}",
         "--time-scale", f"{args.rehearse_time_scale:g}", *load])


def rehearse(key: str, plan: str, placement: Placement, args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    """`helixserve rehearse --offline` of the placement (benchmarks/full_size.py's run)."""
    path = tmp / f"{key}-{plan}-rehearse.json"
    placement.save(path)
    row = full_size.rehearse(key, path, "offline", rehearse_args(args),
                             tmp / f"{key}-{plan}-report.json")
    s = full_size.summary(row)
    if not s:
        return {"error": f"rehearse failed (rc {row['rc']})"}
    return {"decode_tokens_per_s": round(s["decode_measured"], 1),
            "simulated_decode_tokens_per_s": s["decode_simulated"],
            "failed_requests": s["failed"], "time_scale": args.rehearse_time_scale,
            "host_kept_up": s.get("host_kept_up"),
            "command": row["command"], "wall_s": row["wall_s"]}


def ratios(scores: dict[str, float | None]) -> dict[str, Any]:
    """milp over the authors' placement and over the best baseline, for one scorer."""
    milp, authors = scores.get("milp"), scores.get("authors")
    base = [(scores[b], b) for b in BASELINES if scores.get(b) is not None]
    out: dict[str, Any] = {"milp_over_authors": None, "milp_over_best_baseline": None,
                           "best_baseline": None}
    if milp is not None and authors:
        out["milp_over_authors"] = round(milp / authors, 3)
    if milp is not None and base:
        best, name = max(base)  # type: ignore[type-var]
        out["best_baseline"] = name
        out["milp_over_best_baseline"] = round(milp / best, 3) if best else None
    return out


def rankings(by_scorer: dict[str, dict[str, float | None]]) -> dict[str, list[str]]:
    """Each scorer's placements, best first (unscored ones left out)."""
    return {s: sorted((p for p, v in scores.items() if v is not None),
                      key=lambda p: -scores[p])  # type: ignore[operator]
            for s, scores in by_scorer.items()}


def disagreements(by_scorer: dict[str, dict[str, float | None]],
                  tie: float = 0.0) -> list[dict[str, Any]]:
    """Placement pairs that one scorer ranks a > b and another b > a (beyond `tie`, a
    fraction: x > y (1 + tie) is ahead). Every such pair, with the scorers on each side."""
    plans = sorted({p for scores in by_scorer.values() for p in scores},
                   key=lambda p: PLANS.index(p) if p in PLANS else len(PLANS))
    out = []
    for a, b in combinations(plans, 2):
        ahead: dict[str, list[str]] = {a: [], b: []}
        for scorer, scores in by_scorer.items():
            x, y = scores.get(a), scores.get(b)
            if x is None or y is None:
                continue
            if x > y * (1 + tie):
                ahead[a].append(scorer)
            elif y > x * (1 + tie):
                ahead[b].append(scorer)
        if ahead[a] and ahead[b]:
            out.append({"pair": [a, b], "ahead": ahead,
                        "scores": {s: [by_scorer[s].get(a), by_scorer[s].get(b)]
                                   for s in ahead[a] + ahead[b]}})
    return out


def analyse(case: dict[str, Any], tie: float) -> None:
    """Fill a cluster's ratios, rankings and disagreements from its scores."""
    scores = {s: v for s, v in case["scores"].items() if any(x is not None for x in v.values())}
    case["ratios"] = {s: ratios(v) for s, v in scores.items()}
    case["rankings"] = rankings(scores)
    case["disagreements"] = disagreements(scores, tie)
    case["predictions"] = predictions(case)


def merge(old: dict[str, Any], case: dict[str, Any], ran: list[str]) -> None:
    """Add to `case` (this run's) what `old` (an earlier run's) has that this run did not
    score: every scorer not in `ran` whole (scores, details, why skipped), and for the scorers
    in `ran` the placements not scored now."""
    for plan, meta in old["placements"].items():
        case["placements"].setdefault(plan, meta)
    for scorer, scores in old["scores"].items():
        if scorer not in ran:
            case["scores"][scorer] = scores
            case["details"][scorer] = old["details"].get(scorer, {})
            case["skipped"].pop(scorer, None)
            if scorer in old["skipped"]:
                case["skipped"][scorer] = old["skipped"][scorer]
            continue
        now, details = case["scores"][scorer], case["details"][scorer]
        for plan, value in scores.items():
            if now.get(plan) is None and value is not None or plan not in now:
                now[plan] = value
                details[plan] = old["details"].get(scorer, {}).get(plan, {})
        for key, value in old["details"].get(scorer, {}).items():
            details.setdefault(key, value)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_case(name: str, case: dict[str, Any]) -> None:
    scorers = [s for s in SCORERS if s in case["scores"]
               and any(v is not None for v in case["scores"][s].values())]
    load = case.get("serve_concurrency")
    print(f"\n{name}, llama-2-70b: decode tokens/s" + (
        "" if load is None else f"; {load} requests in flight in the simulated scorers"))
    width = {s: max(16, len(s) + 2) for s in scorers}
    print(f"{'placement':<15}" + "".join(f"{s:>{width[s]}}" for s in scorers))
    for plan in (p for p in PLANS if p in case["placements"]):
        print(f"{plan:<15}" + "".join(f"{fmt(case['scores'][s].get(plan), '.1f'):>{width[s]}}"
                                     for s in scorers))
    for label, key in (("milp/authors", "milp_over_authors"),
                       ("milp/best base", "milp_over_best_baseline")):
        cells = []
        for s in scorers:
            r = case["ratios"][s]
            cell = fmt(r[key], ".2f")
            if key == "milp_over_best_baseline" and r["best_baseline"]:
                cell += f" ({r['best_baseline']})"
            cells.append(f"{cell:>{width[s]}}")
        print(f"{label:<15}" + "".join(cells))
    for label, p in case.get("predictions", {}).items():
        print(f"  milp/authors predicted by {label.replace(' vs ', ', simulated in ')}: "
              f"{p['predicted']:.2f} against {p['simulated']:.2f} ({p['off_by']:+.0%})")
    for s, why in case["skipped"].items():
        print(f"  {s}: {why}")
    if not case["disagreements"]:
        print("  rankings agree across the scorers")
    for d in case["disagreements"]:
        a, b = d["pair"]
        print(f"  DISAGREE {a} vs {b}: {a} ahead in {', '.join(d['ahead'][a])}; "
              f"{b} ahead in {', '.join(d['ahead'][b])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.planner_served",
        description="milp vs the Helix authors' placement vs swarm, separate and petals on "
        "Helix's clusters, scored by our evaluator, our simulator (vllm, helix-prototype), "
        "Helix's own simulator and (--rehearse) the real runtime")
    ap.add_argument("--clusters", nargs="+", choices=list(CLUSTERS), default=list(CLUSTERS))
    ap.add_argument("--plans", nargs="+", choices=PLANS, default=PLANS,
                    help="which placements (default: all)")
    ap.add_argument("--scorers", nargs="+", choices=SCORERS[:-1], default=SCORERS[:-1],
                    help="which scorers (default: all but the rehearsal, see --rehearse)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--work-limit", type=float, default=None, metavar="UNITS",
                        help="helixserve plan --work-limit for milp (the same placement on "
                        "any machine)")
    budget.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="helixserve plan --time-limit for milp (default: neither "
                        "flag, plan's default budget: 600 work units capped at 600 s)")
    ap.add_argument("--jobs", type=int, default=None, help="helixserve plan --jobs for milp")
    ap.add_argument("--gpu-reserve-gb", type=float, default=None, metavar="GB",
                    help="helixserve plan --gpu-reserve-gb for every planned placement "
                    "(default: plan's, 1 GiB; 4.5 is the memory the vllm engine model and the "
                    "rehearsal serve with)")
    ap.add_argument("--planner-repo", type=Path, default=REPO, metavar="DIR",
                    help="checkout whose `helixserve plan` plans (default: this one)")
    ap.add_argument("--placements", type=Path, default=None, metavar="DIR",
                    help="read DIR/<cluster>-<plan>.json (milp also DIR/<cluster>.json) "
                    "instead of planning, where present")
    ap.add_argument("--save-placements", type=Path, default=None, metavar="DIR",
                    help="write the placements used to DIR/<cluster>-<plan>.json")
    for engine, (duration, warmup) in WINDOWS.items():
        ap.add_argument(f"--{engine}-window", type=float, nargs=2, default=[duration, warmup],
                        metavar=("DURATION", "WARMUP"),
                        help=f"simulated seconds and warmup of the {engine} scorer "
                        f"(default {duration:g} {warmup:g})")
    ap.add_argument("--estimate-lengths", choices=ESTIMATE_LENGTHS, default="held-out",
                    help="the served estimate's requests: " + "; ".join(
                        f"{k}: {v}" for k, v in ESTIMATE_LENGTHS.items()))
    ap.add_argument("--helix-artifact", type=Path, default=None, metavar="PATH",
                    help="a local checkout of Thesys-lab/Helix-ASPLOS25 (benchmarks/helix_sim.py "
                    "says how to get it); without it the helix-sim column is skipped")
    ap.add_argument("--helix-sim-window", type=float, nargs=2, default=None,
                    metavar=("DURATION", "WARMUP"),
                    help="simulated seconds and warmup of Helix's simulator (default: the "
                    "authors' 660 60, their own function; another window runs its steps "
                    "with that window, benchmarks/helix_sim.py)")
    ap.add_argument("--helix-python", default=sys.executable, metavar="PY",
                    help="interpreter with Helix's requirements (gurobipy, networkx, matplotlib)")
    ap.add_argument("--helix-no-partial-inference", action="store_true",
                    help="Helix's simulator links only exact hand-offs (as the authors "
                    "generated their own files)")
    ap.add_argument("--helix-published", action="store_true",
                    help="also run the authors' placement with their own published simulator "
                    "cluster file (the number their artifact gives; details only)")
    ap.add_argument("--serve-concurrency", type=int, default=None, metavar="N",
                    help="the load of every simulated scorer: N requests in flight, a closed "
                    "loop (estimate-*: evaluate --served --serve-concurrency N; vllm, "
                    "helix-prototype: simulate --offline --concurrency N; the rehearsal: "
                    "--concurrency N); default: saturated (the rehearsal: what the KV holds, "
                    "at most 256). The evaluator's max flow and Helix's simulator (its own "
                    "feeder) have no such load")
    ap.add_argument("--trace-start", type=float, default=0.0, metavar="FRACTION",
                    help="the vllm and helix-prototype scorers run the trace's requests from "
                    "this fraction of them on, only those, cycled (default 0: all). The "
                    "trace's requests change over the day (the first half's outputs are "
                    "longer), so a ratio that holds on one part may not on another; other "
                    "starts say how much")
    ap.add_argument("--rehearse", action="store_true",
                    help="also score each placement with helixserve rehearse --offline "
                    "(benchmarks/full_size.py; minutes a placement)")
    ap.add_argument("--rehearse-duration", type=float, default=40.0)
    ap.add_argument("--rehearse-warmup", type=float, default=10.0)
    ap.add_argument("--rehearse-time-scale", type=float, default=4.0)
    ap.add_argument("--tie", type=float, default=0.0, metavar="FRACTION",
                    help="scores within this fraction count as a tie in the disagreements "
                    "(default 0: every opposite order is reported)")
    ap.add_argument("--label", default=None,
                    help="which planner produced milp, kept in the JSON (default: the planner "
                    "repo's path and revision)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    ap.add_argument("--merge", action="store_true",
                    help="keep OUT's scores of the (cluster, scorer, placement) not run now "
                    "(so the columns can be run one at a time) and replace those run now")
    ap.add_argument("--merge-from", type=Path, nargs="+", default=[], metavar="JSON",
                    help="merge these earlier outputs too, in order (runs of columns side by "
                    "side, each with its own --json)")
    args = ap.parse_args(argv)
    for flag, window in (("--vllm-window", args.vllm_window),
                         ("--helix-prototype-window", args.helix_prototype_window),
                         ("--helix-sim-window", args.helix_sim_window)):
        if window is not None and (window[0] <= 0 or not 0 <= window[1] < window[0]):
            ap.error(f"{flag}: bad value {window[0]:g} {window[1]:g}; need DURATION > 0 and "
                     "0 <= WARMUP < DURATION")
    if args.serve_concurrency is not None and args.serve_concurrency < 1:
        ap.error(f"--serve-concurrency: bad value {args.serve_concurrency}; need an integer >= 1")
    if not 0.0 <= args.trace_start < 1.0:
        ap.error(f"--trace-start: bad value {args.trace_start:g}; need 0 <= FRACTION < 1")
    if args.placements is not None and not args.placements.is_dir():
        ap.error(f"--placements: {args.placements} is not a directory")
    args.planner_repo = args.planner_repo.resolve()
    scorers = list(args.scorers) + (["rehearsal"] if args.rehearse else [])
    helix_window = None  # (warmup, counted) seconds; None: the authors'
    if args.helix_sim_window:
        helix_window = (args.helix_sim_window[1], args.helix_sim_window[0] - args.helix_sim_window[1])
    notes: list[str] = []
    helix_missing = None
    if "helix-sim" in scorers:
        helix_missing = helix_sim.missing_artifact(args.helix_artifact)
        if helix_missing:
            notes.append(f"helix-sim skipped: {helix_missing} (benchmarks/helix_sim.py says "
                         "how to get the artifact)")

    command = shlex.join(["python", "-m", "benchmarks.planner_served",
                          *(sys.argv[1:] if argv is None else argv)])
    report: dict[str, Any] = {
        "format": FORMAT, "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                    "loadavg_1m_start": round(os.getloadavg()[0], 2),
                    "python": platform.python_version()},
        "planner": {"label": args.label or f"{args.planner_repo} @ "
                    f"{git_describe(args.planner_repo)}",
                    "repo": str(args.planner_repo), "rev": git_describe(args.planner_repo),
                    "work_limit": args.work_limit, "time_limit_s": args.time_limit,
                    "gpu_reserve_gb": args.gpu_reserve_gb},
        "scorers": scorers,
        "serve_concurrency": args.serve_concurrency,
        "trace_start": args.trace_start,
        "windows_s": {"vllm": args.vllm_window, "helix-prototype": args.helix_prototype_window,
                      "helix-sim": args.helix_sim_window or [
                          helix_sim.WINDOW["warmup_s"] + helix_sim.WINDOW["duration_s"],
                          helix_sim.WINDOW["warmup_s"]]},
        "notes": notes, "clusters": {},
    }
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    priors: list[dict[str, Any]] = []
    if args.merge and args.json and args.json.exists():
        priors.append(json.loads(args.json.read_text()))
    priors += [json.loads(path.read_text()) for path in args.merge_from]
    for old in priors:  # the evaluator and Helix's simulator have no load: any run merges
        loaded = set(old.get("scorers", [])) - {"evaluator", "helix-sim"}
        if loaded and old.get("serve_concurrency") != args.serve_concurrency:
            ap.error(f"--merge-from: {old.get('command')!r} ran --serve-concurrency "
                     f"{old.get('serve_concurrency')}, this run {args.serve_concurrency}; "
                     "scores at two loads are not one table")
        if loaded & SIMULATED and old.get("trace_start", 0.0) != args.trace_start:
            ap.error(f"--merge-from: {old.get('command')!r} ran --trace-start "
                     f"{old.get('trace_start', 0.0):g}, this run {args.trace_start:g}; scores "
                     "on two parts of the trace are not one table")
    if priors:
        report["merged_commands"] = [c for old in priors
                                     for c in old.get("merged_commands", [old.get("command")])]
    started = time.perf_counter()
    scoring = Scoring(args.estimate_lengths, args.serve_concurrency, args.trace_start)
    with tempfile.TemporaryDirectory(prefix="planner-served-") as tmp_name:
        tmp = Path(tmp_name)
        for key in args.clusters:
            name = scoring.cluster(key).name
            try:
                plans = placements_for(key, args, tmp)
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            case: dict[str, Any] = {
                "placements": {p: {**meta, "nodes": placement.to_dict()["nodes"]}
                               for p, (placement, meta) in plans.items()},
                "scores": {s: {} for s in scorers}, "details": {s: {} for s in scorers},
                "skipped": {}, "serve_concurrency": args.serve_concurrency,
            }
            for scorer in scorers:
                if scorer == "helix-sim" and helix_missing:
                    case["skipped"][scorer] = helix_missing
                    case["scores"][scorer] = {p: None for p in plans}
                    continue
                for plan, (placement, _) in plans.items():
                    print(f"scoring {name} {plan} with {scorer}", file=sys.stderr, flush=True)
                    if scorer == "evaluator":
                        out = scoring.evaluator(key, placement)
                    elif scorer in ESTIMATES:
                        out = scoring.estimate(key, placement, ESTIMATES[scorer],
                                               args.gpu_reserve_gb)
                    elif scorer in WINDOWS:
                        window = getattr(args, f"{scorer.replace('-', '_')}_window")
                        out = scoring.simulate(key, placement, scorer, tuple(window))
                    elif scorer == "helix-sim":
                        out = helix_sim.score(args.helix_artifact, name, placement,
                                              python=args.helix_python,
                                              partial_inference=not args.helix_no_partial_inference,
                                              window=helix_window)
                    else:
                        out = rehearse(key, plan, placement, args, tmp)
                    case["scores"][scorer][plan] = out.get("decode_tokens_per_s")
                    case["details"][scorer][plan] = out
                    if "error" in out:
                        print(f"  {scorer} {plan}: {out['error']}", file=sys.stderr)
                if scorer == "helix-sim" and "authors" in plans and args.helix_published:
                    # the authors' own files (exact hand-offs), the number their artifact gives
                    case["details"][scorer]["authors_published_files"] = helix_sim.score(
                        args.helix_artifact, name, None, python=args.helix_python,
                        window=helix_window)
            ran = [s for s in scorers if s not in case["skipped"]]
            for old in priors:
                if name in old["clusters"]:
                    merge(old["clusters"][name], case, ran)
                    ran += [s for s in old["clusters"][name]["scores"]
                            if s not in ran and s not in old["clusters"][name]["skipped"]]
            analyse(case, args.tie)
            report["clusters"][name] = case
            print_case(name, case)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1) + "\n")
    for old in priors:
        for name, old_case in old["clusters"].items():
            if name not in report["clusters"]:
                report["clusters"][name] = old_case
                print_case(name, old_case)
    # Helix's simulator's window as each cell ran (merged runs may differ): [warmup, counted]
    ran_windows = {name: sorted({tuple(d["window_s"]) for d in c["details"].get("helix-sim", {})
                                 .values() if isinstance(d, dict) and "window_s" in d})
                   for name, c in report["clusters"].items()}
    if any(ran_windows.values()):
        report["helix_sim_windows_warmup_counted_s"] = {n: [list(w) for w in ws]
                                                        for n, ws in ran_windows.items() if ws}
    report["scorers"] = [s for s in SCORERS
                         if any(s in c["scores"] for c in report["clusters"].values())]
    report["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    for note in notes:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
