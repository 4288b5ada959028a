"""Placements against each other at several offline loads, in the rehearsal's simulator.

`helixserve rehearse --offline` keeps at most 256 streams in flight (`MAX_OFFLINE_STREAMS`:
what this host's runtime carries), and its simulated side follows the runtime's engine rules
(`rehearse/run.py` `simulate`: measured within 0.94-1.05 of it on Helix's clusters,
docs/benchmarks.md). A saturated run, Helix's offline setting and what `plan`'s served
objective scores, has as many requests in flight as the KV holds: 865 on the Helix
authors' placement of helix-mix-42 and 1,399 on today's pick. This script runs that
simulation for each placement at each `--concurrency` (a closed loop of N streams, as the
rehearsal drives it) and prints decode tokens/s and each placement's ratio to the first, so a
ranking that turns with the load is seen, and says what the rehearsal's window measures.

    python -m benchmarks.load_sweep --cluster benchmarks/helix-clusters/helix-mix-42.yaml \
        --placements benchmarks/results/planner_served_work600_placements/helix-mix-42-milp.json \
        benchmarks/helix-placements/helix-mix-42-llama-2-70b.json \
        --concurrency 256 512 1024 1400 --window 1800 600 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from helixserve.errors import UserError

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "llama-2-70b"
PROFILES = REPO / "examples" / "profiles" / "helix-measured.csv"
TRACE = REPO / "examples" / "traces" / "azure-llm-conv-2023.csv"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", type=Path, required=True)
    ap.add_argument("--placements", type=Path, nargs="+", required=True,
                    help="placement JSON files; ratios are to the first")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[256],
                    help="offline streams in flight; 0: as many as each placement's KV holds")
    ap.add_argument("--window", type=float, nargs=2, default=[1800.0, 600.0],
                    metavar=("DURATION_S", "WARMUP_S"),
                    help="cluster seconds simulated, and the first of them not counted")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--profiles", type=Path, default=PROFILES)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def sweep(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from helixserve.rehearse.inputs import load_inputs
    from helixserve.rehearse.run import OFFLINE_RAMP_S, offline_concurrency, simulate

    duration, warmup = args.window
    if not 0 <= warmup < duration:
        raise UserError(f"--window: bad value {duration:g} {warmup:g}; need DURATION_S > "
                        "WARMUP_S >= 0")
    for c in args.concurrency:
        if not 0 <= c <= 65536:
            raise UserError(f"--concurrency: bad value {c}; need 0..65536")
    rows: list[dict[str, Any]] = []
    for path in args.placements:
        inputs = load_inputs(args.cluster, args.model, args.profiles, path, args.trace)
        kv_streams = offline_concurrency(inputs, limit=1 << 30)
        for c in args.concurrency:
            streams = c or kv_streams
            t0 = time.process_time()
            sim = simulate(inputs, offline=True, duration_s=duration, warmup_s=warmup,
                           concurrency=streams, ramp_s=OFFLINE_RAMP_S)
            m = sim["metrics"]
            rows.append({"placement": str(path), "kv_streams": kv_streams,
                         "concurrency": streams, "requested": c,
                         "decode_tokens_per_s": round(m["decode_tokens_per_s"], 1),
                         "prompt_tokens_per_s": round(m["prompt_tokens_per_s"], 1),
                         "cpu_s": round(time.process_time() - t0, 1)})
            print(f"  {path}: {streams} streams, decode "
                  f"{rows[-1]['decode_tokens_per_s']:.1f}", file=sys.stderr, flush=True)
    return {"cluster": str(args.cluster), "window": {"duration_s": duration,
                                                     "warmup_s": warmup},
            "rows": rows, "command": " ".join(["python -m benchmarks.load_sweep", *argv]),
            "machine": {"python": platform.python_version(), "platform": platform.platform()}}


def short_names(paths: list[str]) -> dict[str, str]:
    """Each path by its file name, or by as many of its last parts as tell it apart from the
    others (two `helix-mix-42-milp.json` in different folders)."""
    out: dict[str, str] = {}
    for path in paths:
        parts = Path(path).parts
        for k in range(1, len(parts) + 1):
            tail = parts[-k:]
            if sum(Path(o).parts[-k:] == tail for o in paths) == 1 or k == len(parts):
                out[path] = str(Path(*tail))
                break
    return out


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    names = list(dict.fromkeys(r["placement"] for r in rows))
    short = short_names(names)
    width = max(40, *(len(x) + 2 for x in short.values()))
    first = {r["requested"]: r["decode_tokens_per_s"] for r in rows if r["placement"] == names[0]}
    w = result["window"]
    out = [f"{result['cluster']}: decode tokens/s, window {w['warmup_s']:g}-{w['duration_s']:g} s "
           "of cluster time (the rehearsal's simulator, closed loop of N streams)",
           f"{'placement':<{width}}{'KV streams':>11}{'streams':>9}{'decode':>10}{'/ first':>9}"]
    for r in rows:
        base = first.get(r["requested"])
        ratio = f"{r['decode_tokens_per_s'] / base:.2f}" if base else "-"
        out.append(f"{short[r['placement']]:<{width}}{r['kv_streams']:>11}{r['concurrency']:>9}"
                   f"{r['decode_tokens_per_s']:>10.1f}{ratio:>9}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        result = sweep(args, argv)
    except UserError as exc:
        print(f"load_sweep: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
