"""What mutual TLS costs on worker traffic: the same requests over two real workers, plaintext
vs mutual TLS, measured in one run (alternating, so machine load hits both alike).

Two `helixserve worker` processes (SmolLM2-135M, fp32 on CPU, layers [0,15) and [15,30)) per
mode; a coordinator in this process sends `--requests` greedy requests of `--max-tokens`
tokens, one at a time (decode: every token crosses coordinator -> n0 -> n1 -> coordinator).

    PYTHONPATH=$PWD python benchmarks/tls_overhead.py --json benchmarks/results/tls_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "runtime"))

from runtime_procs import (  # noqa: E402
    free_port,
    make_placement,
    start_worker,
    stop_workers,
    wait_ready,
)

from helixserve.engine import prepare_demo_model  # noqa: E402
from helixserve.request import GenerationRequest, SamplingParams  # noqa: E402
from helixserve.runtime import Coordinator, security  # noqa: E402
from helixserve.spec import ClusterSpec, NodeSpec  # noqa: E402


async def tokens_per_s(coord: Coordinator, max_tokens: int, tag: str) -> float:
    req = GenerationRequest(tag, [1, 504, 3458, 282], SamplingParams(temperature=0.0),
                            max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    n = 0
    async for _ in coord.generate(req):
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = prepare_demo_model()
    tmp = Path(tempfile.mkdtemp(prefix="helix-tls-"))
    creds = security.create_dev_credentials(tmp / "certs", ["n0", "n1"])
    placement = make_placement([("n0", 0, 15), ("n1", 15, 30)],
                               [("coordinator", "n0", 1), ("n0", "n1", 1), ("n1", "coordinator", 1)])
    procs = []
    stacks: dict[str, tuple[ClusterSpec, Any]] = {}
    for mode in ("plaintext", "mutual TLS"):
        ports = {"n0": free_port(), "n1": free_port()}
        peers = ",".join(f"127.0.0.1:{p}" for p in ports.values())
        for n, p in ports.items():
            extra = ["--peers", peers]
            if mode == "mutual TLS":
                extra += creds.nodes[n].flags()
            start, end = (0, 15) if n == "n0" else (15, 30)
            procs.append(start_worker(model, n, start, end, tmp, extra=extra, port=p,
                                      peers=None, log_name=f"{mode[:3]}-{n}"))
        cluster = ClusterSpec(name="test-local", nodes=[
            NodeSpec(name=n, gpu="L4", address=f"127.0.0.1:{p}") for n, p in ports.items()])
        stacks[mode] = (cluster, creds.coordinator if mode == "mutual TLS" else None)

    async def run() -> dict[str, list[float]]:
        coords = {m: await Coordinator.create(c, placement, model, tls=tls)
                  for m, (c, tls) in stacks.items()}
        out: dict[str, list[float]] = {m: [] for m in coords}
        try:
            for m, coord in coords.items():  # warm-up
                await tokens_per_s(coord, 8, f"warm-{m}")
            for i in range(args.requests):
                for m, coord in coords.items():
                    out[m].append(await tokens_per_s(coord, args.max_tokens, f"{m}-{i}"))
        finally:
            for coord in coords.values():
                await coord.close()
        return out

    try:
        wait_ready(procs)
        results = asyncio.run(run())
    finally:
        stop_workers(procs)
    base = statistics.median(results["plaintext"])
    print(f"{'mode':<12} {'median tok/s':>12} {'vs plaintext':>13}")
    for m, vals in results.items():
        med = statistics.median(vals)
        print(f"{m:<12} {med:>12.1f} {med / base:>12.3f}x")
    if args.json:
        args.json.write_text(json.dumps({
            "requests": args.requests, "max_tokens": args.max_tokens,
            "tokens_per_s": {m: [round(v, 2) for v in vals] for m, vals in results.items()},
            "median_tokens_per_s": {m: round(statistics.median(v), 2)
                                    for m, v in results.items()},
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
