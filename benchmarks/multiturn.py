"""Multi-turn chat, shared system prompt: prefix caching off vs on, plain vs cache-aware routes.

Issue 30's benchmark. Conversations share one system prompt (1,000 tokens by default,
generated from a seed) and grow their history turn by turn (each request re-sends every
earlier message and the assistant's actual replies); conversations run concurrently, the turns
of one conversation one after another (helixserve/bench/conversations.py, multiturn.py), each
after the user's think time with `--think-time-s MEAN` (exponential per turn, seeded). The
client is the `openai` package, streaming, so TTFT is what a chat client sees.

Setups, each started as a user starts it, measured with the same conversations, and stopped
before the next (one run, side by side):
- `off`:   `helixserve demo --no-prefix-caching`
- `plain`: `helixserve demo --no-cache-aware-routing` (caching on, the plain router's routes)
- `aware`: `helixserve demo` (caching on, cache-aware routes: the default)
- `vllm`:  one vLLM OpenAI server on the same weights with automatic prefix caching
  (`--enable-prefix-caching`), as benchmarks/serving_vllm.py starts it; only when this python
  has vLLM (`~/.cache/helixserve/ci-venv-vllm/bin/python -m benchmarks.multiturn`), else
  skipped with a note.
A demo without a setup's flag (a build before prefix caching) gets the row "not available in
this build"; `off` then runs the plain demo, which is caching off, and says so.
`--url [NAME=]URL` measures servers already running instead (e.g. an emulated cluster started
with and without the flags: `--url off=http://127.0.0.1:8001/v1 --url aware=...`).

`--emulated-cluster CLUSTER.yaml --placement P.json --profiles P.csv --model DIR` runs the
setups `off`, `plain`, `aware` on an EMULATED cluster instead of the demo: per setup,
`helixserve rehearse`'s own processes (helixserve/rehearse/cluster.py: one emulated worker
per placed node, no weights, GPU times from the profiles; the link proxy; `helixserve
serve`) are started with the setup's flags (`off`: workers and serve `--no-prefix-caching`;
`plain`: serve `--no-cache-aware-routing`), the same conversations are run through its API,
and it is stopped. Every row and the JSON say EMULATED; `vllm` has no emulated counterpart.

    python -m benchmarks.multiturn --json benchmarks/results/multiturn.json

Per setup: TTFT p50/p90 (and p50 per turn), output tok/s and requests/s, and the prefix-cache
hit rate from the responses (`usage.prompt_tokens_details.cached_tokens` / `prompt_tokens`)
and from /metrics (`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, the
run's difference). Targets (issue 30), printed as pass/fail: aware vs off TTFT p50 >= 3x lower
and output throughput >= 1.5x higher; aware's hit rate >= 1.5x plain's. Aware and off against
vLLM: reported.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serving_vllm import stop, wait_ready
from helixserve.bench.conversations import ConversationConfig, make_conversations, parse_turns
from helixserve.bench.multiturn import (
    CacheCounters,
    ChatConfig,
    MultiTurnSummary,
    run_conversations,
    summarize,
)
from helixserve.errors import UserError
from helixserve.local.launch import free_port

SETUPS = ("off", "plain", "aware", "vllm")
DESCRIPTIONS = {
    "off": "demo, prefix caching off",
    "plain": "demo, caching on, plain routes",
    "aware": "demo, caching on, cache-aware routes",
    "vllm": "one vLLM-CPU server, automatic prefix caching",
    "url": "a running server",
}
EMULATED_DESCRIPTIONS = {
    "off": "EMULATED cluster, prefix caching off",
    "plain": "EMULATED cluster, caching on, plain routes",
    "aware": "EMULATED cluster, caching on, cache-aware routes",
    "vllm": "one vLLM-CPU server (no emulated counterpart)",
}
NO_CACHING = "--no-prefix-caching"
NO_AWARE = "--no-cache-aware-routing"
MODEL_NAME = "smollm2-135m-instruct"
#: issue 30's targets
TTFT_TARGET = 3.0
THROUGHPUT_TARGET = 1.5
HIT_RATE_TARGET = 1.5


@dataclass
class SetupRun:
    """A setup's row: its result, or why it has none."""

    setup: str
    #: "ok", "not available in this build", "skipped" or "failed"
    status: str
    description: str
    note: str = ""
    command: list[str] = field(default_factory=list)
    summary: MultiTurnSummary | None = None


