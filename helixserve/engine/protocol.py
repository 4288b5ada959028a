"""What every engine is: the `Engine` protocol, and the types a step takes and returns.

An engine runs one contiguous layer range [start_layer, end_layer) of one model for a batch
of work items (prefill chunks and decode tokens of many requests; runtime/worker.py forms the
batch), keeps each request's KV cache in fixed-size blocks, and frees a request on demand.
Three implement it: `torch` (engine/shard.py), `vllm` (engine/vllm_stage.py) and
`emulated` (engine/emulated.py: no weights, each step takes the time the profiles give).
A failed step raises one of engine/errors.py's classes and changes nothing.

With prefix caching (docs/prefix-caching.md) an engine keeps the full KV blocks of running
and finished requests, named by prefix.block_hashes; a new request's first item may carry
`prefix_token_ids`, whose blocks the engine attaches instead of computing them, and the
engine's `take_cache_events` tells the worker what it stored and evicted.

Hidden states between stages are a torch tensor [num_tokens, hidden_size] for the torch and
vllm engines, and `RawHidden` (the same bytes, dtype and shape, without torch) for the
emulated engine; runtime/transport.py puts either on the wire. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from helixserve.request import PromptLogprob, SamplingParams

if TYPE_CHECKING:
    import torch

    from helixserve.prefix import CacheEvents


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
    prefix_token_ids: list[int] | None = None
    """Only on a request's first item at a hop, with `position > 0`: tokens [0, position)
    whose KV the engine must take from its prefix cache (docs/prefix-caching.md); the engine
    raises PrefixMissError if it does not hold them all."""


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
    cached_blocks: int
    """Blocks holding cached prefixes no request uses (also counted in free_blocks)."""


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
    #: whether finished requests' prefix blocks are kept for reuse (the worker's
    #: --no-prefix-caching turns it off)
    prefix_caching: bool

    def step(self, items: list[WorkItem]) -> list[ItemOutput]:
        """One batched step over `items` (at most one per request); outputs in their order.
        Raises KvExhaustedError / InvalidWorkError / PrefixMissError (engine/errors.py)
        changing nothing."""
        ...

    def free(self, request_id: str) -> None:
        """Release a request's KV blocks and state; idempotent."""
        ...

    def seq_len(self, request_id: str) -> int:
        """Tokens of this request held in this engine's KV cache (0 if unknown)."""
        ...

    def kv_stats(self) -> KvStats: ...

    def take_cache_events(self) -> CacheEvents:
        """Prefix blocks stored and removed since the last call (prefix.CacheEventLog; reset
        on the first call); empty, but for that reset, without prefix caching."""
        ...


class RangeSwitchable(Engine, Protocol):
    """An engine whose worker may take a new layer range while serving (LoadRange): the
    old engine drops its memory before the new one allocates its KV cache."""

    def release_memory(self) -> None: ...

    def allocate_kv(self, kv_cache_bytes: int | None = None) -> None: ...


def check_step(items: list[WorkItem], engine: Any, seq_len: Callable[[str], int],
               max_item_tokens: int | None = None) -> None:
    """THE check of one step's items, before an engine changes anything: each request once,
    layers inside the engine's range, tokens present (at most `max_item_tokens` per item), a
    position the KV has reached (for an item with `prefix_token_ids`: the prefix's end; that
    the cache holds it is the engine's check), hidden states of the right shape after layer
    0, sampling params on the last layer, no prompt logprobs with a cached prefix. `engine` gives start_layer, end_layer, hidden_size and
    num_model_layers; raises InvalidWorkError naming the request."""
    from helixserve.engine.errors import InvalidWorkError

    seen: set[str] = set()
    for it in items:
        rid = it.request_id
        if rid in seen:
            raise InvalidWorkError(f"request {rid!r} appears twice in one step")
        seen.add(rid)
        if not engine.start_layer <= it.start_layer < it.end_layer <= engine.end_layer:
            raise InvalidWorkError(
                f"request {rid!r}: layers [{it.start_layer}, {it.end_layer}) not "
                f"inside this shard's [{engine.start_layer}, {engine.end_layer})")
        if not it.token_ids:
            raise InvalidWorkError(f"request {rid!r}: no token ids")
        if max_item_tokens is not None and len(it.token_ids) > max_item_tokens:
            raise InvalidWorkError(f"request {rid!r}: {len(it.token_ids)} tokens in one item; "
                                   f"this engine takes at most {max_item_tokens}")
        have = seq_len(rid)
        if it.prefix_token_ids:
            # A new request whose tokens [0, position) are taken from the prefix cache.
            if len(it.prefix_token_ids) != it.position:
                raise InvalidWorkError(
                    f"request {rid!r}: {len(it.prefix_token_ids)} prefix tokens but position "
                    f"{it.position} (the prefix is every token before the item's)")
        elif it.position > have:
            raise InvalidWorkError(
                f"request {rid!r}: position {it.position} but only {have} tokens "
                "in this shard's KV cache (a step was skipped?)")
        shape = None if it.hidden is None else tuple(it.hidden.shape)
        if it.start_layer > 0 and shape != (len(it.token_ids), engine.hidden_size):
            raise InvalidWorkError(
                f"request {rid!r}: starts at layer {it.start_layer} so needs "
                f"hidden [{len(it.token_ids)}, {engine.hidden_size}], got {shape}")
        if it.end_layer == engine.num_model_layers and it.sample and it.sampling is None:
            raise InvalidWorkError(f"request {rid!r}: reaches the last layer without "
                                   "sampling params")
        if (it.prefix_token_ids and it.end_layer == engine.num_model_layers
                and it.sampling is not None and it.sampling.prompt_logprobs is not None):
            # The prefix's rows are not computed, so its tokens cannot be scored (vLLM
            # skips its prefix cache for such requests too).
            raise InvalidWorkError(f"request {rid!r}: asks for prompt logprobs, which need "
                                   "the whole prompt computed, not taken from the prefix cache")


def kv_stats_of(kv: Any) -> KvStats:
    """An engine's KV report from its block allocator (engine/kv_blocks.py)."""
    return {
        "block_size": kv.block_size,
        "total_blocks": kv.num_blocks,
        "used_blocks": kv.used_blocks,
        "free_blocks": kv.free_blocks,
        "capacity_tokens": kv.capacity_tokens,
        "cached_blocks": getattr(kv, "cached_blocks", 0),
    }
