"""Small analytic clusters for the simulator tests, built from the real spec and cost model.

A `tiny` Llama (1024 hidden, 4 layers) on machines whose profiled per-layer time is a
constant (`decode_ms` for any decode batch up to `max_decode`, `prompt_ms` for any prompt),
so the iteration time of a batch is known exactly: layers x (prompt_ms + decode_ms), plus
`head_ms` on a machine holding the last layer when the iteration samples a row (0 unless
given: the profiles' head rows say so, so the cost model does not estimate one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from helixserve.costmodel import CostModel
from helixserve.planner.placement import NodeRange, Placement
from helixserve.simulator.workload import TraceRequest
from helixserve.spec import ClusterSpec, Curve, ModelSpec, ProfileTable, parse_cluster, parse_model

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"

TINY = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 2048,
    "vocab_size": 1000,
}
FAST_GBPS = 1e6  # a link that never limits anything here


@dataclass
class Machine:
    name: str
    gpu: str
    start_layer: int
    end_layer: int
    decode_ms: float
    prompt_ms: float = 0.0
    max_decode: int = 8
    memory_gb: float = 16.0
    head_ms: float = 0.0


@dataclass
class Setup:
    cluster: ClusterSpec
    model: ModelSpec
    cost: CostModel
    placement: Placement


def make_setup(
    machines: list[Machine],
    links: list[dict[str, object]] | None = None,
    default_gbps: float = FAST_GBPS,
    latency_ms: float = 0.0,
) -> Setup:
    """Each machine gets its own GPU type (profiles are per GPU type): pass distinct gpus."""
    model = parse_model(TINY, "tiny")
    curves = {}
    heads = {}
    for m in machines:
        curves[("tiny", m.gpu, 1, "decode")] = Curve((1, m.max_decode), (m.decode_ms, m.decode_ms))
        curves[("tiny", m.gpu, 1, "prompt")] = Curve((1, 100_000), (m.prompt_ms, m.prompt_ms))
        for phase in ("decode", "prompt"):
            heads[("tiny", m.gpu, 1, phase)] = Curve((1, 100_000), (m.head_ms, m.head_ms))
    cost = CostModel(model, ProfileTable(curves, source="test", head_curves=heads))
    cluster = parse_cluster(
        {
            "name": "analytic",
            "nodes": [{"name": m.name, "gpu": m.gpu, "memory_gb": m.memory_gb} for m in machines],
            "links": {
                "default": {"bandwidth_gbps": default_gbps, "latency_ms": latency_ms},
                "explicit": links or [],
            },
        },
        source="test-cluster",
    )
    placement = Placement(
        model="tiny",
        cluster="analytic",
        num_layers=4,
        planner="hand",
        nodes=[NodeRange(m.name, m.start_layer, m.end_layer) for m in machines],
    )
    return Setup(cluster, model, cost, placement)


def with_flows(s: Setup) -> Setup:
    from helixserve.planner.flow import evaluate

    res = evaluate(s.cluster, s.model, s.cost, s.placement)
    s.placement.flows = res.flows
    s.placement.throughput_tokens_per_s = res.throughput_tokens_per_s
    return s


def fixed_requests(n: int, prompt: int, output: int, gap_s: float = 0.0) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", i * gap_s, prompt, output) for i in range(n)]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED
