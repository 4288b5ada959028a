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


def scheduler_output(
    call: list[BatchEntry],
    requests: dict[str, RunnerRequest],
    finished: set[str],
    placeholder_sampling: Any,
) -> Any:
    """A vLLM `SchedulerOutput` for one runner call; updates `requests` (known, counts).

    `placeholder_sampling` is the vllm.SamplingParams given to new requests: the runner
    needs one to build its persistent batch, but its sampler never runs here."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new_reqs: list[Any] = []
    cached = CachedRequestData.make_empty()
    num_scheduled: dict[str, int] = {}
    for e in call:
        state = requests[e.request_id]
        num_scheduled[e.request_id] = len(e.token_ids)
        if not state.known:
            assert e.position == 0, "a request new to the runner starts at position 0"
            new_reqs.append(
                NewRequestData(
                    req_id=e.request_id,
                    prompt_token_ids=list(e.token_ids),
                    mm_features=[],
                    sampling_params=placeholder_sampling,
                    pooling_params=None,
                    block_ids=(list(state.block_ids),),
                    num_computed_tokens=0,
                    lora_request=None,
                )
            )
            state.known = True
        else:
            state.runner_outputs += len(e.token_ids)
            cached.req_ids.append(e.request_id)
            cached.new_token_ids.append(list(e.token_ids))
            cached.new_block_ids.append((list(e.new_block_ids),) if e.new_block_ids else None)
            cached.num_computed_tokens.append(e.position)
            cached.num_output_tokens.append(state.runner_outputs)
    total = sum(num_scheduled.values())
    out = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=total,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )
    finished.clear()
    return out
