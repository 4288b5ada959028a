"""The batch description a vLLM stage worker hands its model runner each step.

vLLM's head scheduler would give every pipeline stage the same batch; under per-request
routes every worker sees a different set of requests, so each worker describes its own
batch: which requests are new to its runner (`NewRequestData`: first tokens, block table),
which it already knows (`CachedRequestData`: tokens so far, new blocks, tokens of this
step), how many tokens each runs (a prefill chunk or one decode token), and which requests
were freed since the last call (the runner drops their state).

The runner keeps a token list per request. It is fed exactly the tokens that arrive: the
first step's tokens are the request's "prompt" as far as the runner knows, every later
step's tokens are appended (the runner's path for non-last pipeline ranks, which gets
sampled tokens from the scheduler). The runner never samples here (the engine does), so
its notion of prompt vs output does not matter; positions come from `num_computed_tokens`.

A request that starts from cached prefix blocks (prefix caching, docs/prefix-caching.md) is
new to the runner at `position > 0`: as vLLM's own scheduler does for a prefix-cache hit, its
`NewRequestData` carries the prefix tokens followed by the step's tokens, the whole block
table (the shared cached blocks first) and `num_computed_tokens = position`, so the runner
computes only the tokens after the prefix and attends to the prefix's KV in the shared blocks.

`plan_batches` (pure) packs a step's entries into runner calls within the runner's limits;
`scheduler_output` (vLLM types) turns one call into a `SchedulerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunnerRequest:
    """What this worker has told its runner about one request."""

    block_ids: list[int] = field(default_factory=list)
    """KV blocks of the request in this worker's cache (vLLM block ids)."""
    num_tokens: int = 0
    """Tokens whose KV is written here (= position of the next token)."""
    known: bool = False
    """The runner holds the request's state (a NewRequestData was sent, not finished since)."""
    runner_outputs: int = 0
    """Tokens appended after the first step (the runner counts them as outputs)."""
    prefix_token_ids: list[int] = field(default_factory=list)
    """Tokens [0, position) whose KV the request took from the prefix cache, until the runner
    has been told (its first call); then empty."""


@dataclass(frozen=True)
class BatchEntry:
    """One request's share of one runner call."""

    request_id: str
    position: int
    token_ids: list[int]
    new_block_ids: list[int]
    """Blocks allocated for this step (appended to the request's table)."""
    layers: tuple[int, int]
    """Layers [start, end) this entry runs (a sub-range of the shard: partial inference)."""


def plan_batches(
    entries: list[BatchEntry], max_tokens: int, max_requests: int
) -> list[list[BatchEntry]]:
    """Runner calls for one step: one per layer sub-range, each split so that no call has
    more than `max_tokens` tokens or `max_requests` requests (an entry is never split: the
    coordinator's prefill chunks are already bounded, see `check_entry`)."""
    by_layers: dict[tuple[int, int], list[BatchEntry]] = {}
    for e in entries:
        by_layers.setdefault(e.layers, []).append(e)
    calls: list[list[BatchEntry]] = []
    for group in by_layers.values():
        call: list[BatchEntry] = []
        tokens = 0
        for e in group:
            n = len(e.token_ids)
            if call and (tokens + n > max_tokens or len(call) >= max_requests):
                calls.append(call)
                call, tokens = [], 0
            call.append(e)
            tokens += n
        if call:
            calls.append(call)
    return calls


