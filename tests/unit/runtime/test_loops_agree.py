"""The two loops around the scheduling core agree: the simulator and the live Coordinator,
fed the same events, make the same admissions, routes and preemptions.

Both drive one `SchedulerCore` (scheduler/core.py), whose transitions and policies
tests/unit/scheduler/test_core.py covers. What this checks is the loops: that each turns its
events into the same core calls. The simulator runs a small trace with the core's decision
log on. The same events then drive the real `Coordinator` (its `_admit` wait on the
admission pump, token accounting, `_finish`, and the KV-full path: a worker's result through
the result inbox -> `_next_token` -> `_replay`), over fake node clients that report the simulated nodes' KV capacities and accept
items without running them (no torch, no gRPC, no clock: the simulator's event order is the
clock). Compared: each admission's request, route and the per-node free KV the router saw,
and each preemption's victim, in order.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from helixserve.request import GenerationRequest, SamplingParams
from helixserve.runtime.coordinator import Coordinator
from helixserve.runtime.inflight import InFlight
from helixserve.runtime.transport import RESOURCE_EXHAUSTED, WireResult
from helixserve.scheduler import make_router
from helixserve.scheduler.options import router_options
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import TraceRequest
from tests.unit.simulator.conftest import Machine, make_setup, with_flows


class FakeNode:
    """What the coordinator reads of a NodeClient; items are recorded, never run."""

    def __init__(self, name: str, start: int, end: int, kv_capacity_tokens: int) -> None:
        self.name, self.start_layer, self.end_layer = name, start, end
        self.kv_capacity_tokens = kv_capacity_tokens
        self.alive = True
        self.queue_len = 0
        self.address = f"fake-{name}:1"
        self.info = SimpleNamespace(kv_block_size=1)  # the simulator counts single slots
        self.sent: list[Any] = []

    def send(self, item: Any) -> None:
        self.sent.append(item)

    async def release(self, ids: list[str]) -> int:
        return len(ids)

    def release_on_stream(self, request_id: str) -> bool:
        return True

    async def check_alive(self, timeout_s: float) -> bool:
        return True

    async def close(self) -> None:
        self.alive = False


def _setup():  # type: ignore[no-untyped-def]
    # a is the small first stage (its KV fills first); b and c can both run layers [2, 4)
    return with_flows(make_setup([
        Machine("a", "T4", 0, 2, decode_ms=10.0, max_decode=64, memory_gb=0.06),
        Machine("b", "L4", 2, 4, decode_ms=8.0, max_decode=64, memory_gb=0.1),
        Machine("c", "A10", 2, 4, decode_ms=12.0, max_decode=64, memory_gb=0.1),
    ]))


def _trace() -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.02 * i, 120, 60 + (37 * i) % 140) for i in range(20)]


def _simulate(s: Any, victim_rule: str) -> Simulation:
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, _trace(),
                     SimConfig(scheduler="maxflow", kv_allocation="on-demand",
                               victim_rule=victim_rule, duration_s=600.0))
    sim.decisions = []
    sim.run()
    return sim


async def _settle() -> None:
    for _ in range(50):  # let woken admission waits and spawned tasks run
        await asyncio.sleep(0)


async def _drive(s: Any, sim: Simulation, router: Any = None) -> Coordinator:
    """Replay the simulator's decision log through the coordinator; `router`: the
    coordinator's own (default: one built from the simulator's router options)."""
    if router is None:
        router = make_router("maxflow", s.placement, seed=0,
                             **router_options(s.cluster, s.model, s.placement, s.cost))
    coord = Coordinator(s.placement, Path("."), router, max_queue=1000, max_reroutes=3,
                        stats_interval_s=3600.0, kv_allocation="on-demand")
    coord.nodes.update({n.name: FakeNode(n.name, n.start, n.end, n.kv_cap)  # type: ignore[misc]
                        for n in sim.nodes.values()})
    coord.max_model_len, coord.dispatch.chunk_tokens, coord.step_timeout_s = 10**6, 10**6, 3600.0
    coord.core.log = []
    acts: dict[str, InFlight] = {}
    tasks: list[asyncio.Task[Any]] = []
    assert sim.decisions is not None
    try:
        await _replay_log(coord, sim.decisions, acts, tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await coord.close()
    return coord


async def _replay_log(coord: Coordinator, log: list[tuple[Any, ...]],
                      acts: dict[str, InFlight], tasks: list[asyncio.Task[Any]]) -> None:
    for ev in log:
        kind = ev[0]
        if kind == "arrive":
            _, rid, prompt, output = ev
            req = GenerationRequest(rid, [1] * prompt, SamplingParams(), max_tokens=output)
            fl = acts[rid] = InFlight.of(req, coord._new_internal_id(req), [])
            tasks.append(asyncio.create_task(coord._admit(fl)))
            await _settle()
        elif kind == "token":
            coord._on_token(acts[ev[1]], 7)
        elif kind == "finish":
            coord._on_token(acts[ev[1]], 7)
            coord._finish(acts[ev[1]])
        elif kind == "wake":  # the simulator admits after the last token of a batch
            await _settle()
        elif kind == "preempt":
            _, _victim, node, requester = ev
            fl = acts[requester]
            # the worker at `node` refuses the requester's next step: no KV block left
            coord.inbox.deliver(node, WireResult(fl.internal_id, 0, status_code=RESOURCE_EXHAUSTED,
                                                 error="KvExhaustedError", node=node))
            tasks.append(asyncio.create_task(coord._next_token(fl)))
            await _settle()
    await _settle()


def _decisions(log: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Admissions (request, route, free KV seen) and preemption victims, with the
    coordinator's internal ids (`request#coordinator.n`) mapped back to request ids."""
    out: list[tuple[Any, ...]] = []
    for ev in log:
        if ev[0] == "admit":
            out.append((ev[0], ev[1].split("#")[0], *ev[2:4]))
        elif ev[0] == "preempt":
            out.append((ev[0], ev[1].split("#")[0]))
    return out


