"""What mutual TLS costs on worker traffic: the same requests over two real workers, plaintext
vs mutual TLS, measured in one run (alternating, so machine load hits both alike).

Two `helixserve worker` processes (SmolLM2-135M, fp32 on CPU, layers [0,15) and [15,30)) per
mode; a coordinator in this process sends `--requests` greedy requests of `--max-tokens`
tokens, one at a time (decode: every token crosses coordinator -> n0 -> n1 -> coordinator).

    python -m benchmarks.tls_overhead --json benchmarks/results/tls_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from helixserve.engine import prepare_demo_model
from helixserve.local.launch import (
    free_port,
    spawn_worker,
    stop_processes,
    wait_grpc_ready,
    worker_command,
)
from helixserve.planner.placement import Flow, NodeRange, Placement
from helixserve.request import GenerationRequest, SamplingParams
from helixserve.runtime import Coordinator, security
from helixserve.spec import ClusterSpec, NodeSpec

#: KV cache of each worker (bytes): room for the requests, and the same in both modes
KV_CACHE_BYTES = 64 * 1024 * 1024


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
    ranges = {"n0": (0, 15), "n1": (15, 30)}
    placement = Placement(
        model="smollm2-135m-instruct", cluster="test-local", num_layers=30, planner="bench",
        nodes=[NodeRange(n, a, b) for n, (a, b) in ranges.items()],
        flows=[Flow("coordinator", "n0", 1), Flow("n0", "n1", 1), Flow("n1", "coordinator", 1)])
    # (node, address, process, log, coordinator's TLS) of every worker, both modes
    procs: list[tuple[str, str, subprocess.Popen[bytes], Path, Any]] = []
    stacks: dict[str, tuple[ClusterSpec, Any]] = {}
    for mode in ("plaintext", "mutual TLS"):
        ports = {"n0": free_port(), "n1": free_port()}
        peers = ",".join(f"127.0.0.1:{p}" for p in ports.values())
        tls = creds.coordinator if mode == "mutual TLS" else None
        for n, p in ports.items():
            flags = creds.nodes[n].flags() if tls is not None else []
            cmd = worker_command(model, n, p, layers=ranges[n], num_threads=1, peers=peers,
                                 kv_cache_bytes=KV_CACHE_BYTES, extra_args=flags)
            log = tmp / f"{mode[:3]}-{n}.log"
            procs.append((n, f"127.0.0.1:{p}", spawn_worker(cmd, log, num_threads=1), log, tls))
        cluster = ClusterSpec(name="test-local", nodes=[
            NodeSpec(name=n, gpu="L4", address=f"127.0.0.1:{p}") for n, p in ports.items()])
        stacks[mode] = (cluster, tls)

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
        for node, address, proc, log, tls in procs:
            wait_grpc_ready(node, address, proc, log, tls)
        results = asyncio.run(run())
    finally:
        stop_processes([proc for _, _, proc, _, _ in procs], grace_s=15.0)
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