# Every field of vLLM's batch types, in every version named in vllm_build (SUPPORTED_VLLM and
# READ_VLLM), with what this engine sets it to and why; `scheduler_output` passes each one
# explicitly, so nothing is left to a default a GPU code path might read differently. A field
# the installed vLLM has and these tables do not fails `test_vllm_batch_fields` (a test in the
# vllm venv), not a GPU run. "batch": from the step. Read in vLLM 0.32.0 (run) and 0.33.0 (read
# only): `GPUModelRunner._update_states`, `_prepare_inputs`, `execute_model` and
# `Worker.execute_model` (the CPU runner subclasses the GPU one; only the attention backend,
# warm-up and `_zero_block_ids` differ on a GPU).
SCHEDULER_OUTPUT_FIELDS: dict[str, str] = {
    "scheduled_new_reqs": "batch: requests new to the runner",
    "scheduled_cached_reqs": "batch: requests the runner knows",
    "num_scheduled_tokens": "batch: tokens of each request in this call",
    "total_num_scheduled_tokens": "batch: their sum",
    "finished_req_ids": "batch: requests freed since the last call",
    "new_block_ids_to_zero": "the call's new blocks when the cache needs zeroing (Mamba, mixed "
                             "precision: KVCacheConfig.needs_kv_cache_zeroing), else None",
    "scheduled_spec_decode_tokens": "{}: no speculative decoding",
    "scheduled_encoder_inputs": "{}: no multimodal inputs",
    "free_encoder_mm_hashes": "[]: no encoder cache",
    "encoder_input_updates": "{} (0.33): no multimodal inputs",
    "scheduled_encoder_input_stats": "None: no encoder",
    "preempted_req_ids": "None: read by the V2 runner only (VLLM_USE_V2_MODEL_RUNNER=0); a "
                         "preempted request is freed (finished_req_ids) and re-prefilled",
    "has_structured_output_requests": "False: the runner never samples here",
    "pending_structured_output_tokens": "False: no structured output",
    "num_invalid_spec_tokens": "None: no speculative decoding",
    "kv_connector_metadata": "None: no KV connector",
    "has_sync_kv_loads": "False: no KV connector",
    "aux_output_connector_metadata": "None: no KV connector",
    "ec_connector_metadata": "None: no encoder-cache connector",
    "ec_manager_metadata": "None: no encoder cache",
    "kv_cache_block_copies": "None: only full blocks are shared (prefix caching), and a full "
                             "block is never written again, so nothing is copied on write",
    "kv_connector_block_state": "None: scheduler-local in vLLM",
    "num_spec_tokens_to_schedule": "0: no speculative decoding",
    "num_common_prefix_blocks": "[]: cascade attention is gone in 0.32/0.33 (deprecated field); "
                                "an empty list also means no common prefix to older runners",
    "skip_drafts": "False (0.33): no draft model",
}
NEW_REQUEST_FIELDS: dict[str, str] = {
    "req_id": "batch",
    "prompt_token_ids": "batch: the request's first tokens here, after the cached prefix's "
                        "tokens if it attached one (module doc)",
    "mm_features": "[]: no multimodal inputs",
    "sampling_params": "a greedy placeholder: the runner's persistent batch needs one, its "
                       "sampler never runs",
    "pooling_params": "None: generation",
    "block_ids": "batch: the request's blocks, one KV group",
    "num_computed_tokens": "batch: 0, or the cached prefix's length (its position) for a "
                           "request that attached one",
    "lora_request": "None: no LoRA",
    "prompt_embeds": "None: tokens, embedded by the engine",
    "prompt_is_token_ids": "None: every prompt position is a token",
    "prefill_token_ids": "None: read by the V2 runner only",
    "replay_start": "0: no replay",
}
CACHED_REQUEST_FIELDS: dict[str, str] = {
    "req_ids": "batch",
    "resumed_req_ids": "empty: a preempted request comes back as a new one",
    "new_token_ids": "batch: the call's tokens (the runner's non-last-rank path)",
    "all_token_ids": "{}: only for resumed requests and KV connectors",
    "new_block_ids": "batch: blocks added this call, or None",
    "num_computed_tokens": "batch: the request's position",
    "num_output_tokens": "batch: tokens appended after the first call",
}


