"""Per-hop overhead of the distributed runtime: coordinator + gRPC vs the engine alone.

Starts real `helixserve worker` processes on 127.0.0.1 with the demo model (SmolLM2-135M,
30 layers): one worker holding all layers (1 hop) and a 3-worker pipeline [0,10) [10,20)
[20,30) (3 hops), and drives them through the `Coordinator` (no HTTP).

Per-hop overhead, per decoded token: every result carries `compute_s`, the engine step time
summed over the route's hops, measured inside the workers. The coordinator-side latency of the
token (time between two consecutive tokens of one stream, which is one full round trip:
coordinator -> hop 0 -> ... -> last hop -> coordinator) minus `compute_s` is what the runtime
adds: protobuf conversion, gRPC, the workers' queues and threads, the coordinator's
detokenization. Divided by the number of hops. Measured with one stream at a time (batch 1),
so queueing behind other requests is not counted as overhead.

Floor: a bare gRPC echo round trip to another process, after the same idle gap as a decode
step (the processes sleep between tokens, and waking costs), and back to back.

Throughput: `--streams` concurrent requests (default 16) with a fixed output length
(ignore_eos), output tokens per second over the wall time, pipeline vs single worker. Setups
alternate per round, so drift of a shared machine hits both alike. Over the same phase: CPU
milliseconds per output token of the coordinator (this process) and of the workers (their
whole processes, engine included, from /proc), which a loaded machine disturbs less than
tok/s; and items per message each sender sent (coordinator -> first hop, worker -> next hop
or coordinator).

    python -m benchmarks.runtime_overhead --json benchmarks/results/runtime_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.local.launch import free_port, spawn_worker, stop_processes, worker_command

NUM_LAYERS = 30
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "List three fruits.",
]


@dataclass
class Worker:
    name: str
    start: int
    end: int
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_worker(model: Path, name: str, start: int, end: int, threads: int, log: Path) -> Worker:
    port = free_port()
    cmd = worker_command(model, name, port, layers=(start, end), num_threads=threads,
                         peers="127.0.0.1:*", kv_cache_bytes=256 * 1024 * 1024)
    return Worker(name, start, end, port, spawn_worker(cmd, log, num_threads=threads))


class _Echo:
    """A HelixWorker whose Work stream answers every message at once: the gRPC floor."""

    async def Work(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        from helixserve.runtime.proto import helix_pb2 as pb

        async for _ in request_iterator:
            yield pb.ResultBatch(results=[pb.WorkResult(request_id="echo")])


async def echo_server(port: int) -> None:
    import grpc

    from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

    class Servicer(_Echo, pb_grpc.HelixWorkerServicer):
        pass

    server = grpc.aio.server()
    pb_grpc.add_HelixWorkerServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def grpc_floor(port: int, gap_s: float, pings: int) -> list[float]:
    """Round trips (s) of one small message over a gRPC aio stream to another process, each
    after `gap_s` of idleness: what a hop costs with no work at all, on this machine."""
    import grpc

    from helixserve.runtime.proto import helix_pb2 as pb
    from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def requests() -> Any:
        while True:
            yield await queue.get()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        call = pb_grpc.HelixWorkerStub(channel).Work(requests())
        replies = call.__aiter__()
        item = pb.WorkItem(request_id="echo", token_ids=[1])
        out = []
        for i in range(pings + 5):
            await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            queue.put_nowait(pb.WorkBatch(items=[item]))
            await replies.__anext__()
            if i >= 5:
                out.append(time.perf_counter() - t0)
        call.cancel()
    return out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


async def make_coordinator(model: Path, workers: list[Worker]) -> Any:
    from helixserve.planner.placement import Flow, NodeRange, Placement
    from helixserve.runtime import Coordinator
    from helixserve.spec import ClusterSpec, NodeSpec

    chain = ["coordinator", *(w.name for w in workers), "coordinator"]
    placement = Placement(
        model=model.name, cluster="bench", num_layers=NUM_LAYERS, planner="bench",
        nodes=[NodeRange(w.name, w.start, w.end) for w in workers],
        flows=[Flow(a, b, 1.0) for a, b in zip(chain, chain[1:], strict=False)],
    )
    cluster = ClusterSpec("bench", [NodeSpec(w.name, "L4", address=w.address) for w in workers])
    return await Coordinator.create(cluster, placement, model)


async def node_counters(coord: Any) -> dict[str, tuple[int, int, int, int]]:
    """(engine steps, items run, Work/result messages sent, items they carried) per node, fresh
    from the workers, and the coordinator's messages to its workers (key "coordinator")."""
    for n in coord.nodes.values():
        await n.refresh_info()
    # (a tree from before these counters existed reports no messages: 0)
    out = {name: (n.info.steps, n.info.items_run, getattr(n.info, "work_messages_out", 0),
                  getattr(n.info, "work_items_out", 0)) for name, n in coord.nodes.items()}
    out["coordinator"] = (0, 0, sum(getattr(n, "messages_out", 0) for n in coord.nodes.values()),
                          sum(getattr(n, "items_out", 0) for n in coord.nodes.values()))
    return out


