"""vLLM-like engine options of the simulator: on-demand KV with recompute preemption, and
chunked prefill. Cases with a known answer on the analytic machines of conftest.py."""

from __future__ import annotations

import pytest

from helixserve.errors import UserError
from helixserve.simulator.metrics import summarize
from helixserve.simulator.sim import SimConfig, Simulation
from tests.unit.simulator.conftest import Machine, fixed_requests, make_setup, with_flows


def small_node(memory_gb: float = 0.2):  # type: ignore[no-untyped-def]
    return with_flows(
        make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, max_decode=64, memory_gb=memory_gb)])
    )


def simulate(setup, reqs, **cfg):  # type: ignore[no-untyped-def]
    sim = Simulation(
        setup.cluster, setup.model, setup.cost, setup.placement, reqs,
        SimConfig(**{"scheduler": "maxflow", **cfg}),
    )  # fmt: skip
    return sim, summarize(sim.run())


def test_on_demand_admits_by_prompt_and_preempts_instead_of_overfilling() -> None:
    s = small_node()
    cap = s.cost.kv_capacity_tokens(s.cluster.node("a"), 4)
    reserve_fit = cap // 1000  # prompt 500 + output 500 reserved up front
    reqs = fixed_requests(20, prompt=500, output=500)
    sim, out = simulate(s, reqs, kv_allocation="on-demand", duration_s=5.0)
    node = out["nodes"][0]
    # Admission needs only the prompt (and the 1% watermark): more requests than reserving
    # prompt + output would admit are in flight at once ...
    admitted = min(20, int((cap - int(0.01 * cap)) // 500))
    assert sim.nodes["a"].kv_peak <= cap
    assert node["kv_peak_usage"] <= 1.0
    assert out["requests_in_flight"] + out["preemptions"] >= reserve_fit + 1
    assert admitted > reserve_fit
    # ... and growth past the capacity preempts (recompute) rather than overfilling.
    assert out["preemptions"] > 0 and node["preempted"] == out["preemptions"]
    assert out["kv_allocation"] == "on-demand"


def test_on_demand_every_request_finishes_with_exactly_its_tokens() -> None:
    s = small_node()
    reqs = fixed_requests(20, prompt=500, output=500)
    sim, out = simulate(s, reqs, kv_allocation="on-demand", duration_s=900.0)
    assert out["requests_finished"] == 20 and out["requests_waiting"] == 0
    assert out["preemptions"] > 0
    # A preempted request re-prefills its prompt and its tokens so far, then goes on: every
    # output token is counted once, and each request ends with its own output length.
    assert sim.decode_tokens == 20 * 500
    assert all(r.generated == r.output == 500 for r in sim.finished)
    assert sorted(r.rid for r in sim.finished) == sorted(q.request_id for q in reqs)
    # Prompt tokens count once per request (a recompute is not a new prompt).
    assert sim.prompt_tokens == 20 * 500
    node = sim.nodes["a"]
    assert node.kv_used == 0 and node.kv_grown == 0
    assert sim.kv.nodes["a"].promised_tokens == 0


def test_on_demand_frees_a_preempted_request_on_every_node_of_its_route() -> None:
    s = with_flows(
        make_setup(
            [
                Machine("a", "T4", 0, 2, decode_ms=5.0, max_decode=64, memory_gb=0.2),
                Machine("b", "L4", 2, 4, decode_ms=5.0, max_decode=64, memory_gb=0.2),
            ]
        )
    )
    sim, out = simulate(
        s, fixed_requests(30, prompt=400, output=600), kv_allocation="on-demand", duration_s=900.0
    )
    assert out["preemptions"] > 0
    assert out["requests_finished"] == 30
    for n in sim.nodes.values():
        assert n.kv_used == 0 and n.kv_peak <= n.kv_cap
        assert sim.kv.nodes[n.name].promised_tokens == 0


def test_on_demand_with_ample_kv_matches_reservation() -> None:
    s = small_node(memory_gb=16.0)
    reqs = fixed_requests(40, prompt=64, output=200, gap_s=0.05)
    _, reserve = simulate(s, reqs, duration_s=60.0, warmup_s=5.0)
    _, demand = simulate(s, reqs, kv_allocation="on-demand", duration_s=60.0, warmup_s=5.0)
    assert demand["preemptions"] == 0
    assert demand["decode_throughput_tokens_per_s"] == reserve["decode_throughput_tokens_per_s"]
    assert demand["nodes"][0]["kv_peak_usage"] < reserve["nodes"][0]["kv_peak_usage"]


def test_chunked_prefill_splits_a_long_prompt_over_iterations() -> None:
    # Constant per-layer times: any prompt batch 20 ms a layer, any decode batch 10 ms.
    s = with_flows(
        make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, prompt_ms=20.0, max_decode=64)])
    )
    one = fixed_requests(1, prompt=1000, output=2)
    _, whole = simulate(s, one, duration_s=10.0)
    assert whole["ttft_s"]["p50"] == pytest.approx(4 * 0.020, rel=1e-6)
    _, chunked = simulate(s, one, duration_s=10.0, chunked_prefill=True, max_prompt_tokens=250)
    # 1000 tokens in chunks of 250: four prompt iterations before the first token.
    assert chunked["ttft_s"]["p50"] == pytest.approx(4 * 4 * 0.020, rel=1e-6)
    assert chunked["nodes"][0]["iterations"] == whole["nodes"][0]["iterations"] + 3


