"""/metrics: vLLM's names with model_name, helixserve's per-node and per-hop series."""

from __future__ import annotations

import httpx
from api_testlib import API_KEY, MODEL
from prometheus_client.parser import text_string_to_metric_families

from helixserve.runtime.stats import CoordinatorStats, NodeStats, ProcessStats

VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_names_present_and_moving(server):
    before = scrape(server.url)
    names = {name for name, _ in before}
    for name in VLLM_NAMES:
        if name != "vllm:request_success_total":  # appears with its first finished request
            assert name in names, name
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 5},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    n_prompt = resp.json()["usage"]["prompt_tokens"]
    after = scrape(server.url)
    assert (
        value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total")
        == n_prompt
    )
    assert (
        value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
        == 5
    )
    assert (
        value(after, "vllm:request_success_total", finished_reason="length")
        == value(before, "vllm:request_success_total", finished_reason="length") + 1
    )
    assert (
        value(after, "vllm:time_to_first_token_seconds_count")
        == value(before, "vllm:time_to_first_token_seconds_count") + 1
    )
    assert (
        value(after, "vllm:inter_token_latency_seconds_count")
        - value(before, "vllm:inter_token_latency_seconds_count")
        == 4
    )
    for name in VLLM_NAMES:
        assert name in {n for n, _ in after}, name


def test_state_gauges_from_coordinator_stats(server):
    samples = scrape(server.url)
    # fake stats: 4 of 20 KV blocks used over two nodes
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.2
    assert value(samples, "helixserve:node_layers", node="n2") == 18
    assert value(samples, "helixserve:node_queue_length", node="n1") == 1
    assert value(samples, "helixserve:node_batch_size", node="n1") == 2
    assert value(samples, "helixserve:node_kv_cache_usage_perc", node="n1") == 0.3
    assert value(samples, "helixserve:node_busy_fraction", node="n2") == 0.25
    assert value(samples, "helixserve:route_requests_total", route="n1->n2") == 3
    assert value(samples, "helixserve:request_reroutes_total") == 2
    assert value(samples, "vllm:num_preemptions_total") == 5
    for src, dst in (("coordinator", "n1"), ("n1", "n2"), ("n2", "coordinator")):
        assert value(samples, "helixserve:route_hop_requests_total", src=src, dst=dst) == 3


def render(stats: CoordinatorStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples a ServingMetrics renders for these coordinator stats."""
    from helixserve.api.metrics import ServingMetrics

    text = ServingMetrics("m", lambda: stats).render()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def node(alive: bool, in_placement: bool = True,
         process: ProcessStats | None = None) -> NodeStats:
    return NodeStats(alive=alive, in_placement=in_placement, start_layer=0, end_layer=10,
                     queue_len=3, batch_size=2, kv_used_blocks=5, kv_total_blocks=10,
                     kv_block_size=16, busy_fraction=0.5, dtype="float32", backend="torch",
                     step_tokens_counts=[4, 2] + [0] * 12, step_tokens_sum=20, process=process)


def test_a_down_node_keeps_only_its_up_series_and_a_gone_one_nothing():
    samples = render(CoordinatorStats(nodes={
        "n1": node(True, process=ProcessStats(process_up=True, restarts=0)),
        "n2": node(False, process=ProcessStats(process_up=False, restarts=2)),
        "n3": node(False, in_placement=False)}))
    per_node = {(name, dict(labels)["node"]) for name, labels in samples if
                "node" in dict(labels)}
    assert ("helixserve:node_queue_length", "n1") in per_node
    # n2 is down: up = 0 and its restarts, no stale queue / KV / busy values
    assert samples[("helixserve:node_up", (("model_name", "m"), ("node", "n2")))] == 0.0
    assert samples[("helixserve:node_restarts_total", (("model_name", "m"), ("node", "n2")))] == 2
    assert {n for n, who in per_node if who == "n2"} == {
        "helixserve:node_up", "helixserve:node_restarts_total", "helixserve:node_process_up"}
    # n3 is down and out of the placement (a re-plan moved its layers): nothing at all
    assert not any(who == "n3" for _, who in per_node)


def test_recovery_series_and_worker_counted_step_tokens():
    stats = CoordinatorStats(nodes={"n1": node(True)}, down_events=3, kv_allocation="on-demand",
                             recovery={"state": "loading", "replans": 2, "failed_replans": 1,
                                       "last": {"total_s": 7.5}})
    s = render(stats)
    lm = (("model_name", "m"),)
    assert s[("helixserve:replans_total", lm)] == 2
    assert s[("helixserve:replan_failures_total", lm)] == 1
    assert s[("helixserve:node_down_events_total", lm)] == 3
    assert s[("helixserve:replan_last_duration_seconds", lm)] == 7.5
    assert s[("helixserve:recovery_state", (("model_name", "m"), ("state", "loading")))] == 1
    assert s[("helixserve:recovery_state", (("model_name", "m"), ("state", "idle")))] == 0
    n1 = (("model_name", "m"), ("node", "n1"))
    # 4 steps of <= 1 token, 2 of 2..8 tokens: cumulative buckets
    assert s[("vllm:iteration_tokens_total_bucket", (("le", "1.0"), *n1))] == 4
    assert s[("vllm:iteration_tokens_total_bucket", (("le", "8.0"), *n1))] == 6
    assert s[("vllm:iteration_tokens_total_count", n1)] == 6
    assert s[("vllm:iteration_tokens_total_sum", n1)] == 20
    info = [labels for name, labels in s if name == "vllm:cache_config_info"]
    assert dict(info[0])["num_gpu_blocks"] == "10" and dict(info[0])["block_size"] == "16"
