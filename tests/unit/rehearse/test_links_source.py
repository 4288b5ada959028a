"""The link proxy names a caller by the process holding its socket (rehearse/links.py): the
socket is the one bound to the caller's address AND connected to the address it called.
Linux lets two sockets share a local port when they connect to different destinations, so
the port alone may name another process's socket: on helix-geo-24 a worker's connection was
taken for the coordinator's and 718 MB it declared were charged on no link (issue 27)."""

from __future__ import annotations

import os
import socket

from helixserve.rehearse.links import socket_inode


def _inode(sock: socket.socket) -> int:
    return int(os.readlink(f"/proc/self/fd/{sock.fileno()}")[len("socket:["):-1])


def test_two_sockets_on_one_local_port_are_told_apart_by_what_they_called():
    servers = [socket.socket() for _ in range(2)]
    clients = [socket.socket() for _ in range(2)]
    try:
        for s in servers:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
        for c in clients:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        clients[0].bind(("127.0.0.1", 0))
        port = clients[0].getsockname()[1]
        clients[1].bind(("127.0.0.1", port))  # the same local port, another destination
        for c, s in zip(clients, servers, strict=True):
            c.connect(s.getsockname())
        for c, s in zip(clients, servers, strict=True):
            assert socket_inode("127.0.0.1", port, s.getsockname()) == _inode(c)
        # by the port alone, one of them is found for both: the bug
        alone = socket_inode("127.0.0.1", port)
        assert alone in (_inode(clients[0]), _inode(clients[1]))
        assert socket_inode("127.0.0.1", port, ("127.0.0.1", 1)) is None
    finally:
        for sock in servers + clients:
            sock.close()


def test_a_closed_connection_on_the_same_port_does_not_hide_a_live_one():
    """CI failure: an earlier connection from the caller's port, closed by its side first,
    sat in TIME_WAIT (inode 0) in /proc/net/tcp and the live caller was not looked for.
    Where the kernel lists the two depends on their hashes, so ten ports are tried."""
    for _ in range(10):
        _closed_then_live()


def _closed_then_live() -> None:
    servers = [socket.socket() for _ in range(2)]
    first, live = socket.socket(), socket.socket()
    accepted = []
    try:
        for s in servers:
            s.bind(("127.0.0.1", 0))
            s.listen(1)
        for c in (first, live):
            c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind(("127.0.0.1", 0))
        port = first.getsockname()[1]
        first.connect(servers[0].getsockname())
        accepted.append(servers[0].accept()[0])
        first.close()  # the active closer keeps the tuple in TIME_WAIT
        accepted[0].close()
        live.bind(("127.0.0.1", port))
        live.connect(servers[1].getsockname())
        assert socket_inode("127.0.0.1", port) == _inode(live)
        assert socket_inode("127.0.0.1", port, servers[0].getsockname()) == 0
    finally:
        for sock in servers + [live] + accepted:
            sock.close()
