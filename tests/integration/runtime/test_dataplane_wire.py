"""The stream data plane's declared wire size is the size on the wire (runtime/dataplane.py
`frame_wire_bytes`, what `StreamPeer` names to the rehearsal's link emulation with each
message; gRPC's counterpart is tests/integration/rehearse/test_declared_sizes.py): DATA
frames written by `write_data`, as `StreamPeer` writes them, over real mutual TLS, through
a byte-counting relay on loopback, sized around one TLS record (16 KiB). Byte counts only,
no timing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helixserve.runtime import dataplane, security

pytestmark = pytest.mark.integration

#: serialized message sizes: a decode batch, one just under, at and past one TLS record, a
#: prefill chunk's several records
SIZES = [180, 16379, 16384, 16385, 40_000, 100_000, 1]


class _Serialized(bytes):
    """A message of these serialized bytes (what `write_data` asks a protobuf for)."""

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return bytes(self)


def test_a_frame_crosses_as_frame_wire_bytes(tmp_path: Path) -> None:
    creds = security.create_dev_credentials(tmp_path / "tls", ["n0", "n1"])

    async def main() -> list[tuple[int, int]]:
        received: asyncio.Queue[int] = asyncio.Queue()
        relayed = [0]  # client -> server bytes through the relay

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    _, body = await dataplane.read_frame(reader)
                except asyncio.IncompleteReadError:
                    break
                received.put_nowait(len(body))
            writer.close()

        server = await asyncio.start_server(
            serve, "127.0.0.1", 0, ssl=dataplane.ssl_context(creds.nodes["n0"], server=True))
        target = server.sockets[0].getsockname()[1]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       count: bool) -> None:
            while data := await src.read(65536):
                if count:
                    relayed[0] += len(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

        front = await asyncio.start_server(relay, "127.0.0.1", 0)
        port = front.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await writer.start_tls(dataplane.ssl_context(creds.nodes["n1"], server=False),
                               server_hostname="127.0.0.1")
        counts = []
        try:
            for size in [10, *SIZES]:  # the first frame settles the handshake's last bytes
                before = relayed[0]
                await dataplane.write_data(writer, _Serialized(b"x" * size))  # as StreamPeer
                assert await asyncio.wait_for(received.get(), 30) == size
                counts.append((size, relayed[0] - before))
        finally:
            writer.close()
            front.close()
            server.close()
        return counts[1:]

    for size, wire in asyncio.run(main()):
        assert wire == dataplane.frame_wire_bytes(size), (size, wire)
