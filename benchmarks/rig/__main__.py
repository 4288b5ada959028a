"""The emulated cluster rig: simulator vs real runtime, milp vs baseline placements.

    python -m benchmarks.rig --quick --json benchmarks/results/rig.json

Starts real `helixserve worker` processes with the demo model on this host, made unequal
(per-worker slowdown or cgroup CPU quota) and far apart (a userspace proxy per link with
the cluster YAML's bandwidth and latency), serves each placement with the real coordinator
and API, sends the same request burst through the bench client, and simulates that burst
on the same placement. Prints a table and writes JSON. See docs/rig.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from benchmarks.rig.clusters import CLUSTERS
from benchmarks.rig.run import (
    ALL_PLACEMENTS,
    PLACEMENTS,
    RigOptions,
    full_workloads,
    quick_workloads,
    run_rig,
    save,
)
from benchmarks.rig.speed import SPEED_MODES
from benchmarks.rig.table import format_markdown, format_summary, format_table


def _names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in known]
    if bad or not names:
        print(f"{flag}: unknown {bad or text!r}; known: {', '.join(known)}", file=sys.stderr)
        sys.exit(2)
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small bursts (under 15 min on 2 cores)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results here")
    p.add_argument("--markdown", type=Path, default=None, metavar="OUT",
                   help="also write the table as markdown (for docs/benchmarks.md)")
    p.add_argument("--clusters", default=",".join(CLUSTERS), help="comma list")
    p.add_argument("--placements", default=",".join(PLACEMENTS),
                   help=f"comma list of {', '.join(ALL_PLACEMENTS)} (default: all but milp-flow)")
    p.add_argument("--workloads", default="conversation,prefill-heavy", help="comma list")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests per burst (default: 6 and 3 with --quick, 16 and 8 without)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="bursts per (placement, workload), on the same stack; each row "
                   "reports the per-metric median and the JSON every run (default 1)")
    p.add_argument("--speed", choices=SPEED_MODES, default="slowdown",
                   help="slowdown (worker --slowdown, default) or cgroup (CPU quotas; root)")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext gRPC between coordinator and workers (default: mutual TLS "
                   "with dev credentials, as local stacks run)")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    p.add_argument("--reprofile", action="store_true", help="profile again even if cached")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="every process the rig starts stops by itself after this (default 3600)")
    args = p.parse_args()
    if args.repeats < 1:
        print(f"--repeats: bad value {args.repeats}; need >= 1", file=sys.stderr)
        return 2
    if args.requests is not None and args.requests < 1:
        print(f"--requests: bad value {args.requests}; need >= 1", file=sys.stderr)
        return 2
    workloads = (quick_workloads if args.quick else full_workloads)(args.requests)
    wanted = _names(args.workloads, tuple(w.name for w in workloads), "--workloads")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="helixserve-rig-"))
    opts = RigOptions(
        workdir=workdir,
        clusters=_names(args.clusters, tuple(CLUSTERS), "--clusters"),
        placements=_names(args.placements, ALL_PLACEMENTS, "--placements"),
        workloads=tuple(w for w in workloads if w.name in wanted),
        speed=args.speed,
        reprofile=args.reprofile,
        max_seconds=args.max_seconds,
        repeats=args.repeats,
        tls=not args.insecure,
        log=lambda msg: print(msg, flush=True),
    )
    # SIGTERM unwinds like Ctrl-C, so every stack's finally stops its processes
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = run_rig(opts)
    except KeyboardInterrupt:
        print("rig: interrupted; processes and cgroups cleaned up", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError) as exc:
        print(f"rig: {exc}", file=sys.stderr)
        return 1
    print()
    print(format_table(report["results"]))
    print()
    print(format_summary(report["results"]))
    if args.json is not None:
        save(report, args.json)
        print(f"wrote {args.json}")
    if args.markdown is not None:
        args.markdown.write_text(format_markdown(report["results"]) + "\n\n"
                                 + format_summary(report["results"]) + "\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
