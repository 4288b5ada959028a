"""Live re-planning: losing the only holder of some layers is not an outage.

The coordinator's `Recovery` watches the live workers. When some layer has no live holder
(a worker died, hung or was drained), it

1. plans again for the machines it has: `plan --from` (planner/incremental.py) over the
   cluster less the dead nodes, from the placement it runs now, in `plan_time_limit_s`
   (or, with `plan_work_limit`, to a budget of work: the same plan whatever the load);
2. tells every live worker whose range changes to load its new range over `LoadRange`
   (the worker loads the new layers beside the old ones while serving, switches, frees the
   old; requests that held KV of its old range are told UNAVAILABLE and replayed);
3. installs the placement the workers now actually hold (their `Info`, not the plan: a
   worker that failed to load keeps its old range) with its max flow, and rebuilds the
   router over it; requests waiting for the model to be covered go on.

If the installed placement still leaves a layer uncovered (another worker died meanwhile),
it plans again, at most `max_attempts` times in a row. When no plan can cover the model with
the machines left (not enough memory), the state is `uncoverable`: new requests get a 503
with Retry-After, requests already running wait `wait_s` for a worker to come back.

A worker that comes back (restarted by the local supervisor or its orchestrator) or joins
reports the range it loaded; `rejoin` installs the actual placement again, so its range is
served (or it is an extra holder of layers the re-plan moved elsewhere). Then, while the
model is covered, it plans once more with the returned worker: when that placement's max
flow beats the current one's (same cost model) by `join_min_gain` (25%), it is applied the
same way; else the placement stays (a move pauses the moved workers' requests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from helixserve.errors import UserError
from helixserve.runtime.config import RecoveryConfig

if TYPE_CHECKING:
    from helixserve.costmodel import CostModel
    from helixserve.planner.placement import Placement
    from helixserve.runtime.node_client import NodeClient

log = logging.getLogger("helixserve.coordinator")

STATES = ("idle", "planning", "loading", "uncoverable")


@dataclass
class ReplanRecord:
    """One re-plan, for /metrics, /health and the logs."""

    reason: str
    started_s: float  # time.time()
    plan_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    changes: str = ""
    covered: bool = False
    error: str = ""


class RecoveryHost(Protocol):
    """What the re-plan needs of the coordinator (which implements it)."""

    @property
    def nodes(self) -> Mapping[str, NodeClient]:
        """Every worker's client: liveness, the range it holds, LoadRange."""
        ...

    @property
    def placement(self) -> Placement:
        """The placement routes are made over now."""
        ...

    #: bumped when a re-plan starts and when it ends: older routes are stale, not unlucky
    epoch: int

    def covered(self) -> bool:
        """Whether the live workers' ranges cover every layer."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...

    async def notify_admit(self) -> None:
        """An admission point: waiting requests may be admitted now."""
        ...

    def cost_model(self) -> CostModel: ...

    async def install_placement(self, placement: Placement) -> None:
        """Route over `placement` from now on."""
        ...

    def stop_routing_to(self, node: str) -> None:
        """Send no new work to `node` (its range is changing)."""
        ...


class Recovery:
    def __init__(self, coord: RecoveryHost, cluster: Any, config: RecoveryConfig) -> None:
        self.coord = coord
        self.cluster = cluster
        self.config = config
        self.state = "idle"
        self.replans = 0  # re-plans that ended with the model covered
        self.failed_replans = 0
        self.history: list[ReplanRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._lock = asyncio.Lock()  # one install at a time (re-plan, rejoin)

    @property
    def uncoverable(self) -> bool:
        return self.state == "uncoverable"

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def stop_waiting(self, waited_s: float, replay: bool) -> str | None:
        """A request has waited `waited_s` for the model to be covered again: why it should
        stop waiting, as the end of its error message (None: it waits on, and a re-plan starts
        unless one is under way or none can cover the model). `replay`: it was running (it
        waits for a restart too)."""
        if waited_s > self.config.wait_s:
            return f"; waited {waited_s:.0f} s for a re-plan or a restart"
        if self.uncoverable and not replay:
            return ", and no placement over them covers it"  # a new request: come back later
        if not self.busy and not self.uncoverable:
            self.trigger("layers without a live holder")
        return None

    def trigger(self, reason: str) -> None:
        """Re-plan soon (now, or again once the re-plan under way ends)."""
        if self.busy:
            self._again = True
            return
        self._task = self.coord.spawn(self._run(reason))

    async def _run(self, reason: str) -> None:
        attempts = 0
        while True:
            self._again = False
            if self.coord.covered():
                if self.state != "loading":
                    self.state = "idle"
                break
            if attempts >= self.config.max_attempts:
                self.state = "uncoverable"
                log.error("re-plan: layers still uncovered after %d attempts; waiting for a "
                          "worker to come back", attempts)
                break
            attempts += 1
            try:
                await self._replan_once(reason)
            except Exception as exc:  # a bug must not kill recovery silently
                log.exception("re-plan failed: %s", exc)
                self.failed_replans += 1
                self.state = "uncoverable"
            if not self._again and self.state == "uncoverable":
                break
            reason = "layers still uncovered after a re-plan"
        await self.coord.notify_admit()

    async def _replan_once(self, reason: str) -> None:
        coord = self.coord
        record = ReplanRecord(reason, time.time())
        self.history = [*self.history[-19:], record]
        t0 = time.perf_counter()
        live = sorted(n.name for n in coord.nodes.values() if n.alive)
        log.warning("re-plan: %s; planning for the live workers %s", reason, ", ".join(live))
        self.state = "planning"
        current = coord.placement
        try:
            new = await asyncio.get_running_loop().run_in_executor(
                None, self._plan, live, current)
        except UserError as exc:
            record.error = str(exc)
            record.total_s = time.perf_counter() - t0
            self.failed_replans += 1
            self.state = "uncoverable"
            log.error("re-plan: no placement covers the model with %s: %s",
                      ", ".join(live) or "no workers", exc)
            return
        record.plan_s = time.perf_counter() - t0
        await self._apply(current, new, record, t0)

    async def _apply(self, current: Any, new: Any, record: ReplanRecord, t0: float) -> None:
        """Load the changed ranges, install what the workers hold (module doc, 4-5)."""
        from helixserve.planner.incremental import changes

        coord = self.coord
        diff = changes(current, new)
        record.changes = diff.summary()
        log.warning("re-plan: planned in %.2f s: %s", record.plan_s, record.changes)
        self.state = "loading"
        coord.epoch += 1  # routes made before now may be stale: replaying them is free
        t1 = time.perf_counter()
        loads = [(name, rng) for name, _, rng in diff.moved] + list(diff.added)
        loads = [(name, rng) for name, rng in loads if name in coord.nodes]
        results = await asyncio.gather(*(self._load(name, s, e) for name, (s, e) in loads),
                                       return_exceptions=True)
        for (name, (s, e)), res in zip(loads, results, strict=True):
            if isinstance(res, BaseException):
                log.warning("re-plan: %s could not load [%d, %d): %s", name, s, e, res)
                self._again = True
        record.load_s = time.perf_counter() - t1
        await self.install_actual()
        coord.epoch += 1
        record.total_s = time.perf_counter() - t0
        record.covered = coord.covered()
        if record.covered:
            self.replans += 1
            self.state = "idle"
            log.warning("re-plan: serving again %.2f s after it began (plan %.2f s, load "
                        "%.2f s)", record.total_s, record.plan_s, record.load_s)
        else:
            self._again = True

    async def _load(self, name: str, start: int, end: int) -> None:
        """One worker's LoadRange. It serves its old range while it loads; once it has
        switched, the router must not send it work for the old range any more (such work
        would only bounce back as a stale route) until the new placement is installed."""
        coord = self.coord
        try:
            await coord.nodes[name].load_range(start, end, self.config.load_timeout_s)
        finally:
            coord.stop_routing_to(name)

    def _plan(self, live: list[str], current: Any) -> Any:
        """Blocking: the incremental re-plan over the live workers (a thread runs it)."""
        return self._plan_and_value(live, current)[0]

    def _plan_and_value(self, live: list[str], current: Any) -> tuple[Any, float | None]:
        """Blocking: (re-plan, max flow of `current` under the same cost model; None when
        `current` does not fit the cluster file's memory)."""
        from helixserve.planner import evaluate
        from helixserve.planner.incremental import replan

        if not live:
            raise UserError("no live worker")
        cluster = live_cluster(self.cluster, set(live))
        # the cost model the coordinator routes with (runtime/costs.py: the operator's
        # profiles, catalog and dtype), so the re-plan's flow is the router's
        cost = self.coord.cost_model()
        model = cost.model
        value: float | None
        try:
            value = evaluate(cluster, model, cost, current).throughput_tokens_per_s
        except UserError:
            value = None
        result = replan(cluster, model, cost, current,
                        planner=self.config.planner, time_limit_s=self.config.plan_time_limit_s,
                        work_limit=self.config.plan_work_limit)
        placement = result.placement
        if not placement.covers_all_layers():
            raise UserError(f"the {self.config.planner} re-plan leaves layers uncovered")
        return placement, value

    async def _join(self, name: str) -> None:
        """A worker came back while the model is covered: move ranges only when the
        re-plan's max flow beats the current one by `join_min_gain` (moving costs a pause:
        the moved workers' requests are replayed)."""
        coord, gain = self.coord, self.config.join_min_gain
        assert gain is not None
        live = sorted(n.name for n in coord.nodes.values() if n.alive)
        current = coord.placement
        t0 = time.perf_counter()
        try:
            new, value = await asyncio.get_running_loop().run_in_executor(
                None, self._plan_and_value, live, current)
        except UserError as exc:
            log.warning("re-plan after %s joined: %s; keeping the placement", name, exc)
            return
        planned = new.throughput_tokens_per_s or 0.0
        if value is None or planned < (1.0 + gain) * value:
            log.warning("re-plan after %s joined: %.1f tokens/s planned vs %s now; keeping "
                        "the placement (a move needs +%.0f%%)", name, planned,
                        "?" if value is None else f"{value:.1f}", 100 * gain)
            return
        record = ReplanRecord(f"node {name} joined: {value:.1f} -> {planned:.1f} tokens/s "
                              "planned", time.time(), plan_s=time.perf_counter() - t0)
        self.history = [*self.history[-19:], record]
        log.warning("re-plan: %s", record.reason)
        await self._apply(current, new, record, t0)
        if not coord.covered():
            self._task = None
            self.trigger("layers uncovered after a re-plan for a joining worker")
        await coord.notify_admit()

    async def install_actual(self) -> None:
        """Route over the ranges the live workers hold now (asked, not assumed)."""
        async with self._lock:
            coord = self.coord
            live = [n for n in coord.nodes.values() if n.alive]
            await asyncio.gather(*(n.refresh_info() for n in live), return_exceptions=True)
            for n in live:
                if n.info is not None:
                    n.start_layer, n.end_layer = n.info.start_layer, n.info.end_layer
            if not coord.covered():
                return
            await coord.install_placement(actual_placement(coord.placement, live))

    async def rejoin(self, node: Any) -> None:
        """A worker came back or joined: serve whatever range it holds."""
        await self.install_actual()
        log.warning("node %s rejoined with layers [%d, %d)", node.name, node.start_layer,
                    node.end_layer)
        if not self.coord.covered():
            self.trigger(f"node {node.name} rejoined, layers still uncovered")
            return
        if self.state == "uncoverable":
            self.state = "idle"  # covered again without a re-plan: new requests are served
        if self.config.join_min_gain is not None and not self.busy:
            self._task = self.coord.spawn(self._join(node.name))

    def snapshot(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else None
        return {
            "state": self.state,
            "replans": self.replans,
            "failed_replans": self.failed_replans,
            "last": None if last is None else dataclasses.asdict(last),
        }


def live_cluster(cluster: Any, names: set[str]) -> Any:
    """The cluster restricted to `names` (links to other nodes dropped)."""
    return dataclasses.replace(
        cluster,
        nodes=[n for n in cluster.nodes if n.name in names],
        explicit={k: v for k, v in cluster.explicit.items()
                  if all(e == "coordinator" or e in names for e in k)},
    )


def actual_placement(template: Any, live: list[Any]) -> Any:
    """A placement of the live workers' actual ranges (flows left for the coordinator to
    evaluate)."""
    from helixserve.planner.placement import NodeRange, Placement

    return Placement(
        model=template.model, cluster=template.cluster, num_layers=template.num_layers,
        planner=f"{template.planner.removesuffix('-live')}-live",
        nodes=[NodeRange(n.name, n.start_layer, n.end_layer)
               for n in sorted(live, key=lambda n: (n.start_layer, n.name))],
        flows=[],
    )


__all__ = ["Recovery", "RecoveryHost", "ReplanRecord", "actual_placement", "live_cluster"]
