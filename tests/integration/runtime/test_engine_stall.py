"""A worker whose engine thread hangs (not the process: its sockets, event loop, Info and
health keep answering) is detected by its own watchdog, and the coordinator routes around it.

Two plaintext workers each hold the whole model, a [0,30) and b [0,30). Worker a runs with
`HELIXSERVE_TEST_ENGINE_HANG=STEPS:600` (its engine thread sleeps 600 s before a given step)
and `--engine-stall-s 4`; 16 greedy requests stream concurrently through a coordinator with
live recovery. The hang must turn a's health NOT_SERVING and its Info into DEADLINE_EXCEEDED
(what the coordinator counts as a hung worker's missed answer), the coordinator must mark a
down, and every request must complete with the single engine's tokens on b (none lost, no
gap, no duplicate). Numbers are printed for docs/resilience.md.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from runtime_procs import (
    NUM_LAYERS,
    make_cluster,
    make_placement,
    start_worker,
    stop_workers,
    wait_ready,
)

from helixserve.engine import ShardEngine, WorkItem
from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc
from helixserve.runtime.worker import HANG_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 32
STREAMS = 16
STALL_S = 4.0
HANG_AFTER_STEPS = 12
PROMPT = [1, 504, 3458, 282, 4649, 30, 2, 17]


def _reference(model: Path) -> list[int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = ShardEngine.load(model, 0, NUM_LAYERS, kv_cache_bytes=32 * 1024 * 1024)
    rid = uuid.uuid4().hex
    tokens = [engine.step([WorkItem(rid, 0, NUM_LAYERS, 0, PROMPT, None, GREEDY)])[0].token_id]
    while len(tokens) < MAX_TOKENS:
        pos = len(PROMPT) + len(tokens) - 1
        tokens.append(engine.step([WorkItem(rid, 0, NUM_LAYERS, pos, [tokens[-1]], None,
                                            GREEDY)])[0].token_id)
    torch.set_num_threads(threads)
    return tokens


@pytest.mark.slow
def test_a_hung_engine_is_detected_and_routed_around(demo_model, tmp_path):
    reference = _reference(demo_model)
    hung = start_worker(demo_model, "a", 0, NUM_LAYERS, tmp_path,
                        extra=["--engine-stall-s", str(STALL_S), "--drain-timeout-s", "1"],
                        env={HANG_ENV: f"{HANG_AFTER_STEPS}:600"})
    good = start_worker(demo_model, "b", 0, NUM_LAYERS, tmp_path)
    workers = [hung, good]
    placement = make_placement([("a", 0, NUM_LAYERS), ("b", 0, NUM_LAYERS)],
                               [("coordinator", "a", 1), ("coordinator", "b", 1),
                                ("a", "coordinator", 1), ("b", "coordinator", 1)])
    # no live re-planning: a hung worker is detected (and routed around) without it too
    config = CoordinatorConfig(hang_timeout_s=10.0)
    seen: dict[str, float] = {}  # first time each was observed (unix time)
    messages: list[str] = []  # the stalled Info's error details, and the coordinator's reason

    async def watch(coord: Coordinator) -> None:
        async with grpc.aio.insecure_channel(hung.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                now = time.time()
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    seen.setdefault("not_serving", now)
                    try:
                        await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest(), timeout=5)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                            seen.setdefault("info_error", now)
                            messages.append(exc.details() or "")
                if not coord.stats().nodes["a"].alive:
                    seen.setdefault("down", now)
                await asyncio.sleep(0.1)

    async def main() -> list[list[int]]:
        coord = await Coordinator.create(make_cluster(workers), placement, demo_model, config)
        watcher = asyncio.create_task(watch(coord))

        async def one(i: int) -> list[int]:
            req = GenerationRequest(f"s{i}", PROMPT, GREEDY, max_tokens=MAX_TOKENS,
                                    ignore_eos=True)
            return [ev.token_id async for ev in coord.generate(req)]

        try:
            results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
            seen["done"] = time.time()
            messages.append(f"coordinator: {coord.counts.down_reasons.get('a', '')}")
            return results
        finally:
            watcher.cancel()
            await coord.close()

    try:
        wait_ready(workers)
        results = asyncio.run(main())
    finally:
        stop_workers(workers)
    log = hung.log()
    m = re.search(r"engine thread hangs for \d+ s now \(unix time ([\d.]+)\)", log)
    assert m, log[-2000:]
    hang_at = float(m.group(1))
    print(f"\nengine hang at step {HANG_AFTER_STEPS + 1}, bound {STALL_S:g} s: health "
          f"NOT_SERVING after {seen['not_serving'] - hang_at:.1f} s, coordinator marked it down "
          f"after {seen['down'] - hang_at:.1f} s; all {STREAMS} streams done "
          f"{seen['done'] - hang_at:.1f} s after the hang; Info said: {messages[0]!r}; "
          f"{messages[-1]}")
    # none lost: every stream completed with the single engine's tokens
    assert results == [reference] * STREAMS
    # detected by the watchdog (never before its bound), and the coordinator acted on it
    assert seen["not_serving"] - hang_at >= STALL_S - 0.5
    assert "info_error" in seen and "down" in seen
    assert "engine made no progress" in messages[0], messages
    assert messages[-1].startswith("coordinator: no answer to 2 Info calls"), messages
    assert seen["down"] - hang_at < STALL_S + 20  # generous: a loaded 2-core machine
    assert "engine made no progress" in log