def demo_flags(python: str) -> set[str]:
    """The prefix-caching flags `helixserve demo` of this checkout knows."""
    res = subprocess.run([python, "-m", "helixserve", "demo", "--help"], capture_output=True,
                         text=True, timeout=300)
    return {f for f in (NO_CACHING, NO_AWARE) if f in res.stdout}


def plan_setup(setup: str, flags: set[str], has_vllm: bool) -> tuple[list[str] | None, str, str]:
    """(extra demo flags, or None for a setup that does not run; status; note)."""
    if setup == "vllm":
        if has_vllm:
            return [], "ok", ""
        return None, "skipped", ("vLLM is not installed in this python; run the script with "
                                 "the vllm venv's python (docs/vllm.md)")
    if setup == "off":
        if NO_CACHING in flags:
            return [NO_CACHING], "ok", ""
        return [], "ok", (f"caching not yet on: this build's demo has no {NO_CACHING}, so its "
                          "default has no prefix caching")
    if NO_CACHING not in flags:
        return None, "not available in this build", f"the demo has no {NO_CACHING} (no caching)"
    if setup == "plain":
        if NO_AWARE not in flags:
            return None, "not available in this build", f"the demo has no {NO_AWARE}"
        return [NO_AWARE], "ok", ""
    note = "" if NO_AWARE in flags else f"the demo has no {NO_AWARE}: routes may not be aware"
    return [], "ok", note