def encode(coord: Any, question: str) -> list[int]:
    tok = coord.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


async def one_stream(coord: Any, rid: str, prompt: list[int], max_tokens: int) -> list[tuple[float, float, int]]:
    """(inter-token latency s, engine compute s, hops) per decoded token after the first."""
    from helixserve.request import SamplingParams
    from helixserve.runtime import GenerationRequest

    req = GenerationRequest(rid, prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens,
                            ignore_eos=True)
    out = []
    last = None
    async for ev in coord.generate(req):
        now = time.perf_counter()
        if last is not None:
            out.append((now - last, ev.compute_s, ev.num_hops))
        last = now
    return out


async def measure_overhead(coord: Any, prompts: list[list[int]], tokens: int, rounds: int) -> list[tuple[float, float, int]]:
    samples = []
    for r in range(rounds):
        for i, p in enumerate(prompts):
            samples += await one_stream(coord, f"ovh-{r}-{i}", p, tokens)
    return samples


async def measure_throughput(coord: Any, prompts: list[list[int]], streams: int, tokens: int) -> float:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        one_stream(coord, f"tput-{i}", prompts[i % len(prompts)], tokens) for i in range(streams)
    ))
    wall = time.perf_counter() - t0
    return sum(len(r) + 1 for r in results) / wall


