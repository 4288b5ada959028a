"""Scheduling constants, defined once: the scheduling core (helixserve/scheduler), the
simulator, the coordinator, the workers, the engines and the CLI import them from here
(docs/scheduler.md lists who uses which). Pure data in `spec`, the bottom layer, so that
the engine and request modules can import them without the control plane."""

from __future__ import annotations

#: how a node allocates KV: "reserve" (prompt + output at admission, held to the end) or
#: "on-demand" (the prompt at admission, one slot per generated token, preemption by
#: recompute when a node runs out; vLLM's paged allocation)
KV_ALLOCATIONS = ("reserve", "on-demand")

#: fraction of a node's KV kept free at on-demand admission for running requests to grow
#: into (vLLM's default watermark, 0.01)
DEFAULT_KV_WATERMARK = 0.01

#: tokens per KV block of the paged caches (engine/kv_cache.py, vLLM's default); the
#: simulator counts single slots (a block of 1)
DEFAULT_KV_BLOCK_SIZE = 16

#: prompt tokens one engine step may run besides its decode tokens (vLLM's
#: max_num_batched_tokens of the `vllm` engine model; the workers' default step budget)
DEFAULT_STEP_PROMPT_TOKENS = 512

#: the coordinator's largest prefill chunk (smaller when the hidden size would make the
#: message too big): one chunk fills one worker step's prompt budget
DEFAULT_PREFILL_CHUNK_TOKENS = DEFAULT_STEP_PROMPT_TOKENS

#: admitted requests still prefilling beyond which the `vllm` engine model admits no more
DEFAULT_MAX_PREFILLING = 64

#: the rules that pick which request a node out of KV preempts (scheduler/kv.py: `victim`)
VICTIM_RULES = ("newest", "requester")

#: the victim rule of the live coordinator: a worker reports KV exhaustion by failing the
#: step of the request that needed the block, which must then be recomputed anyway; picking
#: another victim would recompute two requests (docs/scheduler.md)
RUNTIME_VICTIM_RULE = "requester"
