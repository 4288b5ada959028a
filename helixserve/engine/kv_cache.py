"""Paged KV cache: fixed-size blocks, one block table per request.

The block bookkeeping is `BlockAllocator` (kv_blocks.py, torch-free); this adds the memory.
All memory is allocated once, at start, from a byte budget: for every layer this shard
holds, a key and a value tensor of `num_blocks * block_size` token slots. A block is a run
of `block_size` consecutive slots and covers the same slots in every local layer, so one
block table per request serves all layers (as in vLLM). A request grows block by block as
its sequence grows; `free` returns its blocks. Asking for more blocks than are free raises
`KvExhaustedError` (engine/errors.py) before anything is changed, so a full cache never
corrupts state. With prefix caching the allocator also keeps full blocks of gone requests,
named, for later requests to share (kv_blocks.py): a block handed out fresh is zeroed,
whether it was never used or evicted from the cache; a block attached from the cache keeps
its KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helixserve.engine.host_copy import from_host
from helixserve.engine.kv_blocks import BlockAllocator, Prefix


@dataclass(frozen=True)
class KVCacheLayout:
    """Sizes that fix the cache's memory: layers * 2 * slots * kv_heads * head_dim * elem bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all local layers, keys and values."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(0, int(budget_bytes) // self.block_bytes)


class PagedKVCache(BlockAllocator):
    """Preallocated key/value slots plus the block bookkeeping (BlockAllocator)."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int, device: torch.device,
                 prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: one block needs {layout.block_bytes} bytes"
            )
        super().__init__(num_blocks, layout.block_size, prefix_caching)
        self.layout = layout
        num_slots = num_blocks * layout.block_size
        shape = (layout.num_layers, 2, layout.num_kv_heads, num_slots, layout.head_dim)
        # kv: [num_local_layers, 2 (keys, values), num_kv_heads, num_slots, head_dim], one
        # tensor so that a layer's new keys and values are stored by one index_copy_.
        # k, v: views [num_local_layers, num_kv_heads, num_slots, head_dim]. Heads first,
        # so that gathering a request's slots yields [kv_heads, ctx, head_dim] for SDPA.
        # torch.empty: on CPU, pages become resident only when blocks are first used;
        # blocks are zeroed when handed out (see `reserve`).
        self.kv = torch.empty(shape, dtype=layout.dtype, device=device)
        self.k = self.kv[:, 0]
        self.v = self.kv[:, 1]
        self.device = device

    def reserve(self, demands: dict[str, int],
                prefixes: dict[str, Prefix] | None = None) -> list[int]:
        """BlockAllocator.reserve, and the fresh blocks zeroed (evicted cached ones too; the
        attached ones keep their KV)."""
        fresh = super().reserve(demands, prefixes)
        if fresh:
            self._zero_blocks(fresh)
        return fresh

    def _copy_block(self, src: int, dst: int) -> None:
        """A request's own copy of a shared block it rewinds into (BlockAllocator.truncate)."""
        bs = self.block_size
        self.kv[:, :, :, dst * bs : (dst + 1) * bs] = self.kv[:, :, :, src * bs : (src + 1) * bs]

    def _zero_blocks(self, blocks: list[int]) -> None:
        """Zero new blocks: padded attention reads unwritten slots (masked out), and
        uninitialized memory could hold NaN, which a mask does not cancel (0 * NaN)."""
        bs = self.block_size
        # Slice assignment per block: index_fill_ along the block dim of a 5-D view walked
        # the whole cache (~5 ms a call on the dev CPU); these are a few small writes.
        for b in blocks:
            self.kv[:, :, :, b * bs : (b + 1) * bs].zero_()

    # ---- slot indices ------------------------------------------------------------------
    def slot_ids(self, request_id: str, start: int, num_tokens: int) -> list[int]:
        """Flat slot index of each token position in [start, start + num_tokens)."""
        table = self._tables[request_id]
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    def context_blocks(self, request_ids: list[str], ctx_len: int) -> torch.Tensor:
        """Blocks holding positions [0, ctx_len) of each request: [len(request_ids), nb].

        nb = ceil(ctx_len / block_size); a request with fewer blocks is padded with its
        first block (finite values; the caller masks them out).
        """
        num_blocks = -(-ctx_len // self.block_size)
        rows = []
        for rid in request_ids:
            table = self._tables[rid]
            rows.append(table[:num_blocks] + [table[0]] * (num_blocks - len(table)))
        return from_host(rows, self.device)  # [r, nb]

    def context_slots(self, request_ids: list[str], ctx_len: int) -> torch.Tensor:
        """Slots of positions [0, ctx_len) of each request: [len(request_ids), ctx_len].

        A request with fewer tokens is padded with its own slots (blocks it owns, or its
        first block repeated), which hold finite values; the caller masks them out.
        """
        bs = self.block_size
        num_blocks = -(-ctx_len // bs)
        rows = []
        for rid in request_ids:
            table = self._tables[rid]
            rows.append(table[:num_blocks] + [table[0]] * (num_blocks - len(table)))
        tables = from_host(rows, self.device)  # [r, num_blocks]
        offsets = torch.arange(bs, device=self.device)
        slots = (tables[:, :, None] * bs + offsets).view(len(request_ids), num_blocks * bs)
        return slots[:, :ctx_len]
