"""SimConfig.prefill_chunk_tokens: prompt chunks pipeline along the route, as the live
coordinator sends them (all at once; each node passes a chunk on once it has run it)."""

from __future__ import annotations

import pytest

from helixserve.errors import UserError
from helixserve.simulator.sim import SimConfig, Simulation
from tests.unit.simulator.conftest import Machine, fixed_requests, make_setup, with_flows

# two stages of 2 layers; a prompt iteration costs 2 x 10 ms whatever its size
STAGES = [
    Machine("a", "A100-40GB", 0, 2, decode_ms=1.0, prompt_ms=10.0),
    Machine("b", "L4", 2, 4, decode_ms=1.0, prompt_ms=10.0),
]


def _first_token_s(chunk: int | None) -> float:
    s = with_flows(make_setup(STAGES))
    config = SimConfig(duration_s=60.0, chunked_prefill=True, max_prompt_tokens=256,
                       prefill_chunk_tokens=chunk, kv_allocation="on-demand")
    result = Simulation(s.cluster, s.model, s.cost, s.placement,
                        fixed_requests(1, prompt=1024, output=1), config).run()
    (r,) = result.finished
    return r.first_s - r.arrival_s


def test_chunks_pipeline_along_the_route() -> None:
    # 4 chunks of 256 on 2 stages of 20 ms: pipelined, the last chunk leaves stage b after
    # (4 + 2 - 1) iterations; moved whole, the prompt runs 4 iterations on a, then 4 on b
    assert _first_token_s(None) == pytest.approx(8 * 0.020, abs=1e-3)
    assert _first_token_s(256) == pytest.approx(5 * 0.020, abs=1e-3)
    # chunks bigger than the step budget are split by it and still pipeline per chunk
    assert _first_token_s(512) == pytest.approx(6 * 0.020, abs=1e-3)


def test_a_bad_chunk_size_is_an_error() -> None:
    s = with_flows(make_setup(STAGES))
    with pytest.raises(UserError, match="prefill_chunk_tokens: must be >= 1, got 0"):
        Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 10, 1),
                   SimConfig(prefill_chunk_tokens=0))
