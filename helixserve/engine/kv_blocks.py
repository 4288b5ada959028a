"""Paged KV bookkeeping: fixed-size blocks, one block table per request, and the prefix
cache of full blocks. Torch-free.

A cache of `num_blocks` blocks of `block_size` token slots. A request's table grows block by
block as its sequence grows (`reserve`), shrinks when it is rewound (`truncate`) and is
returned whole by `free`. `reserve` of more blocks than are free raises KvExhaustedError
before anything changes, so a full cache never corrupts state. The torch engine's
`PagedKVCache` (kv_cache.py) is this plus the key/value tensors; the emulated engine uses it
as is: the same admission, growth, exhaustion and caching, without the memory.

Prefix caching (`prefix_caching=True`; docs/prefix-caching.md), as vLLM's automatic prefix
caching:

- Every block has a reference count: the requests whose tables hold it.
- The engine reports the tokens whose KV a step wrote (`commit`). Each block of a request
  that is full now is named (prefix.extend_hashes: its tokens, all tokens before it, the
  layer span that computed it) and cached: the name maps to the block. If another block
  already holds that name, that one stays the cached one and this copy stays private.
- A cached block outlives its requests: at reference 0 it is evictable, kept in an LRU, and
  counted as free. `reserve` takes never-cached free blocks first, then evicts the least
  recently used cached ones (a request's last blocks are released first, so a prefix's tail
  goes before its head). A block some request holds is never evicted.
- A new request whose first blocks are cached takes them (`reserve(..., prefixes=...)` /
  `attach`): reference + 1, out of the LRU; its KV is not computed again. All of a step's
  attaches and growth are all or nothing: PrefixMissError (a name not cached) or
  KvExhaustedError before any change.
- A rewind into the middle of a cached block would overwrite KV that the block's name
  promises: the block is un-cached when the request holds it alone, and copied to a private
  block first when others share it (`_copy_block`, the torch cache copies the slots).

Stored and removed names go to a `prefix.CacheEventLog` (`take_cache_events`), which the
worker reports to the scheduling core. Without prefix caching the allocator names nothing,
keeps no tokens and behaves as a plain free list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from helixserve.engine.errors import InvalidWorkError, KvExhaustedError, PrefixMissError
from helixserve.prefix import (
    BlockHash,
    CacheEventLog,
    CacheEvents,
    block_hashes,
    extend_hashes,
)


@dataclass(frozen=True)
class Prefix:
    """Tokens [0, len(token_ids)) of a new request to take from the prefix cache: whole
    blocks, computed on layers [start_layer, end_layer) (a WorkItem's prefix_token_ids)."""

    token_ids: Sequence[int]
    start_layer: int
    end_layer: int


@dataclass
class _Written:
    """The tokens a request's KV holds, in order, and the names of its full blocks."""

    span: tuple[int, int] | None
    """Layers that computed them; None: mixed spans, so its blocks are never named."""
    tokens: list[int] = field(default_factory=list)
    names: list[BlockHash] = field(default_factory=list)


class BlockAllocator:
    """Free list, per-request block tables and the prefix cache of a paged KV cache."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("KV cache budget too small: not even one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        # A stack, so recently freed (cache-warm) blocks are reused first. Never-cached
        # blocks only; evictable cached ones wait in `_lru`.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._ref = [0] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self._name_of: dict[int, BlockHash] = {}
        # Cached blocks at reference 0, least recently released first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._written: dict[str, _Written] = {}
        self._log = CacheEventLog()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks a reserve may take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks some request holds."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Cached blocks no request holds (evictable; also counted in free_blocks)."""
        return len(self._lru)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ---- requests ----------------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def refcount(self, block: int) -> int:
        """Requests holding `block`."""
        return self._ref[block]

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks a request needs to hold `num_tokens` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        want = -(-num_tokens // self.block_size)
        return max(0, want - have)

    # ---- the prefix cache --------------------------------------------------------------
    def is_cached(self, name: BlockHash) -> bool:
        return name in self._block_of

    def cached_block(self, name: BlockHash) -> int | None:
        """The block cached under `name`, or None."""
        return self._block_of.get(name)

    def prefix_names(self, token_ids: Sequence[int], start_layer: int,
                     end_layer: int) -> list[BlockHash]:
        """Names of the full blocks of `token_ids` computed on [start_layer, end_layer)."""
        return block_hashes(token_ids, self.block_size, start_layer, end_layer)

    def check_prefix(self, request_id: str, prefix: Prefix) -> list[BlockHash]:
        """The names of `prefix`'s blocks, all cached here; else InvalidWorkError (not whole
        blocks) or PrefixMissError naming the missing ones (all of them when caching is
        off). Changes nothing."""
        n = len(prefix.token_ids)
        if n % self.block_size:
            raise InvalidWorkError(f"request {request_id!r}: a prefix of {n} tokens is not "
                                   f"whole blocks of {self.block_size}")
        names = self.prefix_names(prefix.token_ids, prefix.start_layer, prefix.end_layer)
        missing = [h for h in names if h not in self._block_of]
        if missing:
            raise PrefixMissError(request_id, missing)
        return names

    def take_cache_events(self) -> CacheEvents:
        """Names stored and removed since the last call (reset on the first)."""
        return self._log.take()

    # ---- growth and release ------------------------------------------------------------
    def reserve(self, demands: dict[str, int],
                prefixes: dict[str, Prefix] | None = None) -> list[int]:
        """Attach each new request's cached `prefixes`, then grow each request's table to
        hold the given total token counts; all or nothing (PrefixMissError, InvalidWorkError
        or KvExhaustedError change nothing). Returns the blocks handed out fresh (never the
        attached ones, whose KV is kept)."""
        attach, needed, total, available = self._plan(demands, prefixes)
        if total > available:
            raise KvExhaustedError(
                f"KV cache full: step needs {total} more blocks of {self.block_size} tokens "
                f"({', '.join(f'{r}: {n}' for r, n in needed.items() if n)}) but only "
                f"{available} of {self.num_blocks} are free "
                f"(capacity {self.capacity_tokens} tokens)",
                needed_blocks=total,
                free_blocks=available,
            )
        for rid, (prefix, names, blocks) in attach.items():
            for b in blocks:
                self._ref[b] += 1
                self._lru.pop(b, None)
            self._tables[rid] = list(blocks)
            if self.prefix_caching:
                self._written[rid] = _Written((prefix.start_layer, prefix.end_layer),
                                              list(prefix.token_ids), names)
        fresh: list[int] = []
        for rid, n in needed.items():
            table = self._tables.setdefault(rid, [])
            for _ in range(n):
                table.append(self._take_block())
                fresh.append(table[-1])
        return fresh

    def fits(self, demands: dict[str, int], prefixes: dict[str, Prefix] | None = None) -> bool:
        """Whether `reserve(demands, prefixes)` would find its blocks free; changes nothing.
        A prefix `reserve` would refuse for another reason (PrefixMissError,
        InvalidWorkError) counts as fitting: `reserve` says why."""
        try:
            _, _, total, available = self._plan(demands, prefixes)
        except (PrefixMissError, InvalidWorkError):
            return True
        return total <= available

    def _plan(self, demands: dict[str, int], prefixes: dict[str, Prefix] | None
              ) -> tuple[dict[str, tuple[Prefix, list[BlockHash], list[int]]], dict[str, int],
                         int, int]:
        """What `reserve` takes: the prefixes' cached blocks to attach, the fresh blocks each
        request needs, their total and the blocks free for them."""
        attach: dict[str, tuple[Prefix, list[BlockHash], list[int]]] = {}
        for rid, prefix in (prefixes or {}).items():
            if self._tables.get(rid):
                raise InvalidWorkError(f"request {rid!r}: a prefix for a request whose KV this "
                                       "cache already holds")
            names = self.check_prefix(rid, prefix)
            attach[rid] = (prefix, names, [self._block_of[h] for h in names])
        # Attached blocks at reference 0 leave the evictable pool.
        pinned = {b for _, _, blocks in attach.values() for b in blocks if self._ref[b] == 0}
        needed = {}
        for rid, n in demands.items():
            have = len(attach[rid][2]) if rid in attach else len(self._tables.get(rid, ()))
            needed[rid] = max(0, -(-n // self.block_size) - have)
        return attach, needed, sum(needed.values()), self.free_blocks - len(pinned)

    def attach(self, request_id: str, prefix: Prefix) -> None:
        """Give a new request the cached blocks of `prefix` (shared, reference + 1)."""
        self.reserve({}, {request_id: prefix})

    def commit(self, request_id: str, position: int, token_ids: Sequence[int],
               start_layer: int, end_layer: int) -> list[BlockHash]:
        """Tokens [position, position + len(token_ids)) of a request now have their KV
        written for layers [start_layer, end_layer): name and cache the blocks that are full
        now. Returns the names newly stored (none without prefix caching)."""
        table = self._tables.get(request_id)
        if not self.prefix_caching or table is None:
            return []
        span = (start_layer, end_layer)
        w = self._written.get(request_id)
        if w is None:
            # A sequence first seen at `position` > 0 has tokens this cache never saw.
            w = self._written[request_id] = _Written(span if position == 0 else None)
        if w.span != span or len(w.tokens) != position:
            w.span, w.tokens, w.names = None, [], []
            return []
        w.tokens.extend(token_ids)
        first = len(w.names)
        stored: list[BlockHash] = []
        for i, h in enumerate(extend_hashes(w.names, w.tokens, self.block_size, *span), first):
            b = table[i]
            if b in self._name_of or h in self._block_of:
                continue  # attached from the cache, or a private copy of a cached block
            self._block_of[h], self._name_of[b] = b, h
            self._log.stored(h)
            stored.append(h)
        return stored

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Drop blocks past `num_tokens` tokens (a request rewound, e.g. re-prefilled).
        KvExhaustedError, changing nothing, when the block the rewind ends in is a cached
        one other requests share and no block is free for the request's own copy."""
        table = self._tables.get(request_id)
        if table is None:
            return
        bs = self.block_size
        keep = -(-num_tokens // bs)
        partial = table[keep - 1] if num_tokens % bs and keep <= len(table) else None
        if partial is not None and partial in self._name_of:
            # Slots [num_tokens % bs, bs) of this block will be written again.
            if self._ref[partial] == 1:
                self._uncache(partial)
            else:
                if not self.free_blocks:
                    raise KvExhaustedError(
                        f"KV cache full: rewinding {request_id!r} to {num_tokens} tokens needs "
                        f"a copy of a shared block, but none of {self.num_blocks} is free",
                        needed_blocks=1, free_blocks=0)
                own = self._take_block()
                self._copy_block(partial, own)
                table[keep - 1] = own
                self._release(partial)
        while len(table) > keep:
            self._release(table.pop())
        w = self._written.get(request_id)
        if w is not None:
            if num_tokens == 0:
                del self._written[request_id]
            else:
                del w.tokens[num_tokens:], w.names[num_tokens // bs:]

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks; a no-op for an unknown request. Its cached
        blocks stay cached (evictable), its last block first in line for eviction."""
        table = self._tables.pop(request_id, None)
        self._written.pop(request_id, None)
        for b in reversed(table or ()):
            self._release(b)

    # ---- internals ---------------------------------------------------------------------
    def _take_block(self) -> int:
        """A block for one request (reference 1): a never-cached one if any, else the least
        recently used cached one, evicted. The caller has checked that one is free."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            self._uncache(b)
        self._ref[b] = 1
        return b

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block]:
            return
        if block in self._name_of:
            self._lru[block] = None
        else:
            self._free.append(block)

    def _uncache(self, block: int) -> None:
        name = self._name_of.pop(block)
        del self._block_of[name]
        self._log.removed(name)

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy a block's KV (nothing to copy here; the torch cache copies its slots)."""


def items_fit(kv: BlockAllocator, items: Sequence[Any]) -> bool:
    """Whether an engine step over `items` (engine WorkItems) would find its KV blocks in
    `kv`: the demands and prefixes the emulated and torch engines reserve, checked without
    changing anything (`BlockAllocator.fits`). Conservative for a request the step rewinds or
    restarts from a prefix (the blocks that would free first are not counted)."""
    demands = {it.request_id: it.position + len(it.token_ids) for it in items}
    prefixes = {it.request_id: Prefix(it.prefix_token_ids, it.start_layer, it.end_layer)
                for it in items if it.prefix_token_ids}
    return kv.fits(demands, prefixes)
