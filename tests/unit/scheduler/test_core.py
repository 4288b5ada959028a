"""The scheduling core, one transition and one policy field at a time, on small placements.

Pure: no simulator, no coordinator. tests/unit/runtime/test_loops_agree.py checks that the
two loops around the core feed it the same events on a trace.
"""

from __future__ import annotations

import pytest

from helixserve.errors import UserError
from helixserve.planner.placement import Flow, NodeRange, Placement
from helixserve.scheduler import ROUTERS, make_router
from helixserve.scheduler.core import (
    GROWN,
    Admission,
    CoreRequest,
    NeverFitsError,
    Preempted,
    Rejection,
    RerouteLimitError,
    SchedulerCore,
    SchedulerPolicy,
)
from helixserve.scheduler.kv import KvPolicy
from helixserve.spec.cluster import COORDINATOR as C


def placement(ranges: dict[str, tuple[int, int]], num_layers: int = 8) -> Placement:
    flows = [Flow(C, n, 1.0) for n, (s, _) in ranges.items() if s == 0]
    flows += [Flow(n, C, 1.0) for n, (_, e) in ranges.items() if e == num_layers]
    for a, (_, ea) in ranges.items():
        flows += [Flow(a, b, 1.0) for b, (sb, _) in ranges.items() if sb == ea]
    return Placement(model="m", cluster="c", num_layers=num_layers, planner="hand",
                     nodes=[NodeRange(n, s, e) for n, (s, e) in ranges.items()], flows=flows)


def core(capacities: dict[str, int], ranges: dict[str, tuple[int, int]] | None = None,
         policy: str = "maxflow", **fields: object) -> SchedulerCore:
    ranges = ranges or {n: (0, 8) for n in capacities}
    kv = fields.pop("kv", KvPolicy("reserve"))
    return SchedulerCore(make_router(policy, placement(ranges)),
                         SchedulerPolicy(kv=kv, **fields), capacities)  # type: ignore[arg-type]


def admitted(decisions: list[Admission | Rejection]) -> list[str]:
    return [d.request_id for d in decisions if isinstance(d, Admission)]


def test_admits_in_order_and_the_ledger_is_the_routers_view() -> None:
    c = core({"a": 100})
    c.arrive(CoreRequest("r1", 20, 20))
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.route.nodes == ("a",) and not d.resumed
    # one ledger: what the router may still promise is the capacity less the promise
    assert c.view["a"].kv_free_tokens == 60 and c.view["a"].active_requests == 1
    assert c.kv.nodes["a"].promised_tokens == 40
    c.finish("r1")
    assert c.view["a"].kv_free_tokens == 100 and c.view["a"].active_requests == 0
    assert c.running == 0 and "r1" not in c.requests


def test_head_of_line_blocks_smaller_requests_behind_it() -> None:
    c = core({"a": 100})
    c.arrive(CoreRequest("big", 30, 30))
    assert admitted(c.schedule()) == ["big"]
    c.arrive(CoreRequest("wide", 30, 20))  # 50 > 40 left: waits at the head
    c.arrive(CoreRequest("small", 5, 5))  # would fit, but is behind the head
    assert c.schedule() == [] and list(c.queue) == ["wide", "small"]
    c.finish("big")  # an admission point: both fit now, in order
    assert admitted(c.schedule()) == ["wide", "small"]


def test_only_admission_points_offer_the_queue() -> None:
    c = core({"a": 100})
    c.arrive(CoreRequest("r1", 40, 40))
    c.schedule()
    c.arrive(CoreRequest("r2", 40, 40))
    assert c.schedule() == []  # no room; nothing changes without an admission point
    c.report("a", 200)  # a worker reports more KV: nothing happens until a wake
    assert c.schedule() == []
    c.wake()
    assert admitted(c.schedule()) == ["r2"]


def test_on_demand_grows_one_slot_per_token_and_preempts_the_newest() -> None:
    kv = KvPolicy("on-demand", watermark=0.0, victim_rule="newest")
    c = core({"a": 30}, kv=kv, refuse_never_fits=False)
    for rid in ("old", "new"):
        c.arrive(CoreRequest(rid, 10, 50))
        assert admitted(c.schedule()) == [rid]
    assert c.kv.nodes["a"].used_tokens == 20
    for _ in range(10):
        assert c.on_token("old") is GROWN
    # a is full (30): the next token of `old` preempts the newest holder, `new`
    out = c.on_token("old")
    assert isinstance(out, Preempted) and out.victims == ("new",)
    assert list(c.queue) == ["new"] and c.preemptions == 1 and c.kv.nodes["a"].preempted == 1
    assert c.kv.nodes["a"].used_tokens == 21  # old's 10 + 10 grown + this token
    # a preempted request waits for an admission point; re-admitted, it prefills its
    # prompt and the token it generated before
    assert c.schedule() == []
    c.finish("old")
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.resumed and d.info.prompt_tokens == 10 + 0