def max_model_len(cfg: ConversationConfig, output_tokens: int) -> int:
    """A context length for the vLLM server that holds the longest conversation: its prompt
    tokens with some slack for the chat template, rounded up to 1,024, at least 2,048 (as
    serving_vllm) and at most the demo model's 8,192."""
    user = cfg.user_tokens * (1 + cfg.user_tokens_range_ratio) * 1.1 + 16
    need = cfg.system_prompt_tokens * 1.1 + cfg.max_turns * (user + output_tokens + 16) + 64
    return int(min(8192, max(2048, -(-need // 1024) * 1024)))


def start_server(setup: str, extra: list[str], port: int, workdir: Path,
                 args: argparse.Namespace, model_dir: Path, context_len: int
                 ) -> tuple[subprocess.Popen[bytes], list[str]]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", VLLM_LOGGING_LEVEL="WARNING")
    if setup == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", MODEL_NAME,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(context_len),
               # the demo workers' KV in all, as serving_vllm (vLLM-CPU would take 92% of RAM)
               "--kv-cache-memory-bytes", str(3 * args.worker_kv_cache_mb << 20),
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "helixserve", "demo", "--engine", args.engine,
               "--port", str(port), "--workdir", str(workdir / "demo"),
               "--worker-kv-cache-mb", str(args.worker_kv_cache_mb),
               *(["--memory-gb", args.memory_gb] if args.memory_gb else []),
               *extra, *args.demo_arg]  # fmt: skip
    log = (workdir / f"{setup}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, cmd


def served_model(api_root: str) -> str:
    import httpx

    models = httpx.get(api_root + "/models", timeout=30.0).json()
    return str(models["data"][0]["id"])


def scrape(api_root: str) -> CacheCounters | None:
    import httpx

    root = api_root.removesuffix("/").removesuffix("/v1")
    try:
        resp = httpx.get(root + "/metrics", timeout=30.0)
    except httpx.HTTPError:
        return None
    return CacheCounters.parse(resp.text) if resp.status_code == 200 else None


def measure(api_root: str, conv_cfg: ConversationConfig, args: argparse.Namespace
            ) -> MultiTurnSummary:
    """Warm up (2 short conversations of another seed: their system prompt is not the run's,
    so they prime no cache the run uses), then the run, between two /metrics scrapes."""
    chat = ChatConfig(api_root, served_model(api_root), output_tokens=args.output_tokens,
                      ignore_eos=not args.no_ignore_eos, max_concurrency=args.max_concurrency,
                      timeout_s=args.request_timeout_s)
    warm = ConversationConfig(num_conversations=2, min_turns=1, max_turns=1,
                              system_prompt_tokens=64, user_tokens=16, seed=conv_cfg.seed + 1000)
    warm_results, _ = asyncio.run(run_conversations(chat, make_conversations(warm)))
    if not all(r.success for r in warm_results):
        raise RuntimeError(f"warm-up failed: {[r.error for r in warm_results if r.error][:2]}")
    conversations = make_conversations(conv_cfg)
    before = scrape(api_root)
    results, duration_s = asyncio.run(run_conversations(chat, conversations))
    after = scrape(api_root)
    counters = after.minus(before) if after is not None else None
    return summarize(results, duration_s, len(conversations), counters)


def run_setup(setup: str, args: argparse.Namespace, conv_cfg: ConversationConfig,
              flags: set[str], has_vllm: bool, workdir: Path, model_dir: Path) -> SetupRun:
    extra, status, note = plan_setup(setup, flags, has_vllm)
    run = SetupRun(setup, status, DESCRIPTIONS[setup], note)
    if extra is None:
        return run
    port = free_port()
    proc, run.command = start_server(setup, extra, port, workdir, args, model_dir,
                                     max_model_len(conv_cfg, args.output_tokens))
    log = workdir / f"{setup}.log"
    try:
        try:
            wait_ready(proc, port, log, args.start_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            if "unrecognized arguments" in log.read_text(errors="replace"):
                run.status = "not available in this build"
                run.note = "the server refused its flags: " + log.read_text().strip()[-200:]
            else:
                run.status, run.note = "failed", f"did not start: {str(exc)[-500:]}"
            return run
        run.summary = measure(f"http://127.0.0.1:{port}/v1", conv_cfg, args)
    except Exception as exc:  # one setup failing leaves the others' rows
        run.status, run.note = "failed", f"{type(exc).__name__}: {exc}"[-500:]
    finally:
        stop(proc)
    return run


def emulated_flags(setup: str) -> tuple[list[str], list[str]] | None:
    """(each emulated worker's extra flags, `helixserve serve`'s) for a setup; None for one
    with no emulated counterpart (vllm)."""
    if setup == "off":
        return [NO_CACHING], [NO_CACHING]
    if setup == "plain":
        return [], [NO_AWARE]
    if setup == "aware":
        return [], []
    return None


def load_emulated(args: argparse.Namespace) -> Any:
    """The rehearsal's inputs, checked as `helixserve rehearse` checks them (the trace is
    only read: the conversations are the workload)."""
    from helixserve.rehearse.inputs import load_inputs

    missing = [f for f, v in (("--placement", args.placement), ("--profiles", args.profiles),
                              ("--model", args.model)) if v is None]
    if missing:
        raise UserError(f"--emulated-cluster needs {', '.join(missing)}")
    if args.url:
        raise UserError("--emulated-cluster and --url: give one")
    if args.time_scale <= 0:
        raise UserError(f"--time-scale: must be > 0, got {args.time_scale:g}")
    return load_inputs(args.emulated_cluster, args.model, args.profiles, args.placement,
                       args.trace)


def run_emulated_setup(setup: str, inputs: Any, args: argparse.Namespace,
                       conv_cfg: ConversationConfig, workdir: Path) -> SetupRun:
    """One setup on a fresh EMULATED cluster started with its flags, stopped after."""
    from helixserve.rehearse.cluster import EmulatedCluster

    flags = emulated_flags(setup)
    run = SetupRun(setup, "ok", EMULATED_DESCRIPTIONS[setup])
    if flags is None:
        run.status, run.note = "skipped", "no emulated counterpart (a real vLLM server)"
        return run
    worker_args, serve_args = flags
    run.command = [f"worker: {' '.join(worker_args) or '(defaults)'}",
                   f"serve: {' '.join(serve_args) or '(defaults)'}"]
    cluster = EmulatedCluster(inputs, workdir / setup, time_scale=args.time_scale,
                              worker_args=worker_args, serve_args=serve_args)
    try:
        with cluster:
            run.summary = measure(cluster.api_url + "/v1", conv_cfg, args)
    except Exception as exc:  # one setup failing leaves the others' rows
        run.status, run.note = "failed", f"{type(exc).__name__}: {exc}"[-500:]
    # the workers' shutdown lines: tokens computed and taken from the cache, summed over
    # every stage (a token counts once per stage it passes), warm-up included
    cached = sum(int(e["cached_tokens"]) for e in cluster.emulated.values())
    computed = sum(int(e["prompt_tokens"]) for e in cluster.emulated.values())
    if cluster.emulated:
        run.note = (run.note + "; " if run.note else "") + (
            f"EMULATED workers (all stages, warm-up included): {computed} prompt tokens "
            f"computed, {cached} from the prefix cache")
    return run


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None:
        return None
    if den == 0:
        return float("inf") if num > 0 else None
    return num / den


def compare(runs: dict[str, SetupRun]) -> dict[str, Any]:
    """Issue 30's targets from the rows that ran: ratio, target, pass (None: a row missing)."""
    s = {k: r.summary for k, r in runs.items() if r.status == "ok" and r.summary is not None
         and r.summary.completed > 0}
    off, plain, aware, vllm = (s.get(k) for k in ("off", "plain", "aware", "vllm"))

    def target(ratio: float | None, at_least: float | None, what: str) -> dict[str, Any]:
        ok = None if ratio is None or at_least is None else ratio >= at_least
        return {"what": what, "ratio": ratio, "target": at_least, "pass": ok}

    return {
        "ttft_p50_off_over_aware": target(
            _ratio(off and off.ttft_p50_ms, aware and aware.ttft_p50_ms), TTFT_TARGET,
            "TTFT p50, off / aware (x lower with caching)"),
        "throughput_aware_over_off": target(
            _ratio(aware and aware.output_tokens_per_s, off and off.output_tokens_per_s),
            THROUGHPUT_TARGET, "output tok/s, aware / off"),
        "hit_rate_aware_over_plain": target(
            _ratio(aware and aware.hit_rate, plain and plain.hit_rate), HIT_RATE_TARGET,
            "prefix-cache hit rate, aware / plain"),
        "ttft_p50_vllm_over_aware": target(
            _ratio(vllm and vllm.ttft_p50_ms, aware and aware.ttft_p50_ms), None,
            "TTFT p50, vLLM / helix aware (> 1: helix lower)"),
        "throughput_aware_over_vllm": target(
            _ratio(aware and aware.output_tokens_per_s, vllm and vllm.output_tokens_per_s),
            None, "output tok/s, helix aware / vLLM"),
        # the baseline against vLLM too: what caching has to make up
        "ttft_p50_vllm_over_off": target(
            _ratio(vllm and vllm.ttft_p50_ms, off and off.ttft_p50_ms), None,
            "TTFT p50, vLLM / helix off"),
        "throughput_off_over_vllm": target(
            _ratio(off and off.output_tokens_per_s, vllm and vllm.output_tokens_per_s),
            None, "output tok/s, helix off / vLLM"),
    }  # fmt: skip


def _finite(obj: Any) -> Any:
    """JSON has no infinity: an infinite ratio (a zero denominator) is written "inf"."""
    if isinstance(obj, float) and obj == float("inf"):
        return "inf"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(runs: dict[str, SetupRun], targets: dict[str, Any]) -> str:
    lines = [f"{'setup':<6} {'status':<10} {'ok/sent':>7} {'out tok/s':>9} {'req/s':>6} "
             f"{'TTFT p50':>9} {'TTFT p90':>9} {'hit resp':>8} {'hit /metrics':>12}"
             f" {'history found':>13}  (TTFT in ms)"]  # fmt: skip
    notes = []
    for name, r in runs.items():
        s = r.summary
        if r.status != "ok" or s is None:
            lines.append(f"{name:<6} {r.status}")
        else:
            lines.append(
                f"{name:<6} {'ok':<10} {f'{s.completed}/{s.requests}':>7} "
                f"{s.output_tokens_per_s:>9.1f} {s.requests_per_s:>6.2f} {s.ttft_p50_ms:>9.0f} "
                f"{s.ttft_p90_ms:>9.0f} {_pct(s.hit_rate_responses):>8} "
                f"{_pct(s.hit_rate_metrics):>12} {_pct(s.history_found):>13}")  # fmt: skip
            notes += [f"{name}: error: {e}" for e in s.errors]
        if r.note:
            notes.append(f"{name}: {r.note}")
    lines.append("")
    for t in targets.values():
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        verdict = ("reported" if t["target"] is None else "n/a (a row is missing)"
                   if t["pass"] is None else "PASS" if t["pass"] else "FAIL")
        goal = "" if t["target"] is None else f" (target >= {t['target']:g}x)"
        lines.append(f"{t['what']}: {ratio}{goal}  {verdict}")
    return "\n".join(lines + [""] + notes)


def parse_urls(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, url = v.partition("=")
        name, url = (name, url) if sep and not name.startswith("http") else ("url", v)
        if name not in (*SETUPS, "url"):
            raise UserError(f"--url: bad name {name!r} in {v!r}; known: {', '.join(SETUPS)}")
        if name in out:
            raise UserError(f"--url: {name} given twice")
        out[name] = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write results here")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                    help="measure a running server instead of starting setups (NAME: one of "
                    "the setups, so targets compare them; repeatable)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", default="4", help="turns per conversation: N or MIN-MAX (4)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--user-tokens-range-ratio", type=float, default=0.5)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--no-ignore-eos", action="store_true",
                    help="let replies end at EOS (default: exactly --output-tokens each)")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="conversations in flight at once (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--think-time-s", type=float, default=0.0, metavar="MEAN",
                    help="mean seconds a user waits before each turn (exponential, seeded; "
                         "0: none). Without it equal conversations send their turns in the "
                         "same order every round, and round-robin routes repeat")
    ap.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                    help="the demo workers' engine")
    ap.add_argument("--worker-kv-cache-mb", type=int, default=128,
                    help="demo KV per worker; the vLLM server gets 3x")
    ap.add_argument("--memory-gb", default=None,
                    help="the demos' --memory-gb (the workers' budgets the MILP plans for; "
                    "1,1,1: two routes of 50%%; 1,1,1,1,1 with --demo-arg=--worker-link-fraction "
                    "--demo-arg=0.3: four routes of 25%%, docs/benchmarks.md)")
    ap.add_argument("--demo-arg", action="append", default=[],
                    help="one more argument for every demo (repeat: --demo-arg=--worker-threads "
                    "--demo-arg=2)")
    emu = ap.add_argument_group("EMULATED cluster (instead of the demo)")
    emu.add_argument("--emulated-cluster", type=Path, default=None, metavar="CLUSTER.yaml",
                     help="run off/plain/aware on this cluster's emulated workers")
    emu.add_argument("--placement", type=Path, default=None)
    emu.add_argument("--profiles", type=Path, default=None)
    emu.add_argument("--model", type=Path, default=None,
                     help="the model's directory (config.json; no weights)")
    emu.add_argument("--trace", type=Path, default=Path("examples/traces/azure-llm-conv-2023.csv"),
                     help="what rehearse's inputs check needs; not run")
    emu.add_argument("--time-scale", type=float, default=1.0,
                     help="each emulated step takes K x its GPU time (docs/rehearse.md)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lo, hi = parse_turns(args.turns)
        conv_cfg = ConversationConfig(args.conversations, lo, hi, args.system_tokens,
                                      args.user_tokens, args.user_tokens_range_ratio, args.seed,
                                      args.think_time_s)
        conv_cfg.check()
        if args.output_tokens < 1:
            raise UserError(f"--output-tokens: must be >= 1, got {args.output_tokens}")
        urls = parse_urls(args.url)
        inputs = load_emulated(args) if args.emulated_cluster is not None else None
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="helix-multiturn-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, SetupRun] = {}
    started = time.time()
    if urls:
        for name, url in urls.items():
            run = SetupRun(name, "ok", DESCRIPTIONS[name], f"at {url}")
            try:
                run.summary = measure(url, conv_cfg, args)
            except Exception as exc:
                run.status, run.note = "failed", f"{url}: {type(exc).__name__}: {exc}"[-500:]
            runs[name] = run
    elif inputs is not None:
        for setup in args.setups:
            print(f"--- {setup}: {EMULATED_DESCRIPTIONS[setup]}", flush=True)
            runs[setup] = run_emulated_setup(setup, inputs, args, conv_cfg, workdir)
    else:
        from helixserve.engine import prepare_demo_model

        model_dir = prepare_demo_model()
        flags = demo_flags(sys.executable)
        has_vllm = importlib.util.find_spec("vllm") is not None
        for setup in args.setups:
            print(f"--- {setup}: {DESCRIPTIONS[setup]}", flush=True)
            runs[setup] = run_setup(setup, args, conv_cfg, flags, has_vllm, workdir, model_dir)
    targets = compare(runs)
    print()
    if inputs is not None:
        print(f"EMULATED cluster {args.emulated_cluster} (no GPU: step times from "
              f"{args.profiles}, time scale {args.time_scale:g})")
    print(format_table(runs, targets), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_finite({
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.multiturn",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg()},
            "started_unix_s": started,
            "workload": asdict(conv_cfg) | {"output_tokens": args.output_tokens,
                                            "ignore_eos": not args.no_ignore_eos,
                                            "max_concurrency": args.max_concurrency},
            "emulated": None if inputs is None else {
                "label": "EMULATED: no GPU, no weights; step times from the profiles",
                "cluster": str(args.emulated_cluster), "placement": str(args.placement),
                "profiles": str(args.profiles), "model": str(args.model),
                "time_scale": args.time_scale},
            "setups": {k: asdict(r) for k, r in runs.items()},
            "targets": targets,
        }), indent=2, default=str) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
