"""The rehearsal's simulated side forms each node's steps as the runtime's workers do
(helixserve/rehearse/run.py `simulator_fields`): at every step the simulator starts, the
worker's own batching (`Worker._next_batch`, which feeds the emulated, torch and vllm engines
alike) is given the same queue, and both must pick the same items with the same tokens. The
`vllm` preset as it stands cuts the prompt that does not fit what is left of a step's budget
and runs its rest a step later; a worker never cuts a chunk the coordinator sent."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
from test_rehearse_inputs import load

from helixserve.planner.placement import NodeRange
from helixserve.rehearse.run import simulate, simulator_fields
from helixserve.runtime.worker import Worker, _Job
from helixserve.simulator.nodes import Chunk, NodeSteps, SimNode


class _Engine:
    start_layer, end_layer, num_model_layers, hidden_size, dtype = 0, 80, 80, 8192, "float16"

    def kv_stats(self) -> dict[str, int]:
        return {"capacity_tokens": 1 << 20}


def _rid(r: Any) -> str:
    return r.req.rid if type(r) is Chunk else r.rid


def _job(rid: str, tokens: int) -> _Job:
    item = SimpleNamespace(request_id=rid, coordinator_id="c", hop=NodeRange("n", 0, 80),
                           position=0, token_ids=[1] * tokens)
    return _Job(item=item, msg=None, origin=None)  # type: ignore[arg-type]


def _worker_step(worker: Worker, node: SimNode) -> list[tuple[str, int]]:
    """What the worker's engine loop runs next from `node`'s queues: decode items (one token)
    and the prompt pieces waiting, oldest first (a worker holds one FIFO; the order between a
    decode item and a prompt of another request does not change its step)."""
    jobs = [_job(_rid(r), 1) for r in node.dq if not r.dead]
    jobs += [_job(_rid(r), r.left) for r in node.pq if not r.dead]
    batch, _ = worker._next_batch(deque(jobs))
    return sorted((j.item.request_id, len(j.item.token_ids)) for j in batch)


def test_every_simulated_step_is_the_one_a_worker_forms_from_the_same_queue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = load()
    budget = simulator_fields(inputs)["max_prompt_tokens"]
    worker = Worker(_Engine(), node="n", model="m", backend="emulated", device="cpu",
                    step_prompt_tokens=budget)
    start = NodeSteps.start
    steps: list[tuple[list[tuple[str, int]], list[tuple[str, int]]]] = []

    def recorded(self: NodeSteps, node: SimNode, now: float) -> Any:
        expected = _worker_step(worker, node)
        out = start(self, node, now)
        if out is not None:
            prompts, decode = out[1]
            ran = sorted([(_rid(r), r.chunk) for r in prompts] + [(r.rid, 1) for r in decode])
            steps.append((ran, expected))
        return out

    monkeypatch.setattr(NodeSteps, "start", recorded)
    sim = simulate(inputs, offline=True, duration_s=20.0, warmup_s=0.0, concurrency=36)
    assert sim["metrics"]["output_tokens"] > 100
    assert sum(1 for ran, _ in steps if any(n > 1 for _, n in ran)) > 50  # prompts ran
    mismatched = [(ran, exp) for ran, exp in steps if ran != exp]
    assert not mismatched, f"{len(mismatched)} of {len(steps)} steps differ, e.g. {mismatched[0]}"
    # and the budget bound: some step left a whole prompt for later rather than cutting it
    assert any(sum(n for _, n in ran if n > 1) < budget for ran, _ in steps)
