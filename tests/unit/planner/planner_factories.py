"""Small factories for planner tests: clusters built in code, shared models and profiles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helixserve.costmodel import CostModel
from helixserve.planner import clock
from helixserve.spec import ClusterSpec, LinkSpec, ModelSpec, NodeSpec, load_model, load_profiles

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"


def make_cluster(name: str = "test", link_gbps: float = 8.0, **counts: int) -> ClusterSpec:
    """make_cluster(a100=2, t4=4): nodes named a100-0, ..., all links `link_gbps`."""
    gpus = {"a100": "A100-40GB", "l4": "L4", "t4": "T4", "v100": "V100-16GB", "h100": "H100-80GB"}
    nodes = [NodeSpec(f"{key}-{i}", gpus[key]) for key, n in counts.items() for i in range(n)]
    return ClusterSpec(name=name, nodes=nodes, default_link=LinkSpec(link_gbps, 1.0))


def tiny_model(num_layers: int = 8, name: str = "tiny") -> ModelSpec:
    return ModelSpec(name=name, num_layers=num_layers, hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                     vocab_size=32000, max_position_embeddings=4096)


@pytest.fixture(scope="session")
def llama70b() -> ModelSpec:
    return load_model(SHARED / "models" / "llama-2-70b")


@pytest.fixture(scope="session")
def measured_cost(llama70b: ModelSpec) -> CostModel:
    return CostModel(llama70b, load_profiles(SHARED / "profiles" / "helix-measured.csv"))


@pytest.fixture
def counted() -> Iterator[None]:
    """Run the test on the planner's work clock (planner/clock.py): the searches stop after
    counted work, not at a deadline, so a busy machine cannot change what they find."""
    with clock.work_clock():
        yield


def work(units: float) -> float:
    """A deadline `units` of work from now, for a search run inside `counted`."""
    return clock.now() + units
