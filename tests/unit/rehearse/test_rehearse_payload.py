"""A rehearsal's smaller activation payload (engine/emulated.py, module doc): what the wire
accepts, what a sender declares to the link ledger, and how the link proxy charges it."""

from __future__ import annotations

import socket
import uuid

import pytest

from helixserve.engine.emulated import ZeroHidden
from helixserve.rehearse.links import Link, LinkProxy, LinkShape, ProxyConfig, ProxyRoute
from helixserve.runtime import transport as tp

ROW = 8 * 2  # hidden_size 8 x float16
EMULATED = tp.ExpectedInput(10, 20, 30, 8, "float16")


def tensor(num_tokens: int, num_bytes: int) -> tp.pb.Tensor:
    return tp.pb.Tensor(dtype="float16", shape=[num_tokens, 8], data=bytes(num_bytes))


def test_an_emulated_receiver_takes_whole_bytes_a_token_up_to_a_row():
    for sent in (3 * ROW, 3 * 1, 3 * 5):
        got = tp.hidden_from_pb(tensor(3, sent), "h", 3, EMULATED)
        assert got.shape == (3, 8) and got.dtype == "float16" and len(got.data) == sent
    for bad in (0, 4, 3 * ROW + 3, 3 * ROW * 2):  # nothing, not whole per token, too much
        with pytest.raises(tp.WireError, match=r"h\.data: \d+ bytes, expected 48"):
            tp.hidden_from_pb(tensor(3, bad), "h", 3, EMULATED)


def test_a_torch_receiver_takes_only_the_real_size():
    torch = pytest.importorskip("torch")
    expect = tp.ExpectedInput(10, 20, 30, 8, torch.float16)
    assert tuple(tp.hidden_from_pb(tensor(3, 3 * ROW), "h", 3, expect).shape) == (3, 8)
    with pytest.raises(tp.WireError, match="h.data: 15 bytes, expected 48"):
        tp.hidden_from_pb(tensor(3, 15), "h", 3, expect)


def test_a_smaller_payload_goes_on_the_wire_with_the_real_shape():
    h = ZeroHidden("float16", (3, 8), 3 * ROW, 3 * 2)
    msg = tp.pb.WorkItem()
    tp.set_tensor_pb(msg.hidden, h)
    assert list(msg.hidden.shape) == [3, 8] and msg.hidden.data == bytes(6)


