"""A userspace TCP proxy that gives every emulated link its own bandwidth and latency.

Why userspace: this kernel has no `netem`, so `tc` can rate-limit but not delay; one
mechanism for both keeps a link's bandwidth and latency consistent, and needs no root.

Topology: every emulated machine's worker listens on a private port; the proxy listens on
the machine's public address (the one in the cluster YAML, so the coordinator and the other
workers connect there) and forwards to the private port. Which link a connection travels
is (source machine, destination machine): the destination is the listening address, the
source is found from the connection's peer port: /proc/net/tcp gives the socket's inode,
and the process holding that inode among its file descriptors is one of the rig's workers
(or the coordinator). Loopback connections all come from 127.0.0.1, so the address alone
cannot say who is calling.

A link is one FIFO per direction: a chunk read at time t leaves when the link has sent
everything before it (serialization at `bandwidth_gbps`, shared by all connections on the
link), and arrives `latency_ms` later. The reverse direction of a connection (replies,
results) travels the reverse link (dst -> src).

Run as a process: `python benchmarks/rig/proxy.py CONFIG.json` (see `ProxyConfig`); it
prints `ready` once listening, stops on SIGTERM/SIGINT or after `max_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from helixserve.rehearse.links import RESOLVE_RETRIES, RESOLVE_RETRY_S, pid_holding, socket_inode

#: bytes read from a socket at once; one chunk is one unit of the link FIFO
CHUNK_BYTES = 64 * 1024
#: chunks queued per connection direction before the reader waits (bounded memory)
MAX_QUEUED_CHUNKS = 256
#: name of the source when a connection's process is not a known worker
DEFAULT_SOURCE = "coordinator"


@dataclass(frozen=True)
class LinkShape:
    """One direction of an emulated link."""

    #: Gbit/s (10^9 bit/s); 0 = unlimited
    bandwidth_gbps: float
    latency_ms: float


class Link:
    """One direction of a link: a FIFO with a serialization rate and a propagation delay."""

    def __init__(self, shape: LinkShape) -> None:
        self.shape = shape
        self.free_at_s = 0.0  # when the link has finished sending what it was given
        self.bytes_sent = 0

    def schedule(self, num_bytes: int, now_s: float) -> float:
        """Arrival time of `num_bytes` handed to the link at `now_s`."""
        start = max(now_s, self.free_at_s)
        tx_s = num_bytes * 8 / (self.shape.bandwidth_gbps * 1e9) if self.shape.bandwidth_gbps else 0
        self.free_at_s = start + tx_s
        self.bytes_sent += num_bytes
        return self.free_at_s + self.shape.latency_ms / 1000.0


@dataclass(frozen=True)
class ProxyRoute:
    """Connections to `listen` reach `target`; `node` is the destination machine."""

    node: str
    listen_host: str
    listen_port: int
    target_host: str
    target_port: int


@dataclass
class ProxyConfig:
    routes: list[ProxyRoute]
    #: (src, dst) -> shape; pairs not listed use `default`
    links: dict[tuple[str, str], LinkShape]
    default: LinkShape
    #: JSON file {pid: machine name}, re-read when it changes (workers start after the proxy)
    pid_map_path: str | None = None
    max_seconds: float = 3600.0
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "routes": [r.__dict__ for r in self.routes],
            "links": [{"src": s, "dst": d, **shape.__dict__} for (s, d), shape in self.links.items()],
            "default": self.default.__dict__,
            "pid_map_path": self.pid_map_path,
            "max_seconds": self.max_seconds,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        raw = json.loads(text)
        return cls(
            routes=[ProxyRoute(**r) for r in raw["routes"]],
            links={(r["src"], r["dst"]): LinkShape(r["bandwidth_gbps"], r["latency_ms"])
                   for r in raw["links"]},
            default=LinkShape(**raw["default"]),
            pid_map_path=raw.get("pid_map_path"),
            max_seconds=float(raw.get("max_seconds", 3600.0)),
        )


# ---- who is calling (the sockets' owners: helixserve/rehearse/links.py) ---------------------


class SourceResolver:
    """Machine name of a connection's peer, via its socket's owning process."""

    def __init__(self, pid_map_path: str | None) -> None:
        self.path = Path(pid_map_path) if pid_map_path else None
        self._mtime = -1.0
        self._pids: dict[int, str] = {}

    def _reload(self) -> None:
        if self.path is None:
            return
        with contextlib.suppress(OSError, ValueError):
            mtime = self.path.stat().st_mtime
            if mtime != self._mtime:
                self._pids = {int(k): str(v) for k, v in json.loads(self.path.read_text()).items()}
                self._mtime = mtime

    def __call__(self, peer: tuple[str, int]) -> str:
        self._reload()
        if not self._pids:
            return DEFAULT_SOURCE
        inode = socket_inode(peer[0], peer[1])
        pid = pid_holding(inode, list(self._pids)) if inode is not None else None
        return self._pids.get(pid, DEFAULT_SOURCE) if pid is not None else DEFAULT_SOURCE


# ---- the proxy -----------------------------------------------------------------------------


class LinkProxy:
    def __init__(self, config: ProxyConfig,
                 resolve: Callable[[tuple[str, int]], str] | None = None) -> None:
        self.config = config
        self.resolve = resolve or SourceResolver(config.pid_map_path)
        self.links: dict[tuple[str, str], Link] = {}
        self.servers: list[asyncio.AbstractServer] = []
        self.connections: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def link(self, src: str, dst: str) -> Link:
        key = (src, dst)
        if key not in self.links:
            self.links[key] = Link(self.config.links.get(key, self.config.default))
        return self.links[key]

    async def start(self) -> None:
        for route in self.config.routes:
            server = await asyncio.start_server(
                lambda r, w, route=route: self._accept(r, w, route),
                route.listen_host, route.listen_port, reuse_address=True)
            self.servers.append(server)

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      route: ProxyRoute) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        peer = writer.get_extra_info("peername")
        src = self.resolve((peer[0], peer[1])) if peer else DEFAULT_SOURCE
        # a worker's socket may not be found at once on a loaded host: ask again before
        # counting the peer as the coordinator (as helixserve rehearse's proxy does)
        for _ in range(RESOLVE_RETRIES if peer else 0):
            if src != DEFAULT_SOURCE:
                break
            await asyncio.sleep(RESOLVE_RETRY_S)
            src = self.resolve((peer[0], peer[1]))
        self.connections[(src, route.node)] = self.connections.get((src, route.node), 0) + 1
        try:
            up_reader, up_writer = await asyncio.open_connection(route.target_host,
                                                                 route.target_port)
        except OSError:
            writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]
            return
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, self.link(src, route.node)),
                self._pump(up_reader, writer, self.link(route.node, src)),
            )
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    link: Link) -> None:
        """Copy reader -> writer, each chunk delivered at the link's arrival time."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)

        async def deliver() -> None:
            while True:
                at_s, data = await chunks.get()
                if not data:
                    break
                delay_s = at_s - loop.time()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(Exception):
                writer.write_eof()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                await chunks.put((link.schedule(len(data), loop.time()), data))
            await chunks.put((loop.time(), b""))
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()

    def stats(self) -> dict[str, dict[str, float]]:
        return {f"{s}->{d}": {"bytes": link.bytes_sent, "connections": self.connections.get((s, d), 0)}
                for (s, d), link in sorted(self.links.items())}


async def _main(config_path: str) -> None:
    config = ProxyConfig.from_json(Path(config_path).read_text())
    proxy = LinkProxy(config)
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    t0 = time.monotonic()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=config.max_seconds)
    await proxy.close()
    print(json.dumps({"stats": proxy.stats(), "ran_s": round(time.monotonic() - t0, 1)}),
          flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python benchmarks/rig/proxy.py CONFIG.json", file=sys.stderr)
        sys.exit(2)
    asyncio.run(_main(sys.argv[1]))