def _construct(cls: Any, values: dict[str, Any], table: dict[str, str]) -> Any:
    """cls(**values) over the fields the installed vLLM has. Every one of them must be in
    `table` and `values` (a new vLLM field is an error here, before any GPU code runs)."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [n for n in names if n not in table or n not in values]
    if unknown:
        from helixserve.engine.vllm_build import vllm_version

        raise RuntimeError(f"vLLM {vllm_version()}: {cls.__name__} has fields the vllm engine "
                           f"does not set: {', '.join(unknown)}; this vLLM version is not "
                           "supported (helixserve/engine/vllm_batch.py)")
    return cls(**{n: values[n] for n in names})


def scheduler_output(
    call: list[BatchEntry],
    requests: dict[str, RunnerRequest],
    finished: set[str],
    placeholder_sampling: Any,
    zero_new_blocks: bool = False,
) -> Any:
    """A vLLM `SchedulerOutput` for one runner call, every field set (the tables above);
    updates `requests` (known, counts) and empties `finished`.

    `placeholder_sampling` is the vllm.SamplingParams given to new requests: the runner
    needs one to build its persistent batch, but its sampler never runs here.
    `zero_new_blocks`: the cache needs new blocks zeroed (`BuiltStage.zero_new_blocks`)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new_reqs: list[Any] = []
    cached: dict[str, Any] = {"req_ids": [], "resumed_req_ids": set(), "new_token_ids": [],
                              "all_token_ids": {}, "new_block_ids": [],
                              "num_computed_tokens": [], "num_output_tokens": []}
    num_scheduled: dict[str, int] = {}
    to_zero: list[int] = []
    for e in call:
        state = requests[e.request_id]
        num_scheduled[e.request_id] = len(e.token_ids)
        to_zero.extend(e.new_block_ids)
        if not state.known:
            assert e.position == len(state.prefix_token_ids), \
                "a request new to the runner starts right after its cached prefix (or at 0)"
            new_reqs.append(_construct(NewRequestData, {
                "req_id": e.request_id,
                "prompt_token_ids": state.prefix_token_ids + list(e.token_ids),
                "mm_features": [],
                "sampling_params": placeholder_sampling,
                "pooling_params": None,
                "block_ids": (list(state.block_ids),),
                "num_computed_tokens": e.position,
                "lora_request": None,
                "prompt_embeds": None,
                "prompt_is_token_ids": None,
                "prefill_token_ids": None,
                "replay_start": 0,
            }, NEW_REQUEST_FIELDS))
            state.known = True
            state.prefix_token_ids = []
        else:
            state.runner_outputs += len(e.token_ids)
            cached["req_ids"].append(e.request_id)
            cached["new_token_ids"].append(list(e.token_ids))
            cached["new_block_ids"].append((list(e.new_block_ids),) if e.new_block_ids else None)
            cached["num_computed_tokens"].append(e.position)
            cached["num_output_tokens"].append(state.runner_outputs)
    out = _construct(SchedulerOutput, {
        "scheduled_new_reqs": new_reqs,
        "scheduled_cached_reqs": _construct(CachedRequestData, cached, CACHED_REQUEST_FIELDS),
        "num_scheduled_tokens": num_scheduled,
        "total_num_scheduled_tokens": sum(num_scheduled.values()),
        "finished_req_ids": set(finished),
        "new_block_ids_to_zero": to_zero if zero_new_blocks and to_zero else None,
        "scheduled_spec_decode_tokens": {},
        "scheduled_encoder_inputs": {},
        "free_encoder_mm_hashes": [],
        "encoder_input_updates": {},
        "scheduled_encoder_input_stats": None,
        "preempted_req_ids": None,
        "has_structured_output_requests": False,
        "pending_structured_output_tokens": False,
        "num_invalid_spec_tokens": None,
        "kv_connector_metadata": None,
        "has_sync_kv_loads": False,
        "aux_output_connector_metadata": None,
        "ec_connector_metadata": None,
        "ec_manager_metadata": None,
        "kv_cache_block_copies": None,
        "kv_connector_block_state": None,
        "num_spec_tokens_to_schedule": 0,
        "num_common_prefix_blocks": [],
        "skip_drafts": False,
    }, SCHEDULER_OUTPUT_FIELDS)
    finished.clear()
    return out
