"""The coordinator's view of its workers: one `NodeClient` per placed node (node_client.py),
by node name.

- `covered(nodes, num_layers)`: whether the live workers' ranges cover every layer (whether
  any route exists);
- `report(core, nodes)`: the workers' latest reports handed to the scheduling core: KV
  capacity in tokens, queue, liveness, and the KV block size (the ledger asks the router for
  block slack, so its promises in tokens never add up to more blocks than a worker has);
- `open_all(nodes, num_layers, timeout_s)`: the first connection to every worker;
- `WorkerWatch`: every `interval_s`, each live worker's Info (its KV and queue; with `hang_s`,
  one that lets two calls in a row pass unanswered is declared down, as a hung machine is a
  dead one), and a reconnection to each down one every `node_client.REVIVE_INTERVAL_S`;
  `on_back(node)` once a worker answers again and runs the vLLM version the others run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from helixserve.errors import UserError
from helixserve.runtime.startup import check_vllm_versions, connect_all

if TYPE_CHECKING:
    from helixserve.runtime.node_client import NodeClient
    from helixserve.scheduler.core import SchedulerCore

log = logging.getLogger("helixserve.coordinator")


def covered(nodes: Mapping[str, NodeClient], num_layers: int) -> bool:
    """Whether the live workers' ranges cover layers [0, num_layers)."""
    from helixserve.planner.placement import layer_gaps

    return not layer_gaps(((n.start_layer, n.end_layer) for n in nodes.values() if n.alive),
                          num_layers)


def report(core: SchedulerCore, nodes: Mapping[str, NodeClient]) -> None:
    """Hand the core the workers' latest reports (see the module doc)."""
    core.set_block_size(max((n.info.kv_block_size for n in nodes.values() if n.info),
                            default=1))
    for name, n in nodes.items():
        core.report(name, n.kv_capacity_tokens, n.queue_len, n.alive)


async def open_all(nodes: Mapping[str, NodeClient], num_layers: int,
                   timeout_s: float) -> dict[str, str]:
    """Connect to every worker; returns {name: why} of those that did not answer (down,
    retried later). ConnectionError, every client closed, when the others do not cover the
    model; a configuration error (startup.connect_all) is raised as it is."""
    unreachable = await connect_all(nodes, num_layers, timeout_s)
    missing = "; ".join(f"{name}: {why}" for name, why in unreachable.items())
    if not covered(nodes, num_layers):
        await asyncio.gather(*(n.close() for n in nodes.values()), return_exceptions=True)
        raise ConnectionError(f"no route covers the model over the reachable workers; {missing}")
    if missing:
        log.warning("starting without %s", missing)
    return unreachable


class WorkerWatch:
    """See the module doc. `check_range`: a worker coming back must hold its placed range
    (False with live re-planning, which takes whatever range it holds)."""

    def __init__(self, nodes: Mapping[str, NodeClient], num_layers: int, interval_s: float,
                 hang_s: float | None, check_range: bool,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
                 on_back: Callable[[NodeClient], Awaitable[None]]) -> None:
        self.nodes, self.num_layers = nodes, num_layers
        self.interval_s, self.hang_s, self.check_range = interval_s, hang_s, check_range
        self.spawn, self.on_back = spawn, on_back

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.hang_s is None:
                await asyncio.gather(*(n.refresh_info() for n in self.nodes.values() if n.alive),
                                     return_exceptions=True)
            else:
                # one task per node: a hung worker must not hold up the others' stats
                for n in self.nodes.values():
                    if n.alive and not n.refreshing:
                        self.spawn(n.refresh_info(timeout_s=self.hang_s))
                    n.check_answering(self.hang_s)
            for n in self.nodes.values():
                if not n.alive and n.reconnectable():
                    self.spawn(self._revive(n))

    async def _revive(self, node: NodeClient) -> None:
        if not await node.revive(self.num_layers, check_range=self.check_range):
            return
        try:
            check_vllm_versions({n.name: n.info for n in self.nodes.values()
                                 if n.info and (n.alive or n is node)})
        except UserError as exc:
            log.error("not taking node %s back: %s", node.name, exc)
            await node.close()
            return
        log.info("node %s is back", node.name)
        await self.on_back(node)


__all__ = ["WorkerWatch", "covered", "open_all", "report"]
