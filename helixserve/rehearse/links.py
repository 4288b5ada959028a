"""Links as the cluster file says: a userspace TCP proxy per machine, one FIFO per directed link.

Why userspace: this host's kernel has no `netem` (tc can rate-limit but not delay), and
network namespaces need root; one mechanism for bandwidth and latency keeps a link's two
numbers consistent and needs no privileges. Traffic stays on 127.0.0.0/8.

Topology: every emulated machine's worker listens on a private port; the proxy listens on the
machine's public address (the `address` the rehearsal writes into its copy of the cluster
file, so the coordinator and the other workers connect there) and forwards to the private
port. The rehearsal puts every machine on 127.0.0.1; the rig (benchmarks/rig) gives each its
own loopback address (`ProxyRoute.host`). A connection travels the directed link (source machine, destination machine): the
destination is the listening port; the source is found from the connection's peer port:
/proc/net/tcp (or tcp6: gRPC uses dual-stack sockets) gives the socket's inode, and the
process holding that inode among its file descriptors is one of the rehearsal's workers or
its coordinator. Loopback connections all come from 127.0.0.1, so the address alone cannot
say who is calling.

A direction of a link is one FIFO shared by all connections on it: a chunk read at time t
leaves when the link has sent everything queued before it (serialization at
`bandwidth_gbps`), and arrives `latency_ms` later. Replies on a connection (the last hop's
tokens on the coordinator's stream, flow control) travel the reverse link. Times are x
`time_scale` (bandwidth / K, latency x K), as the emulated GPUs' are.

A caller whose socket is not in /proc/net/tcp(6) (that table is read in pieces while
connections come and go, and an entry can be missed on a busy host) is looked up again,
waiting longer each time; one still not found is `UNATTRIBUTED`: its bytes are forwarded
without limits and counted apart (the stats file's "unattributed", `read_unattributed`),
never credited to the coordinator. Only a socket found and held by none of the workers is
the other source's (the coordinator's).

Declared bytes (the link ledger). An emulated worker may send its activations as a smaller
payload (engine/emulated.py): the proxy sees only TLS ciphertext, so the sender declares the
bytes it left out, just before it writes the batch they belong to, as one datagram on an
abstract unix socket (`ProxyConfig.ledger`; runtime/transport.py `declare_unsent`): "node
src, the next hop's address, K bytes" and, optionally, a fourth line: "W", the batch's own
size on the wire. The proxy names the destination by the address (the route listening
there). A declaration with W is a debt of K bytes spread over the next W bytes the link
reads (`Link.debts`, oldest first): each chunk carries the declared bytes of the messages,
or the parts of them, it holds, so a message leaves after its own real size, however many
messages the sender wrote ahead of the proxy. That holds only while the W named add up to
the bytes read: a W short of the message (its payloads alone, without its ids, route and
gRPC / HTTP/2 / TLS framing) lets each message's bytes pay debts of messages written after
it, and on a link that never drains a decode step's message waits for the next prefill
chunk's megabytes, which the simulator (one FIFO transfer per message) never makes it wait
for (issue 27, helix-geo-24). The workers name the serialized batch with its framing
(runtime/transport.py `_wire_bytes`): exactly what this proxy reads for a message written
whole (tests/integration/rehearse/test_declared_sizes.py); what no declaration names is a
stream's HEADERS (~250 bytes, once) and a frame and a TLS record more (31 bytes) when flow
control splits a message. One without W adds K to the link's pending
debt, all of which rides on the next chunk read: right when the proxy reads each batch as
it comes (the datagram is queued before the worker writes the batch, and one loop pass
handles it before the pump it wakes), but a sender that runs ahead lumps the debts of all
the batches it declared meanwhile onto one chunk, which then arrives that much later and
its receiver hears nothing in between (gRPC's aio writes do not wait for HTTP/2 flow
control, and with the payload 64 bytes a token the wire bytes are ~1/256 of the real
ones, so a worker runs ahead by up to tens of MB of real bytes; issue 27). Either way the
link's total is the same. Stats: `bytes` are charged (on the wire + declared), `wire_bytes`
and `declared_bytes` apart. A unix datagram socket does not drop; a declaration naming no
route is counted in the stats file's "undeclared" section, never on a link.

Delivery in pieces. A chunk (one read of a socket, up to CHUNK_BYTES: with a smaller payload,
often several messages) arrives message by message (`Link.pieces`): the bytes of each sized
declaration's message arrive once they and their own declared bytes have been serialized,
as the simulator's FIFO delivers each transfer, so a decode step's small message read with
the next prefill chunk's does not wait for that one's megabytes. A message ends with the TLS
record that holds the last byte its declaration names (`TlsRecords`: a record's 5-byte
header is in the clear; gRPC ends a record with each message it writes), so the bytes no
declaration names (a stream's HEADERS, a frame and record more where flow control split a
message) stay with their message rather than waiting with the next one. A message (or the
unsized rest of a chunk) whose serialization takes over PIECE_GAP_S arrives in pieces of at
least PIECE_MIN_BYTES (a TLS record is read whole) spread evenly over it, its last byte when
it is serialized: a real link delivers bytes as they come off the wire, and gRPC counts any
bytes read as the peer being alive, so a receiver must not hear nothing for the whole of a
long message.

Backpressure (the link's window, `ProxyConfig.window_bytes`). A real link does not queue
what its senders write for minutes: the sender's socket buffer and flow control hold it back
once a few MiB are in flight. Here a link stops taking chunks while `window_bytes` or more
wait to be serialized (`Link.room_at_s`), in real bytes (on the wire + declared), so the
sender's socket and HTTP/2 window fill and its writes wait. Without it a link's FIFO grew
to minutes on helix-geo-24, a keepalive PING sent after a quiet spell waited behind it for
its ACK, and gRPC closed the connection (`GOAWAY ping_timeout`; issue 27). The window holds
back only links whose declarations are sized (or that carry real bytes): while unsized
declared bytes are pending, the next chunk is taken at once, since holding it back would
lump the debts of every batch declared meanwhile onto it (gRPC's aio writes do not wait for
HTTP/2 flow control, so a worker keeps declaring) and a connection held back longer than
the keepalive timeout is aborted (seen with a 1 s timeout: `recvmsg: Connection timed
out`, the kernel's TCP_USER_TIMEOUT, which gRPC sets from the keepalive timeout). Stats: `bytes` are what a link ACCEPTED, not what it delivered: `backlog_bytes` is
the part still to be serialized when the stats were written (delivered = bytes -
backlog_bytes; a broken connection's chunks count as delivered: they kept the link busy as
lost bytes would). Without a window a link can accept far more than its bandwidth x wall
time (helix-geo-24 milp, issue 27: n1 -> n8 accepted 757 MB against 568 MB of capacity).

A pair the cluster file gives no link (`ClusterSpec.link` is None: bandwidth 0) should carry
nothing, since no route uses it; if it does, its bytes are forwarded without limits and
counted under that pair with `"unlinked": true`, so the report shows it.

Run as a process: `python -m helixserve.rehearse.links CONFIG.json` (see `ProxyConfig`): it
prints `ready` once listening; SIGUSR1 writes the per-link counters to `stats_path`; SIGTERM
or SIGINT (or `max_seconds`) stops it, after writing them once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from helixserve.spec.cluster import COORDINATOR, ClusterSpec

#: bytes read from a socket at once; one chunk is one unit of a link's FIFO
CHUNK_BYTES = 64 * 1024
#: chunks queued per connection direction before the reader waits (bounded memory)
MAX_QUEUED_CHUNKS = 256
#: real bytes (on the wire + declared) a link with a window holds accepted but not yet
#: serialized before it stops reading its connections (module doc, Backpressure): Linux's
#: largest default TCP send buffer (net.ipv4.tcp_wmem's max)
WINDOW_BYTES = 4 * 1024 * 1024
#: a chunk longer than this on the wire (declared bytes included) arrives in pieces spread
#: over its serialization (`Link.pieces`), each at least PIECE_MIN_BYTES: a TLS record
#: holds up to 16 KiB and the receiver can read none of it before it is whole
PIECE_GAP_S = 0.25
PIECE_MIN_BYTES = 17 * 1024


@dataclass(frozen=True)
class LinkShape:
    """One direction of an emulated link, already x time scale."""

    #: Gbit/s (10^9 bit/s); 0: unlimited (a pair the cluster file gives no link)
    bandwidth_gbps: float
    latency_ms: float

    @property
    def limited(self) -> bool:
        return self.bandwidth_gbps > 0


#: what a pair without a link in the cluster file gets (module doc)
UNLIMITED = LinkShape(0.0, 0.0)


def link_table(cluster: ClusterSpec, names: list[str],
               time_scale: float = 1.0) -> dict[tuple[str, str], LinkShape]:
    """Every directed link between `names` (nodes and "coordinator") that the cluster file
    gives, as the planner and the simulator read it (`ClusterSpec.effective_bandwidth_gbps`:
    the link capped by both ends' NICs; `ClusterSpec.link` latency), times `time_scale`."""
    out: dict[tuple[str, str], LinkShape] = {}
    for src in names:
        for dst in names:
            if src == dst:
                continue
            link = cluster.link(src, dst)
            if link is None:
                continue
            out[(src, dst)] = LinkShape(cluster.effective_bandwidth_gbps(src, dst) / time_scale,
                                        link.latency_ms * time_scale)
    return out


class Link:
    """One direction of a link: a FIFO with a serialization rate and a propagation delay,
    which takes a chunk only while less than `window_bytes` wait to be serialized (module
    doc, Backpressure; None: unbounded)."""

    def __init__(self, shape: LinkShape, window_bytes: int | None = None) -> None:
        self.shape = shape
        self.window_bytes = window_bytes
        self.free_at_s = 0.0  # when the link has finished sending what it was given
        #: bytes that crossed the proxy (on the wire)
        self.bytes_sent = 0
        #: bytes declared by a sender (module doc), charged ahead of the next chunk
        self.bytes_declared = 0
        #: declared bytes of declarations that name no size on the wire: all ride on the
        #: next chunk
        self.pending_bytes = 0
        #: [declared bytes, bytes on the wire] still due of each declaration that names its
        #: message's size on the wire, oldest first: the chunks carry them as they carry the
        #: message's own bytes (module doc, Declared bytes)
        self.debts: deque[list[int]] = deque()
        self.chunks = 0
        #: seconds the last chunk scheduled took to serialize, its declared bytes included
        self.last_serialize_s = 0.0
        #: (bytes on the wire, when serialized) of each segment of the last chunk scheduled
        #: (`_segments`), for `pieces`
        self.last_segments: list[tuple[int, float]] = []
        #: bytes still to come of the last TLS record of a message whose debt is paid (its
        #: named size ended in a record that went on past the chunk): they are that
        #: message's, not the next one's (module doc, Delivery in pieces)
        self.record_rest = 0
        #: set by an unsized declaration: a connection held back takes its next chunk now
        self.declared_event = asyncio.Event()

    def declare(self, num_bytes: int, wire_bytes: int = 0) -> None:
        """`num_bytes` the sender left out of the message it is about to write, whose own
        bytes on the wire are `wire_bytes` (0: not said): they are serialized ahead of the
        message's bytes, spread over the chunks that carry them; without a size, all ahead
        of the next chunk."""
        self.bytes_declared += num_bytes
        if wire_bytes > 0:
            self.debts.append([num_bytes, wire_bytes])
        else:
            self.pending_bytes += num_bytes
            self.declared_event.set()

    def _segments(self, num_bytes: int,
                  records: TlsRecordEnds | None = None) -> list[list[int]]:
        """A chunk of `num_bytes` on the wire as [bytes on the wire, declared bytes due with
        them] segments, in order: one per sized declaration (or part of one) the chunk's
        bytes carry (module doc, Declared bytes), the rest with none. With the chunk's TLS
        record ends (`records`), a message ends where the record holding the last byte its
        declaration names ends: a message written whole ends a record, and what no
        declaration names (a stream's HEADERS, a frame and record more where flow control
        split a message) would otherwise put a message's last bytes in the next one's
        segment, to wait for that one's declared bytes."""
        out: list[list[int]] = []
        pos = 0
        if self.record_rest:  # the last record of a message whose debt was paid
            take = min(self.record_rest, num_bytes)
            out.append([take, 0])
            pos, self.record_rest = take, self.record_rest - take
        while pos < num_bytes and self.debts:
            debt = self.debts[0]
            if num_bytes - pos < debt[1]:  # the message goes on in the next chunk
                part = debt[0] * (num_bytes - pos) // debt[1]
                out.append([num_bytes - pos, part])
                debt[0] -= part
                debt[1] -= num_bytes - pos
                pos = num_bytes
                break
            end = pos + debt[1]
            if records is not None:
                snapped = next((e for e in records.ends if e >= end), None)
                if snapped is None:  # its last record goes on past the chunk
                    snapped, self.record_rest = num_bytes, records.rest
                end = snapped
            out.append([end - pos, debt[0]])
            self.debts.popleft()
            pos = end
        if pos < num_bytes:
            out.append([num_bytes - pos, 0])
        return out

    @property
    def bytes_per_s(self) -> float:
        return self.shape.bandwidth_gbps * 1e9 / 8

    def backlog_bytes(self, now_s: float) -> int:
        """Bytes accepted and not yet serialized at `now_s`, declared ones still pending
        (not yet on a chunk) included."""
        if not self.shape.limited:
            return 0
        return (round(max(0.0, self.free_at_s - now_s) * self.bytes_per_s) + self.pending_bytes
                + sum(debt[0] for debt in self.debts))

    def room_at_s(self, now_s: float) -> float:
        """When the link takes its next chunk: at once on an unlimited or unbounded link,
        or while unsized declared bytes are pending (they leave with the next chunk: held
        back, it would gather the debts of every batch declared meanwhile); else once less
        than the window waits to be serialized."""
        if self.window_bytes is None or not self.shape.limited or self.pending_bytes:
            return now_s  # unsized declared bytes wait for a chunk: take it at once
        return max(now_s, self.free_at_s - self.window_bytes / self.bytes_per_s)

    def schedule(self, num_bytes: int, now_s: float,
                 records: TlsRecordEnds | None = None) -> float:
        """Arrival time of `num_bytes` handed to the link at `now_s` (after any declared
        bytes pending). Each segment's serialization (`_segments`: a message's bytes with
        its declared ones) is kept in `last_segments` for `pieces`."""
        self.bytes_sent += num_bytes
        self.chunks += 1
        segments = self._segments(num_bytes, records) if num_bytes else [[0, 0]]
        if self.pending_bytes:  # unsized declarations ride on the chunk's first bytes
            segments[0][1] += self.pending_bytes
            self.pending_bytes = 0
        charged = num_bytes + sum(declared for _, declared in segments)
        if not self.shape.limited:
            self.last_segments = [(num_bytes, now_s)]
            return now_s
        start = max(now_s, self.free_at_s)
        self.last_serialize_s = charged / self.bytes_per_s
        self.free_at_s = start + self.last_serialize_s
        ends, done = [], 0
        for wire, declared in segments:
            done += wire + declared
            ends.append((wire, start + done / self.bytes_per_s))
        ends[-1] = (ends[-1][0], self.free_at_s)
        self.last_segments = ends
        return self.free_at_s + self.shape.latency_ms / 1000.0

    def pieces(self, data: bytes, now_s: float,
               records: TlsRecordEnds | None = None) -> list[tuple[float, bytes]]:
        """`data` handed to the link at `now_s` as (arrival time, bytes) pieces, in order: the
        bytes of each message the chunk carries (`_segments`) arrive when they, with their
        own declared bytes, have been serialized, as the simulator's FIFO delivers each
        transfer, not with the chunk's last byte: a decode step's small message read in one
        chunk with the next prefill chunk's message must not wait for that one's megabytes.
        A segment whose serialization takes over PIECE_GAP_S is cut into pieces of at least
        PIECE_MIN_BYTES that arrive evenly over it (module doc, Delivery in pieces), so the
        receiver reads as a real link's would, not nothing for seconds and then all at once.
        The last byte arrives when `schedule` says."""
        arrive_s = self.schedule(len(data), now_s, records)
        if not self.shape.limited:
            return [(arrive_s, data)]
        latency_s = arrive_s - self.free_at_s
        out: list[tuple[float, bytes]] = []
        pos, begin_s = 0, self.free_at_s - self.last_serialize_s
        for wire, end_s in self.last_segments:
            serialize_s = end_s - begin_s
            count = min(wire // PIECE_MIN_BYTES, math.ceil(serialize_s / PIECE_GAP_S))
            if count <= 1:
                out.append((end_s + latency_s, data[pos:pos + wire]))
            else:
                cuts = [pos + wire * i // count for i in range(count + 1)]
                out.extend((end_s - serialize_s * (count - i) / count + latency_s,
                            data[cuts[i - 1]:cuts[i]]) for i in range(1, count + 1))
            pos, begin_s = pos + wire, end_s
        return out


#: TLS record content types (change_cipher_spec, alert, handshake, application_data)
TLS_CONTENT_TYPES = frozenset((20, 21, 22, 23))
TLS_HEADER_BYTES = 5


@dataclass(frozen=True)
class TlsRecordEnds:
    """Where TLS records end in one chunk read from a connection: offsets in the chunk
    (after the record's last byte), and the bytes still to come of the record the chunk ends
    in (0: it ends at a record's end)."""

    ends: tuple[int, ...]
    rest: int


class TlsRecords:
    """Follows the TLS records of one direction of a connection through the chunks read from
    it. A record's 5-byte header (type, version, length) is sent in the clear, so the proxy
    sees where each ends without decrypting anything. A stream that is not TLS (a test's
    plain bytes, a cluster without mutual TLS) gives None from the first header that is not
    a record's, for good."""

    def __init__(self) -> None:
        self.body_left = 0  # bytes of the current record's body still to come
        self.header = bytearray()  # the part of a record header read so far
        self.tls = True

    def feed(self, data: bytes) -> TlsRecordEnds | None:
        if not self.tls:
            return None
        ends: list[int] = []
        i, n = 0, len(data)
        while i < n:
            if self.body_left:
                take = min(self.body_left, n - i)
                i += take
                self.body_left -= take
                if not self.body_left:
                    ends.append(i)
                continue
            take = min(TLS_HEADER_BYTES - len(self.header), n - i)
            self.header += data[i:i + take]
            i += take
            if len(self.header) == TLS_HEADER_BYTES:
                if self.header[0] not in TLS_CONTENT_TYPES or self.header[1] != 3:
                    self.tls = False
                    return None
                self.body_left = int.from_bytes(self.header[3:5], "big")
                self.header.clear()
                if not self.body_left:
                    ends.append(i)
        rest = self.body_left + (TLS_HEADER_BYTES - len(self.header) if self.header else 0)
        return TlsRecordEnds(tuple(ends), rest)


@dataclass(frozen=True)
class ProxyRoute:
    """Connections to `host`:`listen_port` reach `host`:`target_port`, machine `node`."""

    node: str
    listen_port: int
    target_port: int
    #: the machine's loopback address; None: the config's `host`
    host: str | None = None


@dataclass
class ProxyConfig:
    routes: list[ProxyRoute]
    #: (src, dst) -> shape, x time scale; a pair not here is unlinked (module doc)
    links: dict[tuple[str, str], LinkShape]
    #: {pid: machine name} of the processes whose connections are told apart (workers and
    #: the coordinator); a connection from any other process counts as `other_source`
    pids: dict[int, str]
    stats_path: str
    host: str = "127.0.0.1"
    other_source: str = COORDINATOR
    #: the proxy stops by itself after this long, whatever happens to its parent
    max_seconds: float = 3600.0
    #: the link ledger's name (an abstract unix datagram socket, "\0" + this) where senders
    #: declare the bytes they left out (module doc); None: no ledger
    ledger: str | None = None
    #: a link's window in real bytes (module doc, Backpressure); None: unbounded, the FIFO
    #: takes whatever its senders write
    window_bytes: int | None = WINDOW_BYTES

    def to_json(self) -> str:
        return json.dumps({
            "routes": [asdict(r) for r in self.routes],
            "links": [{"src": s, "dst": d, **asdict(shape)} for (s, d), shape in self.links.items()],
            "pids": {str(k): v for k, v in self.pids.items()},
            "stats_path": self.stats_path, "host": self.host, "other_source": self.other_source,
            "max_seconds": self.max_seconds, "ledger": self.ledger,
            "window_bytes": self.window_bytes,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        raw = json.loads(text)
        return cls(
            routes=[ProxyRoute(**r) for r in raw["routes"]],
            links={(r["src"], r["dst"]): LinkShape(r["bandwidth_gbps"], r["latency_ms"])
                   for r in raw["links"]},
            pids={int(k): str(v) for k, v in raw["pids"].items()},
            stats_path=raw["stats_path"], host=raw.get("host", "127.0.0.1"),
            other_source=raw.get("other_source", COORDINATOR),
            max_seconds=float(raw.get("max_seconds", 3600.0)),
            ledger=raw.get("ledger"),
            window_bytes=raw.get("window_bytes", WINDOW_BYTES),
        )


# ---- who is calling ------------------------------------------------------------------------

#: times a caller not found among the workers is looked up again, and the wait between
RESOLVE_RETRIES = 5
RESOLVE_RETRY_S = 0.02
#: a caller whose socket was not found at all is looked up this many more times, the wait
#: doubling from RESOLVE_RETRY_S (about 1.3 s in all), before it counts as UNATTRIBUTED
MISS_RETRIES = 6
#: the source of a connection whose caller could not be found (module doc)
UNATTRIBUTED = "unattributed"


def _packed(host: str, port: int, v6: bool) -> str:
    """host:port as /proc/net/tcp (v6: tcp6, a dual-stack socket's ::ffff:host) writes it."""
    v4 = "".join(f"{int(b):02X}" for b in reversed(host.split(".")))
    # /proc/net/tcp6: four 32-bit words, each in host (little-endian) byte order
    return f"{'0000000000000000FFFF0000' + v4 if v6 else v4}:{port:04X}"


def socket_inode(host: str, port: int,
                 remote: tuple[str, int] | None = None) -> int | None:
    """Inode of the local TCP socket bound to host:port and, when `remote` is given,
    connected to it, from /proc/net/tcp, or tcp6 where the caller used a dual-stack socket
    (gRPC does: the address is then ::ffff:host). Give `remote`: Linux lets connect() reuse a
    local port for another destination, so host:port alone may name another process's
    socket (seen: the proxy's own connection to a worker, which made a worker's connection
    the coordinator's and left its declared bytes charged nowhere; issue 27).

    A socket in TIME_WAIT is listed with inode 0 and may share host:port with a live one
    (seen in CI: an earlier test's closed connection from the same port hid a live IPv6
    caller), so it is passed over; 0 is returned only when nothing live matches."""
    closed = None
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        want = _packed(host, port, v6)
        peer = _packed(*remote, v6) if remote else None
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[1] == want and (peer is None or cols[2] == peer):
                if int(cols[9]):
                    return int(cols[9])
                closed = 0
    return closed


def pid_holding(inode: int, pids: list[int]) -> int | None:
    """The first of `pids` with socket `inode` among its open file descriptors."""
    target = f"socket:[{inode}]"
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    return pid
    return None


class SourceResolver:
    """Machine name of a connection's peer, via the process that holds its socket: a worker's
    name, `other` when the socket was found and none of the workers holds it, UNATTRIBUTED
    when the socket was not found (a miss, or a caller already gone)."""

    def __init__(self, pids: dict[int, str], other: str) -> None:
        self.pids = pids
        self.other = other

    def __call__(self, peer: tuple[str, int], local: tuple[str, int] | None = None) -> str:
        """`peer`: the caller's address; `local`: the address it called (the proxy's
        listening one), which tells its socket apart from others on the same port."""
        inode = socket_inode(peer[0], peer[1], local)
        if not inode:  # not listed, or listed without a socket (0: closed, TIME_WAIT)
            return UNATTRIBUTED
        pid = pid_holding(inode, list(self.pids))
        return self.other if pid is None else self.pids[pid]


# ---- the proxy -----------------------------------------------------------------------------


class LinkProxy:
    def __init__(self, config: ProxyConfig,
                 resolve: Callable[[tuple[str, int]], str] | None = None) -> None:
        self.config = config
        self.resolve = resolve or SourceResolver(config.pids, config.other_source)
        self.links: dict[tuple[str, str], Link] = {}
        self.connections: dict[tuple[str, str], int] = {}
        self.servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        #: times the counters were written (a reader waits for it to change after SIGUSR1)
        self.writes = 0
        #: "host:port" a route listens on -> its machine (declarations name the address)
        self.node_at = {f"{self.host_of(r)}:{r.listen_port}": r.node for r in config.routes}
        #: declarations whose address or message was not understood: reason -> bytes
        self.undeclared: dict[str, int] = {}
        self._ledger: asyncio.DatagramTransport | None = None
        #: seconds spent finding callers (`_resolve_off_loop`), on threads, summed
        self.resolve_s = 0.0

    def link(self, src: str, dst: str) -> Link:
        key = (src, dst)
        if key not in self.links:
            self.links[key] = Link(self.config.links.get(key, UNLIMITED),
                                   self.config.window_bytes)
        return self.links[key]

    def host_of(self, route: ProxyRoute) -> str:
        return route.host or self.config.host

    async def start(self) -> None:
        for route in self.config.routes:
            server = await asyncio.start_server(
                functools.partial(self._accept, route=route),
                self.host_of(route), route.listen_port, reuse_address=True)
            self.servers.append(server)
        if self.config.ledger:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind("\0" + self.config.ledger)
            sock.setblocking(False)
            transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                functools.partial(_LedgerProtocol, self), sock=sock)
            self._ledger = transport

    def declared(self, message: bytes) -> None:
        """A sender's declaration (runtime/transport.py `ledger_message`): bytes it left out
        of what it is about to write on the link src -> the route at an address."""
        try:
            src, address, count, *wire = message.decode().split("\n")
            num_bytes = int(count)
            wire_bytes = int(wire[0]) if wire else 0
            if len(wire) > 1:
                raise ValueError(message)
        except ValueError:
            self.undeclared["malformed"] = self.undeclared.get("malformed", 0) + 1
            return
        dst = self.node_at.get(address)
        if dst is None or num_bytes < 0:
            why = f"{src} -> {address}"
            self.undeclared[why] = self.undeclared.get(why, 0) + max(num_bytes, 0)
            return
        self.link(src, dst).declare(num_bytes, max(wire_bytes, 0))

    async def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        for server in self.servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      route: ProxyRoute) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            peer = writer.get_extra_info("peername")
            local = writer.get_extra_info("sockname")
            src = (await self._source((peer[0], peer[1]),
                                      (local[0], local[1]) if local else None) if peer
                   else self.config.other_source)
            key = (src, route.node)
            self.connections[key] = self.connections.get(key, 0) + 1
            try:
                up_reader, up_writer = await asyncio.open_connection(self.host_of(route),
                                                                     route.target_port)
            except OSError:
                writer.close()
                return
            try:
                await asyncio.gather(self._pump(reader, up_writer, self.link(src, route.node)),
                                     self._pump(up_reader, writer, self.link(route.node, src)))
            finally:
                for w in (writer, up_writer):
                    with contextlib.suppress(Exception):
                        w.close()
        finally:
            self._tasks.discard(task)

    def _resolve(self, peer: tuple[str, int], local: tuple[str, int] | None) -> str:
        if isinstance(self.resolve, SourceResolver):
            return self.resolve(peer, local)
        return self.resolve(peer)

    async def _source(self, peer: tuple[str, int],
                      local: tuple[str, int] | None = None) -> str:
        """Who is calling from `peer`. A worker's socket may not be found at once on a loaded
        host (seen: a t0 -> t1 connection, and 1.1 GB to n9, counted as the coordinator's):
        ask again before taking the peer for the other source, which costs only the
        coordinator's connections a short wait; a socket never found is UNATTRIBUTED.
        Each lookup runs on a thread (`_resolve_off_loop`), never on the event loop."""
        src = await self._resolve_off_loop(peer, local)
        other = self.config.other_source
        for _ in range(RESOLVE_RETRIES):
            if src not in (other, UNATTRIBUTED):
                return src
            await asyncio.sleep(RESOLVE_RETRY_S)
            src = await self._resolve_off_loop(peer, local)
        wait_s = RESOLVE_RETRY_S
        for _ in range(MISS_RETRIES):
            if src != UNATTRIBUTED:
                break
            await asyncio.sleep(wait_s)
            wait_s *= 2
            src = await self._resolve_off_loop(peer, local)
        return src

    async def _resolve_off_loop(self, peer: tuple[str, int],
                                local: tuple[str, int] | None) -> str:
        """`_resolve` on a thread: a lookup reads /proc/net/tcp(6) and the file descriptors of
        every worker (tens of ms on a loaded host with a rehearsal's ~1,000 sockets), and on
        the event loop it held back every link's deliveries meanwhile; a cold start opens
        dozens of connections at once (each worker's streams to its next hops), so the links
        already busy stalled for a connection on another one. The time is counted
        (`resolve_s`)."""
        t0 = time.monotonic()
        try:
            return await asyncio.to_thread(self._resolve, peer, local)
        finally:
            self.resolve_s += time.monotonic() - t0

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    link: Link) -> None:
        """Copy reader -> writer, each chunk delivered at its arrival time on `link`."""
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
        records = TlsRecords()
        try:
            while True:
                # the link's window: no read (so the sender's socket and HTTP/2 window fill
                # and its writes wait) while the link has a window's worth to serialize
                while (wait_s := link.room_at_s(loop.time()) - loop.time()) > 0:
                    link.declared_event.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(link.declared_event.wait(), wait_s)
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                for piece in link.pieces(data, loop.time(), records.feed(data)):
                    await chunks.put(piece)
            await chunks.put((loop.time(), b""))
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per directed link between machines that carried a connection: bytes, chunks,
        connections, shape (UNATTRIBUTED traffic is in `unattributed`)."""
        out: dict[str, dict[str, Any]] = {}
        now_s = time.monotonic()  # the event loop's clock (asyncio's default)
        for (src, dst), link in sorted(self.links.items()):
            if UNATTRIBUTED in (src, dst):
                continue
            out[f"{src}->{dst}"] = {
                "src": src, "dst": dst, "bytes": link.bytes_sent + link.bytes_declared,
                "wire_bytes": link.bytes_sent, "declared_bytes": link.bytes_declared,
                "chunks": link.chunks, "backlog_bytes": link.backlog_bytes(now_s),
                "connections": self.connections.get((src, dst), 0),
                "bandwidth_gbps": link.shape.bandwidth_gbps, "latency_ms": link.shape.latency_ms,
                **({"unlinked": True} if (src, dst) not in self.config.links else {}),
            }
        return out

    def unattributed(self) -> dict[str, dict[str, int]]:
        """Per machine called by a caller that was not found: bytes to it ("bytes_in"), bytes
        of its replies ("bytes_out") and connections."""
        nodes = sorted({dst if src == UNATTRIBUTED else src
                        for src, dst in self.links if UNATTRIBUTED in (src, dst)})

        def sent(key: tuple[str, str]) -> int:
            link = self.links.get(key)
            return 0 if link is None else link.bytes_sent

        return {node: {"bytes_in": sent((UNATTRIBUTED, node)),
                       "bytes_out": sent((node, UNATTRIBUTED)),
                       "connections": self.connections.get((UNATTRIBUTED, node), 0)}
                for node in nodes}

    def write_stats(self) -> None:
        self.writes += 1
        path = Path(self.config.stats_path)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"writes": self.writes, "links": self.stats(),
                                   "unattributed": self.unattributed(),
                                   "undeclared": self.undeclared,
                                   "resolve_s": round(self.resolve_s, 3)}))
        os.replace(tmp, path)  # a reader never sees half a file


class _LedgerProtocol(asyncio.DatagramProtocol):
    """The proxy's end of the link ledger: each datagram is one declaration. Called from the
    event loop's I/O pass, before the pumps whose reads that pass completed run (module doc)."""

    def __init__(self, proxy: LinkProxy) -> None:
        self.proxy = proxy

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.proxy.declared(data)


def read_stats(path: str | Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """(times written, per-link counters) a proxy last wrote; (0, {}) before it wrote any."""
    try:
        raw = json.loads(Path(path).read_text())
        return int(raw["writes"]), dict(raw["links"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, {}


def read_unattributed(path: str | Path) -> dict[str, dict[str, int]]:
    """Per machine, the traffic of callers that were not found (`LinkProxy.unattributed`);
    {} before the proxy wrote any, or when all were found."""
    try:
        return dict(json.loads(Path(path).read_text()).get("unattributed", {}))
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


async def run_proxy(config_path: str) -> None:
    config = ProxyConfig.from_json(Path(config_path).read_text())
    proxy = LinkProxy(config)
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, proxy.write_stats)
    proxy.write_stats()
    print("ready", flush=True)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=config.max_seconds)
    proxy.write_stats()
    await proxy.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m helixserve.rehearse.links CONFIG.json", file=sys.stderr)
        sys.exit(2)
    asyncio.run(run_proxy(sys.argv[1]))
