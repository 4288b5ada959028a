"""Prometheus metrics under vLLM's names (so existing vLLM dashboards work) plus helixserve's.

Request-level series (token counters, TTFT / ITL / E2E histograms, successes by finish
reason) are updated by the serving code as tokens stream out. Gauges of the system's state
(running / waiting requests, KV usage, and helixserve's per-node and per-hop series) are read
from `coordinator.stats()` at scrape time by a custom collector, so they are never stale.
Everything lives in the app's own `CollectorRegistry`, so several apps (tests, the benchmark)
can exist in one process.

vLLM conventions kept: a `model_name` label on every vLLM series; `kv_cache_usage_perc` is a
fraction in [0, 1] despite its name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's buckets (seconds), so histograms line up with vLLM's dashboards.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _num(value: Any, default: float = 0.0) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    )


class _StateCollector(Collector):
    """Gauges read from `coordinator.stats()` at every scrape."""

    def __init__(self, model_name: str, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.stats_fn()
        except Exception:  # a scrape must not fail because the coordinator is shutting down
            return
        model = [self.model_name]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests generating now.", labels=["model_name"]
        )
        running.add_metric(model, _num(stats.get("running")))
        yield running
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting for a route.", labels=["model_name"]
        )
        waiting.add_metric(model, _num(stats.get("waiting")))
        yield waiting
        reroutes = CounterMetricFamily(
            "helixserve:request_reroutes",
            "Requests moved to a new route after a node or link failure (replayed there).",
            labels=["model_name"],
        )
        reroutes.add_metric(model, _num(stats.get("reroutes")))
        yield reroutes
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Requests preempted (KV freed, recomputed later) because a worker ran out of KV "
            "(on-demand KV allocation).",
            labels=["model_name"],
        )
        preemptions.add_metric(model, _num(stats.get("preemptions")))
        yield preemptions

        nodes: Mapping[str, Mapping[str, Any]] = stats.get("nodes") or {}
        used = sum(_num(n.get("kv_used_blocks")) for n in nodes.values())
        total = sum(_num(n.get("kv_total_blocks")) for n in nodes.values())
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV cache usage over all workers (fraction of blocks used, 0..1).",
            labels=["model_name"],
        )
        kv.add_metric(model, used / total if total else 0.0)
        yield kv

        labels = ["model_name", "node"]
        families = {
            "layers": GaugeMetricFamily(
                "helixserve:node_layers", "Layers held by the node.", labels=labels
            ),
            "queue": GaugeMetricFamily(
                "helixserve:node_queue_length", "Work items waiting on the node.", labels=labels
            ),
            "batch": GaugeMetricFamily(
                "helixserve:node_batch_size", "Items in the node's last engine step.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "helixserve:node_kv_cache_usage_perc",
                "Node's KV cache usage (fraction of blocks used, 0..1).",
                labels=labels,
            ),
            "busy": GaugeMetricFamily(
                "helixserve:node_busy_fraction",
                "Share of recent wall time the node spent in engine steps.",
                labels=labels,
            ),
            "up": GaugeMetricFamily(
                "helixserve:node_up", "1 when the coordinator reaches the node.", labels=labels
            ),
        }
        for name, n in sorted(nodes.items()):
            key = [self.model_name, name]
            layers = _num(n.get("end_layer")) - _num(n.get("start_layer"))
            families["layers"].add_metric(key, _num(n.get("layers"), layers))
            families["queue"].add_metric(key, _num(n.get("queue_len")))
            families["batch"].add_metric(key, _num(n.get("batch_size")))
            node_total = _num(n.get("kv_total_blocks"))
            node_kv = _num(n.get("kv_used_blocks")) / node_total if node_total else 0.0
            families["kv"].add_metric(key, node_kv)
            families["busy"].add_metric(key, _num(n.get("busy_fraction")))
            families["up"].add_metric(key, 0.0 if n.get("alive") is False else 1.0)
        yield from families.values()

        routes = CounterMetricFamily(
            "helixserve:route_requests",
            "Requests admitted on each route (its nodes joined by '->').",
            labels=["model_name", "route"],
        )
        hops = CounterMetricFamily(
            "helixserve:route_hop_requests",
            "Requests routed over each hop (src -> dst, coordinator at both ends).",
            labels=["model_name", "src", "dst"],
        )
        route_counts = _route_counts(stats.get("routes"))
        for route, count in route_counts:
            routes.add_metric([self.model_name, "->".join(route)], count)
        for (src, dst), count in _hop_counts(route_counts):
            hops.add_metric([self.model_name, src, dst], count)
        yield routes
        yield hops


def _route_counts(raw: Any) -> list[tuple[tuple[str, ...], float]]:
    """Routes from stats: {"n1->n2": count} or {("n1", "n2"): count}."""
    out: list[tuple[tuple[str, ...], float]] = []
    for key, count in (raw or {}).items() if isinstance(raw, Mapping) else []:
        route = tuple(key) if isinstance(key, tuple) else tuple(str(key).split("->"))
        out.append((tuple(str(n).strip() for n in route), _num(count)))
    return sorted(out)


def _hop_counts(
    routes: list[tuple[tuple[str, ...], float]],
) -> list[tuple[tuple[str, str], float]]:
    """Per-hop totals of the route counts: coordinator -> first, each pair, last -> coordinator."""
    totals: dict[tuple[str, str], float] = {}
    for route, count in routes:
        path = ("coordinator", *route, "coordinator")
        for src, dst in zip(path, path[1:], strict=False):
            totals[(src, dst)] = totals.get((src, dst), 0.0) + count
    return sorted(totals.items())


class ServingMetrics:
    """The app's metrics; `observe_*` are called by the serving code."""

    def __init__(self, model_name: str, stats_fn: Callable[[], Mapping[str, Any]]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        lm = ["model_name"]
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", lm, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", lm, registry=r
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            lm,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive tokens of a request.",
            lm,
            buckets=ITL_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            lm,
            buckets=ITL_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            lm,
            buckets=E2E_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request.",
            lm,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per request.",
            lm,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        r.register(_StateCollector(model_name, stats_fn))

    def observe_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        generated_tokens: int,
        e2e_s: float,
        ttft_s: float | None,
    ) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None and generated_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (generated_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