def test_chunked_prefill_lets_decode_steps_pass_a_long_prompt() -> None:
    # A request decoding alone (40 ms a step) when a 4,000-token prompt arrives at 0.5 s
    # (1.6 s of prefill). Unchunked, the next decode step shares that one 1.64 s iteration,
    # so in [0, 1.5 s] only the ~13 steps before the prompt come back; chunked by 250 tokens
    # (0.10-0.14 s an iteration), the decode step rides every other chunk (it is back from
    # the coordinator just after the next chunk started): ~3 more come back by 1.5 s.
    s = make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, max_decode=64)])
    curve = type(s.cost.profiles.curves[("tiny", "T4", 1, "decode")])
    s.cost.profiles.curves[("tiny", "T4", 1, "prompt")] = curve((1, 4000), (1.0, 400.0))
    s = with_flows(s)
    reqs = fixed_requests(1, prompt=16, output=400)
    reqs.append(type(reqs[0])("long", 0.5, 4000, 2))
    plain_sim, _ = simulate(s, reqs, duration_s=1.5)
    chunked_sim, _ = simulate(s, reqs, duration_s=1.5, chunked_prefill=True, max_prompt_tokens=250)
    assert plain_sim.decode_tokens <= 14
    assert chunked_sim.decode_tokens >= plain_sim.decode_tokens + 2


def test_bad_kv_allocation_is_a_user_error() -> None:
    s = small_node()
    with pytest.raises(UserError, match="kv_allocation"):
        simulate(s, fixed_requests(1, 16, 16), kv_allocation="lazy")


def test_max_prefilling_staggers_admission() -> None:
    # Ample KV: without a cap all 20 requests are admitted at t = 0 and prefill together;
    # with max_prefilling=3 only 3 are in flight until the first prompts are done.
    s = with_flows(
        make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, prompt_ms=100.0, max_decode=64)])
    )
    reqs = fixed_requests(20, prompt=64, output=50)
    _, free = simulate(s, reqs, duration_s=0.2)
    assert free["requests_in_flight"] == 20
    sim, capped = simulate(s, reqs, duration_s=0.2, max_prefilling=3)
    assert capped["requests_in_flight"] == 3 and capped["requests_waiting"] == 17
    assert sim.core.prefilling == 3
    # Later, as first tokens come back, more are admitted, never more than 3 prefilling.
    sim, later = simulate(s, reqs, duration_s=5.0, max_prefilling=3)
    assert later["requests_in_flight"] + later["requests_finished"] > 3
    assert 0 <= sim.core.prefilling <= 3


@pytest.mark.parametrize("scheduler", ["maxflow", "shortest-queue", "swarm"])
def test_vllm_options_keep_decode_steps_under_max_flow(scheduler: str) -> None:
    # The 2 x 2 mesh of test_analytic.py with the benchmark's vLLM-like engine options. The
    # max flow bounds decode steps; a prompt pass also yields a token (the first, or the next
    # one after a recompute), and with on-demand KV an offline run keeps admitting (and
    # preempting) all along, so those tokens are added to the bound explicitly.
    s = with_flows(
        make_setup(
            [
                Machine("a", "T4", 0, 2, decode_ms=10.0, prompt_ms=0.01, memory_gb=1.0),
                Machine("b", "L4", 2, 4, decode_ms=12.0, prompt_ms=0.01, memory_gb=1.0),
                Machine("c", "A10", 0, 2, decode_ms=8.0, prompt_ms=0.01, memory_gb=1.0),
                Machine("d", "A10G", 2, 4, decode_ms=30.0, prompt_ms=0.01, memory_gb=1.0),
            ]
        )
    )
    bound = s.placement.throughput_tokens_per_s
    assert bound is not None and bound > 0
    window = 35.0
    sim, out = simulate(
        s,
        fixed_requests(40, prompt=64, output=300),
        offline=True,
        duration_s=40.0,
        warmup_s=40.0 - window,
        scheduler=scheduler,
        kv_allocation="on-demand",
        chunked_prefill=True,
        max_prompt_tokens=32,
        max_prefilling=8,
    )
    prompt_pass_tokens = sim.prompt_tokens / 64 + out["preemptions"]
    x = out["decode_throughput_tokens_per_s"]
    assert x <= bound * 1.01 + prompt_pass_tokens / window
    assert x > 0.3 * bound
    assert prompt_pass_tokens / window < 0.2 * bound  # the allowance stays small
