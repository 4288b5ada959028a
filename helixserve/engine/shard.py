"""`ShardEngine`: runs layers [start, end) of a model for a batch of work items.

One `step(items)` is one batched forward pass. The tokens of all items are concatenated
into `x: [total_tokens, hidden_size]`; items that start at layer 0 are embedded, the others
bring their hidden states. Each item may run only a sub-range of the shard's layers
(partial inference): layers are applied to the rows of the items that run them, grouped
into runs of consecutive layers with the same active items. Items whose sub-range ends at
the model's last layer get the final norm, lm_head and the sampler (on their last token);
the others hand back their hidden states. A request that asks for prompt logprobs also gets
the lm_head over its prompt rows (and only those requests: the sampler's path stays one row
per request).

Per request the engine keeps: its KV blocks (shared by all local layers), the number of
tokens in its KV (the next position), and on the last stage its token history and, for a
seeded request, its own random generator (unseeded requests draw from the engine's).
With prefix caching (on by default; docs/prefix-caching.md) the KV cache also keeps the full
blocks of running and finished requests, named by their tokens and layer span
(engine/kv_blocks.py): after each step the blocks that became full are cached, and a new
request whose first item carries `prefix_token_ids` takes those blocks from the cache
instead of computing them (its item starts at position len(prefix_token_ids)); a prefix not
all cached raises PrefixMissError before the step changes anything.
A step's inputs come in with one embedding call and one scatter of the hidden states
brought; the hidden states leaving it and the sampled tokens go to the host in one copy
each (engine/host_copy.py), on the engine's thread.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from helixserve.engine.config import ModelArgs
from helixserve.engine.history import RequestHistory
from helixserve.engine.host_copy import from_host, to_host
from helixserve.engine.kv_blocks import Prefix, items_fit
from helixserve.engine.kv_cache import KVCacheLayout, PagedKVCache
from helixserve.engine.loader import load_range
from helixserve.engine.model import (
    AttentionPlan,
    LayerWeights,
    Linear,
    Rope,
    layer_forward,
    rms_norm,
)
from helixserve.engine.protocol import (
    ItemOutput,
    KvStats,
    WorkItem,
    check_step,
    kv_stats_of,
)
from helixserve.engine.sampling import (
    SamplingParams,
    sample_rows,
    score_tokens,
)
from helixserve.errors import UserError
from helixserve.prefix import CacheEvents
from helixserve.spec.scheduling import DEFAULT_KV_BLOCK_SIZE

DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP_BYTES = 2 * 1024**3
DEFAULT_CUDA_KV_FRACTION = 0.85  # of the memory left free after loading the weights

DENSE_DECODE_MAX_BYTES = 1024**3
PROMPT_LOGPROBS_ROWS = 128
"""Prompt rows per lm_head call when scoring a prompt: bounds the [rows, vocab] float32 logits."""
DENSE_DECODE_CAP_STEP = 32

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass
class DenseContexts:
    """Dense copies of the decode contexts of the requests of an all-decode step."""

    ids: tuple[str, ...]
    """The requests, in the order of the step's rows."""
    positions: list[int]
    """Position of each request's token in that step."""
    kv: torch.Tensor
    """[local_layers, 2 (keys, values), d, kv_heads, cap, head_dim]; positions past a
    request's length are finite (masked out)."""


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"--dtype: unknown '{dtype}'; known: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = torch.device("meta")  # not a device name at all: reported below
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device: unknown '{device}'; known: cpu, cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device: '{device}' requested but CUDA is not available")
    return dev


def default_kv_budget_bytes(device: torch.device) -> int:
    """A fraction of free memory: 85% of free GPU memory, or 25% of available RAM capped at 2 GiB."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_KV_FRACTION)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(available * DEFAULT_CPU_KV_FRACTION, DEFAULT_CPU_KV_CAP_BYTES))


def _release_freed_heap() -> None:
    """Give the loader's freed buffers (plain weights replaced by repacked ones) back to
    the OS; glibc keeps them in its heap otherwise, and the RSS would not show that a
    shard's memory follows its range."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


