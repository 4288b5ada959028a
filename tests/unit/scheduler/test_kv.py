"""The scheduling core's pure parts: the KV ledger, the victim rules, batch formation and the
admission queue (scheduler/kv.py, batch.py, queue.py)."""

from __future__ import annotations

from collections import deque

import pytest

from helixserve.errors import UserError
from helixserve.scheduler.batch import StepBudget, plan_step
from helixserve.scheduler.kv import KvBook, KvOverflowError, KvPolicy, victim
from helixserve.scheduler.queue import AdmissionQueue


def test_reserve_holds_prompt_and_output_and_never_grows() -> None:
    book = KvBook(KvPolicy("reserve"), {"a": 1000, "b": 1000})
    info = book.request_info("r", 100, 50)
    assert (info.max_new_tokens, info.kv_tokens) == (50, None)
    book.admit(info, [("a", 2), ("b", 2)])
    book.grow("r")  # reserve: the admission took the whole request
    a = book.nodes["a"]
    assert (a.used_tokens, a.promised_tokens, a.promised_token_layers) == (150, 150, 300)
    assert a.router_free_tokens == 1000  # the router counts its own promises
    book.release("r")
    assert a.used_tokens == a.promised_tokens == 0 and a.peak_tokens == 150


def test_on_demand_holds_the_prompt_grows_per_token_and_keeps_a_watermark() -> None:
    book = KvBook(KvPolicy("on-demand", watermark=0.1), {"a": 1000})
    info = book.request_info("r", 100, 50)
    assert info.kv_tokens == 100  # the router promises the prompt
    book.admit(info, [("a", 4)])
    for _ in range(3):
        book.grow("r")
    a = book.nodes["a"]
    assert a.used_tokens == 103 and a.grown_tokens == 3
    assert a.router_free_tokens == 1000 - 100 - 3  # less the watermark and the growth
    assert book.release("r") is not None and book.release("r") is None
    assert a.used_tokens == a.grown_tokens == 0 and a.router_free_tokens == 900


def test_paged_blocks_add_slack_and_an_expected_output_covers_growth() -> None:
    paged = KvPolicy("on-demand", block_size=16)
    info = paged.request_info("r", 100, 50)
    assert (info.max_new_tokens, info.kv_tokens) == (65, 116)
    book = KvBook(KvPolicy("on-demand", watermark=0.15, expected_output_tokens=240), {"a": 1000})
    info = book.request_info("r", 100, 50)
    assert info.kv_tokens == 340
    book.admit(info, [("a", 1)])
    book.grow("r")
    assert book.nodes["a"].router_free_tokens == 850  # the promise covers the growth
    assert book.fits(book.request_info("s", 899, 1), ["a"])
    assert not book.fits(book.request_info("s", 900, 1), ["a"])


def test_strict_book_refuses_to_overfill_a_node() -> None:
    book = KvBook(KvPolicy("reserve"), {"a": 100})
    with pytest.raises(KvOverflowError, match="overfilled the KV cache of a: 150 > 100"):
        book.admit(book.request_info("r", 100, 50), [("a", 1)])
    loose = KvBook(KvPolicy("reserve"), {"a": 100}, strict=False)
    loose.admit(loose.request_info("r", 100, 50), [("a", 1)])
    assert loose.nodes["a"].used_tokens == 150


def test_victim_rules() -> None:
    book = KvBook(KvPolicy("on-demand", victim_rule="newest"), {"a": 1000, "b": 1000})
    for rid, route in (("r1", ["a", "b"]), ("r2", ["b"]), ("r3", ["a"])):
        book.admit(book.request_info(rid, 10, 10), [(n, 1) for n in route])
    assert book.victim("a", "r1") == "r3" and book.victim("b", "r1") == "r2"
    book.release("r3")
    assert book.victim("a", "r1") == "r1"
    assert victim("requester", ["r1", "r2"], "r1") == "r1"
    with pytest.raises(UserError, match="known: newest, requester"):
        KvPolicy(victim_rule="oldest").check()


def test_policy_checks_name_the_field() -> None:
    with pytest.raises(UserError, match="kv_allocation: 'lazy'"):
        KvPolicy("lazy").check()
    with pytest.raises(UserError, match="kv_watermark"):
        KvPolicy("on-demand", watermark=1.0).check()
    with pytest.raises(UserError, match="needs kv_allocation='on-demand'"):
        KvPolicy("reserve", expected_output_tokens=10).check()


def _queue(*sizes: int) -> deque[list[int]]:
    return deque([n] for n in sizes)  # [prompt tokens left]


def test_whole_prompts_fill_the_budget_and_a_long_one_runs_alone() -> None:
    budget = StepBudget(max_decode_seqs=2, max_prompt_tokens=512)
    plan = plan_step(["d1", "d2", "d3"], _queue(300, 200, 100), budget, lambda r: r[0])
    assert plan.decode == ["d1", "d2"]
    assert [t for _, t in plan.prompts] == [300, 200] and plan.prompts_popped == 2
    plan = plan_step([], _queue(900, 10), budget, lambda r: r[0])
    assert [t for _, t in plan.prompts] == [900] and plan.prompt_tokens == 900
    assert plan_step([], _queue(), budget, lambda r: r[0]).empty


def test_chunked_prefill_cuts_the_head_prompt_and_keeps_it_queued() -> None:
    budget = StepBudget(max_prompt_tokens=512, chunked_prefill=True)
    plan = plan_step([], _queue(300, 400, 50), budget, lambda r: r[0])
    assert [t for _, t in plan.prompts] == [300, 212]
    assert plan.prompts_popped == 1  # the second prompt has 188 tokens left for later


def test_dead_prompts_are_skipped_and_popped() -> None:
    q = deque([("x", 100, True), ("y", 100, False)])
    plan = plan_step([], q, StepBudget(max_prompt_tokens=150), lambda r: r[1], lambda r: r[2])
    assert [r[0] for r, _ in plan.prompts] == ["y"] and plan.prompts_popped == 2


def test_admission_queue_is_fifo_with_preempted_at_the_head() -> None:
    q: AdmissionQueue[str] = AdmissionQueue()
    for rid in ("a", "b"):
        q.arrive(rid)
    q.requeue_preempted("p1")
    q.requeue_preempted("p2")
    assert list(q) == ["p2", "p1", "a", "b"]
    assert q.may_admit("p2") and not q.may_admit("a")
    assert q.admitted() == "p2" and q.may_admit("p1")
