"""Why a request runs again: what the coordinator does when a request's step fails, for each
failure results.py names, before it replays the request (`Coordinator._replay`: its KV freed
on the workers, admitted again under a fresh id, prompt + tokens so far prefilled).

- A broken route (a worker's stream broke, a hop unreachable, a stale range): the core
  re-routes it, counted against `max_reroutes` unless the route was made before a re-plan or
  while one switches the workers' ranges (then it is no fault of the request's).
- A worker out of KV ("on-demand" allocation): the core preempts it by its victim rule
  (RUNTIME_VICTIM_RULE: the request whose step failed), vLLM's preemption by recompute; it
  goes ahead of new requests, and is not counted against `max_reroutes`.
- A prefix miss (a hop evicted the cached prefix after it last reported it): the core forgets
  those blocks there and queues it again, uncounted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from helixserve.runtime.results import KvFull, PrefixMiss, RequestFailedError
from helixserve.scheduler.core import RerouteLimitError, SchedulerCore

if TYPE_CHECKING:
    from helixserve.runtime.counters import CoordinatorCounts
    from helixserve.runtime.inflight import InFlight
    from helixserve.runtime.node_client import NodeClient
    from helixserve.runtime.replan import Recovery

log = logging.getLogger("helixserve.coordinator")


class ReplayHost(Protocol):
    """What these need of the coordinator (which implements it)."""

    core: SchedulerCore
    recovery: Recovery | None

    @property
    def nodes(self) -> Mapping[str, NodeClient]:
        """Every worker's client: asked whether it is alive when a route breaks."""
        ...

    @property
    def counts(self) -> CoordinatorCounts: ...

    @property
    def epoch(self) -> int:
        """Bumped when a re-plan starts and when it ends (routes made before are stale)."""
        ...

    @property
    def hang_timeout_s(self) -> float:
        """The deadline a live worker's Info gets."""
        ...


async def reroute(host: ReplayHost, fl: InFlight, reason: str) -> None:
    """A broken route: have the core re-route the request, or raise RequestFailedError when it
    may not (it gave up after `max_reroutes`)."""
    # routed before a re-plan, or while one switches workers' ranges: not this request's
    # bad luck, so not counted against max_reroutes
    stale = fl.epoch < host.epoch or (host.recovery is not None
                                      and host.recovery.state == "loading")
    if not stale and not host.core.may_reroute(fl.internal_id):
        raise RequestFailedError(f"request {fl.req.request_id}: {reason} (gave up after "
                                 f"{fl.reroutes} re-routes)")
    log.warning("re-routing %s: %s", fl.internal_id, reason)
    # Which hop failed? A worker reports an unreachable next hop before this coordinator's
    # own stream to it breaks: ask every hop, so the new route avoids the dead one. The
    # deadline is the one a live worker's Info gets (hang_timeout_s, scaled by rehearsals):
    # a busy host's worker must not go down on one slow answer.
    await asyncio.gather(*(host.nodes[h.name].check_alive(host.hang_timeout_s)
                           for h in fl.hops))
    host.counts.reroutes += 1
    try:
        host.core.reroute(fl.internal_id, counted=not stale)
    except RerouteLimitError as exc:
        raise RequestFailedError(f"request {fl.req.request_id}: {reason} ({exc})") from None


def preempt(host: ReplayHost, fl: InFlight, full: KvFull) -> None:
    """A worker out of KV: the core preempts the request whose step failed; it is recomputed
    once admitted again."""
    victim = host.core.kv_full(full.node, fl.internal_id)
    assert victim == fl.internal_id, (victim, fl.internal_id)
    log.info("preempting %s (%d tokens generated): %s", fl.internal_id,
             len(fl.output_ids), full.reason)


def prefix_missed(host: ReplayHost, fl: InFlight, miss: PrefixMiss) -> None:
    """A hop evicted the request's cached prefix after it last reported it: the core forgets
    those blocks there (the names the worker listed, else the prefix's on that hop, which it
    named at admission) and queues the request again, uncounted (not a fault); it runs again
    from its admission."""
    host.core.prefix_miss(fl.internal_id, miss.node, miss.missing)
    host.counts.prefix_misses += 1
    log.info("running %s again: %s", fl.internal_id, miss.reason)
