"""The batch the vllm engine hands vLLM's runner, checked against the installed vLLM: every
field of `SchedulerOutput`, `NewRequestData` and `CachedRequestData` is one the engine sets
on purpose (vllm_batch's tables), so a field a new vLLM adds fails here, not on a GPU; and the
worker-start self-check passes on real vllm stages against the torch engine."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from vllm_procs import ENV, VLLM_MARKS

from helixserve.engine.vllm_batch import (
    CACHED_REQUEST_FIELDS,
    NEW_REQUEST_FIELDS,
    SCHEDULER_OUTPUT_FIELDS,
    BatchEntry,
    RunnerRequest,
    scheduler_output,
)

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]


def test_every_field_of_the_installed_vllms_batch_types_is_in_the_tables():
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    for cls, table in ((SchedulerOutput, SCHEDULER_OUTPUT_FIELDS),
                       (NewRequestData, NEW_REQUEST_FIELDS),
                       (CachedRequestData, CACHED_REQUEST_FIELDS)):
        names = {f.name for f in dataclasses.fields(cls)}
        assert names - set(table) == set(), f"{cls.__name__}: fields the engine does not set"


@pytest.mark.parametrize("zero", [False, True])
def test_a_call_sets_the_fields_a_gpu_runner_reads(zero):
    from vllm import SamplingParams

    reqs = {"a": RunnerRequest(block_ids=[1, 2]), "b": RunnerRequest(block_ids=[3], known=True,
                                                                      num_tokens=5)}
    finished = {"gone"}
    call = [BatchEntry("a", 0, [5, 6, 7], [1, 2], (0, 4)),
            BatchEntry("b", 5, [9], [3], (0, 4))]
    so = scheduler_output(call, reqs, finished, SamplingParams(max_tokens=1), zero)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]
    new = so.scheduled_new_reqs[0]
    assert new.block_ids == ([1, 2],) and new.num_computed_tokens == 0
    assert new.prompt_token_ids == [5, 6, 7] and new.prompt_embeds is None
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.new_token_ids == [[9]]
    assert cached.new_block_ids == [([3],)] and cached.num_computed_tokens == [5]
    assert cached.resumed_req_ids == set() and cached.all_token_ids == {}
    assert so.num_scheduled_tokens == {"a": 3, "b": 1} and so.total_num_scheduled_tokens == 4
    assert so.finished_req_ids == {"gone"} and finished == set()
    assert so.new_block_ids_to_zero == ([1, 2, 3] if zero else None)
    assert so.num_common_prefix_blocks == [] and so.kv_cache_block_copies is None
    assert so.scheduled_spec_decode_tokens == {} and so.num_spec_tokens_to_schedule == 0
    assert so.preempted_req_ids is None and so.has_structured_output_requests is False
    assert reqs["a"].known and reqs["b"].runner_outputs == 1


SELF_CHECK = r"""
import json, sys
import torch
from helixserve.engine.vllm_stage import VllmStageEngine, configure_vllm_process
from helixserve.engine.selfcheck import load_reference, self_check
configure_vllm_process(1)
a, b = int(sys.argv[2]), int(sys.argv[3])
eng = VllmStageEngine.load(sys.argv[1], a, b, kv_cache_bytes=32 << 20)
ref = load_reference("vllm", sys.argv[1], a, "cpu", eng.dtype)
r = self_check(eng, "cpu", reference=ref)
print(json.dumps({"line": r.line(), "diff": r.max_rel_diff, "ref": r.reference,
                  "ref_diff": r.reference_rel_diff, "used": eng.kv_stats()["used_blocks"]}))
"""


@pytest.mark.parametrize("layers", [(0, 12), (24, 30)])
def test_the_self_check_passes_on_a_vllm_stage_against_the_torch_engine(demo_model, layers):
    res = subprocess.run([sys.executable, "-c", SELF_CHECK, str(demo_model), *map(str, layers)],
                         capture_output=True, text=True, timeout=800,
                         env=dict(os.environ, **ENV))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["line"].startswith("self-check passed: engine vllm on cpu")
    assert got["ref"] == f"engine torch on layers [{layers[0]}, {layers[0] + 1})"
    assert got["used"] == 0
    if layers[1] < 30:  # float32: vLLM's CPU kernels vs the torch engine, tight
        assert got["diff"] < 1e-3 and got["ref_diff"] < 1e-3