def test_simulator_and_coordinator_decide_the_same_step_by_step() -> None:
    s = _setup()
    sim = _simulate(s, victim_rule="requester")  # the live coordinator's rule
    assert sim.decisions is not None
    simulated = _decisions(sim.decisions)
    # the trace exercises what is compared: queueing, both stage-2 nodes, preemptions
    admits = [d for d in simulated if d[0] == "admit"]
    assert len(admits) > 20, "no request was preempted and re-admitted"
    assert {d[2] for d in admits} == {("a", "b"), ("a", "c")}
    assert sum(d[0] == "preempt" for d in simulated) >= 2
    assert len(sim.finished) == 20
    coord = asyncio.run(_drive(s, sim))
    assert coord.core.log is not None
    live = _decisions(coord.core.log)
    for i, (a, b) in enumerate(zip(simulated, live, strict=False)):
        assert a == b, f"decision {i} differs: simulator {a}, coordinator {b}"
    assert len(live) == len(simulated)
    assert coord.preemptions == sum(d[0] == "preempt" for d in simulated)
    assert not coord.active and not coord.core.kv.holds  # every request finished, its KV freed


@pytest.mark.parametrize("rule", ["newest", "requester"])
def test_simulator_victims_follow_the_rule(rule: str) -> None:
    """The simulator's victims follow the core's rule: the requester itself, or the most
    recently admitted request holding KV on the full node."""
    sim = _simulate(_setup(), victim_rule=rule)
    assert sim.decisions is not None
    holders: dict[str, list[str]] = {}  # node -> request ids holding KV, admission order
    routes: dict[str, tuple[str, ...]] = {}
    preempted = 0
    for ev in sim.decisions:
        if ev[0] == "admit":
            routes[ev[1]] = ev[2]
            for n in ev[2]:
                holders.setdefault(n, []).append(ev[1])
        elif ev[0] in ("finish", "preempt"):
            rid = ev[1]
            if ev[0] == "preempt":
                preempted += 1
                _, victim, node, requester = ev
                assert victim == (requester if rule == "requester" else holders[node][-1])
            for n in routes.pop(rid):
                holders[n].remove(rid)
    assert preempted >= 2
