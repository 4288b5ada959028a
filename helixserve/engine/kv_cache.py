"""Paged KV cache: fixed-size blocks, one block table per request.

All memory is allocated once, at start, from a byte budget: for every layer this shard
holds, a key and a value tensor of `num_blocks * block_size` token slots. A block is a run
of `block_size` consecutive slots and covers the same slots in every local layer, so one
block table per request serves all layers (as in vLLM). A request grows block by block as
its sequence grows; `free` returns its blocks. Asking for more blocks than are free raises
`KVCacheFullError` before anything is changed, so a full cache never corrupts state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCacheFullError(RuntimeError):
    """Not enough free KV blocks for a step; nothing was allocated."""

    def __init__(self, message: str, needed_blocks: int = 0, free_blocks: int = 0) -> None:
        super().__init__(message)
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


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


class PagedKVCache:
    """Preallocated key/value slots plus the block bookkeeping."""

    def __init__(self, layout: KVCacheLayout, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: one block needs {layout.block_bytes} bytes"
            )
        self.layout = layout
        self.block_size = layout.block_size
        self.num_blocks = num_blocks
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
        # A stack, so recently freed (cache-warm) blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    # ---- bookkeeping -------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks a request needs to hold `num_tokens` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        want = -(-num_tokens // self.block_size)
        return max(0, want - have)

    def reserve(self, demands: dict[str, int]) -> None:
        """Grow each request's table to hold the given total token counts, all or nothing."""
        needed = {rid: self.blocks_needed(rid, n) for rid, n in demands.items()}
        total = sum(needed.values())
        if total > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: step needs {total} more blocks of {self.block_size} tokens "
                f"({', '.join(f'{r}: {n}' for r, n in needed.items() if n)}) but only "
                f"{len(self._free)} of {self.num_blocks} are free "
                f"(capacity {self.capacity_tokens} tokens)",
                needed_blocks=total,
                free_blocks=len(self._free),
            )
        fresh: list[int] = []
        for rid, n in needed.items():
            table = self._tables.setdefault(rid, [])
            for _ in range(n):
                table.append(self._free.pop())
                fresh.append(table[-1])
        if fresh:
            self._zero_blocks(fresh)

    def _zero_blocks(self, blocks: list[int]) -> None:
        """Zero new blocks: padded attention reads unwritten slots (masked out), and
        uninitialized memory could hold NaN, which a mask does not cancel (0 * NaN)."""
        bs = self.block_size
        # Slice assignment per block: index_fill_ along the block dim of a 5-D view walked
        # the whole cache (~5 ms a call on the dev CPU); these are a few small writes.
        for b in blocks:
            self.kv[:, :, :, b * bs : (b + 1) * bs].zero_()

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Drop blocks past `num_tokens` tokens (a request rewound, e.g. re-prefilled)."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks; a no-op for an unknown request."""
        table = self._tables.pop(request_id, None)
        if table:
            self._free.extend(reversed(table))

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
        return torch.tensor(rows, dtype=torch.long, device=self.device)  # [r, nb]

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
        tables = torch.tensor(rows, dtype=torch.long, device=self.device)  # [r, num_blocks]
        offsets = torch.arange(bs, device=self.device)
        slots = (tables[:, :, None] * bs + offsets).view(len(request_ids), num_blocks * bs)
        return slots[:, :ctx_len]
