"""The simulator's opt-in prompt-token budget per iteration (SimConfig.max_prompt_tokens)."""

from __future__ import annotations

import pytest

from helixserve.errors import UserError
from helixserve.simulator.sim import SimConfig, Simulation
from tests.unit.simulator.conftest import Machine, Setup, fixed_requests, make_setup, with_flows


def one_node() -> Setup:
    return with_flows(
        make_setup([Machine("a", "T4", 0, 4, decode_ms=1.0, prompt_ms=1.0, max_decode=64)])
    )


def mean_prompt_batch(**cfg: object) -> float:
    s = one_node()
    config = SimConfig(duration_s=5.0, scheduler="maxflow", **cfg)  # type: ignore[arg-type]
    res = Simulation(s.cluster, s.model, s.cost, s.placement,
                     fixed_requests(10, prompt=100, output=50), config).run()
    node = res.nodes[0]
    assert node.prompt_tokens == 1000
    return node.prompt_tokens / node.prompt_iters


def test_prompt_budget_splits_a_burst_of_prompts() -> None:
    # ten 100-token prompts arrive at t = 0; the first starts the idle node alone, the other
    # nine queue behind it: 2 iterations without a budget, 1 + 5 with room for two prompts,
    # and one each when the budget is below a prompt (a longer prompt runs alone)
    assert mean_prompt_batch() == pytest.approx(1000 / 2)
    assert mean_prompt_batch(max_prompt_tokens=250) == pytest.approx(1000 / 6)
    assert mean_prompt_batch(max_prompt_tokens=50) == pytest.approx(100.0)


def test_bad_prompt_budget_is_a_user_error() -> None:
    with pytest.raises(UserError, match="max_prompt_tokens: must be >= 1"):
        mean_prompt_batch(max_prompt_tokens=0)
