"""Abuse tests: real TLS workers, a real coordinator serving a request, and an attacker.

Two workers (n0 [0,15), n1 [15,30)) run with dev credentials and learn their peers from the
placement + cluster files, as the Kubernetes manifests start them. While the coordinator
streams a long greedy request through them, the attacker tries: no credentials, TLS
without a client certificate, a certificate of another CA, a forged next hop (a listener
that counts connections), another coordinator's id on a stream and in Release, and items
meant to hijack the running request's results or KV. Every attempt must be refused; the
request must complete with the same tokens as an undisturbed run (nothing freed, nothing
lost) and the listener must see no connection; the running request's id as release ids on
the attacker's own coordinator stream frees nothing, on a worker's stream it is refused.
With valid credentials of the wrong role (a worker's
certificate, the coordinator's where a worker's is due) it tries LoadRange, Release, a
coordinator stream and items at hop >= 1 from a node that is not the route's previous hop:
all refused, the range unchanged. The counts are in docs/security.md.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from runtime_procs import make_placement, start_worker, stop_workers, wait_ready

from helixserve.local.launch import free_port
from helixserve.planner.placement import NodeRange
from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, GenerationRequest, security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc
from helixserve.spec import ClusterSpec, NodeSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 160


class CountingListener:
    """A TCP port that counts the connections made to it (the forged next hop)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def tls_stack(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("tls")
    creds = security.create_dev_credentials(tmp / "certs", ["n0", "n1"])
    ports = {"n0": free_port(), "n1": free_port()}
    placement = make_placement([("n0", 0, 15), ("n1", 15, 30)],
                               [("coordinator", "n0", 1), ("n0", "n1", 1),
                                ("n1", "coordinator", 1)])
    cluster = ClusterSpec(name="test-local", nodes=[
        NodeSpec(name=n, gpu="L4", address=f"127.0.0.1:{p}") for n, p in ports.items()])
    placement_path, cluster_path = tmp / "placement.json", tmp / "cluster.yaml"
    placement.save(placement_path)
    cluster_path.write_text(
        "name: test-local\nnodes:\n" + "".join(
            f"  - {{name: {n}, gpu: L4, address: '127.0.0.1:{p}'}}\n" for n, p in ports.items()))
    procs = [start_worker(demo_model, n, 0, 0, tmp, placement=placement_path, port=ports[n],
                          peers=None,
                          extra=["--cluster", str(cluster_path), *creds.nodes[n].flags()])
             for n in ports]
    try:
        wait_ready(procs)
        yield creds, cluster, placement, procs
    finally:
        stop_workers(procs)


def _info(address: str, channel: grpc.Channel) -> Any:
    with channel:
        return pb_grpc.HelixWorkerStub(channel).Info(pb.InfoRequest(), timeout=5)


def _refused_at_handshake(address: str, make_channel: Any) -> int:
    """Info, Release and Work on one port with a bad client: each must fail UNAVAILABLE
    (the TLS handshake fails; no method runs). Returns the attempts made."""
    calls = [
        lambda stub: stub.Info(pb.InfoRequest(), timeout=5),
        lambda stub: stub.Release(pb.ReleaseRequest(request_ids=["x"]), timeout=5),
        lambda stub: next(iter(stub.Work(iter([tp.work_batch_pb([], sender="evil")]),
                                         timeout=5))),
    ]
    for call in calls:
        with make_channel() as channel:
            with pytest.raises(grpc.RpcError) as err:
                call(pb_grpc.HelixWorkerStub(channel))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    return len(calls)


def wire_hop(name: str, address: str, start_layer: int, end_layer: int) -> tuple[NodeRange, str]:
    """One hop of a forged route: the layers and the worker address it names."""
    return NodeRange(name, start_layer, end_layer), address


def _forged_item(request_id: str, coordinator_id: str, route: list[tuple[NodeRange, str]],
                 hop_index: int = 0, hidden_size: int = 576) -> pb.WorkItem:
    hidden = torch.zeros(1, hidden_size) if hop_index > 0 else None
    item = tp.WireItem(request_id=request_id, coordinator_id=coordinator_id, step_id=1,
                       hop_index=hop_index, route=tuple(h for h, _ in route),
                       addresses=tuple(a for _, a in route), position=0, token_ids=[1],
                       hidden=hidden, sampling=GREEDY, sample=True)
    return tp.item_to_pb(item)


async def _stream_once(address: str, tls: Any, batch: pb.WorkBatch) -> Any:
    """Send one batch on a new Work stream; the first ResultBatch, or the RpcError."""
    async with security.aio_channel(address, tls) as ch:
        async def requests() -> Any:
            yield batch
            await asyncio.sleep(10)

        call = pb_grpc.HelixWorkerStub(ch).Work(requests())
        try:
            return await asyncio.wait_for(call.__aiter__().__anext__(), 10)
        except grpc.aio.AioRpcError as exc:
            return exc
        finally:
            call.cancel()


async def _attack(creds: Any, cluster: ClusterSpec, coord: Coordinator, other_ca: Any,
                  listener: CountingListener, tally: Counter[str]) -> None:
    addresses = {n.name: str(n.address) for n in cluster.nodes}
    loop = asyncio.get_running_loop()
    # 1-3: no credentials, TLS without a client certificate, another CA's certificate
    for address in addresses.values():
        for kind, make in (
            ("no credentials", lambda a=address: grpc.insecure_channel(a)),
            ("TLS, no client certificate", lambda a=address: grpc.secure_channel(
                a, grpc.ssl_channel_credentials(root_certificates=creds.coordinator.ca_pem))),
            ("certificate of another CA", lambda a=address: grpc.secure_channel(
                a, grpc.ssl_channel_credentials(root_certificates=creds.coordinator.ca_pem,
                                                private_key=other_ca.coordinator.key_pem,
                                                certificate_chain=other_ca.coordinator.cert_pem))),
        ):
            n = await loop.run_in_executor(None, _refused_at_handshake, address, make)
            tally[f"{kind}: tried"] += n
            tally[f"{kind}: refused"] += n

    # The rest with valid credentials (a stolen or second coordinator's certificate).
    tls = creds.coordinator
    (victim,) = coord.active.values()
    victim_rid = victim.internal_id
    own_id, own_token = security.new_coordinator_identity()
    n0, n1 = addresses["n0"], addresses["n1"]

    def per_item_refusal(reply: Any) -> bool:
        return (isinstance(reply, pb.ResultBatch) and len(reply.results) == 1
                and reply.results[0].status_code == tp.PERMISSION_DENIED)

    # 4: forged next hops, from hop 0 on n0 and from n1 (the placement's last hop)
    forged = [
        (n0, [wire_hop("n0", n0, 0, 15), wire_hop("x", listener.address, 15, 30)], 0),
        (n0, [wire_hop("n0", n0, 0, 10), wire_hop("n1", "127.0.0.2:9", 10, 30)], 0),
        (n1, [wire_hop("n0", n0, 0, 15), wire_hop("n1", n1, 15, 20),
              wire_hop("x", listener.address, 20, 30)], 1),
    ]
    for address, route, hop in forged:
        if hop == 0:
            batch = tp.work_batch_pb([_forged_item("forged", own_id, route, hop)],
                                     coordinator_id=own_id, sender="coordinator",
                                     coordinator_token=own_token)
            reply = await _stream_once(address, tls, batch)
        else:  # from the previous hop's own certificate: only the next hop is forged
            batch = tp.work_batch_pb([_forged_item("forged", own_id, route, hop)], sender="n0")
            reply = await _stream_once(address, creds.nodes["n0"], batch)
        tally["forged next hop: tried"] += 1
        tally["forged next hop: refused"] += per_item_refusal(reply)
        assert per_item_refusal(reply) and "not a peer" in reply.results[0].error, reply

    # 5: another coordinator's id on a stream: wrong token, no token
    for address in addresses.values():
        for token in ("0" * 64, ""):
            batch = tp.work_batch_pb([], coordinator_id=coord.coordinator_id,
                                     sender="coordinator", coordinator_token=token)
            reply = await _stream_once(address, tls, batch)
            tally["another coordinator's id (stream): tried"] += 1
            ok = (isinstance(reply, grpc.aio.AioRpcError)
                  and reply.code() == grpc.StatusCode.PERMISSION_DENIED)
            tally["another coordinator's id (stream): refused"] += ok
            assert ok, reply

    # 6: Release of the running request: its coordinator's id without the token, no id, and
    # with the attacker's own valid identity (accepted, but frees nothing of another's)
    for address in addresses.values():
        async with security.aio_channel(address, tls) as ch:
            stub = pb_grpc.HelixWorkerStub(ch)
            for cid, token in ((coord.coordinator_id, "f" * 64), ("", ""), (own_id, own_token)):
                tally["Release of another's request: tried"] += 1
                try:
                    reply = await stub.Release(tp.release_pb([victim_rid], cid, token), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc
                    tally["Release of another's request: refused"] += 1
                else:
                    assert cid == own_id and reply.released == 0, reply
                    tally["Release of another's request: refused"] += 1  # freed nothing

    # 6b: the running request's id as release ids on a Work stream: the attacker's own
    # coordinator stream (accepted: frees only its own coordinator's requests, so nothing) and
    # a worker's (n1's) stream without a coordinator hello (refused)
    for address in addresses.values():
        batch = tp.work_batch_pb([], coordinator_id=own_id, sender="coordinator",
                                 coordinator_token=own_token, release_ids=[victim_rid])
        reply = await _stream_once(address, tls, batch)
        tally["release ids of another's request (stream): tried"] += 1
        assert not isinstance(reply, grpc.aio.AioRpcError), reply
        tally["release ids of another's request (stream): refused"] += 1  # freed nothing
        batch = tp.work_batch_pb([], sender="n0", release_ids=[victim_rid])
        reply = await _stream_once(address, creds.nodes["n1"], batch)
        tally["release ids of another's request (stream): tried"] += 1
        ok = (isinstance(reply, grpc.aio.AioRpcError)
              and reply.code() == grpc.StatusCode.PERMISSION_DENIED
              and "without a coordinator hello" in (reply.details() or ""))
        tally["release ids of another's request (stream): refused"] += ok
        assert ok, reply
        assert (await _info_async(address, tls)).active_requests == 1

    # 7: items on the attacker's own stream naming the victim's coordinator (result
    # injection) or the victim's request id (KV corruption), and a first-hop item from a
    # stream that is not a coordinator's
    route = [wire_hop("n0", n0, 0, 15), wire_hop("n1", n1, 15, 30)]
    for item, hello, cert in (
        (_forged_item("inject", coord.coordinator_id, route), (own_id, own_token), tls),
        (_forged_item(victim_rid, own_id, route), (own_id, own_token), tls),
        (_forged_item("peer-hop0", own_id, route), ("", ""), creds.nodes["n1"]),
    ):
        batch = tp.work_batch_pb([item], coordinator_id=hello[0], sender="n9",
                                 coordinator_token=hello[1])
        reply = await _stream_once(n0, cert, batch)
        tally["hijack items: tried"] += 1
        tally["hijack items: refused"] += per_item_refusal(reply)
        assert per_item_refusal(reply), reply

    # 8: a worker's certificate (n1's, valid, of the same CA) with a freshly minted coordinator
    # id and token: LoadRange and Release on both workers, and a coordinator stream
    for address in addresses.values():
        before = await _info_async(address, tls)
        async with security.aio_channel(address, creds.nodes["n1"]) as ch:
            stub = pb_grpc.HelixWorkerStub(ch)
            calls = {
                "LoadRange": stub.LoadRange(pb.LoadRangeRequest(
                    start_layer=0, end_layer=30, coordinator_id=own_id,
                    coordinator_token=own_token), timeout=10),
                "Release": stub.Release(tp.release_pb([victim_rid], coord.coordinator_id, ""),
                                        timeout=10),
            }
            for what, call in calls.items():
                tally[f"{what} with a worker's certificate: tried"] += 1
                try:
                    await call
                except grpc.aio.AioRpcError as exc:
                    ok = (exc.code() == grpc.StatusCode.PERMISSION_DENIED
                          and "coordinator certificate" in (exc.details() or ""))
                    tally[f"{what} with a worker's certificate: refused"] += ok
                    assert ok, exc
        batch = tp.work_batch_pb([], coordinator_id=own_id, sender="coordinator",
                                 coordinator_token=own_token)
        reply = await _stream_once(address, creds.nodes["n1"], batch)
        tally["coordinator stream with a worker's certificate: tried"] += 1
        ok = (isinstance(reply, grpc.aio.AioRpcError)
              and reply.code() == grpc.StatusCode.PERMISSION_DENIED)
        tally["coordinator stream with a worker's certificate: refused"] += ok
        assert ok, reply
        after = await _info_async(address, tls)
        assert (after.start_layer, after.end_layer) == (before.start_layer, before.end_layer)
        assert after.active_requests == before.active_requests == 1

    # 9: forged previous hop: items at hop 1 for n1 (whose previous hop is n0) from n1's own
    # certificate, from a coordinator stream, and continuing the victim's request
    hop1 = [(_forged_item("prev-hop", own_id, route, 1), creds.nodes["n1"], ("", "")),
            (_forged_item(victim_rid, coord.coordinator_id, route, 1), creds.nodes["n1"],
             ("", "")),
            (_forged_item("prev-hop", own_id, route, 1), tls, (own_id, own_token))]
    for item, cert, hello in hop1:
        batch = tp.work_batch_pb([item], coordinator_id=hello[0], sender="n0",
                                 coordinator_token=hello[1])
        reply = await _stream_once(n1, cert, batch)
        tally["forged previous hop: tried"] += 1
        ok = per_item_refusal(reply) and "previous hop 'n0'" in reply.results[0].error
        tally["forged previous hop: refused"] += ok
        assert ok, reply


async def _info_async(address: str, tls: Any) -> Any:
    async with security.aio_channel(address, tls) as ch:
        return await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest(), timeout=10)


@pytest.mark.slow
def test_abuse_is_refused_and_nothing_is_lost(tls_stack, demo_model, tmp_path):
    creds, cluster, placement, procs = tls_stack
    other_ca = security.create_dev_credentials(tmp_path / "other-ca", ["n0"])
    listener = CountingListener()
    tally: Counter[str] = Counter()
    prompt = [1, 504, 3458, 282, 4649, 30]

    async def run(attack: bool) -> list[int]:
        coord = await Coordinator.create(cluster, placement, demo_model, tls=creds.coordinator)
        try:
            req = GenerationRequest("victim", prompt, GREEDY, max_tokens=MAX_TOKENS,
                                    ignore_eos=True)
            tokens: list[int] = []
            async for ev in coord.generate(req):
                tokens.append(ev.token_id)
                if attack and len(tokens) == 5:
                    await _attack(creds, cluster, coord, other_ca, listener, tally)
                    tally["attacks done while the request ran"] = int(len(coord.active) == 1)
            return tokens
        finally:
            await coord.close()

    try:
        reference = asyncio.run(run(attack=False))
        attacked = asyncio.run(run(attack=True))
    finally:
        listener.close()
    print("\nabuse tally:", dict(tally))
    assert tally["attacks done while the request ran"] == 1
    assert len(attacked) == MAX_TOKENS and attacked == reference  # nothing freed or lost
    assert listener.accepted == 0  # nothing connected to the forged next hop
    tried = sum(v for k, v in tally.items() if k.endswith(": tried"))
    refused = sum(v for k, v in tally.items() if k.endswith(": refused"))
    assert tried == refused == 2 * 3 * 3 + 3 + 4 + 6 + 4 + 3 + 2 * 3 + 3
    for address in (str(n.address) for n in cluster.nodes):
        info = _info(address, security.sync_channel(address, creds.coordinator))
        assert info.active_requests == 0 and info.kv_used_blocks == 0
    assert "refused" in procs[0].log()
