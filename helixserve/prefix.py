"""Prefix blocks: the names of full KV blocks, shared by the engines and the scheduling core.

Prefix caching keeps the KV of full blocks of `block_size` tokens after the request that
computed them is gone, so a later request whose prompt starts with the same tokens reuses
them instead of computing them again (vLLM's automatic prefix caching). A block's KV depends
on every token before it and on the layers that computed it, so a block is named by a hash
chain, as in vLLM's block hashing:

    root   = H("helixserve-prefix-v1", start_layer, end_layer, block_size)
    h[0]   = H(root   || tokens of block 0)
    h[i]   = H(h[i-1] || tokens of block i)

with H = BLAKE2b of 16 bytes. Two requests share block i on a node exactly when they share
tokens [0, (i+1) * block_size) and ran the same layers [start_layer, end_layer) there, so a
hop that runs a different span of a node's layers (partial inference) never reads KV that
was not computed for its layers. Only full blocks are named; the partial last block of a
sequence is never shared.

Engines name the blocks they fill (and report them stored / removed with `CacheEvents`);
the core (scheduler/prefix.py) names a new request's blocks the same way, per hop of a
candidate route, to count the tokens a route would reuse. Torch-free, no helixserve imports.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_HASH_BYTES = 16
"""Digest size: 128 bits, so that an accidental collision (which would hand one request
another's KV) is out of reach at any cache size."""

BlockHash = bytes


def chain_root(start_layer: int, end_layer: int, block_size: int) -> BlockHash:
    """The hash before block 0 for blocks computed on layers [start_layer, end_layer)."""
    seed = f"helixserve-prefix-v1:{start_layer}:{end_layer}:{block_size}".encode()
    return hashlib.blake2b(seed, digest_size=BLOCK_HASH_BYTES).digest()


def next_hash(parent: BlockHash, block_tokens: Sequence[int]) -> BlockHash:
    """The name of a full block whose predecessor is named `parent`."""
    h = hashlib.blake2b(parent, digest_size=BLOCK_HASH_BYTES)
    h.update(struct.pack(f"<{len(block_tokens)}i", *block_tokens))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, start_layer: int,
                 end_layer: int, max_blocks: int | None = None) -> list[BlockHash]:
    """Names of the full blocks of `token_ids` (at most `max_blocks`), in order."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[BlockHash] = []
    parent = chain_root(start_layer, end_layer, block_size)
    for i in range(n):
        parent = next_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def extend_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                  start_layer: int, end_layer: int) -> list[BlockHash]:
    """Append to `hashes` (the names of the first len(hashes) blocks of `token_ids`) the
    names of the blocks that are full now; returns the new ones. For a sequence that grows
    a token at a time (decode) this hashes each block once."""
    fresh: list[BlockHash] = []
    parent = hashes[-1] if hashes else chain_root(start_layer, end_layer, block_size)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = next_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        fresh.append(parent)
    hashes.extend(fresh)
    return fresh


def reusable_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt that may be taken from cache when its first `matched_blocks`
    blocks are cached: whole blocks only, and never the last prompt token (its logits, or
    its hidden state for the next hop, must be computed)."""
    return min(matched_blocks, max(0, prompt_tokens - 1) // block_size) * block_size


@dataclass
class CacheEvents:
    """What one node's prefix cache did since its last report: blocks it holds now that it
    may not have held then (`stored`) and blocks it dropped (`removed`). A hash is in at most
    one list (its state at the end of the report), so the order of applying them does not
    matter. `reset`: the node's cache was emptied before these (a new process, a new layer
    range, caching turned off): forget everything known of it first."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    reset: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.reset)


class CacheEventLog:
    """An engine's record of stored / removed blocks between two reports (`take`), kept as
    each hash's last state so that a report never lists one hash twice."""

    def __init__(self) -> None:
        self._state: dict[BlockHash, bool] = {}
        self._reset = True  # the first report of a process tells the core to start afresh

    def stored(self, h: BlockHash) -> None:
        self._state[h] = True

    def removed(self, h: BlockHash) -> None:
        self._state[h] = False

    def reset(self) -> None:
        """The whole cache was dropped: what was logged before no longer matters."""
        self._state.clear()
        self._reset = True

    def take(self) -> CacheEvents:
        """The events since the last call (falsy when there are none)."""
        ev = CacheEvents([h for h, s in self._state.items() if s],
                         [h for h, s in self._state.items() if not s], self._reset)
        self._state.clear()
        self._reset = False
        return ev