async def run(args: argparse.Namespace, setups: dict[str, list[Worker]], model: Path) -> dict[str, Any]:
    coords = {name: await make_coordinator(model, ws) for name, ws in setups.items()}
    try:
        prompts = [encode(coords["single"], q) for q in PROMPTS]
        # warm-up: first steps allocate and fill caches
        for c in coords.values():
            await one_stream(c, "warm", prompts[0], 4)
        overhead: dict[str, list[tuple[float, float, int]]] = {n: [] for n in coords}
        tput: dict[str, list[float]] = {n: [] for n in coords}
        mean_batch: dict[str, dict[str, float]] = {}
        per_message: dict[str, dict[str, float]] = {}
        cpu: dict[str, list[tuple[float, float]]] = {n: [] for n in coords}
        for _ in range(args.rounds):
            for name, c in coords.items():
                overhead[name] += await measure_overhead(c, prompts, args.tokens, 1)
            for name, c in coords.items():
                before = await node_counters(c)
                pids = [w.proc.pid for w in setups[name]]
                coord0, workers0 = time.process_time(), sum(process_cpu_s(p) for p in pids)
                tput[name].append(await measure_throughput(c, prompts, args.streams, args.tokens))
                tokens = args.streams * args.tokens
                cpu[name].append(((time.process_time() - coord0) * 1000 / tokens,
                                  (sum(process_cpu_s(p) for p in pids) - workers0) * 1000 / tokens))
                after = await node_counters(c)
                mean_batch[name] = {
                    n: (after[n][1] - before[n][1]) / max(1, after[n][0] - before[n][0])
                    for n in after if n != "coordinator"
                }
                per_message[name] = {
                    n: (after[n][3] - before[n][3]) / max(1, after[n][2] - before[n][2])
                    for n in after
                }
    finally:
        for c in coords.values():
            await c.close()
    result: dict[str, Any] = {"setups": {}}
    for name in coords:
        s = overhead[name]
        per_hop_ms = [(itl - comp) / hops * 1000 for itl, comp, hops in s]
        result["setups"][name] = {
            "hops": s[0][2],
            "tokens_measured": len(s),
            "itl_p50_ms": percentile([x[0] * 1000 for x in s], 50),
            "engine_p50_ms": percentile([x[1] * 1000 for x in s], 50),
            "overhead_per_hop_p50_ms": percentile(per_hop_ms, 50),
            "overhead_per_hop_p99_ms": percentile(per_hop_ms, 99),
            "overhead_per_hop_mean_ms": statistics.fmean(per_hop_ms),
            "throughput_tokens_per_s": tput[name],
            "throughput_median_tokens_per_s": statistics.median(tput[name]),
            "mean_batch_items_per_node_last_round": mean_batch[name],
            # items (or results) per Work/result message each sender sent, under --streams
            "items_per_message_last_round": per_message[name],
            # CPU ms per output token under --streams: this process (the coordinator), and
            # the workers' processes together (engine included); median over rounds
            "coordinator_cpu_ms_per_token": statistics.median(x[0] for x in cpu[name]),
            "workers_cpu_ms_per_token": statistics.median(x[1] for x in cpu[name]),
        }
    gap_s = result["setups"]["single"]["itl_p50_ms"] / 1000
    port = free_port()
    echo = subprocess.Popen([sys.executable, "-m", "benchmarks.runtime_overhead",
                             "--echo-server", str(port)], cwd=Path(__file__).resolve().parents[1])
    try:
        rtts = await grpc_floor(port, gap_s, pings=100)
        busy = await grpc_floor(port, 0.0, pings=300)
    finally:
        echo.terminate()
        echo.wait()
    result["grpc_floor"] = {
        "idle_gap_ms": gap_s * 1000,
        "rtt_after_idle_p50_ms": percentile([r * 1000 for r in rtts], 50),
        "rtt_after_idle_p99_ms": percentile([r * 1000 for r in rtts], 99),
        "rtt_back_to_back_p50_ms": percentile([r * 1000 for r in busy], 50),
    }
    ratios = [p / s for p, s in zip(tput["pipeline"], tput["single"], strict=True)]
    result["pipeline_over_single_throughput"] = ratios
    result["pipeline_over_single_median"] = statistics.median(ratios)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams (throughput)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per setup")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--echo-server", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        asyncio.run(echo_server(args.echo_server))
        return 0

    from helixserve.engine import prepare_demo_model

    model = prepare_demo_model()
    tmp = Path(tempfile.mkdtemp(prefix="helix-bench-"))
    specs = {"single": [("s", 0, 30)], "pipeline": [("p0", 0, 10), ("p1", 10, 20), ("p2", 20, 30)]}
    setups = {k: [start_worker(model, n, a, b, args.threads, tmp / f"{n}.log") for n, a, b in v]
              for k, v in specs.items()}
    all_workers = [w for ws in setups.values() for w in ws]
    try:
        result = asyncio.run(run(args, setups, model))
    finally:
        stop_processes([w.proc for w in all_workers], grace_s=30.0)
    result["config"] = {
        "tokens": args.tokens, "streams": args.streams, "rounds": args.rounds,
        "threads_per_worker": args.threads, "model": model.name,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join(["python", *sys.argv]),
    }
    print(f"{'setup':<10} {'hops':>4} {'tokens':>6} {'ITL p50':>9} {'engine p50':>11} "
          f"{'ovh/hop p50':>12} {'ovh/hop p99':>12} {'tok/s (16 streams)':>19}")
    for name, r in result["setups"].items():
        print(f"{name:<10} {r['hops']:>4} {r['tokens_measured']:>6} {r['itl_p50_ms']:>7.1f}ms "
              f"{r['engine_p50_ms']:>9.1f}ms {r['overhead_per_hop_p50_ms']:>10.2f}ms "
              f"{r['overhead_per_hop_p99_ms']:>10.2f}ms {r['throughput_median_tokens_per_s']:>19.1f}")
    for name, r in result["setups"].items():
        batches = ", ".join(f"{n} {b:.1f}" for n, b in r["mean_batch_items_per_node_last_round"].items())
        print(f"{name}: mean items per engine step under {args.streams} streams: {batches}")
        per_msg = ", ".join(f"{n} {b:.1f}" for n, b in r["items_per_message_last_round"].items())
        print(f"{name}: items per message sent under {args.streams} streams: {per_msg}")
        print(f"{name}: CPU ms per output token under {args.streams} streams: coordinator "
              f"{r['coordinator_cpu_ms_per_token']:.3f}, workers {r['workers_cpu_ms_per_token']:.2f}")
    floor = result["grpc_floor"]
    print(f"gRPC floor (echo to another process, round trip): p50 "
          f"{floor['rtt_after_idle_p50_ms']:.2f} ms after {floor['idle_gap_ms']:.0f} ms idle, "
          f"{floor['rtt_back_to_back_p50_ms']:.2f} ms back to back")
    print(f"pipeline / single throughput (median of rounds): {result['pipeline_over_single_median']:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
