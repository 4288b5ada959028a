"""The worker's engine loop forms each step with the core's `plan_step`: one item per
request, every decode item, prompt chunks up to `step_prompt_tokens` (the first always
runs), never splitting a chunk. A fake engine records the steps (no model, no gRPC)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from helixserve.engine.errors import KvExhaustedError
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


def _job(rid: str, tokens: int, route: str = "r") -> _Job:
    hop = NodeRange("n", 0, 2)
    item = SimpleNamespace(request_id=rid, coordinator_id="c", hop=hop, position=0, step_id=0,
                           route=(hop, NodeRange(route, 2, 4)),
                           token_ids=[1] * tokens, hidden=None, sampling=None, sample=True,
                           num_prompt_tokens=None, prefix_token_ids=None)
    return _Job(item=item, msg=None, origin=None)  # type: ignore[arg-type]


def _run(step_prompt_tokens: int | None, jobs: list[_Job], steps: int,
         engine: FakeEngine | None = None, batch_wait: float = 0.0) -> list[list[tuple[str, int]]]:
    engine = engine or FakeEngine(steps)
    worker = Worker(engine, node="n", model="m", backend="torch", device="cpu",
                    step_prompt_tokens=step_prompt_tokens, batch_wait=batch_wait)
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


class ReturningEngine(FakeEngine):
    """Step 1 takes `step_s`; during it the first request's next item comes back at once
    and the other's `late_s` later (as a pipeline returns a group's tokens unevenly)."""

    def __init__(self, steps: int, step_s: float, late_s: float, route_b: str) -> None:
        super().__init__(steps)
        self.step_s, self.late_s, self.route_b = step_s, late_s, route_b

    def step(self, items: list[Any]) -> list[Any]:
        if not self.calls:
            import time

            assert self.worker is not None
            inbox = self.worker.inbox
            inbox.put([_job("a", 1)])
            threading.Timer(self.late_s, inbox.put, [[_job("b", 1, self.route_b)]]).start()
            time.sleep(self.step_s)
        return super().step(items)


@pytest.mark.parametrize("batch_wait", [0.0, 20.0])
def test_batch_wait_holds_a_step_for_the_rest_of_its_route_group(batch_wait: float) -> None:
    """b's token comes back 0.1 s after a's: with a wait of up to 20 x the 0.05 s step both
    run in one step; without, a runs alone. (The margin, 1 s vs 0.1 s, is wide on purpose:
    the test asserts which items share a step, not a time.)"""
    engine = ReturningEngine(steps=3 if batch_wait == 0 else 2, step_s=0.05, late_s=0.1,
                             route_b="r")
    calls = _run(None, [_job("a", 4), _job("b", 4)], 0, engine, batch_wait)
    assert calls[0] == [("a", 4), ("b", 4)]
    if batch_wait:
        assert calls[1:] == [[("a", 1), ("b", 1)]]
    else:
        assert calls[1:] == [[("a", 1)], [("b", 1)]]


def test_batch_wait_does_not_hold_a_step_for_another_route() -> None:
    """b runs on another route (its group comes back through another next hop): a's step
    does not wait for it, even with a long wait allowed."""
    engine = ReturningEngine(steps=3, step_s=0.05, late_s=0.3, route_b="other")
    calls = _run(None, [_job("a", 4), _job("b", 4, "other")], 0, engine, batch_wait=20.0)
    assert calls == [[("a", 4), ("b", 4)], [("a", 1)], [("b", 1)]]


@pytest.mark.parametrize("text", ["x", "-1", "11", "nan"])
def test_bad_batch_wait_environment_value_is_a_user_error(text: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from helixserve.errors import UserError
    from helixserve.runtime.worker import BATCH_WAIT_ENV, _batch_wait_default

    monkeypatch.setenv(BATCH_WAIT_ENV, text)
    with pytest.raises(UserError, match=f"{BATCH_WAIT_ENV}: bad value '{text}'"):
        _batch_wait_default()
    monkeypatch.setenv(BATCH_WAIT_ENV, "1.5")
    assert _batch_wait_default() == 1.5


class KvEngine(FakeEngine):
    """KV for `capacity` tokens: a step that needs more fails changing nothing (as the
    engines' all-or-nothing reserve), a step that fits holds its tokens."""

    def __init__(self, steps: int, capacity: int, dry_run: bool) -> None:
        super().__init__(steps)
        self.capacity, self.held = capacity, 0
        if dry_run:
            self.kv_fits = lambda items: self.held + self._tokens(items) <= self.capacity

    @staticmethod
    def _tokens(items: list[Any]) -> int:
        return sum(len(it.token_ids) for it in items)

    def step(self, items: list[Any]) -> list[Any]:
        if self.held + self._tokens(items) > self.capacity:
            self.calls.append([("refused", len(items))])
            raise KvExhaustedError(f"KV cache full: {self._tokens(items)} tokens, "
                                   f"{self.capacity - self.held} free")
        self.held += self._tokens(items)
        return super().step(items)


def _run_out_of_kv(dry_run: bool, steps: int) -> tuple[list[Any], list[Any]]:
    jobs = [_job("a", 400), _job("b", 400), _job("c", 1)]
    engine = KvEngine(steps, capacity=450, dry_run=dry_run)
    dispatched: list[Any] = []
    worker = Worker(engine, node="n", model="m", backend="torch", device="cpu",
                    step_prompt_tokens=None, batch_wait=0.0)
    engine.worker = worker
    worker.loop = SimpleNamespace(  # type: ignore[assignment]
        call_soon_threadsafe=lambda fn, *a: dispatched.append(a[1]) if a and
        fn == worker._dispatch else None)
    worker.inbox.put(jobs)
    t = threading.Thread(target=worker._engine_loop, daemon=True)
    t.start()
    t.join(10.0)
    assert not t.is_alive()
    return engine.calls, dispatched[0]


def test_out_of_kv_the_items_that_fit_run_as_one_step_and_the_rest_fail() -> None:
    # b's 400 tokens do not fit beside a's: a and c run in one step, b fails out of KV
    # (its request is preempted); no step of one item each
    calls, outputs = _run_out_of_kv(dry_run=True, steps=2)
    assert calls == [[("refused", 3)], [("a", 400), ("c", 1)]]
    assert isinstance(outputs[1], KvExhaustedError)
    assert "the step ran the 2 of its 3 items that fit" in str(outputs[1])
    assert not isinstance(outputs[0], Exception) and not isinstance(outputs[2], Exception)


def test_out_of_kv_an_engine_that_cannot_say_what_fits_runs_one_item_a_step() -> None:
    calls, outputs = _run_out_of_kv(dry_run=False, steps=4)
    assert calls == [[("refused", 3)], [("a", 400)], [("refused", 1)], [("c", 1)]]
    assert [isinstance(o, KvExhaustedError) for o in outputs] == [False, True, False]


def test_a_job_for_a_range_the_worker_no_longer_holds_is_replayed_not_run() -> None:
    """A job accepted against the range held before a LoadRange switch can reach the engine
    thread after it (the loop thread checks items against the old range): it is dropped
    and its request told UNAVAILABLE (the coordinator replays it), not run on the new
    engine, which would refuse it as invalid work and fail the request (seen in CI:
    test_z_killing_the_only_holder_of_layers_replans_and_serves_again)."""
    import dataclasses
    from collections import deque

    from helixserve.runtime import transport as tp

    worker = Worker(FakeEngine(1), node="n", model="m", backend="torch", device="cpu")
    calls: list[tuple[Any, ...]] = []
    worker.loop = SimpleNamespace(  # type: ignore[assignment]
        call_soon_threadsafe=lambda fn, *a: calls.append((fn.__name__, *a)))
    old, other = _job("a", 1), _job("b", 1)
    batch, rest = worker._next_batch(deque([old, other]))
    assert [j.item.request_id for j in batch] == ["a", "b"] and not calls  # range as held

    moved = FakeEngine(1)
    moved.start_layer, moved.end_layer = 2, 4  # re-planned: [0, 2) is no longer here
    worker.engine, worker.range_changes = moved, 1  # type: ignore[assignment]
    worker.expect = dataclasses.replace(worker.expect, start_layer=2, end_layer=4)  # as _switch
    batch, rest = worker._next_batch(deque([old, other]))
    assert batch == [] and not rest
    errors = [c for c in calls if c[0] == "report_error"]
    assert [(c[1], c[4]) for c in errors] == [("a", tp.UNAVAILABLE), ("b", tp.UNAVAILABLE)]
    assert all("re-planned to layers [2, 4); replay the request" in c[5] for c in errors)
    assert [c[0] for c in calls].count("_forget") == 2
    assert ("c", "a") in worker.released  # a late item of the old attempt is dropped
