"""What freeing a finished request's KV costs: a `Release` call per request and hop (wire
version 2) against its id on the coordinator's Work stream (`WorkBatch.release_ids`, wire
version 3; docs/runtime.md, Release).

One emulated worker (`helixserve worker --engine emulated`, plaintext on 127.0.0.1) and this
process as its coordinator. Each way frees `--releases` request ids one at a time, `--gap-ms`
apart (as finished requests come, not in a burst), and the worker's process CPU (all threads,
from /proc) and this process's CPU over them give the CPU per release on each side. The
stream way sends each id alone in its own message, its worst case: a coordinator puts the ids
of one event-loop turn in the message of that turn's items.

    python -m benchmarks.release_cost --releases 2000 --json benchmarks/results/release_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from helixserve.local.launch import (
    free_port,
    spawn_worker,
    stop_processes,
    wait_grpc_ready,
    worker_command,
)
from helixserve.runtime.threads import process_cpu_seconds

REPO = Path(__file__).resolve().parents[1]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    s = process_cpu_seconds(pid)
    if s is None:
        raise RuntimeError(f"release_cost: the worker (pid {pid}) is gone")
    return s


async def _measure(port: int, pid: int, releases: int, gap_s: float) -> dict[str, Any]:
    import grpc

    from helixserve.runtime import security
    from helixserve.runtime import transport as tp
    from helixserve.runtime.proto import helix_pb2 as pb
    from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

    cid, token = security.new_coordinator_identity()
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.HelixWorkerStub(ch)
        info = tp.info_from_pb(await stub.Info(pb.InfoRequest(), timeout=30))
        out["worker_wire_version"] = info.wire_version

        worker0, own0 = _cpu_s(pid), time.process_time()
        for i in range(releases):
            await stub.Release(tp.release_pb([f"call-{i}"], cid, token), timeout=10)
            await asyncio.sleep(gap_s)
        out["call"] = {"worker_cpu_s": _cpu_s(pid) - worker0,
                       "coordinator_cpu_s": time.process_time() - own0}

        sent = asyncio.Event()

        async def batches() -> Any:
            yield tp.work_batch_pb([], coordinator_id=cid, sender="coordinator",
                                   coordinator_token=token)
            for i in range(releases):
                yield tp.work_batch_pb([], release_ids=[f"stream-{i}"])
                await asyncio.sleep(gap_s)
            sent.set()
            await asyncio.sleep(3600)

        call = stub.Work(batches())
        reader = asyncio.create_task(_drain(call))
        await asyncio.sleep(0.5)  # the stream open and its hello answered
        worker0, own0 = _cpu_s(pid), time.process_time()
        await sent.wait()
        await asyncio.sleep(0.5)  # the last ids read and freed (nothing answers a release)
        out["stream"] = {"worker_cpu_s": _cpu_s(pid) - worker0,
                         "coordinator_cpu_s": time.process_time() - own0}
        call.cancel()
        reader.cancel()
    return out


async def _drain(call: Any) -> None:
    try:
        async for _ in call:
            pass
    except Exception:  # cancelled at the end
        return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--releases", type=int, default=2000, help="ids freed each way")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="milliseconds between two")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.releases < 1 or args.gap_ms < 0:
        print("release_cost: --releases must be >= 1 and --gap-ms >= 0", file=sys.stderr)
        return 2

    port = free_port()
    cmd = worker_command(REPO / "examples/models/llama-2-70b", "n0", port, layers=(0, 10),
                         engine="emulated",
                         extra_args=["--gpu", "A100-40GB", "--profiles",
                                     str(REPO / "examples/profiles/helix-measured.csv"),
                                     "--insecure"])
    with tempfile.TemporaryDirectory(prefix="release-cost-") as tmp:
        log = Path(tmp) / "worker.log"
        proc = spawn_worker(cmd, log)
        try:
            wait_grpc_ready("n0", f"127.0.0.1:{port}", proc, log)
            res = asyncio.run(_measure(port, proc.pid, args.releases, args.gap_ms / 1000))
        finally:
            stop_processes([proc])

    rows = []
    print(f"{'how':<40} {'worker ms':>10} {'coordinator ms':>15}   (CPU a release)")
    for key, label in (("call", "Release call, one id (wire version 2)"),
                       ("stream", "release id on the Work stream (3)")):
        w = 1000 * res[key]["worker_cpu_s"] / args.releases
        c = 1000 * res[key]["coordinator_cpu_s"] / args.releases
        rows.append({"how": key, "worker_ms": round(w, 4), "coordinator_ms": round(c, 4)})
        print(f"{label:<40} {w:>10.3f} {c:>15.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "format": "helixserve.benchmarks.release_cost/v1",
            "command": "python -m benchmarks.release_cost " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "loadavg_1m": os.getloadavg()[0]},
            "releases": args.releases, "gap_ms": args.gap_ms, "rows": rows, "raw": res,
        }, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