class ShardEngine:
    """A contiguous layer range of one model on one device, with its paged KV cache."""

    engine_name = "torch"

    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, torch.Tensor],
        start_layer: int,
        end_layer: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_KV_BLOCK_SIZE,
        reuse_layers: dict[int, LayerWeights] | None = None,
        allocate_kv: bool = True,
        prefix_caching: bool = True,
    ) -> None:
        self.args = args
        self.prefix_caching = prefix_caching
        self.num_model_layers = args.num_layers
        self.start_layer, self.end_layer = start_layer, end_layer
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        self.eos_token_ids = list(args.eos_token_ids)
        self.device, self.dtype = device, dtype
        self.is_first = start_layer == 0
        self.is_last = end_layer == args.num_layers
        self.loaded_tensor_names = sorted(weights)
        # Consume `weights` tensor by tensor, so re-laid-out copies never double the peak.
        w = weights
        embed = w.pop("model.embed_tokens.weight", None)  # [vocab, hidden]
        lm_head = w.pop("lm_head.weight", None)  # [vocab, hidden]; the embedding if tied
        self.final_norm = w.pop("model.norm.weight", None)  # [hidden]
        self.lm_head: Linear | None = None  # hidden -> vocab
        self.embed: torch.Tensor | None = embed if self.is_first else None  # [vocab, hidden]
        if lm_head is not None:
            self.lm_head = Linear(lm_head, single=True)
        del embed, lm_head
        reuse = reuse_layers or {}
        self.layers = [reuse[i] if i in reuse else LayerWeights.from_tensors(w, i, args)
                       for i in range(start_layer, end_layer)]
        self.rope = Rope(args, device, dtype)
        self._kv_layout = KVCacheLayout(
            num_layers=end_layer - start_layer,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            block_size=block_size,
            dtype=dtype,
        )
        self._seq_len: dict[str, int] = {}
        self._history: dict[str, RequestHistory] = {}
        self._dense: DenseContexts | None = None
        """Dense decode contexts of the last all-decode step; valid only for the very next step."""
        self.kv: PagedKVCache
        if allocate_kv:
            self.allocate_kv(kv_cache_bytes)
        else:  # a placeholder of one block until `allocate_kv`
            self.kv = PagedKVCache(self._kv_layout, 1, device, prefix_caching)
        self._generator = torch.Generator(device=device)
        """Unseeded requests' draws (seeded ones have their own generator)."""
        self._generator.manual_seed(random.SystemRandom().getrandbits(62))
        self.last_logits: torch.Tensor | None = None
        """Logits of the rows sampled in the last step, [num_sampled, vocab] (tests, debugging)."""

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        start_layer: int,
        end_layer: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        kv_cache_bytes: int | None = None,
        block_size: int = DEFAULT_KV_BLOCK_SIZE,
        prefix_caching: bool = True,
    ) -> ShardEngine:
        """Load only the tensors of [start_layer, end_layer) from an HF dir or a GGUF file."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        loaded = load_range(Path(model_dir), start_layer, end_layer, dt, dev)
        args, tensors = loaded.args, loaded.tensors
        del loaded
        engine = cls(
            args,
            tensors,
            start_layer,
            end_layer,
            dev,
            dt,
            kv_cache_bytes=kv_cache_bytes,
            block_size=block_size,
            prefix_caching=prefix_caching,
        )
        _release_freed_heap()
        return engine

    @classmethod
    def load_beside(
        cls,
        old: ShardEngine,
        model_dir: str | Path,
        start_layer: int,
        end_layer: int,
    ) -> tuple[ShardEngine, int]:
        """A shard of [start_layer, end_layer) of the same model, loaded while `old` keeps
        serving: layers both ranges hold are shared with `old` (not read again), the others
        are read from `model_dir`. Its KV cache is not allocated yet: `allocate_kv` once `old`
        has freed its own (so the two caches never coexist). Returns (engine, layers read)."""
        kept = {i: old.layers[i - old.start_layer]
                for i in range(max(start_layer, old.start_layer), min(end_layer, old.end_layer))}
        loaded = load_range(Path(model_dir), start_layer, end_layer, old.dtype, old.device,
                            skip_layers=frozenset(kept))
        if loaded.args.num_layers != old.num_model_layers:
            raise UserError(f"{model_dir}: {loaded.args.num_layers} layers, the running shard's "
                            f"model has {old.num_model_layers}")
        engine = cls(loaded.args, loaded.tensors, start_layer, end_layer, old.device, old.dtype,
                     block_size=old.kv.block_size, reuse_layers=kept, allocate_kv=False,
                     prefix_caching=old.prefix_caching)
        _release_freed_heap()
        return engine, end_layer - start_layer - len(kept)

    def allocate_kv(self, kv_cache_bytes: int | None = None) -> None:
        """(Re)allocate the paged KV cache: `kv_cache_bytes`, or the default share of the
        memory free now. Drops every request's KV and the prefix cache (the next
        `take_cache_events` says reset)."""
        self.kv = PagedKVCache(self._kv_layout, 1, self.device)  # the old cache freed first
        budget = (default_kv_budget_bytes(self.device) if kv_cache_bytes is None
                  else kv_cache_bytes)
        self.kv = PagedKVCache(self._kv_layout, self._kv_layout.num_blocks_for(budget),
                               self.device, self.prefix_caching)
        self._seq_len, self._history, self._dense = {}, {}, None

    def release_memory(self) -> None:
        """Drop the KV cache and the weights this shard holds alone (shared layers live on
        in the shard that took them over); the engine is unusable afterwards."""
        self.kv = PagedKVCache(self._kv_layout, 1, self.device, self.prefix_caching)
        self.layers = []
        self.embed = self.lm_head = self.final_norm = None
        self._seq_len, self._history, self._dense = {}, {}, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        _release_freed_heap()

    # ---- bookkeeping -------------------------------------------------------------------
    def kv_stats(self) -> KvStats:
        return kv_stats_of(self.kv)

    def take_cache_events(self) -> CacheEvents:
        """Prefix blocks stored and evicted since the last call (reset on the first)."""
        return self.kv.take_cache_events()

    def free(self, request_id: str) -> None:
        """Release a request's KV blocks and sampler state; idempotent."""
        self.kv.free(request_id)
        self._dense = None
        self._seq_len.pop(request_id, None)
        self._history.pop(request_id, None)

    def seq_len(self, request_id: str) -> int:
        """Tokens of this request held in this shard's KV cache (0 if unknown)."""
        return self._seq_len.get(request_id, 0)

    # ---- the step ----------------------------------------------------------------------
    def kv_fits(self, items: list[WorkItem]) -> bool:
        """Whether `step(items)` would find its KV blocks (changes nothing): the worker asks
        it to run the items that fit when a step is out of KV (runtime/worker.py)."""
        return items_fit(self.kv, items)

    @torch.inference_mode()
    def step(self, items: list[WorkItem]) -> list[ItemOutput]:
        """One batched forward over all items; outputs in the order of `items`."""
        if not items:
            return []
        prev_dense, self._dense = self._dense, None  # valid only if this step succeeds
        self._validate(items)
        prefixes = self._prefixes(items)  # PrefixMissError before anything changes
        # Reserve KV before computing: KvExhaustedError leaves every request as it was
        # (except a rewind the items themselves asked for).
        for it in items:
            rid = it.request_id
            if rid in prefixes:
                if self.kv.has(rid) or rid in self._seq_len:
                    self._rewind(rid, 0)  # known here: it starts over from its prefix
            elif it.position < self._seq_len.get(rid, 0):
                self._rewind(rid, it.position)
        self.kv.reserve({it.request_id: it.position + len(it.token_ids) for it in items},
                        prefixes)

        x = self._input_rows(items)  # [total_tokens, hidden]
        offsets = [0]
        for it in items:
            offsets.append(offsets[-1] + len(it.token_ids))
        plans: dict[tuple[int, ...], AttentionPlan] = {}
        dense = self._dense_contexts(items, prev_dense, plans)
        whole = all(
            it.start_layer == self.start_layer and it.end_layer == self.end_layer for it in items
        )
        everyone = tuple(range(len(items)))
        for layer in range(self.start_layer, self.end_layer):
            if whole:
                active = everyone
            else:
                active = tuple(
                    i for i, it in enumerate(items) if it.start_layer <= layer < it.end_layer
                )
                if not active:
                    continue
            if active not in plans:
                plans[active] = self._plan(items, active)
            plan = plans[active]
            local = layer - self.start_layer
            w = self.layers[local]
            kv = self.kv.kv[local]  # [2, kv_heads, slots, head_dim]
            if dense is not None:
                x = layer_forward(x, w, kv, plan, self.args, dense.kv[local])
            elif len(active) == len(items):
                x = layer_forward(x, w, kv, plan, self.args)
            else:
                rows = self._rows(offsets, active).to(self.device)
                x = x.index_copy(0, rows, layer_forward(x[rows], w, kv, plan, self.args))

        for it in items:
            self._seq_len[it.request_id] = it.position + len(it.token_ids)
            self.kv.commit(it.request_id, it.position, it.token_ids, it.start_layer,
                           it.end_layer)
        outs = self._outputs(items, offsets, x)
        self._dense = dense
        return outs

    def _dense_contexts(
        self,
        items: list[WorkItem],
        prev: DenseContexts | None,
        plans: dict[tuple[int, ...], AttentionPlan],
    ) -> DenseContexts | None:
        """Dense decode contexts for an all-decode step over all local layers, or None.

        Gathering every request's keys/values out of the paged cache each step (per
        layer) cost ~25% of a batch-32 decode step. When the same requests decode step
        after step, their contexts are kept in one dense [layers, 2, d, kv_heads, cap, hd]
        tensor, with spare capacity (up to DENSE_DECODE_CAP_STEP positions) into which each
        step writes its new token in place. The paged cache stays the source of truth: the
        dense copy is rebuilt from it whenever the batch changes, and grown (copied into a
        larger buffer) when the longest context reaches its capacity. It is not used when
        it would exceed DENSE_DECODE_MAX_BYTES.
        """
        ok = all(
            len(it.token_ids) == 1
            and it.position > 0
            and it.start_layer == self.start_layer
            and it.end_layer == self.end_layer
            for it in items
        )
        if not ok:
            return None
        ids = tuple(it.request_id for it in items)
        positions = [it.position for it in items]
        max_ctx = max(positions) + 1
        active = tuple(range(len(items)))
        plan = plans[active] = self._plan(items, active)
        a = self.args
        layers, d, bs = self.end_layer - self.start_layer, len(items), self.kv.block_size
        step = DENSE_DECODE_CAP_STEP
        cap = -(-max_ctx // step) * step
        elem = torch.empty((), dtype=self.dtype).element_size()
        if 2 * layers * d * a.num_kv_heads * cap * a.head_dim * elem > DENSE_DECODE_MAX_BYTES:
            return None
        plan.dense_rows = torch.arange(d, device=self.device)
        plan.dense_pos = from_host(positions, self.device)
        # Attend to positions <= each row's own; the rest of the capacity is masked.
        past = torch.arange(cap, device=self.device)[None, :] > plan.dense_pos[:, None]
        bias = torch.zeros(d, a.num_kv_heads, 1, cap, dtype=self.dtype, device=self.device)
        plan.dense_bias = bias.masked_fill_(past[:, None, None, :], float("-inf")).view(
            d * a.num_kv_heads, 1, cap
        )
        same = (
            prev is not None
            and prev.ids == ids
            and all(p == q + 1 for p, q in zip(positions, prev.positions, strict=True))
        )
        if same and prev is not None:
            have = prev.kv.shape[4]
            if cap == have:
                return DenseContexts(ids, positions, prev.kv)
            # Grow: copy into a larger buffer; the new positions are zeros (masked, finite).
            grown = torch.empty(
                (layers, 2, d, a.num_kv_heads, cap, a.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            grown[:, :, :, :, :have] = prev.kv
            grown[:, :, :, :, have:] = 0
            return DenseContexts(ids, positions, grown)
        dkv = torch.empty(
            (layers, 2, d, a.num_kv_heads, cap, a.head_dim), dtype=self.dtype, device=self.device
        )
        blocks = self.kv.context_blocks(list(ids), max_ctx).reshape(-1)  # [d * nb]
        n = min(blocks.shape[0] // d * bs, cap)
        # Positions past a request's length are masked, but must be finite: the gathered
        # blocks hold finite values (zeroed when handed out), the rest is zeroed here.
        dkv[:, :, :, :, n:] = 0
        for local in range(layers):
            g = self.kv.kv[local].view(2, a.num_kv_heads, -1, bs * a.head_dim)
            g = g.index_select(2, blocks).view(2, a.num_kv_heads, d, -1, a.head_dim)
            dkv[local, :, :, :, :n] = g[:, :, :, :n].transpose(1, 2)
        return DenseContexts(ids, positions, dkv)

    def _validate(self, items: list[WorkItem]) -> None:
        check_step(items, self, lambda rid: self._seq_len.get(rid, 0))

    def _prefixes(self, items: list[WorkItem]) -> dict[str, Prefix]:
        """The cached prefixes the items' new requests take; PrefixMissError (or, without
        prefix caching, a miss of every block) before anything changes."""
        out: dict[str, Prefix] = {}
        for it in items:
            if it.prefix_token_ids:
                p = Prefix(it.prefix_token_ids, it.start_layer, it.end_layer)
                self.kv.check_prefix(it.request_id, p)
                out[it.request_id] = p
        return out

    def _rewind(self, request_id: str, position: int) -> None:
        """The coordinator restarts a request from an earlier position (e.g. re-prefill)."""
        self.kv.truncate(request_id, position)
        self._seq_len[request_id] = position
        if position == 0:
            self._history.pop(request_id, None)

    def _input_rows(self, items: list[WorkItem]) -> torch.Tensor:
        """x: [total_tokens, hidden]. One embedding call over every row (rows that bring
        hidden states look up token 0, then are overwritten), one host-to-device copy of the
        brought hidden states and one scatter of them; no per-item copies."""
        ids: list[int] = []
        brought: list[torch.Tensor] = []
        brought_rows: list[int] = []
        for it in items:
            if it.start_layer == 0:
                ids += it.token_ids
            else:
                assert isinstance(it.hidden, torch.Tensor), "wire hidden states are tensors here"
                brought.append(it.hidden)  # [num_tokens, hidden], on the host
                brought_rows += range(len(ids), len(ids) + len(it.token_ids))
                ids += [0] * len(it.token_ids)
        host = brought[0] if len(brought) == 1 else torch.cat(brought) if brought else None
        hidden = None if host is None else host.to(device=self.device, dtype=self.dtype)
        if hidden is not None and len(brought_rows) == len(ids):
            return hidden
        assert self.embed is not None, "layer 0 is held, so the embedding is loaded"
        x = F.embedding(from_host(ids, self.device), self.embed)
        if hidden is not None:
            x.index_copy_(0, from_host(brought_rows, self.device), hidden)
        return x

    @staticmethod
    def _rows(offsets: list[int], active: tuple[int, ...]) -> torch.Tensor:
        rows: list[int] = []
        for i in active:
            rows.extend(range(offsets[i], offsets[i + 1]))
        return torch.tensor(rows, dtype=torch.long)

    def _plan(self, items: list[WorkItem], active: tuple[int, ...]) -> AttentionPlan:
        """Slots, positions and attention groups of the active items, shared by their layers."""
        dev = self.device
        slots: list[int] = []
        positions: list[int] = []
        decode_rows: list[int] = []
        decode_ids: list[str] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, torch.Tensor | None]] = []
        row = 0
        for i in active:
            it = items[i]
            n = len(it.token_ids)
            end = it.position + n
            slots += self.kv.slot_ids(it.request_id, it.position, n)
            positions += range(it.position, end)
            if n == 1:
                decode_rows.append(row)
                decode_ids.append(it.request_id)
                decode_lens.append(end)
            elif it.position == 0:
                prefills.append((row, n, None))
            else:
                prefills.append((row, n, self.kv.context_slots([it.request_id], end)[0]))
            row += n
        d_rows = d_blocks = d_mask = None
        max_ctx = 0
        if decode_rows:
            max_ctx = max(decode_lens)
            d_rows = from_host(decode_rows, dev)
            d_blocks = self.kv.context_blocks(decode_ids, max_ctx).reshape(-1)  # [d * nb]
            if min(decode_lens) != max_ctx:
                lens = from_host(decode_lens, dev)
                d_mask = torch.arange(max_ctx, device=dev)[None, :] < lens[:, None]
                d_mask = d_mask[:, None, None, :]  # [d, 1, 1, max_ctx]
        pos_t = from_host(positions, dev)
        cos, sin = self.rope.qkv_tables(pos_t, max(positions))
        return AttentionPlan(
            slots=from_host(slots, dev),
            cos=cos,
            sin=sin,
            decode_rows=d_rows,
            decode_ctx_blocks=d_blocks,
            block_size=self.kv.block_size,
            decode_max_ctx=max_ctx,
            decode_mask=d_mask,
            prefills=prefills,
            all_decode=len(decode_rows) == row,
        )

    def _outputs(
        self, items: list[WorkItem], offsets: list[int], x: torch.Tensor
    ) -> list[ItemOutput]:
        outs = [ItemOutput(it.request_id) for it in items]
        to_sample: list[int] = []
        self._hidden_outputs(items, offsets, x, outs)
        for i, it in enumerate(items):
            if it.end_layer < self.num_model_layers:
                continue
            hist = self._history.setdefault(it.request_id, RequestHistory())
            self._record_tokens(hist, it)
            if it.sampling is not None and it.sampling.prompt_logprobs is not None:
                # x rows of the item: [num_tokens, hidden]
                self._score_prompt(it, hist, x[offsets[i] : offsets[i + 1]])
                if it.sample and not hist.sampled_once:
                    outs[i].prompt_logprobs, hist.prompt_logprobs = hist.prompt_logprobs, []
            if it.sample:
                to_sample.append(i)
        if to_sample:
            assert self.final_norm is not None and self.lm_head is not None
            last_rows = [offsets[i + 1] - 1 for i in to_sample]
            rows = x if len(last_rows) == x.shape[0] else x[from_host(last_rows, self.device)]
            h = rms_norm(rows, self.final_norm, self.args.rms_norm_eps)
            logits = self.lm_head(h)  # [num_sampled, vocab]
            self.last_logits = logits
            params = [items[i].sampling or SamplingParams() for i in to_sample]
            hists = [self._history[items[i].request_id] for i in to_sample]
            results = sample_rows(logits, params, hists, self._generator)
            for i, res in zip(to_sample, results, strict=True):
                outs[i].token_id, outs[i].logprob = res.token_id, res.logprob
                outs[i].top_logprobs = res.top_logprobs
                self._history[items[i].request_id].sampled_once = True
        return outs

    def _hidden_outputs(self, items: list[WorkItem], offsets: list[int], x: torch.Tensor,
                        outs: list[ItemOutput]) -> None:
        """The hidden states of the items that end before the model's last layer, taken off
        the device in one copy (pinned, on this engine thread); each output is a view of it.
        x: [total_tokens, hidden]."""
        leaving = [i for i, it in enumerate(items) if it.end_layer < self.num_model_layers]
        if not leaving:
            return
        if len(leaving) == len(items):
            host, starts = to_host(x), offsets
        else:
            rows: list[int] = []
            starts = [0] * (len(items) + 1)
            for i in leaving:
                starts[i] = len(rows)
                rows.extend(range(offsets[i], offsets[i + 1]))
            host = to_host(x[from_host(rows, self.device)])
        for i in leaving:
            n = offsets[i + 1] - offsets[i]
            outs[i].hidden = host[starts[i] : starts[i] + n]  # [num_tokens, hidden]

    @staticmethod
    def _prompt_end(it: WorkItem, hist: RequestHistory) -> int | None:
        """Position one past the prompt's last token, or None while it goes on after this item."""
        if it.num_prompt_tokens is not None:
            return it.num_prompt_tokens
        if hist.sampled_once:
            return 0
        return it.position + len(it.token_ids) if it.sample else None

    def _score_prompt(self, it: WorkItem, hist: RequestHistory, x: torch.Tensor) -> None:
        """Log-softmax of the prompt rows of one item; row j scores the token at position
        position + j + 1. The row before a chunk boundary waits for the next chunk's first
        token (`pending_prompt_row`). x: [num_tokens, hidden], before the final norm."""
        assert it.sampling is not None and it.sampling.prompt_logprobs is not None
        top_n = it.sampling.prompt_logprobs
        pos, n = it.position, len(it.token_ids)
        prompt_end = self._prompt_end(it, hist)
        pending, hist.pending_prompt_row = hist.pending_prompt_row, None
        if prompt_end is not None and pos >= prompt_end:
            return
        if pending is not None and pending[0] == pos:
            hist.prompt_logprobs += score_tokens(pending[1][None], it.token_ids[:1], top_n)
        # Rows whose next token is a prompt token: all of them if the prompt goes on past
        # this item, else up to the one before the prompt's last token.
        rows = n if prompt_end is None or prompt_end > pos + n else prompt_end - pos - 1
        assert self.final_norm is not None and self.lm_head is not None
        for a in range(0, rows, PROMPT_LOGPROBS_ROWS):
            b = min(rows, a + PROMPT_LOGPROBS_ROWS)
            h = rms_norm(x[a:b], self.final_norm, self.args.rms_norm_eps)
            logprobs = torch.log_softmax(self.lm_head(h).float(), dim=-1)  # [b - a, vocab]
            targets = it.token_ids[a + 1 : b + 1]  # one short at the item's last row
            hist.prompt_logprobs += score_tokens(logprobs[: len(targets)], targets, top_n)
            if len(targets) < b - a:
                hist.pending_prompt_row = (pos + n, logprobs[-1].clone())

    @staticmethod
    def _record_tokens(hist: RequestHistory, it: WorkItem) -> None:
        """The item's tokens into the request's history; for a request that took a prefix
        from the cache, the prefix's tokens first (prompt ones, and generated ones past
        num_prompt_tokens), as if it had been computed."""
        if it.prefix_token_ids:
            _add_tokens(hist, 0, it.prefix_token_ids, it.num_prompt_tokens)
        _add_tokens(hist, it.position, it.token_ids, it.num_prompt_tokens)


def _add_tokens(hist: RequestHistory, position: int, token_ids: list[int],
                num_prompt_tokens: int | None) -> None:
    """Tokens at [position, ...) into a history: prompt or generated ones."""
    if num_prompt_tokens is None:
        hist.add_tokens(token_ids, generated=hist.sampled_once)
        return
    split = max(0, min(len(token_ids), num_prompt_tokens - position))
    hist.add_tokens(token_ids[:split], generated=False)
    hist.add_tokens(token_ids[split:], generated=True)
