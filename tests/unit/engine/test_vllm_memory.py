"""Per-stage GPU memory budgets of the vllm engine (engine/vllm_memory.py) and the batch
tables' guard against vLLM fields nobody set (engine/vllm_batch.py); pure, no GPU, no vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from helixserve.engine.vllm_batch import SCHEDULER_OUTPUT_FIELDS, _construct
from helixserve.engine.vllm_memory import (
    GIB,
    LONE_STAGE_FRACTION,
    GpuBudget,
    kv_after_load,
    plan_gpu_budget,
)
from helixserve.errors import UserError

H100 = 80 * GIB


def test_a_lone_stage_without_flags_takes_most_of_an_idle_device():
    b = plan_gpu_budget(H100, H100 - GIB // 2, None, None, "cuda:0")
    assert b.stage_bytes == int(LONE_STAGE_FRACTION * H100) and b.kv_cache_bytes is None
    # KV: the stage budget less the weights and the activation reserve (10% of the budget)
    assert kv_after_load(b, 10 * GIB, 60 * GIB) == b.stage_bytes - 10 * GIB - b.stage_bytes // 10


def test_a_shared_device_without_an_explicit_budget_is_refused_naming_both_flags():
    with pytest.raises(UserError) as err:
        plan_gpu_budget(H100, 40 * GIB, None, None, "cuda:0")
    msg = str(err.value)
    assert "\n" not in msg and "cuda:0: 40.0 GiB of 80.0 GiB is already in use" in msg
    assert "--gpu-memory-fraction" in msg and "--kv-cache-bytes" in msg


def test_fractions_of_stages_sharing_a_device_must_fit_in_what_is_free():
    first = plan_gpu_budget(H100, H100, 0.45, None, "cuda:0")
    assert first.utilization == 0.45 and first.stage_bytes == int(0.45 * H100)
    # the second stage starts after the first holds its 36 GiB: 0.45 fits, 0.6 does not
    assert plan_gpu_budget(H100, 43 * GIB, 0.45, None, "cuda:0").stage_bytes == int(0.45 * H100)
    with pytest.raises(UserError, match=r"--gpu-memory-fraction: 0.6 of cuda:0 is 48.0 GiB "
                                        r"but only 43.0 GiB of 80.0 GiB is free"):
        plan_gpu_budget(H100, 43 * GIB, 0.6, None, "cuda:0")
    for bad in (0.0, 0.99, -1.0):
        with pytest.raises(UserError, match=f"--gpu-memory-fraction: bad value {bad}"):
            plan_gpu_budget(H100, H100, bad, None, "cuda:0")


def test_a_fraction_too_small_for_the_weights_is_refused():
    b = plan_gpu_budget(H100, H100, 0.1, None, "cuda:0")  # 8 GiB
    with pytest.raises(UserError, match="holds the range's weights .* but no KV cache"):
        kv_after_load(b, 7 * GIB, 70 * GIB)
    fixed = plan_gpu_budget(H100, H100, 0.5, 30 * GIB, "cuda:0")
    assert kv_after_load(fixed, 5 * GIB, 70 * GIB) == 30 * GIB
    with pytest.raises(UserError, match="--kv-cache-bytes: .* does not fit in the stage's"):
        kv_after_load(fixed, 8 * GIB, 70 * GIB)
    with pytest.raises(UserError, match="does not fit in --gpu-memory-fraction 0.5"):
        plan_gpu_budget(H100, H100, 0.5, 40 * GIB, "cuda:0")


def test_kv_cache_bytes_alone_is_checked_at_start_and_after_loading():
    b = plan_gpu_budget(H100, 30 * GIB, None, 20 * GIB, "cuda:0")  # shared: explicit KV
    assert b.stage_bytes is None and b.kv_cache_bytes == 20 * GIB
    assert b.utilization * H100 <= 30 * GIB  # vLLM's own start check passes
    assert kv_after_load(b, 5 * GIB, 25 * GIB) == 20 * GIB
    with pytest.raises(UserError, match="does not fit on cuda:0 after the range's weights"):
        kv_after_load(b, 12 * GIB, 18 * GIB)
    with pytest.raises(UserError, match="only 10.0 GiB of cuda:0 is free"):
        plan_gpu_budget(H100, 10 * GIB, None, 20 * GIB, "cuda:0")
    assert isinstance(b, GpuBudget)


def test_a_vllm_field_missing_from_the_tables_fails_before_any_runner_sees_it():
    known = {name: None for name in SCHEDULER_OUTPUT_FIELDS}

    @dataclasses.dataclass
    class NewerOutput:
        scheduled_new_reqs: list
        shiny_new_gpu_flag: bool = True

    with pytest.raises(RuntimeError, match="NewerOutput has fields the vllm engine does not "
                                           "set: shiny_new_gpu_flag"):
        _construct(NewerOutput, known, SCHEDULER_OUTPUT_FIELDS)

    @dataclasses.dataclass
    class OlderOutput:
        scheduled_new_reqs: list

    out = _construct(OlderOutput, dict(known, scheduled_new_reqs=[1]), SCHEDULER_OUTPUT_FIELDS)
    assert out.scheduled_new_reqs == [1]  # values for fields a version lacks are dropped
