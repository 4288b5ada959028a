"""The rig's coordinator + OpenAI API: `helixserve serve`'s stack over already-running workers,
with the cluster read through the rig's GPU catalog (its `cpu-x<F>` speed classes) and the
router given the cost model the rig plans and simulates with (its profiles, fp32), so the
live router routes as the simulated one.

    python benchmarks/rig/server.py --cluster C.yaml --gpus gpus.csv --profiles P.csv \
        --dtype-bytes 4 --placement P.json --model DIR --host 127.0.0.1 --port 8000 \
        [--max-seconds S] [--tls-cert coordinator.crt --tls-key coordinator.key --tls-ca ca.crt]

Stops on SIGTERM/SIGINT, or by itself after --max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path


async def serve(args: argparse.Namespace) -> None:
    from helixserve.api.app import create_app
    from helixserve.commands.certs import tls_from_args
    from helixserve.commands.serve import cost_inputs
    from helixserve.local.launch import serve_app
    from helixserve.planner import load_placement
    from helixserve.runtime import Coordinator, CoordinatorConfig
    from helixserve.spec import load_cluster

    cost = cost_inputs(args)
    cluster = load_cluster(args.cluster, catalog=cost.catalog)
    placement = load_placement(args.placement)
    # the runtime's defaults (CoordinatorConfig) but the cost model: what the rig measures
    coord = await Coordinator.create(cluster, placement, Path(args.model),
                                     CoordinatorConfig(cost=cost), tls=tls_from_args(args))
    try:
        app = create_app(coord)
        loop = asyncio.get_running_loop()
        # uvicorn's own handlers stop the server on SIGTERM; this one bounds the run
        loop.call_later(args.max_seconds, lambda: os.kill(os.getpid(), signal.SIGTERM))
        await serve_app(app, args.host, args.port, log_level="warning")
    finally:
        await coord.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cluster", required=True)
    from helixserve.commands.serve import add_cost_arguments

    add_cost_arguments(p)  # --profiles, --gpus, --dtype-bytes as `helixserve serve`
    p.add_argument("--placement", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-seconds", type=float, default=3600.0)
    from helixserve.commands.certs import add_tls_arguments

    add_tls_arguments(p)  # none given: plaintext worker traffic
    args = p.parse_args()
    if args.gpus is None:
        p.error("--gpus: required (the rig's catalog of its speed classes)")
    from helixserve.errors import UserError

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args))
    except UserError as exc:  # a bad --profiles/--gpus/cluster: one line, as `serve`
        print(f"rig server: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
