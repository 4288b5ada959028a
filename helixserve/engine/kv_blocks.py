"""Paged KV bookkeeping: fixed-size blocks, one block table per request. Torch-free.

A cache of `num_blocks` blocks of `block_size` token slots. A request's table grows block by
block as its sequence grows (`reserve`), shrinks when it is rewound (`truncate`) and is
returned whole by `free`. `reserve` of more blocks than are free raises KvExhaustedError
before anything changes, so a full cache never corrupts state. The torch engine's
`PagedKVCache` (kv_cache.py) is this plus the key/value tensors; the emulated engine uses it
as is: the same admission, growth and exhaustion, without the memory.
"""

from __future__ import annotations

from helixserve.engine.errors import KvExhaustedError


class BlockAllocator:
    """Free list and per-request block tables of a paged KV cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("KV cache budget too small: not even one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # A stack, so recently freed (cache-warm) blocks are reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

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

    def reserve(self, demands: dict[str, int]) -> list[int]:
        """Grow each request's table to hold the given total token counts, all or nothing;
        returns the blocks handed out."""
        needed = {rid: self.blocks_needed(rid, n) for rid, n in demands.items()}
        total = sum(needed.values())
        if total > len(self._free):
            raise KvExhaustedError(
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
        return fresh

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
