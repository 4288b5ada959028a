"""CPU per message of the worker-to-worker data plane: gRPC's bidi stream vs alternatives.

Issue 27's CPU target (docs/benchmarks.md, "Where the CPU goes"): at saturation the workers'
CPU went mostly to gRPC per message (poller threads, HTTP/2, TLS) and to the loop's Python
around it. This measures one worker -> next-hop stream alone, on loopback with mutual TLS
(certificates from `security.create_dev_credentials`, as the rehearsal's): a sender process
writes `--messages` WorkBatch messages of `--items` decode items (one token, a
`--payload-bytes` activation payload each: the rehearsal's 64-byte payload) at `--rate`
messages/s (0: as fast as it can), a receiver process parses them; each side's process CPU
(all threads: gRPC's pollers included) over the run, divided by the messages.

Transports (`--transports`, each run in turn, alternating `--rounds` times, so a loaded host
hits all alike):
- `grpc-gen`: today's worker, grpc.aio `Work` with an async-generator request iterator fed
  from a queue (runtime/peers.py `GrpcPeer`), the server reading with `async for`;
- `grpc-write`: grpc.aio, `call.write()` and `context.read()` (no request iterator task);
- `tls-stream`: an asyncio TLS connection (ssl.SSLContext from the same files, CA required
  both ways) carrying 4-byte length-prefixed WorkBatch frames;
- the same with `-plain` appended: no TLS, for the share of TLS.

    python -m benchmarks.dataplane --json /tmp/dataplane.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

TRANSPORTS = ("grpc-gen", "grpc-write", "tls-stream", "grpc-gen-plain", "tls-stream-plain")
FRAME = struct.Struct("!I")


def make_batch(items: int, payload_bytes: int, seq: int) -> pb.WorkBatch:
    """A batch of continuation decode items, as a worker sends its next hop at decode."""
    batch = pb.WorkBatch()
    for i in range(items):
        it = batch.items.add()
        it.request_id = f"req-{i:04d}-0123456789abcdef"
        it.step_id = seq
        it.position = 100 + seq
        it.token_ids.append(1234)
        it.compute_s = 0.0123
        it.hidden.shape.extend([1, payload_bytes // 2])
        it.hidden.dtype = "float16"
        it.hidden.data = bytes(payload_bytes)
    return batch


def ssl_contexts(tls: security.TlsConfig, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(tls.cert_path, tls.key_path)
    ctx.load_verify_locations(tls.ca_path)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


# ---- receiver (a child process) -------------------------------------------------------------


async def receive(transport: str, port: int, certs: Path, expect: int) -> None:
    secure = not transport.endswith("-plain")
    tls = security.load_tls(certs / "n1.crt", certs / "n1.key", certs / "ca.crt") if secure else None
    done = asyncio.get_running_loop().create_future()
    t0: list[float] = []

    def finish(count: int) -> str:
        return json.dumps({"cpu_s": time.process_time() - t0[0], "count": count})

    if transport.startswith("grpc"):
        import grpc

        class Servicer(pb_grpc.HelixWorkerServicer):
            async def Work(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
                count = 0
                if transport.startswith("grpc-write"):
                    while True:
                        batch = await context.read()
                        if batch is grpc.aio.EOF:
                            break
                        if not t0:
                            t0.append(time.process_time())
                        count += 1
                        if count == expect:
                            break
                else:
                    async for _batch in request_iterator:
                        if not t0:
                            t0.append(time.process_time())
                        count += 1
                        if count == expect:
                            break
                yield pb.ResultBatch(results=[pb.WorkResult(error=finish(count))])
                done.set_result(None)

        server = grpc.aio.server(options=tp.SERVER_OPTIONS)
        pb_grpc.add_HelixWorkerServicer_to_server(Servicer(), server)
        security.add_port(server, f"127.0.0.1:{port}", tls)
        await server.start()
        print("ready", flush=True)
        await done
        await asyncio.sleep(0.2)
        await server.stop(None)
        return

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        count = 0
        while count < expect:
            (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            batch = pb.WorkBatch()
            batch.ParseFromString(await reader.readexactly(n))
            if not t0:
                t0.append(time.process_time())
            count += 1
        reply = finish(count).encode()
        writer.write(FRAME.pack(len(reply)) + reply)
        await writer.drain()
        writer.close()
        done.set_result(None)

    srv = await asyncio.start_server(handle, "127.0.0.1", port,
                                     ssl=ssl_contexts(tls, server=True) if tls else None)
    print("ready", flush=True)
    await done
    srv.close()


# ---- sender (this process) ------------------------------------------------------------------


async def pace(rate: float, i: int, start: float) -> None:
    if rate > 0:
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def send(transport: str, port: int, certs: Path, args: argparse.Namespace) -> dict[str, Any]:
    secure = not transport.endswith("-plain")
    tls = security.load_tls(certs / "n0.crt", certs / "n0.key", certs / "ca.crt") if secure else None
    address = f"127.0.0.1:{port}"
    n = args.messages
    batches = [make_batch(args.items, args.payload_bytes, s) for s in range(64)]
    warm = make_batch(args.items, args.payload_bytes, 0)
    if transport.startswith("grpc"):
        channel = security.aio_channel(address, tls, tp.CHANNEL_OPTIONS)
        stub = pb_grpc.HelixWorkerStub(channel)
        if transport.startswith("grpc-write"):
            call = stub.Work()
            await call.write(warm)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(1, n):
                await pace(args.rate, i, t0)
                await call.write(batches[i % 64])
            await call.done_writing()
        else:
            q: asyncio.Queue[pb.WorkBatch | None] = asyncio.Queue()

            async def requests() -> Any:
                while True:
                    b = await q.get()
                    if b is None:
                        return
                    yield b

            call = stub.Work(requests())
            q.put_nowait(warm)
            await asyncio.sleep(0.05)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(1, n):
                await pace(args.rate, i, t0)
                q.put_nowait(batches[i % 64])
                if args.rate <= 0 and i % 64 == 0:
                    await asyncio.sleep(0)  # let the iterator drain the queue
            q.put_nowait(None)
        reply = None
        async for r in call:
            reply = r
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        await channel.close()
        assert reply is not None
        peer = json.loads(reply.results[0].error)
    else:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ssl_contexts(tls, server=False) if tls else None,
            server_hostname="127.0.0.1" if tls else None)
        data = warm.SerializeToString()
        writer.write(FRAME.pack(len(data)) + data)
        await writer.drain()
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(1, n):
            await pace(args.rate, i, t0)
            data = batches[i % 64].SerializeToString()
            writer.write(FRAME.pack(len(data)) + data)
            await writer.drain()
        (m,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        peer = json.loads(await reader.readexactly(m))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        writer.close()
    assert peer["count"] == n, peer
    return {"transport": transport, "messages_per_s": (n - 1) / wall,
            "sender_cpu_ms_per_message": 1000 * cpu / (n - 1),
            "receiver_cpu_ms_per_message": 1000 * peer["cpu_s"] / (n - 1)}


def one_run(transport: str, certs: Path, args: argparse.Namespace) -> dict[str, Any]:
    from helixserve.local.launch import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.dataplane", "--receive", transport, str(port),
         str(certs), str(args.messages)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        return asyncio.run(send(transport, port, certs, args))
    finally:
        child.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--items", type=int, default=5, help="decode items a message (default 5)")
    ap.add_argument("--payload-bytes", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1000.0, help="messages/s; 0: as fast as it can")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--receive", nargs=4, metavar=("TRANSPORT", "PORT", "CERTS", "N"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receive:
        transport, port, certs, n = args.receive
        asyncio.run(receive(transport, int(port), Path(certs), int(n)))
        return 0
    certs = Path(tempfile.mkdtemp(prefix="helix-dataplane-")) / "certs"
    security.create_dev_credentials(certs, ["n0", "n1"])
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in args.transports}
    for _ in range(args.rounds):
        for t in args.transports:
            runs[t].append(one_run(t, certs, args))
    rows = []
    print(f"{'transport':18} {'msg/s':>8} {'send ms/msg':>12} {'recv ms/msg':>12} {'both':>7}")
    for t, rs in runs.items():
        row = {k: statistics.median(r[k] for r in rs)
               for k in ("messages_per_s", "sender_cpu_ms_per_message",
                         "receiver_cpu_ms_per_message")}
        row["transport"] = t
        rows.append(row)
        print(f"{t:18} {row['messages_per_s']:8.0f} {row['sender_cpu_ms_per_message']:12.3f} "
              f"{row['receiver_cpu_ms_per_message']:12.3f} "
              f"{row['sender_cpu_ms_per_message'] + row['receiver_cpu_ms_per_message']:7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k not in ("json", "receive")},
                                         "load_avg": os.getloadavg(), "median": rows,
                                         "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
