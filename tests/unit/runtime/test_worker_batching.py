"""The worker's engine loop forms each step with the core's `plan_step`: one item per
request, every decode item, prompt chunks up to `step_prompt_tokens` (the first always
runs), never splitting a chunk. A fake engine records the steps (no model, no gRPC)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from helixserve.planner.placement import NodeRange
from helixserve.runtime.worker import Worker, _Job


class FakeEngine:
    start_layer, end_layer, num_model_layers, hidden_size, dtype = 0, 2, 2, 8, "float32"

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.calls: list[list[tuple[str, int]]] = []
        self.worker: Worker | None = None

    def step(self, items: list[Any]) -> list[Any]:
        self.calls.append([(it.request_id, len(it.token_ids)) for it in items])
        if len(self.calls) == self.steps:
            assert self.worker is not None
            self.worker.inbox.put(None)  # stop the loop after the expected steps
        return [SimpleNamespace() for _ in items]


def _job(rid: str, tokens: int) -> _Job:
    hop = NodeRange("n", 0, 2)
    item = SimpleNamespace(request_id=rid, coordinator_id="c", hop=hop, position=0,
                           token_ids=[1] * tokens, hidden=None, sampling=None, sample=True,
                           num_prompt_tokens=None, prefix_token_ids=None)
    return _Job(item=item, msg=None, origin=None)  # type: ignore[arg-type]


def _run(step_prompt_tokens: int | None, jobs: list[_Job], steps: int) -> list[list[tuple[str, int]]]:
    engine = FakeEngine(steps)
    worker = Worker(engine, node="n", model="m", backend="torch", device="cpu",
                    step_prompt_tokens=step_prompt_tokens)
    engine.worker = worker
    worker.loop = SimpleNamespace(call_soon_threadsafe=lambda *a: None)  # type: ignore[assignment]
    worker.inbox.put(jobs)
    t = threading.Thread(target=worker._engine_loop, daemon=True)
    t.start()
    t.join(10.0)
    assert not t.is_alive()
    return engine.calls


def test_step_budget_defers_a_chunk_that_does_not_fit_and_keeps_request_order() -> None:
    jobs = [_job("a", 400), _job("b", 400), _job("c", 1), _job("a", 300)]
    assert _run(512, jobs, steps=3) == [
        [("a", 400), ("c", 1)],  # b's chunk would pass 512 prompt tokens; decode rides along
        [("b", 400)],  # oldest first: a's next chunk (it waited for its first) is behind b
        [("a", 300)],
    ]


@pytest.mark.parametrize("budget", [None, 10])
def test_without_a_budget_or_for_one_long_chunk_the_first_items_all_run(budget: int | None) -> None:
    jobs = [_job("a", 400), _job("b", 1)]
    assert _run(budget, jobs, steps=1) == [[("a", 400), ("b", 1)]]
