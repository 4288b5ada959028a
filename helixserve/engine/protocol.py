"""What every engine is: the `Engine` protocol, and the types a step takes and returns.

An engine runs one contiguous layer range [start_layer, end_layer) of one model for a batch
of work items (prefill chunks and decode tokens of many requests; runtime/worker.py forms the
batch), keeps each request's KV cache in fixed-size blocks, and frees a request on demand.
Three implement it: `torch` (engine/shard.py), `vllm` (engine/vllm_stage.py) and
`emulated` (engine/emulated.py: no weights, each step takes the time the profiles give).
A failed step raises one of engine/errors.py's classes and changes nothing.

Hidden states between stages are a torch tensor [num_tokens, hidden_size] for the torch and
vllm engines, and `RawHidden` (the same bytes, dtype and shape, without torch) for the
emulated engine; runtime/transport.py puts either on the wire. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from helixserve.request import PromptLogprob, SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RawHidden:
    """Hidden states as wire bytes: [shape[0] tokens, shape[1] = hidden_size] of `dtype`
    (a wire name: float16, bfloat16, float32), row-major. The emulated engine's activations:
    real size, no torch."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass
class WorkItem:
    """One request's share of a step on this shard."""

    request_id: str
    start_layer: int
    """First layer to run here (may be after the shard's start: partial inference)."""
    end_layer: int
    """One past the last layer to run here."""
    position: int
    """Position of the first token of this step (= tokens already in this request's KV)."""
    token_ids: list[int]
    """Input token ids of this step; always carried, even to middle and last stages."""
    hidden: torch.Tensor | RawHidden | None = None
    """[num_tokens, hidden_size] when start_layer > 0, else None (tokens are embedded)."""
    sampling: SamplingParams | None = None
    """Set when this step ends at the model's last layer."""
    sample: bool = True
    """Last stage: False for a non-final prompt chunk (no token wanted)."""
    num_prompt_tokens: int | None = None
    """Optional: tokens at positions >= this are generated ones (for penalties after a
    re-prefill of prompt + output). None: tokens before the first sampled one are prompt."""


@dataclass
class ItemOutput:
    request_id: str
    hidden: Any = None
    """[num_tokens, hidden_size] (a torch tensor, or RawHidden) if the item ended before the
    model's last layer."""
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None
    """With the first sampled token of a request that asked for them: prompt tokens 1.. given
    the tokens before each (token 0 has none)."""


class KvStats(TypedDict):
    """An engine's KV cache now, in blocks of `block_size` tokens."""

    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    capacity_tokens: int


@runtime_checkable
class Engine(Protocol):
    """One layer range of one model on one device (module doc)."""

    #: `torch`, `vllm` or `emulated`: the worker's Info reports it
    engine_name: str
    start_layer: int
    end_layer: int
    num_model_layers: int
    hidden_size: int
    vocab_size: int
    #: hidden states' dtype: a torch dtype, or its wire name for the emulated engine
    dtype: Any
    eos_token_ids: list[int]

    def step(self, items: list[WorkItem]) -> list[ItemOutput]:
        """One batched step over `items` (at most one per request); outputs in their order.
        Raises KvExhaustedError / InvalidWorkError (engine/errors.py) changing nothing."""
        ...

    def free(self, request_id: str) -> None:
        """Release a request's KV blocks and state; idempotent."""
        ...

    def seq_len(self, request_id: str) -> int:
        """Tokens of this request held in this engine's KV cache (0 if unknown)."""
        ...

    def kv_stats(self) -> KvStats: ...


class RangeSwitchable(Engine, Protocol):
    """An engine whose worker may take a new layer range while serving (LoadRange): the
    old engine drops its memory before the new one allocates its KV cache."""

    def release_memory(self) -> None: ...

    def allocate_kv(self, kv_cache_bytes: int | None = None) -> None: ...
