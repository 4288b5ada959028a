"""The worker-to-worker data plane: length-prefixed WorkBatch frames on a mutual-TLS stream.

Why: at saturation the runtime's CPU per output token goes mostly to messages, not items
(docs/benchmarks.md, "Where the CPU goes"): a grpc.aio message costs each side's Python a
trip through gRPC's completion-queue poller thread and its HTTP/2 framing. A worker's stream
to its next hop needs none of gRPC: one direction of batches, errors back now and then.
`benchmarks/dataplane.py` measures both on loopback with mutual TLS.

Selected by HELIXSERVE_DATAPLANE (`grpc`, the default, or `stream`) in the workers'
environment; every worker of a cluster must agree (a `stream` sender needs a `stream`
receiver). The coordinator's streams and every RPC stay on gRPC.

One port: a `stream` worker's listener (`Front`, on the worker's address) reads the first
bytes of each connection. MAGIC opens a data-plane connection: TLS starts after it (the
same files, CA required both ways, the same certificate checks as gRPC's port), then frames.
Anything else is a gRPC client (its TLS ClientHello or HTTP/2 preface): its bytes are
spliced to the gRPC server, which listens on an ephemeral port of 127.0.0.1, still mutual
TLS end to end (the splice sees ciphertext). So next hops keep their addresses, and the
rehearsal's link proxy (rehearse/links.py), which forwards a worker's address as TCP bytes,
carries both.

The sender waits for READY after MAGIC before its TLS handshake. Frames: 4-byte big-endian length, 1-byte kind, body. Sender -> receiver: DATA (a WorkBatch,
its first carrying the hello with the sender's node), PING. Receiver -> sender: DATA (a
ResultBatch: per-item errors the receiver could not hand to a coordinator), PONG, CLOSE
(why the stream was refused, utf-8) before it closes.

Trust (runtime/worker.py, Trust): the sender's node is its certificate's (plaintext: its
hello's), an item at hop >= 1 only from the route's previous hop, exactly as on gRPC's
Work stream (`Worker.receive`); a coordinator hello is refused here (coordinators use gRPC).

Failures, as gRPC's: a refused handshake, a reset or a closed connection breaks the stream,
and `Peer.broke` reports its sent and queued items UNAVAILABLE. A hung next hop (its process
stopped: the kernel still accepts bytes) is found by PINGs every KEEPALIVE_S: no frame for
KEEPALIVE_S + KEEPALIVE_TIMEOUT_S breaks the stream. Back-pressure: the sender waits for its
socket buffer to drain (`StreamWriter.drain`), the receiver stops reading a stream whose
results pile up (OUT_PAUSE), as with gRPC's flow control, and sends PONGs meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import ssl
import struct
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime.peers import GrpcPeer, Outgoing, Peer
from helixserve.runtime.proto import helix_pb2 as pb

if TYPE_CHECKING:
    from helixserve.runtime.worker import Worker

log = logging.getLogger("helixserve.worker")

DATAPLANE_ENV = "HELIXSERVE_DATAPLANE"
DATAPLANES = ("grpc", "stream")
#: the first bytes of a data-plane connection: neither a TLS record (0x16 0x03 ...) nor
#: HTTP/2's preface ("PRI * HTTP/2.0")
MAGIC = b"HXDP/1\r\n"
#: the receiver's answer to MAGIC, before TLS starts: the sender starts its handshake only
#: then, so that no TLS byte arrives with MAGIC (a proxy may deliver both in one read, and
#: what the receiver's stream had buffered would never reach its TLS layer)
READY = b"HXDP/ok\n"
HEADER = struct.Struct("!IB")
DATA, PING, PONG, CLOSE = 0, 1, 2, 3
#: seconds a connection has to send its first bytes, and a data-plane one its TLS handshake
HANDSHAKE_S = 20.0
#: bytes read at once when splicing a gRPC connection
SPLICE_CHUNK = 256 * 1024


class DataPlaneError(Exception):
    """A peer broke the framing (the stream is closed)."""


def dataplane_kind(env: dict[str, str] | None = None) -> str:
    """HELIXSERVE_DATAPLANE (module doc); ValueError naming the variable and value."""
    value = (env if env is not None else os.environ).get(DATAPLANE_ENV, "grpc") or "grpc"
    if value not in DATAPLANES:
        raise ValueError(f"{DATAPLANE_ENV}: unknown data plane {value!r}; known: "
                         f"{', '.join(DATAPLANES)}")
    return value


def new_peer(worker: Worker, address: str) -> Peer:
    """The stream to next hop `address` of the worker's data plane."""
    if worker.dataplane == "stream":
        return StreamPeer(worker, address)
    return GrpcPeer(worker, address)


@functools.lru_cache(maxsize=8)
def ssl_context(tls: security.TlsConfig, server: bool) -> ssl.SSLContext:
    """Mutual TLS from the worker's files: its chain, the cluster's CA required of the peer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_path, tls.key_path)
    ctx.load_verify_locations(cadata=tls.ca_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_identity(writer: asyncio.StreamWriter) -> security.PeerIdentity:
    """The certificate identity of a data-plane connection's peer (TLS)."""
    obj = writer.get_extra_info("ssl_object")
    der = obj.getpeercert(binary_form=True) if obj is not None else None
    if not der:
        return security.PeerIdentity("", problem="no certificate")
    return security.identity_of_cert(ssl.DER_cert_to_PEM_cert(der).encode())


