"""The served objective's scoring window: how long a placement is simulated and which part of
the run is counted, following the placement and its cluster (docs/planner.md, "The scoring
window").

Why. Offline, the simulator admits a KV's worth of requests at t = 0, so a run starts with a
cold start (every prompt of the first batch crossing the links and prefilling before any
request decodes), then the first wave of requests decodes together (a burst), and the waves
echo: requests admitted together finish together and their successors are admitted
together, so the decode rate oscillates with a period of about a request's lifetime. On
helix-geo-24 (0.1 Gbit/s coordinator and inter-region links) the max-flow placement decodes
nothing for 380 s, bursts to 520 tokens/s and swings between 60 and 310 tokens/s with a
period of 700-900 s; its mean end-to-end request time is 556 s (2,400 s offline, `vllm`).
On helix-single-24 (8 Gbit/s) the cold start takes 60 s and the swing 250-300 s (mean
lifetime 209 s). A fixed 300 s window (75 s not counted) scores geo-24's max-flow
placement in its cold start (4.9 tokens/s against 132-145 at steady state) and
single-24's in its first burst (621.9 against about 440).

Rule (`ScoringWindow`; `selection.simulate_windowed` runs it), per placement:

1. **fill** (`fill_time_s`, from the cluster and the workload, before any simulation): the
   time the placement's bottleneck needs to pass the prompts of the requests its KV holds
   (N = the fewest KV tokens any layer has over its holders, divided by a request's mean
   prompt + output tokens): the largest over the links its flows use of N x the link's
   share of the flow x the prompt's activation bytes / bandwidth, and over its nodes of N x
   the node's share x the prompt's prefill time; plus the first wave's decode floor, the
   mean output tokens x the latency of the placement's slowest round trip (coordinator to
   coordinator along the flows). Slow links and long latencies lengthen it.
2. **pilot**: simulate `max(min_duration_s, fill + min_measured_s)` seconds; the lifetime L
   (the run's own measure of the oscillation's period) is the larger of the finished
   requests' mean end-to-end time and Little's law's (requests in flight at the end over
   requests finished per second): a short run finishes the short requests first.
3. **needed** = fill + L (the first wave) + `periods` x L (whole periods counted), at most
   `max_duration_s`. When the pilot was shorter, the placement is simulated once more for
   `needed` seconds (L then re-measured in that run); never a third time.
4. **score**: decode tokens per second, from the run's timeline (1 s buckets), over the
   last whole lifetimes that fit after fill + L when `periods` of them do, else over
   everything after fill + L (L re-measured in a longer run can leave fewer); a run too
   short for one lifetime after fill + L counts its last three quarters.

Deterministic: every number comes from the simulation (seeded, event-driven) and the
inputs, never from a clock, so `--work-limit` (the events charged) gives the same windows
and scores on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.planner.placement import Placement
from helixserve.spec import ClusterSpec, ModelSpec
from helixserve.spec.cluster import COORDINATOR

#: prompt tokens one prefill step is timed with (the vllm engine's chunk)
PREFILL_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class ScoringWindow:
    """How `simulate_windowed` sizes a placement's run (the module doc's rule)."""

    #: the pilot's shortest run, simulated seconds (the fixed window this rule replaced)
    min_duration_s: float = 300.0
    #: the pilot counts at least this long after the fill
    min_measured_s: float = 225.0
    #: whole request lifetimes counted
    periods: int = 2
    #: most simulated seconds of one run
    max_duration_s: float = 3600.0

    def pilot_s(self, fill_s: float) -> float:
        return min(self.max_duration_s, max(self.min_duration_s, fill_s + self.min_measured_s))

    def needed_s(self, fill_s: float, lifetime_s: float) -> float:
        return min(self.max_duration_s, fill_s + (1 + self.periods) * lifetime_s)

    def counted_from_s(self, duration_s: float, fill_s: float, lifetime_s: float) -> float:
        """Start of the counted span of a run of `duration_s`: the last whole lifetimes that
        fit after fill + L when `periods` of them do, else everything after fill + L; the
        last three quarters of a run too short for one lifetime after it."""
        start = fill_s + lifetime_s
        if lifetime_s <= 0 or duration_s - start < lifetime_s:
            return duration_s / 4
        whole = int((duration_s - start) // lifetime_s)
        return duration_s - whole * lifetime_s if whole >= self.periods else start


def kv_requests(model: ModelSpec, cost: CostModel, cluster: ClusterSpec, placement: Placement,
                request_tokens: float) -> float:
    """Requests of `request_tokens` (prompt + output) the placement's KV holds: the fewest KV
    tokens any layer has, summed over the nodes that hold it, over `request_tokens`."""
    per_layer = [0] * placement.num_layers
    for r in placement.nodes:
        kv = cost.kv_capacity_tokens(cluster.node(r.name), r.end_layer - r.start_layer)
        for layer in range(r.start_layer, r.end_layer):
            per_layer[layer] += max(0, kv)
    return min(per_layer, default=0) / max(1.0, request_tokens)


def _round_trip_latency_s(cluster: ClusterSpec, placement: Placement) -> float:
    """Latency of the slowest path coordinator -> ... -> coordinator along the flows."""
    out: dict[str, list[str]] = {}
    for f in placement.flows:
        if f.tokens_per_s > 0:
            out.setdefault(f.src, []).append(f.dst)
    memo: dict[str, float] = {}

    def longest(node: str, depth: int) -> float:
        # the flows go forward in layers, so the graph is acyclic; depth guards bad input
        if node in memo:
            return memo[node]
        best = 0.0
        if depth <= len(placement.nodes) + 1:
            for nxt in out.get(node, []):
                link = cluster.link(node, nxt)
                lat_s = (link.latency_ms if link is not None else 0.0) / 1000.0
                best = max(best, lat_s + (0.0 if nxt == COORDINATOR
                                          else longest(nxt, depth + 1)))
        memo[node] = best
        return best

    return longest(COORDINATOR, 0)


def fill_time_s(cluster: ClusterSpec, model: ModelSpec, cost: CostModel, placement: Placement,
                prompt_tokens: float, output_tokens: float) -> float:
    """Step 1 of the module doc's rule: the cold start's length, from the placement's flows,
    links, KV and prefill times, for requests of these mean prompt and output tokens."""
    total = sum(f.tokens_per_s for f in placement.flows if f.src == COORDINATOR)
    if total <= 0:
        return 0.0
    n = kv_requests(model, cost, cluster, placement, prompt_tokens + output_tokens)
    prompt_bits = 8.0 * prompt_tokens * model.activation_bytes_per_token
    links = 0.0
    through: dict[str, float] = {}
    for f in placement.flows:
        if f.tokens_per_s <= 0:
            continue
        share = f.tokens_per_s / total
        if f.dst != COORDINATOR:
            through[f.dst] = through.get(f.dst, 0.0) + share
        bw = cluster.effective_bandwidth_gbps(f.src, f.dst)
        if bw > 0 and f.dst != COORDINATOR:  # the prompt goes in; only tokens come back
            links = max(links, n * share * prompt_bits / (bw * 1e9))
    prefill = 0.0
    ranges = {r.name: r.end_layer - r.start_layer for r in placement.nodes}
    for name, share in through.items():
        k = ranges.get(name, 0)
        if k:
            per_token_s = cost.batch_time_s(cluster.node(name), k, PREFILL_CHUNK_TOKENS,
                                            0) / PREFILL_CHUNK_TOKENS
            prefill = max(prefill, n * share * prompt_tokens * per_token_s)
    return max(links, prefill) + output_tokens * _round_trip_latency_s(cluster, placement)


def mean_lengths(requests: Sequence[Any]) -> tuple[float, float]:
    """Mean prompt and output tokens of the requests (TraceRequest-like)."""
    if not requests:
        return 0.0, 0.0
    n = len(requests)
    return (sum(q.prompt_tokens for q in requests) / n,
            sum(q.output_tokens for q in requests) / n)
