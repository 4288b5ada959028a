"""What comes back from the workers, checked at arrival and told to each request's driver.

Every result arrives on the coordinator's stream to one worker (node_client.py). The last stage
of a request's route writes its tokens and prefill acks on its own stream; any hop of the route
may report an error for it (KV full, next hop unreachable, draining). `ResultInbox.deliver` lets
a result through to its request only when the request waits for it, so a result is *dropped*
(counted in `dropped`, logged at debug, never delivered) when

- no request in flight has its id (it ended, or was replayed under a fresh id);
- it came on the stream of a node that is not on the request's route;
- it is a token or an ack that did not come from the route's last stage;
- its step was not sent on the current route, or was answered already (a step id of 0 on an
  error means the whole request, which is always waited for).

Which node a result came from is the stream's, not what the message says (docs/security.md:
authority comes from the connection). `next_outcome` then says what the next result means for
the request: a token, a route to give up (`Replay`), a worker out of KV (`KvFull`), or a
failure that no re-route can fix (`Failed`), or a hop that no longer holds the cached prefix
the request's first item named (`PrefixMiss`: run it again). A prefix miss is attributed to
the node whose stream it came on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from helixserve.runtime.inflight import InFlight
from helixserve.runtime.node_client import NodeFailure
from helixserve.runtime.transport import RESOURCE_EXHAUSTED, UNAVAILABLE, WireResult

log = logging.getLogger("helixserve.coordinator")


class RequestFailedError(RuntimeError):
    """A worker reported an error for the request that re-routing cannot fix."""


@dataclass(frozen=True)
class Token:
    """The route's last stage sampled the request's next token."""

    result: WireResult


@dataclass(frozen=True)
class Replay:
    """The route failed (a node down, a hop unreachable, a step lost): re-route the request."""

    reason: str


@dataclass(frozen=True)
class KvFull:
    """`node` had no KV block for the request's next step (on-demand KV): preempt it."""

    node: str
    reason: str


@dataclass(frozen=True)
class PrefixMiss:
    """`node` no longer holds the prefix blocks `missing` (all of the request's prefix there
    when empty): forget them and run the request again."""

    node: str
    missing: tuple[bytes, ...]
    reason: str


@dataclass(frozen=True)
class Failed:
    """An error that re-routing cannot fix."""

    reason: str


Outcome = Token | Replay | KvFull | PrefixMiss | Failed


def unexpected(fl: InFlight, node: str, r: WireResult) -> str | None:
    """Why `r`, received on `node`'s stream, is not a result `fl` waits for; None if it is."""
    if not fl.on_route(node):
        return f"from {node}, which is not on its route"
    if r.ok:
        if node != fl.hops[-1].name:
            return f"a token or ack from {node}, not from the route's last stage"
        if r.step_id not in fl.pending:
            return f"step {r.step_id} was not sent on its route or was answered already"
    elif r.step_id and r.step_id not in fl.pending:
        # e.g. a worker whose stream to the next hop broke after it sent the step on
        return f"an error for step {r.step_id}, which was answered already"
    return None


class ResultInbox:
    """The results of the requests in flight (`active`, by internal id)."""

    def __init__(self, active: Mapping[str, InFlight]) -> None:
        self.active = active
        #: results dropped at arrival (see the module doc), since start
        self.dropped = 0

    def deliver(self, node: str, r: WireResult) -> None:
        """A result that arrived on `node`'s stream: to its request, or dropped."""
        fl = self.active.get(r.request_id)
        why = "no request in flight has its id" if fl is None else unexpected(fl, node, r)
        if why is not None:
            self.dropped += 1
            log.debug("dropped a result for %s (step %d) from %s: %s", r.request_id,
                      r.step_id, node, why)
            return
        assert fl is not None
        if r.ok:
            fl.pending.discard(r.step_id)
        elif r.prefix_miss:
            r.node = node  # the stream's, not what the message says
        fl.results.put_nowait(r)

    def node_failed(self, node: str, reason: str) -> None:
        """`node`'s stream broke: every request routed through it gives its route up."""
        for fl in self.active.values():
            if fl.on_route(node):
                fl.results.put_nowait(NodeFailure(node, reason))


async def next_outcome(fl: InFlight, timeout_s: float, on_demand: bool) -> Outcome:
    """Wait for what the request's next result means, skipping prefill acks."""
    while True:
        try:
            if fl.results.empty():
                # asyncio.timeout, not wait_for: no task per token
                async with asyncio.timeout(timeout_s):
                    r = await fl.results.get()
            else:
                r = fl.results.get_nowait()
        except TimeoutError:
            # an item lost without any node failing (e.g. a broken worker-to-worker
            # stream): replay on a route of nodes that pass a health check
            return Replay(f"no result for {timeout_s:.0f} s")
        if isinstance(r, NodeFailure):
            return Replay(f"node {r.node} failed: {r.reason}")
        if r.ok:
            if r.token_id is not None:
                return Token(r)
            continue  # a prefill chunk's ack
        if r.status_code == UNAVAILABLE:
            return Replay(r.error)
        if r.status_code == RESOURCE_EXHAUSTED and on_demand:
            return KvFull(r.node, r.error)
        if r.prefix_miss:
            return PrefixMiss(r.node, tuple(r.prefix_missing), r.error)
        return Failed(r.error)


__all__ = ["Failed", "KvFull", "Outcome", "PrefixMiss", "Replay", "RequestFailedError", "ResultInbox", "Token",
           "next_outcome", "unexpected"]