def frame(kind: int, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body), kind) + body


def put_data(writer: asyncio.StreamWriter, message: Any) -> None:
    """One DATA frame of `message` (a protobuf) into the writer's buffer, its header and
    body written apart (the body is not copied into a joined buffer; each write is its own
    TLS records: `frame_wire_bytes`)."""
    data = message.SerializeToString()
    writer.write(HEADER.pack(len(data), DATA))
    writer.write(data)


async def write_data(writer: asyncio.StreamWriter, message: Any) -> None:
    """`put_data`, then wait for the socket buffer to drain (back-pressure)."""
    put_data(writer, message)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    size, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > tp.MAX_MESSAGE_BYTES:
        raise DataPlaneError(f"a frame of {size} bytes, limit {tp.MAX_MESSAGE_BYTES}")
    return kind, (await reader.readexactly(size) if size else b"")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# ---- sender -----------------------------------------------------------------------------------


#: the most plaintext one TLS record carries (Python's ssl, as asyncio's TLS transport
#: writes: each write its own records of up to this many bytes)
TLS_RECORD_PLAINTEXT_BYTES = 16384


def frame_wire_bytes(message_bytes: int) -> int:
    """Bytes on the wire of one DATA frame carrying a message of `message_bytes` over mutual
    TLS, written as `write_data` writes it: the header and the body, each a write of its own
    and so its own TLS records (what the rehearsal's link proxy reads for it; gRPC's
    counterpart: transport `_wire_bytes`)."""
    records = 1 + -(-message_bytes // TLS_RECORD_PLAINTEXT_BYTES)
    return HEADER.size + message_bytes + records * tp.TLS_RECORD_OVERHEAD_BYTES


#: a sender's socket buffer at most this full for `StreamPeer.notify` to write a step's
#: message at once (asyncio's default high-water mark: past it `drain` would wait)
WRITE_NOW_BYTES = 64 * 1024


class StreamPeer(Peer):
    """The next hop's data-plane stream (module doc): batches as DATA frames, PINGs."""

    framing = staticmethod(frame_wire_bytes)
    #: the stream's writer while it waits for items (`notify` may write for it)
    _parked: asyncio.StreamWriter | None = None

    async def _run(self) -> None:
        while True:
            first = await self._get()
            self.sent.clear()
            writer: asyncio.StreamWriter | None = None
            try:
                reader, writer = await self._connect()
                await self._pump(first, reader, writer)
                self.broke(f"next hop {self.address} closed the stream")
            except (OSError, EOFError, ssl.SSLError, DataPlaneError, TimeoutError) as exc:
                why = str(exc) or type(exc).__name__
                log.warning("stream to %s broke: %s", self.address, why)
                self.broke(f"next hop {self.address} unreachable: {why}")
            finally:
                self.ended()
                if writer is not None:
                    writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = split_address(self.address)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), HANDSHAKE_S)
        writer.write(MAGIC)
        tls = self.worker.tls
        ready = await asyncio.wait_for(reader.readexactly(len(READY)), HANDSHAKE_S)
        if ready != READY:
            raise DataPlaneError(f"not a data-plane port (it answered {ready!r})")
        if tls is not None:
            await asyncio.wait_for(writer.start_tls(ssl_context(tls, server=False),
                                                    server_hostname=host), HANDSHAKE_S)
        return reader, writer

    async def _pump(self, first: Outgoing, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        """Write batches until the stream breaks; what ends first (the writer's error, the
        reader's EOF or silence past the keepalive) ends both."""
        tasks = [asyncio.ensure_future(self._write(first, writer)),
                 asyncio.ensure_future(self._read(reader)),
                 asyncio.ensure_future(self._ping(writer))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
        for t in done:
            t.result()  # its error, if any, is the stream's

    async def _write(self, first: Outgoing, writer: asyncio.StreamWriter) -> None:
        await write_data(writer, self.next_batch(first, hello=True))
        while True:
            while self.queue.empty():
                # parked: `notify` writes a step's batch itself while the socket has room
                self._parked = writer
                try:
                    await self._wait()
                finally:
                    self._parked = None
            await write_data(writer, self.next_batch(self._take(), hello=False))

    def notify(self) -> None:
        """A step's items are queued: with the writer parked (idle, its hello sent) and
        under WRITE_NOW_BYTES waiting in its socket buffer, their message is written now,
        in the loop turn that queued them (a message costs no turn of its own); else the
        writer is woken, and writes it once the buffer has drained (back-pressure)."""
        writer = self._parked
        if (writer is None or writer.is_closing()
                or writer.transport.get_write_buffer_size() >= WRITE_NOW_BYTES):
            super().notify()
            return
        while not self.queue.empty():
            put_data(writer, self.next_batch(self._take(), hello=False))
            if writer.transport.get_write_buffer_size() >= WRITE_NOW_BYTES:
                break
        if not self.queue.empty():
            super().notify()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        silence_s = tp.KEEPALIVE_S + tp.KEEPALIVE_TIMEOUT_S
        while True:
            try:
                kind, body = await asyncio.wait_for(read_frame(reader), silence_s)
            except asyncio.IncompleteReadError:
                return  # closed (a CLOSE frame said why, if it came)
            except TimeoutError:
                raise TimeoutError(f"no answer for {silence_s:.0f} s (keepalive)") from None
            if kind == DATA:
                batch = pb.ResultBatch()
                try:
                    batch.ParseFromString(body)
                except DecodeError as exc:
                    raise DataPlaneError(f"bad result batch: {exc}") from None
                self.deliver_back(batch)
            elif kind == CLOSE:
                raise DataPlaneError(body.decode(errors="replace"))

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        while True:
            await asyncio.sleep(tp.KEEPALIVE_S)
            writer.write(frame(PING))


# ---- receiver ---------------------------------------------------------------------------------


async def wait_for_room(stream: Any, writer: asyncio.StreamWriter) -> None:
    """Hold a stream's items back until its results have room (OUT_PAUSE), answering for
    the PINGs it does not read meanwhile: the sender hears PONGs, so a receiver that is only
    holding back is not taken for a hung one (gRPC answers HTTP/2 PINGs whatever its flow
    control holds back, too)."""
    while not stream.room.is_set():
        try:
            await asyncio.wait_for(stream.room.wait(), tp.KEEPALIVE_S)
        except TimeoutError:
            writer.write(frame(PONG))


class Front:
    """A `stream` worker's listener (module doc): data-plane connections served here, the
    rest spliced to the gRPC server at `grpc_port` on 127.0.0.1."""

    def __init__(self, worker: Worker, tls: security.TlsConfig | None, grpc_port: int) -> None:
        self.worker = worker
        self.tls = tls
        self.grpc_port = grpc_port
        self.server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._handle, host, port,
                                                 limit=2 * tp.MAX_MESSAGE_BYTES)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self._conns):
            t.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            try:
                head = await asyncio.wait_for(reader.readexactly(len(MAGIC)), HANDSHAKE_S)
            except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
                head = exc.partial if isinstance(exc, asyncio.IncompleteReadError) else b""
                if head:
                    await self._splice(head, reader, writer)
                return
            if head == MAGIC:
                await self._serve_stream(reader, writer)
            else:
                await self._splice(head, reader, writer)
        except (OSError, ssl.SSLError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("connection ended: %s", exc)
        except asyncio.CancelledError:
            pass  # the worker stops (Front.stop)
        finally:
            self._conns.discard(task)
            writer.close()

    async def _splice(self, head: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """A gRPC client's connection: its bytes both ways to the gRPC server."""
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.grpc_port)
        up_writer.write(head)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(SPLICE_CHUNK):
                dst.write(data)
                await dst.drain()

        tasks = [asyncio.ensure_future(pipe(reader, up_writer)),
                 asyncio.ensure_future(pipe(up_reader, writer))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            up_writer.close()

    async def _serve_stream(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        w = self.worker
        identity: security.PeerIdentity | None = None
        writer.write(READY)
        if self.tls is not None:
            await asyncio.wait_for(writer.start_tls(ssl_context(self.tls, server=True)),
                                   HANDSHAKE_S)
            identity = peer_identity(writer)
        refusal = w.stream_refusal()
        if refusal:
            writer.write(frame(CLOSE, refusal.encode()))
            await writer.drain()
            return
        stream = w.open_stream(identity.node if identity is not None else "", identity)
        results = asyncio.ensure_future(self._write_results(stream, writer))
        try:
            while True:
                kind, body = await read_frame(reader)
                if kind == PING:
                    writer.write(frame(PONG))
                    continue
                if kind != DATA:
                    continue
                # a caller that does not read its results gets no more of its items read
                if not stream.room.is_set():
                    await wait_for_room(stream, writer)
                batch = pb.WorkBatch()
                try:
                    batch.ParseFromString(body)
                except DecodeError as exc:
                    stream.refused = f"node {w.node}: a message that does not parse: {exc}"
                    break
                hello = tp.hello_of(batch)
                if hello is not None and hello[0]:
                    stream.refused = (f"node {w.node}: a coordinator stream on the data plane "
                                      "(coordinators use gRPC's Work); stream refused")
                    break
                if not w.receive(batch, stream):
                    break
        except (asyncio.IncompleteReadError, DataPlaneError, OSError, ssl.SSLError,
                asyncio.CancelledError):
            pass
        finally:
            stream.out.put_nowait(None)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(results, HANDSHAKE_S)
            w.close_stream(stream)

    async def _write_results(self, stream: Any, writer: asyncio.StreamWriter) -> None:
        async for rb in self.worker.result_batches(stream):
            await write_data(writer, rb)
        if stream.refused:
            log.warning("refused a data-plane stream: %s", stream.refused)
            writer.write(frame(CLOSE, stream.refused.encode()))
            await writer.drain()