def listen(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    return sock


def test_declare_unsent_sends_one_datagram_a_batch_with_what_was_left_out(monkeypatch):
    name = f"helixserve-test-{uuid.uuid4().hex}"
    sock = listen(name)
    monkeypatch.setenv(tp.LINK_LEDGER_ENV, name)
    monkeypatch.setattr(tp, "_ledger", None)
    try:
        batch = [ZeroHidden("float16", (3, 8), 3 * ROW, 6), None,
                 ZeroHidden("float16", (1, 8), ROW, 2), tp.RawHidden("float16", (1, 8), bytes(ROW))]
        tp.declare_unsent("t0", "127.0.0.1:4100", batch)
        # the bytes left out, and the payloads' own size on the wire (6 + 2): the proxy charges
        # the first with the second
        assert sock.recv(1000) == tp.ledger_message("t0", "127.0.0.1:4100", 42 + 14, 6 + 2)
        assert tp.ledger_message("t0", "a", 5, 0) == b"t0\na\n5"  # unsized: three lines
        # real activations leave nothing out: nothing is declared
        tp.declare_unsent("t0", "127.0.0.1:4100", [ZeroHidden("float16", (1, 8), ROW)])
        sock.settimeout(0.05)
        with pytest.raises(TimeoutError):
            sock.recv(1000)
    finally:
        sock.close()


def test_a_declaration_with_its_message_names_the_messages_size_on_the_wire(monkeypatch):
    name = f"helixserve-test-{uuid.uuid4().hex}"
    sock = listen(name)
    monkeypatch.setenv(tp.LINK_LEDGER_ENV, name)
    monkeypatch.setattr(tp, "_ledger", None)
    try:
        hiddens = [ZeroHidden("float16", (3, 8), 3 * ROW, 6)]
        batch = tp.work_batch_pb([], sender="t0")
        tp.set_tensor_pb(batch.items.add(request_id="r", step_id=1).hidden, hiddens[0])
        tp.declare_unsent("t0", "127.0.0.1:4100", hiddens, message=batch)
        wire = batch.ByteSize() + 5 + 9 + 22  # gRPC prefix, one HTTP/2 frame, one TLS record
        assert sock.recv(1000) == tp.ledger_message("t0", "127.0.0.1:4100", 42, wire)
    finally:
        sock.close()


def test_wire_bytes_count_a_frame_per_16_kib_and_a_tls_record_per_16284_bytes():
    assert tp._wire_bytes(100) == 100 + 5 + 9 + 22
    assert tp._wire_bytes(16379) == 16379 + 5 + 9 + 2 * 22  # 16,384 framed: one frame
    assert tp._wire_bytes(16380) == 16380 + 5 + 2 * 9 + 2 * 22  # a second frame
    assert tp._wire_bytes(16270) == 16270 + 5 + 9 + 22  # 16,284 of plaintext: one record
    assert tp._wire_bytes(16271) == 16271 + 5 + 9 + 2 * 22
    assert tp._wire_bytes(34829) == 34829 + 5 + 3 * 9 + 3 * 22  # a 512-token prefill chunk


def test_a_decode_message_carries_only_its_own_debt_when_every_message_is_sized():
    """A sender ahead of the proxy has declared a prefill chunk's message, a decode message
    and the next prefill chunk's before the proxy reads the first. Sized as on the wire, each
    message leaves after its own bytes (the simulator's FIFO: the decode after the first chunk
    alone); sized by its payloads only (smaller than on the wire), the first message's bytes
    pay the next debts too, and the decode message waits for part of the second chunk."""
    def decode_arrival(names: tuple[int, int, int]) -> float:
        link = Link(LinkShape(bandwidth_gbps=8e-6, latency_ms=0.0))  # 1,000 bytes/s
        for declared, named in zip((8000, 160, 8000), names, strict=True):
            link.declare(declared, named)
        link.schedule(340, 0.0)  # the first chunk's message: 340 bytes on the wire
        return link.schedule(40, 0.0)  # the decode message: 40 bytes

    fifo = (340 + 8000 + 40 + 160) / 1000
    assert decode_arrival((340, 40, 340)) == pytest.approx(fifo)
    assert decode_arrival((320, 20, 320)) > fifo + 0.5  # 20 bytes short: 500 declared early


def test_declared_bytes_are_charged_ahead_of_the_next_chunk_on_the_link():
    link = Link(LinkShape(bandwidth_gbps=8e-6, latency_ms=1000.0))  # 1,000 bytes/s, 1 s
    assert link.schedule(100, 0.0) == pytest.approx(0.1 + 1.0)
    link.declare(900)
    # the chunk read at 5 s leaves after 900 declared + its 100 bytes: 1 s, then 1 s latency
    assert link.schedule(100, 5.0) == pytest.approx(5.0 + 1.0 + 1.0)
    assert link.schedule(100, 6.0) == pytest.approx(6.0 + 0.1 + 1.0)  # the debt was paid once
    assert (link.bytes_sent, link.bytes_declared, link.pending_bytes) == (300, 900, 0)
    # the same 1,000 bytes sent for real take the same time
    real = Link(LinkShape(bandwidth_gbps=8e-6, latency_ms=1000.0))
    assert real.schedule(1000, 5.0) == pytest.approx(5.0 + 1.0 + 1.0)


def test_the_proxy_names_a_declarations_link_by_the_address_of_its_route(tmp_path):
    config = ProxyConfig([ProxyRoute("n0", 4100, 4200), ProxyRoute("n1", 4101, 4201,
                                                                    host="127.0.0.21")],
                         {("n1", "n0"): LinkShape(1.0, 1.0)}, {}, str(tmp_path / "s.json"),
                         ledger="x")
    proxy = LinkProxy(config, resolve=lambda peer: "n1")
    proxy.declared(tp.ledger_message("n1", "127.0.0.1:4100", 5000))
    proxy.declared(tp.ledger_message("n0", "127.0.0.21:4101", 7))
    proxy.declared(tp.ledger_message("n0", "127.0.0.1:9999", 11))  # no route listens there
    proxy.declared(b"garbage")
    assert proxy.links[("n1", "n0")].bytes_declared == 5000
    assert proxy.links[("n0", "n1")].bytes_declared == 7
    assert proxy.undeclared == {"n0 -> 127.0.0.1:9999": 11, "malformed": 1}
    stats = proxy.stats()["n1->n0"]
    assert (stats["bytes"], stats["wire_bytes"], stats["declared_bytes"]) == (5000, 0, 5000)
    assert ProxyConfig.from_json(config.to_json()).ledger == "x"


def test_a_declaration_nobody_takes_is_counted_lost_not_dropped_silently(caplog):
    ledger = tp.LinkLedger(f"helixserve-test-nobody-{uuid.uuid4().hex}")
    try:
        with caplog.at_level("WARNING"):
            for _ in range(3):
                ledger.declare("t0", "127.0.0.1:4100", 1000)
    finally:
        ledger.sock.close()
    assert (ledger.lost_declarations, ledger.lost_bytes) == (3, 3000)
    assert len([r for r in caplog.records if "not declared" in r.message]) == 2  # 1st, 2nd


def test_rehearse_refuses_a_bad_payload_in_one_line(capsys, tmp_path):
    from helixserve.cli import main

    code = main(["rehearse", "--cluster", "c.yaml", "--model", "m", "--profiles", "p.csv",
                 "--placement", "p.json", "--trace", "t.csv",
                 "--emulated-payload-bytes-per-token", "lots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--emulated-payload-bytes-per-token: bad value 'lots'" in err[0]


def test_the_report_says_how_many_bytes_were_declared_rather_than_sent():
    from helixserve.rehearse.rehearsal import _link_deltas

    before = {"a->b": {"src": "a", "dst": "b", "bytes": 100, "wire_bytes": 40,
                       "declared_bytes": 60, "connections": 1, "chunks": 3}}
    after = {"a->b": {"src": "a", "dst": "b", "bytes": 1100, "wire_bytes": 140,
                      "declared_bytes": 960, "connections": 2, "chunks": 9}}
    delta = _link_deltas(before, after)["a->b"]
    assert (delta["bytes"], delta["wire_bytes"], delta["declared_bytes"],
            delta["connections"]) == (1000, 100, 900, 1)
    assert "chunks" not in delta
