"""The opt-in serving-aware T(k) (ServingLoad) and the weight-fraction knob of the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from helixserve.costmodel import CostModel, ServingLoad
from helixserve.errors import UserError
from helixserve.spec import NodeSpec

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"


def test_from_lengths_takes_the_means() -> None:
    load = ServingLoad.from_lengths([700, 900], [100, 300], pipeline_depth=4)
    assert load.request_kv_tokens == pytest.approx(1000.0)
    assert load.prompt_tokens_per_output_token == pytest.approx(4.0)
    assert load.prompt_batch_tokens == 800
    assert load.pipeline_depth == 4


@pytest.mark.parametrize("bad", [
    {"request_kv_tokens": 0.0},
    {"prompt_batch_tokens": 0},
    {"pipeline_depth": 0.5},
    {"prompt_tokens_per_output_token": -1.0},
])
def test_bad_serving_load_is_a_user_error(bad: dict[str, float]) -> None:
    args = {"request_kv_tokens": 1000.0, "prompt_tokens_per_output_token": 3.0,
            "prompt_batch_tokens": 700, "pipeline_depth": 2.0, **bad}
    with pytest.raises(UserError, match="serving load"):
        ServingLoad(**args)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="serving load"):
        ServingLoad.from_lengths([], [])


def test_serving_throughput_is_the_documented_formula(parts) -> None:  # type: ignore[no-untyped-def]
    model, profiles = parts
    load = ServingLoad(1000.0, 3.0, 760, pipeline_depth=10.0)
    cost = CostModel(model, profiles, serving=load)
    node = NodeSpec("x", "L4")
    for k in (2, 5, 7):
        requests = cost.kv_capacity_tokens(node, k) / 1000.0
        b = min(cost.batch_limits(node)[1], int(requests / 10.0))
        per_token_ms = k * (cost.layer_time_ms("L4", 1, 0, b) / b
                            + 3.0 * cost.layer_time_ms("L4", 1, 760, 0) / 760)
        assert cost.node_throughput_tokens_per_s(node, k) == pytest.approx(1000.0 / per_token_ms)
    assert cost.node_throughput_tokens_per_s(node, cost.loadable_layers(node) + 1) == 0.0


def test_serving_throughput_is_below_the_decode_only_one(parts) -> None:  # type: ignore[no-untyped-def]
    # prompts add work and the batch is split over the pipeline: below decode-only
    model, profiles = parts
    plain = CostModel(model, profiles)
    for depth in (1.0, 14.0):
        serving = CostModel(model, profiles, serving=ServingLoad(1000.0, 3.3, 763, depth))
        for gpu in ("A100-40GB", "L4", "T4"):
            node = NodeSpec("x", gpu)
            for k in range(1, plain.max_layers(node) + 1):
                t = serving.node_throughput_tokens_per_s(node, k)
                assert 0 < t < plain.node_throughput_tokens_per_s(node, k), (depth, gpu, k)


def test_weight_fraction_bounds_the_layers_and_names_itself(parts) -> None:  # type: ignore[no-untyped-def]
    model, profiles = parts
    node = NodeSpec("x", "A100-40GB")
    half = CostModel(model, profiles)
    third = CostModel(model, profiles, weight_fraction=1 / 3)
    assert half.max_layers(node) == 12
    assert third.max_layers(node) == int(half.memory_bytes(node) / 3 // model.layer_weight_bytes)
    assert third.max_layers(node) < half.max_layers(node)
    with pytest.raises(UserError, match="weight_fraction"):
        CostModel(model, profiles, weight_fraction=0.0)