def test_requester_rule_preempts_the_request_that_needs_the_slot() -> None:
    kv = KvPolicy("on-demand", watermark=0.0, victim_rule="requester")
    c = core({"a": 21}, kv=kv, refuse_never_fits=False)
    for rid in ("r1", "r2"):
        c.arrive(CoreRequest(rid, 10, 50))
        c.schedule()
    c.on_token("r1")  # r1's first token, the slot of its next step: 21, full
    out = c.on_token("r1")
    assert isinstance(out, Preempted) and out.victims == ("r1",)
    # nothing else preempted; r2 keeps running; r1 replays prompt + its 2 tokens
    assert "r2" in c.kv.holds and list(c.queue) == ["r1"]
    c.finish("r2")
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.info.prompt_tokens == 12 and d.info.max_new_tokens == 48


def test_a_preempted_request_is_offered_at_once_when_nothing_else_runs() -> None:
    kv = KvPolicy("on-demand", watermark=0.0, victim_rule="requester")
    c = core({"a": 16}, kv=kv, exact_capacities=False)
    c.arrive(CoreRequest("r1", 10, 5))
    c.schedule()
    # the worker said it is out of KV: the runtime's rule preempts the requester
    assert c.kv_full("a", "r1") == "r1"
    assert c.running == 0 and c.at_admission_point
    assert admitted(c.schedule()) == ["r1"]


def test_preempted_wait_off_makes_a_preemption_an_admission_point() -> None:
    kv = KvPolicy("on-demand", watermark=0.0, victim_rule="newest")
    c = core({"a": 20}, kv=kv, preempted_wait=False, refuse_never_fits=False)
    for rid in ("r1", "r2", "r3"):
        c.arrive(CoreRequest(rid, 10, 50))
        c.schedule()
    assert list(c.queue) == ["r3"]  # 20 used: full
    c.on_token("r1")
    assert list(c.queue) == ["r2", "r3"]  # r2 preempted, ahead of r3
    assert c.at_admission_point


def test_exact_capacities_off_never_preempts_on_the_ledger() -> None:
    kv = KvPolicy("on-demand", watermark=0.0)
    c = core({"a": 10}, kv=kv, exact_capacities=False, refuse_never_fits=False)
    c.arrive(CoreRequest("r1", 10, 50))
    c.schedule()
    for _ in range(5):
        assert c.on_token("r1") is GROWN  # past the reported capacity: the ledger counts
    assert c.kv.nodes["a"].used_tokens == 15


def test_queue_bound_refuses_new_arrivals_only() -> None:
    c = core({"a": 100}, max_queue=1)
    c.arrive(CoreRequest("run", 50, 50))
    assert admitted(c.schedule()) == ["run"]
    c.arrive(CoreRequest("w1", 10, 10))
    assert c.schedule() == []
    c.arrive(CoreRequest("w2", 10, 10))
    (d,) = c.schedule()
    assert isinstance(d, Rejection) and d.request_id == "w2" and "queue full" in d.reason
    assert list(c.queue) == ["w1"] and "w2" not in c.requests
    # a bound of 0: a request that is admitted at once is fine, one that would wait is not
    z = core({"a": 100}, max_queue=0)
    z.arrive(CoreRequest("now", 50, 50))
    assert admitted(z.schedule()) == ["now"]
    z.arrive(CoreRequest("later", 50, 50))
    assert [type(d) for d in z.schedule()] == [Rejection]


def test_prefill_cap_holds_admission_until_a_first_token() -> None:
    c = core({"a": 1000}, max_prefilling=2)
    for i in range(4):
        c.arrive(CoreRequest(f"r{i}", 10, 10))
    assert admitted(c.schedule()) == ["r0", "r1"] and c.prefill_capped
    c.on_token("r0")  # r0's first token: it no longer prefills, an admission point
    assert admitted(c.schedule()) == ["r2"]
    c.finish("r1")  # finishing while prefilling frees the cap too
    assert admitted(c.schedule()) == ["r3"]
    with pytest.raises(UserError, match="max_prefilling"):
        core({"a": 1}, max_prefilling=0)


def test_refuses_a_request_no_route_could_ever_hold() -> None:
    c = core({"a": 100, "b": 60}, ranges={"a": (0, 4), "b": (4, 8)})
    with pytest.raises(NeverFitsError, match="no route can hold more than 60"):
        c.arrive(CoreRequest("big", 40, 30))
    assert not c.queue and not c.requests
    c.arrive(CoreRequest("big", 40, 30), check_fit=False)  # capacities about to change
    assert list(c.queue) == ["big"]
    assert c.max_new_tokens(40) == 20
    # a layer without a live holder: nothing to compare against, no refusal
    c.node_down("b")
    assert c.largest_route_kv_tokens() == 0
    c.arrive(CoreRequest("other", 40, 30))


