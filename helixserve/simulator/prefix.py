"""Prefix caching in the simulator: each node's cache of named KV blocks, modelled as the
engines keep theirs (docs/prefix-caching.md), reported to the scheduling core as workers
report theirs, so routes and predictions see cached prefixes with the core's own rule.

A node's cache (`NodeCache`) holds block names (helixserve/prefix.py, over the layers each
request runs there):
- in use: blocks of running requests, ref-counted; a request's full blocks are stored as
  they are computed: its prompt's when its prefill has run on the node, each generated
  block when the decode step that fills it has run. A request admitted with
  `Admission.cached_tokens` attaches those blocks on every hop at admission.
- free: blocks no running request uses (finished or preempted ones), least recently used
  first, a request's last block before its first (as the engines free them: a prefix's
  tail is evicted before its head). They live in the KV the ledger has not handed out, so after each step the node
  keeps at most `(kv_cap - used_tokens) // block_size` of them and evicts the rest, least
  recently used first; a block in use is never evicted.
After each step the node's `CacheEventLog` (what it stored and removed) goes to the core
(`SchedulerCore.on_cache_events`), as a worker sends its engine's events with its results.
Eviction happens only there, so the core's index is exact when it admits: a simulated hop
never misses a prefix (the live one may; the coordinator re-runs such a request).

Timing: a request's prefill computes `prompt - cached_tokens` tokens (`SimRequest.fill`);
the cost model's prefill time and the activations sent between hops count only those.
Simplifications: blocks are attached on every hop at admission rather than when the first
item reaches the hop, and the KV ledger still counts a shared block once per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from helixserve.prefix import BlockHash, CacheEventLog
from helixserve.scheduler.prefix import RequestNames
from helixserve.simulator.nodes import SimNode, SimRequest


class NodeCache:
    """One simulated node's prefix cache (module doc)."""

    __slots__ = ("refs", "free", "log", "evicted", "peak_blocks")

    def __init__(self) -> None:
        #: names in use -> how many running requests use them
        self.refs: dict[BlockHash, int] = {}
        #: names no running request uses, least recently used first
        self.free: OrderedDict[BlockHash, None] = OrderedDict()
        self.log = CacheEventLog()
        #: blocks evicted so far, and the most blocks held at once (after a step)
        self.evicted = 0
        self.peak_blocks = 0

    def __len__(self) -> int:
        return len(self.refs) + len(self.free)

    def __contains__(self, name: BlockHash) -> bool:
        return name in self.refs or name in self.free

    def matched(self, names: Sequence[BlockHash]) -> int:
        """How many of `names`, consecutive from block 0, it holds."""
        for i, h in enumerate(names):
            if h not in self.refs and h not in self.free:
                return i
        return len(names)

    def use(self, names: Sequence[BlockHash]) -> None:
        """A running request uses these blocks (attached from cache, or just computed: a
        name not held yet is stored)."""
        refs, free = self.refs, self.free
        for h in names:
            n = refs.get(h)
            if n is not None:
                refs[h] = n + 1
                continue
            if h in free:
                del free[h]
            else:
                self.log.stored(h)
            refs[h] = 1

    def release(self, names: Sequence[BlockHash]) -> None:
        """A request stopped using these (finished or preempted): they stay cached, most
        recently used last, its last block first (as the engines and vLLM free a request's
        blocks: a prefix's tail is evicted before its head, whose blocks every later block's
        match needs)."""
        refs, free = self.refs, self.free
        for h in reversed(names):
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                free[h] = None

    def trim(self, room_blocks: int) -> None:
        """Evict unused blocks, least recently used first, down to `room_blocks`."""
        free = self.free
        while len(free) > max(0, room_blocks):
            h, _ = free.popitem(last=False)
            self.log.removed(h)
            self.evicted += 1
        self.peak_blocks = max(self.peak_blocks, len(self.refs) + len(free))


def request_names(r: SimRequest, hop: int, blocks: int, block_size: int) -> list[BlockHash]:
    """The names of the first `blocks` blocks of `r`'s tokens on its hop `hop`."""
    assert r.script is not None
    if r.names is None:
        r.names = RequestNames()
    node = r.nodes[hop]
    start = r.starts[hop]
    return r.names.names(r.script, blocks, block_size, start, node.end)  # type: ignore[no-any-return]


def attach(r: SimRequest, cached_tokens: int, block_size: int) -> int:
    """At admission: `r` takes its first `cached_tokens` tokens from every hop's cache.
    Returns the tokens it really took (the whole-block prefix every hop holds, at most
    `cached_tokens`; equal unless the core's index was stale)."""
    blocks = cached_tokens // block_size
    per_hop = [request_names(r, i, blocks, block_size) for i in range(len(r.nodes))]
    for i, names in enumerate(per_hop):
        blocks = min(blocks, r.nodes[i].cache.matched(names))
    for i, names in enumerate(per_hop):
        r.nodes[i].cache.use(names[:blocks])
    r.held = [blocks] * len(r.nodes)
    return blocks * block_size


def computed(r: SimRequest, hop: int, kv_tokens: int, block_size: int) -> None:
    """`r` has KV for its first `kv_tokens` tokens on hop `hop`: its full blocks not held
    yet are stored (and used by it)."""
    blocks = kv_tokens // block_size
    have = r.held[hop]
    if blocks > have:
        names = request_names(r, hop, blocks, block_size)
        r.nodes[hop].cache.use(names[have:blocks])
        r.held[hop] = blocks


def release(r: SimRequest, block_size: int) -> None:
    """`r` ended or was preempted: its blocks stay cached, unused."""
    for i, node in enumerate(r.nodes):
        if r.held[i]:
            node.cache.release(request_names(r, i, r.held[i], block_size))
    r.held = [0] * len(r.nodes)


def end_of_step(node: SimNode, block_size: int) -> None:
    """After a step: evict unused blocks beyond the KV the ledger has not handed out."""
    node.cache.trim((node.kv_cap - node.kv.used_tokens) // block_size)
