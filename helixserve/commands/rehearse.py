"""`helixserve rehearse`: run a cluster file at full size on this host with EMULATED GPUs and
links, the real coordinator, API, gRPC and mutual TLS; drive a trace through the HTTP API and
print measured next to simulated (docs/rehearse.md).

    helixserve rehearse --cluster C.yaml --model DIR --profiles P.csv --placement p.json \
        --trace T.csv [--rate R | --offline] [--duration S] [--json OUT] [--time-scale K]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from helixserve.commands.args import finite_float


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rehearse",
        help="rehearse a cluster at full size on this host: EMULATED GPUs and links, the real "
        "runtime; measured next to simulated",
        description="Start one EMULATED worker per placed node (GPU times from --profiles), "
        "the cluster file's links (userspace proxy on 127.0.0.1), the real coordinator and "
        "OpenAI API with mutual TLS; drive --trace through the HTTP API; simulate the same "
        "placement and trace; print both and where the time went. No GPU runs: every GPU and "
        "link time is emulated, the runtime's own costs are real.",
    )
    p.add_argument("--cluster", required=True, type=Path, help="cluster YAML")
    p.add_argument("--model", required=True, type=Path,
                   help="model directory with config.json (no weights needed)")
    p.add_argument("--profiles", required=True, type=Path,
                   help="measured per-layer times CSV (e.g. helix-measured.csv)")
    p.add_argument("--placement", required=True, type=Path, help="placement JSON")
    p.add_argument("--trace", required=True, type=Path,
                   help="Azure-format trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=finite_float, default=None, metavar="R",
                      help="online: the trace's arrivals rescaled to R requests/s (default: "
                      "as written)")
    load.add_argument("--offline", action="store_true",
                      help="a closed loop that keeps the cluster busy (--concurrency streams)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="--offline: streams in flight (default: the requests the cluster's KV "
                   "holds at once, at most 256)")
    p.add_argument("--duration", type=finite_float, default=60.0, metavar="S",
                   help="seconds of cluster time to run the load (default 60; wall: S x K)")
    p.add_argument("--warmup", type=finite_float, default=0.0, metavar="S",
                   help="seconds at the start left out of the numbers, both sides (default 0)")
    p.add_argument("--time-scale", type=finite_float, default=1.0, metavar="K",
                   help="every emulated GPU and link time x K, for a host that cannot keep up "
                   "(default 1); results are reported in cluster time, K beside them")
    p.add_argument("--base-port", type=int, default=0, metavar="P",
                   help="take ports P, P+1, ... on 127.0.0.1 (API, then a proxy and a worker "
                   "port per node); default: ports the OS picks")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="keep logs, certificates and the cluster copy here (default: a "
                   "temporary directory, removed unless the run fails)")
    p.add_argument("--emulated-payload-bytes-per-token", default=None, metavar="N|real",
                   help="bytes a token the workers' activation messages carry (default 64); "
                   "the rest of the real size is declared to the link proxy, which charges it "
                   "on the link as if sent; real (or 0): the real bytes cross")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="run every worker and the coordinator + API with --no-prefix-caching "
                   "(no prefix cache, no cache reports, no cache-aware routes), and the "
                   "simulator without its prefix cache")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import signal
    import sys

    from helixserve.commands.args import Output, check_output, write_outputs
    from helixserve.commands.worker import payload_bytes_per_token
    from helixserve.rehearse.cluster import DEFAULT_PAYLOAD_BYTES_PER_TOKEN
    from helixserve.rehearse.rehearsal import RehearsalOptions, run_rehearsal
    from helixserve.rehearse.report import format_report

    if args.json is not None:
        check_output("--json", args.json, make_parents=True)
    payload = (DEFAULT_PAYLOAD_BYTES_PER_TOKEN if args.emulated_payload_bytes_per_token is None
               else payload_bytes_per_token(args.emulated_payload_bytes_per_token))
    opts = RehearsalOptions(
        cluster=args.cluster, model=args.model, profiles=args.profiles,
        placement=args.placement, trace=args.trace, rate_per_s=args.rate,
        offline=args.offline, duration_s=args.duration, warmup_s=args.warmup,
        time_scale=args.time_scale, concurrency=args.concurrency, base_port=args.base_port,
        workdir=args.workdir, payload_bytes_per_token=payload,
        prefix_caching=not args.no_prefix_caching)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the cluster's stop, as Ctrl-C does

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        report = run_rehearsal(opts, log=lambda line: print(line, file=sys.stderr, flush=True))
    except RuntimeError as exc:  # a process of the cluster failed: its log says why
        print(f"helixserve rehearse: failed: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json is not None:
        text = json.dumps(report, indent=1) + "\n"
        write_outputs([Output("--json", args.json, lambda path: path.write_text(text))])
    return 0 if report["measured"]["requests_failed"] == 0 else 1