def test_rejects_the_unroutable_head_on_an_idle_cluster_when_asked() -> None:
    kv = KvPolicy("on-demand", watermark=0.5)
    waits = core({"a": 100}, kv=kv)
    waits.arrive(CoreRequest("r", 60, 10))  # fits alone, but not under the watermark
    assert waits.schedule() == [] and list(waits.queue) == ["r"]
    rejects = core({"a": 100}, kv=kv, reject_unroutable_when_idle=True)
    rejects.arrive(CoreRequest("r", 60, 10))
    rejects.arrive(CoreRequest("s", 10, 10))
    out = rejects.schedule()
    assert [type(d) for d in out] == [Rejection, Admission] and admitted(out) == ["s"]


def test_model_length_caps_what_is_promised() -> None:
    c = core({"a": 1000}, max_model_len=100)
    c.arrive(CoreRequest("r", 80, 500))
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.info.max_new_tokens == 20


def test_reroute_limit_counts_faults_not_stale_routes() -> None:
    c = core({"a": 100, "b": 100}, max_reroutes=1)
    c.arrive(CoreRequest("r", 10, 10))
    c.schedule()
    c.reroute("r", counted=False)  # routed before a re-plan: free
    assert list(c.queue) == ["r"] and c.at_admission_point
    c.schedule()
    c.reroute("r")
    c.schedule()
    assert not c.may_reroute("r")
    with pytest.raises(RerouteLimitError):
        c.reroute("r")
    assert "r" in c.kv.holds  # refused before anything was freed


def test_down_nodes_get_no_routes_and_their_return_is_an_admission_point() -> None:
    for name in ROUTERS:
        c = core({"a": 10**6, "b": 10**6}, policy=name)
        c.node_down("a")
        for i in range(10):
            c.arrive(CoreRequest(f"r{i}", 10, 10))
        assert all(d.route.nodes == ("b",) for d in c.schedule()  # type: ignore[union-attr]
                   ), name
        c.node_down("b")
        c.arrive(CoreRequest("x", 10, 10))
        assert c.schedule() == []
        c.node_up("a")
        (d,) = c.schedule()
        assert isinstance(d, Admission) and d.route.nodes == ("a",), name
        c.report("a", 10**6, alive=True)
        c.node_down("a")
        c.report("a", 10**6, alive=True)  # a report does not revive what the caller took down
        assert not c.view["a"].alive


def test_install_keeps_running_requests_and_names_stale_routes() -> None:
    c = core({"a": 100, "b": 100}, ranges={"a": (0, 8), "b": (0, 8)})
    for rid in ("r1", "r2"):
        c.arrive(CoreRequest(rid, 10, 10))
    c.schedule()
    on_a = [rid for rid in ("r1", "r2") if c.route_of(rid).nodes == ("a",)]  # type: ignore[union-attr]
    stale = c.install(make_router("maxflow", placement({"a": (0, 4), "b": (0, 8),
                                                        "c": (4, 8)})))
    assert stale == on_a and c.running == 2  # kept: their KV is still held
    # marks made while ranges changed are dropped; the caller says what is down now
    c.node_down("a")
    c.node_down("b")
    c.install(make_router("maxflow", placement({"a": (0, 8), "b": (0, 8)})), down=["b"])
    assert c.view["a"].alive and not c.view["b"].alive and c.down == {"b"}


def test_rename_keeps_the_queue_position() -> None:
    c = core({"a": 20})
    c.arrive(CoreRequest("r1", 10, 10))
    c.schedule()
    c.arrive(CoreRequest("r2", 10, 10))
    c.rename("r2", "r2#1")
    assert list(c.queue) == ["r2#1"] and c.requests["r2#1"].request_id == "r2#1"


def test_expected_output_admission_checks_what_requests_really_hold() -> None:
    # Helix's KV expectation: promise prompt + 10, but requests may grow past it
    kv = KvPolicy("on-demand", watermark=0.0, expected_output_tokens=10)
    c = core({"a": 40}, kv=kv, refuse_never_fits=False)
    c.arrive(CoreRequest("r1", 10, 100))
    c.schedule()
    for _ in range(25):
        c.on_token("r1")  # holds 35 now, promised 20
    c.arrive(CoreRequest("r2", 10, 100))
    assert c.schedule() == []  # promises fit (40 - 20 >= 20); the real slots do not


def test_decision_log() -> None:
    c = core({"a": 100})
    c.log = []
    c.arrive(CoreRequest("r1", 10, 10))
    c.schedule()
    c.on_token("r1")
    c.finish("r1")
    assert [e[0] for e in c.log] == ["arrive", "wake", "admit", "token", "finish"]
    assert c.log[2][:3] == ("admit", "r1", ("a",))
