"""The rig's coordinator + OpenAI API: `helixserve serve`'s stack over already-running workers,
with the cluster read through the rig's GPU catalog (its `cpu-x<F>` speed classes).

    python benchmarks/rig/server.py --cluster C.yaml --gpus gpus.csv --placement P.json \
        --model DIR --host 127.0.0.1 --port 8000 [--max-seconds S] \
        [--tls-cert coordinator.crt --tls-key coordinator.key --tls-ca ca.crt]

Stops on SIGTERM/SIGINT, or by itself after --max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path


async def serve(args: argparse.Namespace) -> None:
    from helixserve.api.app import create_app
    from helixserve.commands.certs import tls_from_args
    from helixserve.launch import serve_app
    from helixserve.planner import load_placement
    from helixserve.runtime import Coordinator
    from helixserve.spec import load_cluster
    from helixserve.spec.gpus import load_gpu_catalog

    cluster = load_cluster(args.cluster, catalog=load_gpu_catalog(args.gpus))
    placement = load_placement(args.placement)
    # the runtime's defaults (CoordinatorConfig): what the rig measures
    coord = await Coordinator.create(cluster, placement, Path(args.model),
                                     tls=tls_from_args(args))
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
    p.add_argument("--gpus", required=True)
    p.add_argument("--placement", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-seconds", type=float, default=3600.0)
    from helixserve.commands.certs import add_tls_arguments

    add_tls_arguments(p)  # none given: plaintext worker traffic
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
