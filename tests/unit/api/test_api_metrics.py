"""/metrics: vLLM's names with model_name, helixserve's per-node and per-hop series."""

from __future__ import annotations

import httpx
from api_testlib import API_KEY, MODEL
from prometheus_client.parser import text_string_to_metric_families

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
