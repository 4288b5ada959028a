"""Prometheus metrics under vLLM's names (so existing vLLM dashboards work) plus helixserve's.

Request-level series (token counters, TTFT / ITL / E2E histograms, successes by finish
reason) are updated by the serving code as tokens stream out. Gauges of the system's state
(running / waiting requests, KV usage, and helixserve's per-node and per-hop series) are read
from `coordinator.stats()` (a `CoordinatorStats`) at scrape time by a custom collector, so
they are never stale.
Everything lives in the app's own `CollectorRegistry`, so several apps (tests, the benchmark)
can exist in one process.

vLLM conventions kept: a `model_name` label on every vLLM series; `kv_cache_usage_perc` is a
fraction in [0, 1] despite its name. Request phases as vLLM splits them: queue (arrival to the
first route: admission wait, or waiting for the model to be covered again), prefill (first
route to first token), decode (first to last token). `iteration_tokens_total` is the tokens of
every engine step of every worker (label `node`), counted by the workers themselves.
Prefix caching as vLLM counts it, in prompt tokens: `prefix_cache_queries_total` (looked up)
and `prefix_cache_hits_total` (taken from cache); the series without a `node` label is the
coordinator's count once per admitted request (what one vLLM server reports), those with
`node` the core's per hop of the route (a request queries every hop it runs on), so do not
sum over `node` to get the total.

Per-node series describe live nodes: a node that is down keeps only `node_up` 0 (and its
restart count), so a dead worker's last queue, KV and busy values do not linger; a node that
is down and out of the placement (a re-plan moved its layers away) keeps nothing but that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from helixserve.runtime.stats import CoordinatorStats

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
# vLLM's request-phase buckets (seconds)
PHASE_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: helixserve:recovery_state values
RECOVERY_STATES = ("idle", "planning", "loading", "uncoverable")


def _num(value: Any, default: float = 0.0) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    )


class _StateCollector(Collector):
    """Gauges read from `coordinator.stats()` at every scrape."""

    def __init__(self, model_name: str, stats_fn: Callable[[], CoordinatorStats]) -> None:
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
        running.add_metric(model, stats.running)
        yield running
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting for a route.", labels=["model_name"]
        )
        waiting.add_metric(model, stats.waiting)
        yield waiting
        reroutes = CounterMetricFamily(
            "helixserve:request_reroutes",
            "Requests moved to a new route after a node or link failure (replayed there).",
            labels=["model_name"],
        )
        reroutes.add_metric(model, stats.reroutes)
        yield reroutes
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Requests preempted (KV freed, recomputed later) because a worker ran out of KV "
            "(on-demand KV allocation).",
            labels=["model_name"],
        )
        preemptions.add_metric(model, stats.preemptions)
        yield preemptions

        nodes = stats.nodes
        yield from _prefix_families(self.model_name, stats)
        used = sum(n.kv_used_blocks for n in nodes.values())
        total = sum(n.kv_total_blocks for n in nodes.values())
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
        restarts = CounterMetricFamily(
            "helixserve:node_restarts",
            "Times the local supervisor restarted the node's worker process.",
            labels=labels,
        )
        process_up = GaugeMetricFamily(
            "helixserve:node_process_up",
            "1 while the local supervisor's worker process of the node runs.",
            labels=labels,
        )
        iteration = HistogramMetricFamily(
            "vllm:iteration_tokens_total",
            "Tokens per engine step, per worker (counted by the worker).",
            labels=labels,
        )
        cache_info = InfoMetricFamily(
            "vllm:cache_config",
            "KV cache configuration of each live worker.",
            labels=labels,
        )
        for name, n in sorted(nodes.items()):
            key = [self.model_name, name]
            up = n.alive
            if n.process is not None:
                restarts.add_metric(key, n.process.restarts)
                process_up.add_metric(key, 1.0 if n.process.process_up else 0.0)
            if not up and not n.in_placement:
                continue  # gone: nothing to say but its restarts
            families["up"].add_metric(key, 1.0 if up else 0.0)
            if not up:
                continue  # its last stats are stale
            families["layers"].add_metric(key, n.layers)
            families["queue"].add_metric(key, n.queue_len)
            families["batch"].add_metric(key, n.batch_size)
            node_total = n.kv_total_blocks
            node_kv = n.kv_used_blocks / node_total if node_total else 0.0
            families["kv"].add_metric(key, node_kv)
            families["busy"].add_metric(key, n.busy_fraction)
            counts = n.step_tokens_counts
            if counts:
                from helixserve.runtime.transport import STEP_TOKEN_BUCKETS

                bounds = [*(str(float(b)) for b in STEP_TOKEN_BUCKETS), "+Inf"]
                cumulative: list[tuple[str, float]] = []
                seen = 0.0
                for bound, in_bucket in zip(bounds, counts, strict=False):
                    seen += in_bucket
                    cumulative.append((bound, seen))
                iteration.add_metric(key, cumulative, n.step_tokens_sum)
            if node_total:
                cache_info.add_metric(key, {
                    "block_size": str(n.kv_block_size),
                    "num_gpu_blocks": str(node_total),
                    "cache_dtype": n.dtype or "auto",
                    "kv_allocation": stats.kv_allocation,
                    "backend": n.backend,
                })
        yield from families.values()
        yield restarts
        yield process_up
        yield iteration
        yield cache_info
        yield from _recovery_families(self.model_name, stats)

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
        route_counts = _route_counts(stats.routes)
        for route, count in route_counts:
            routes.add_metric([self.model_name, "->".join(route)], count)
        for (src, dst), count in _hop_counts(route_counts):
            hops.add_metric([self.model_name, src, dst], count)
        yield routes
        yield hops


def _prefix_families(model_name: str, stats: CoordinatorStats) -> Iterator[Metric]:
    """vLLM's prefix cache counters: the total without `node`, then per live node (module
    doc)."""
    for name, what, total, of_node in (
        ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
         stats.prefix_cache_queries, lambda n: n.prefix_cache_queries),
        ("vllm:prefix_cache_hits", "Prompt tokens taken from the prefix cache.",
         stats.prefix_cache_hits, lambda n: n.prefix_cache_hits),
    ):
        fam = CounterMetricFamily(
            name, what + " Without `node`: per admitted request; with it: per hop.",
            labels=["model_name", "node"])
        fam.add_sample(name + "_total", {"model_name": model_name}, float(total))
        for node, n in sorted(stats.nodes.items()):
            if n.alive:
                fam.add_metric([model_name, node], of_node(n))
        yield fam
    misses = CounterMetricFamily(
        "helixserve:prefix_cache_misses",
        "Requests run again because a hop no longer held the prefix they were admitted with.",
        labels=["model_name"],
    )
    misses.add_metric([model_name], stats.prefix_misses)
    yield misses


def _recovery_families(model_name: str, stats: CoordinatorStats) -> Iterator[Metric]:
    lm = [model_name]
    down = CounterMetricFamily(
        "helixserve:node_down_events",
        "Times a node was declared down (stream broke, no answer, drained).",
        labels=["model_name"],
    )
    down.add_metric(lm, stats.down_events)
    yield down
    rec = stats.recovery
    if not isinstance(rec, Mapping):
        return
    replans = CounterMetricFamily(
        "helixserve:replans",
        "Live re-plans that covered the model again after layers lost their last holder.",
        labels=["model_name"],
    )
    replans.add_metric(lm, _num(rec.get("replans")))
    yield replans
    failed = CounterMetricFamily(
        "helixserve:replan_failures",
        "Live re-plans that found no placement covering the model with the live workers.",
        labels=["model_name"],
    )
    failed.add_metric(lm, _num(rec.get("failed_replans")))
    yield failed
    state = GaugeMetricFamily(
        "helixserve:recovery_state",
        "1 for the coordinator's recovery state (idle, planning, loading, uncoverable).",
        labels=["model_name", "state"],
    )
    for name in RECOVERY_STATES:
        state.add_metric([model_name, name], 1.0 if rec.get("state") == name else 0.0)
    yield state
    last = rec.get("last")
    if isinstance(last, Mapping):
        duration = GaugeMetricFamily(
            "helixserve:replan_last_duration_seconds",
            "Seconds the last re-plan took from its start to serving again (plan + load).",
            labels=["model_name"],
        )
        duration.add_metric(lm, _num(last.get("total_s")))
        yield duration


def _route_counts(routes: Mapping[str, int]) -> list[tuple[tuple[str, ...], float]]:
    """Routes from stats: {"n1->n2": count}."""
    return sorted((tuple(n.strip() for n in key.split("->")), float(count))
                  for key, count in routes.items())


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

    def __init__(self, model_name: str, stats_fn: Callable[[], CoordinatorStats]) -> None:
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
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to the first route (waiting for KV room or a re-plan).",
            lm,
            buckets=PHASE_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Time from the first route to the first token.",
            lm,
            buckets=PHASE_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Time from the first token to the last.",
            lm,
            buckets=PHASE_BUCKETS_S,
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
        queue_s: float | None = None,
    ) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None and generated_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (generated_tokens - 1))
        if ttft_s is not None:
            self.decode_time.observe(e2e_s - ttft_s)
            if queue_s is not None:
                self.queue_time.observe(queue_s)
                self.prefill_time.observe(max(0.0, ttft_s - queue_s))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
