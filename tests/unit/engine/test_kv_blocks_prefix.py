"""Prefix caching in the block allocator (engine/kv_blocks.py) and the emulated engine:
reference counts, names of full blocks, LRU eviction of unused cached blocks only,
all-or-nothing attach and growth, rewinds into cached blocks, and the exact cache events.
Torch-free code; the emulated engine's times are the durations it computes, never wall
clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from helixserve.engine.emulated import EmulatedEngine, EmulationSpec
from helixserve.engine.errors import InvalidWorkError, KvExhaustedError, PrefixMissError
from helixserve.engine.kv_blocks import BlockAllocator, Prefix
from helixserve.engine.protocol import RawHidden, WorkItem
from helixserve.prefix import CacheEvents, block_hashes
from helixserve.request import SamplingParams
from helixserve.spec import load_profiles

BS = 4
SPAN = (0, 8)
A = list(range(100, 112))  # 12 tokens: 3 full blocks
B = A[:8] + [7, 7, 7, 7]  # shares A's first 2 blocks


def names(tokens: list[int], span: tuple[int, int] = SPAN) -> list[bytes]:
    return block_hashes(tokens, BS, *span)


def run(kv: BlockAllocator, rid: str, tokens: list[int], position: int = 0,
        prefix: list[int] | None = None, span: tuple[int, int] = SPAN) -> None:
    """What an engine's step does with the allocator for one item."""
    p = {rid: Prefix(prefix, *span)} if prefix else None
    kv.reserve({rid: position + len(tokens)}, p)
    kv.commit(rid, position, tokens, *span)


def state(kv: BlockAllocator) -> tuple:
    """Everything a failed call must leave as it was."""
    return (kv.free_blocks, kv.cached_blocks, dict(kv._tables), list(kv._ref),
            dict(kv._block_of), list(kv._lru), list(kv._free),
            {r: (w.span, list(w.tokens)) for r, w in kv._written.items()})


def test_without_caching_it_is_a_plain_free_list():
    kv = BlockAllocator(4, BS)
    run(kv, "a", A)
    assert kv.commit("a", 12, [1], *SPAN) == [] and not kv._written
    kv.free("a")
    assert (kv.free_blocks, kv.cached_blocks, kv.used_blocks) == (4, 0, 0)
    assert kv._free == [3, 2, 1, 0]  # the stack as it started
    assert kv.take_cache_events() == CacheEvents(reset=True)
    assert not kv.take_cache_events()
    with pytest.raises(PrefixMissError) as err:
        kv.attach("b", Prefix(A[:8], *SPAN))
    assert err.value.request_id == "b" and err.value.missing == names(A[:8])
    assert str(err.value).startswith("prefix miss")


def test_full_blocks_are_named_as_they_fill_and_stay_cached_after_free():
    kv = BlockAllocator(6, BS, prefix_caching=True)
    kv.reserve({"a": 6})
    assert kv.commit("a", 0, A[:6], *SPAN) == names(A[:4])
    kv.reserve({"a": 12})
    assert kv.commit("a", 6, A[6:12], *SPAN) == names(A)[1:]
    assert kv.take_cache_events() == CacheEvents(stored=names(A), reset=True)
    blocks = kv.blocks_of("a")
    assert [kv.cached_block(h) for h in names(A)] == blocks
    assert (kv.used_blocks, kv.cached_blocks) == (3, 0)  # in use: not evictable
    kv.free("a")
    assert (kv.used_blocks, kv.cached_blocks, kv.free_blocks) == (0, 3, 6)
    assert all(kv.is_cached(h) for h in names(A)) and not kv.take_cache_events()
    # another layer span names other blocks: nothing of `a` matches it
    with pytest.raises(PrefixMissError) as err:
        kv.attach("x", Prefix(A[:8], 0, 4))
    assert err.value.missing == names(A[:8], (0, 4))


def test_attach_shares_blocks_and_free_counts_references():
    kv = BlockAllocator(8, BS, prefix_caching=True)
    run(kv, "a", A)
    a_blocks = kv.blocks_of("a")
    run(kv, "b", B[8:], position=8, prefix=B[:8])
    assert kv.blocks_of("b")[:2] == a_blocks[:2]
    assert [kv.refcount(b) for b in a_blocks] == [2, 2, 1]
    assert kv.used_blocks == 4  # a's 3 + b's own third block
    kv.free("a")
    assert [kv.refcount(b) for b in a_blocks] == [1, 1, 0]
    assert kv.cached_blocks == 1  # a's third block; the shared two are in use
    # b's own third block holds other tokens, so it has its own name
    assert kv.is_cached(names(B)[2]) and kv.cached_block(names(B)[2]) == kv.blocks_of("b")[2]
    kv.free("b")
    assert kv.cached_blocks == 4 and kv.used_blocks == 0
    assert kv.take_cache_events() == CacheEvents(stored=names(A) + names(B)[2:], reset=True)


def test_a_prefix_miss_or_a_bad_prefix_changes_nothing():
    kv = BlockAllocator(8, BS, prefix_caching=True)
    run(kv, "a", A[:6])  # only block 0 full
    kv.take_cache_events()
    before = state(kv)
    with pytest.raises(PrefixMissError) as err:
        kv.reserve({"b": 12, "a": 7}, {"b": Prefix(A[:8], *SPAN)})
    assert err.value.missing == names(A[:8])[1:]
    with pytest.raises(InvalidWorkError, match="6 tokens is not whole blocks of 4"):
        kv.attach("b", Prefix(A[:6], *SPAN))
    with pytest.raises(InvalidWorkError, match="already holds"):
        kv.attach("a", Prefix(A[:4], *SPAN))
    assert state(kv) == before and not kv.take_cache_events()


def test_reserve_takes_free_blocks_first_then_evicts_least_recently_used():
    kv = BlockAllocator(6, BS, prefix_caching=True)
    run(kv, "a", A[:8])
    run(kv, "b", B[8:] + [5, 5, 5, 5], position=8, prefix=B[:8])  # 2 shared + 2 own
    kv.free("b")  # b's tail goes first in line (its last block first), then a's
    kv.free("a")
    b_own = names(B + [5, 5, 5, 5])[2:]
    assert list(kv._lru) == [kv.cached_block(h) for h in [b_own[1], b_own[0]] + names(A[:8])[::-1]]
    kv.take_cache_events()
    kv.reserve({"c": 8})  # the 2 never-cached blocks: nothing evicted
    assert kv.cached_blocks == 4 and not kv.take_cache_events()
    kv.reserve({"d": 4})
    assert kv.take_cache_events() == CacheEvents(removed=[b_own[1]])
    kv.reserve({"d": 12})
    assert kv.take_cache_events() == CacheEvents(removed=[b_own[0], names(A)[1]])
    assert kv.is_cached(names(A)[0]) and kv.free_blocks == 1


def test_in_use_blocks_are_never_evicted_and_a_full_cache_changes_nothing():
    kv = BlockAllocator(5, BS, prefix_caching=True)
    run(kv, "a", A)  # 3 blocks, running
    run(kv, "old", [9] * 8)
    kv.free("old")  # 2 cached, evictable
    kv.take_cache_events()
    before = state(kv)
    with pytest.raises(KvExhaustedError, match="needs 3 more blocks .* only 2 of 5") as err:
        kv.reserve({"n": 12})
    assert (err.value.needed_blocks, err.value.free_blocks) == (3, 2)
    assert state(kv) == before and not kv.take_cache_events()
    kv.reserve({"n": 8})  # the 2 cached ones are evicted; a's stay
    assert kv.take_cache_events() == CacheEvents(removed=names([9] * 8)[::-1])  # tail first
    assert all(kv.is_cached(h) for h in names(A)) and kv.free_blocks == 0


def test_attaching_pins_evictable_blocks_all_or_nothing():
    kv = BlockAllocator(3, BS, prefix_caching=True)
    run(kv, "a", A[:8])
    kv.free("a")  # 2 cached at reference 0, 1 never used: 3 free
    before = state(kv)
    # b takes the 2 cached blocks and needs 2 more; only 1 is left once they are pinned
    with pytest.raises(KvExhaustedError) as err:
        kv.reserve({"b": 16}, {"b": Prefix(A[:8], *SPAN)})
    assert (err.value.needed_blocks, err.value.free_blocks) == (2, 1)
    assert state(kv) == before
    fresh = kv.reserve({"b": 12}, {"b": Prefix(A[:8], *SPAN)})
    assert len(fresh) == 1 and fresh[0] not in kv.blocks_of("b")[:2]  # attached: not fresh
    assert kv.free_blocks == 0 and kv.cached_blocks == 0


def test_a_block_computed_twice_stays_private_and_is_named_once():
    kv = BlockAllocator(8, BS, prefix_caching=True)
    run(kv, "a", A[:8])
    run(kv, "b", A[:8])  # the same tokens computed again (before a's blocks were reported)
    assert kv.blocks_of("b") != kv.blocks_of("a")
    assert [kv.cached_block(h) for h in names(A[:8])] == kv.blocks_of("a")
    kv.free("b")  # b's copies are private: back to the free list, not cached
    assert kv.cached_blocks == 0 and kv.free_blocks == 6
    assert kv.take_cache_events() == CacheEvents(stored=names(A[:8]), reset=True)


class CopyingAllocator(BlockAllocator):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.copies: list[tuple[int, int]] = []

    def _copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))


def test_a_rewind_into_a_cached_block_uncaches_or_copies_it():
    kv = CopyingAllocator(5, BS, prefix_caching=True)
    run(kv, "a", A)
    kv.take_cache_events()
    a2 = kv.blocks_of("a")[2]
    kv.truncate("a", 10)  # a holds block 2 alone: it will be overwritten, so un-named
    assert kv.take_cache_events() == CacheEvents(removed=[names(A)[2]])
    assert kv.blocks_of("a")[2] == a2 and not kv.copies
    run(kv, "a", [1, 1], position=10)
    assert kv.take_cache_events() == CacheEvents(stored=[names(A[:10] + [1, 1])[2]])
    # b shares a's first 2 blocks and rewinds into block 1: it gets its own copy
    run(kv, "b", B[8:], position=8, prefix=B[:8])
    shared = kv.blocks_of("a")[1]
    assert kv.refcount(shared) == 2
    kv.truncate("b", 6)
    (src, own), = kv.copies
    assert src == shared and kv.blocks_of("b") == [kv.blocks_of("a")[0], own]
    assert kv.refcount(shared) == 1 and kv.cached_block(names(A)[1]) == shared
    # a's block keeps its name; b's block 2, released, stays cached (stored when computed)
    assert kv.take_cache_events() == CacheEvents(stored=[names(B)[2]])
    run(kv, "b", [2, 2], position=6)  # b's block 1 now holds other tokens: named apart
    assert kv.cached_block(names(A[:6] + [2, 2])[1]) == own
    # no block free for the copy: refused, nothing changed
    run(kv, "c", B[8:], position=8, prefix=B[:8])  # evicts b's old block 2: none left
    assert kv.free_blocks == 0
    before = state(kv)
    with pytest.raises(KvExhaustedError, match="copy of a shared block"):
        kv.truncate("c", 5)
    assert state(kv) == before


def test_mixed_spans_name_nothing_until_a_rewind_to_zero():
    kv = BlockAllocator(8, BS, prefix_caching=True)
    run(kv, "a", A[:4])
    kv.take_cache_events()
    kv.reserve({"a": 8})
    assert kv.commit("a", 4, A[4:8], 0, 4) == []  # another span: its blocks are not named
    kv.reserve({"a": 12})
    assert kv.commit("a", 8, A[8:12], *SPAN) == []
    kv.truncate("a", 0)
    run(kv, "a", A)
    assert kv.take_cache_events().stored == names(A)[1:]  # block 0 was named before


# ---- the emulated engine ------------------------------------------------------------------
SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"
MODEL = SHARED / "models" / "llama-2-70b"  # config.json only
PROFILES = SHARED / "profiles" / "helix-measured.csv"
GREEDY = SamplingParams(temperature=0.0)


def hidden(n: int) -> RawHidden:
    return RawHidden("float16", (n, 8192), bytes(n * 8192 * 2))


@pytest.fixture(scope="module")
def spec():
    return EmulationSpec("L4", load_profiles(PROFILES), time_scale=1e-4)


def last_stage(spec, caching: bool) -> EmulatedEngine:
    return EmulatedEngine.load(MODEL, 70, 80, spec, prefix_caching=caching)


def generate(e: EmulatedEngine, rid: str, prompt: list[int], steps: int,
             cached: int = 0) -> list[int]:
    toks = prompt[cached:]
    item = WorkItem(rid, 70, 80, cached, toks, hidden(len(toks)), GREEDY,
                    prefix_token_ids=prompt[:cached] or None)
    out = [e.step([item])[0].token_id]
    for i in range(steps):
        out.append(e.step([WorkItem(rid, 70, 80, len(prompt) + i, [out[-1]], hidden(1),
                                    GREEDY)])[0].token_id)
    return out  # type: ignore[return-value]


def test_emulated_hit_is_not_charged_and_outputs_match(spec):
    e, plain = last_stage(spec, True), last_stage(spec, False)
    first = list(range(1000, 3000))
    second = first[:1990] + list(range(5000, 5020))  # shares 124 blocks of 16 and 6 tokens
    generate(e, "r1", first, 2)
    e.free("r1")
    assert e.kv_stats()["cached_blocks"] == 125  # 2002 tokens written: 125 full blocks
    want = generate(plain, "p2", second, 3)
    before = e.report()
    assert generate(e, "r2", second, 0, cached=1984) == want[:1]
    got = e.report()
    suffix = WorkItem("r2", 70, 80, 1984, second[1984:], hidden(26), GREEDY)
    # charged: the 26 new tokens' prefill only, far less than the whole prompt's
    assert got.emulated_s - before.emulated_s == pytest.approx(
        e.step_time_s([suffix]) * spec.time_scale)
    whole = WorkItem("p", 70, 80, 0, second, hidden(len(second)), GREEDY)
    assert e.step_time_s([suffix]) < 0.25 * e.step_time_s([whole])
    assert (got.cached_tokens, got.prompt_tokens - before.prompt_tokens) == (1984, 26)
    assert "1984 prompt tokens from the prefix cache" in got.describe()
    out = [want[0]]
    for i in range(3):  # decoding on from the attached prefix: the same tokens
        out.append(e.step([WorkItem("r2", 70, 80, len(second) + i, [out[-1]], hidden(1),
                                    GREEDY)])[0].token_id)
    assert out == want


def test_emulated_miss_without_caching_changes_nothing(spec):
    e = last_stage(spec, False)
    generate(e, "r1", list(range(1000, 1040)), 0)
    e.free("r1")
    assert e.take_cache_events() == CacheEvents(reset=True)
    before, steps = e.kv_stats(), e.report().steps
    item = WorkItem("r2", 70, 80, 32, [1, 2], hidden(2), GREEDY,
                    prefix_token_ids=list(range(1000, 1032)))
    with pytest.raises(PrefixMissError) as err:
        e.step([WorkItem("r3", 70, 80, 0, [5] * 20, hidden(20), GREEDY), item])
    assert err.value.request_id == "r2" and len(err.value.missing) == 2
    assert e.kv_stats() == before and e.report().steps == steps
    assert not e.seq_len("r2") and not e.seq_len("r3") and not e.take_cache_events()


def test_emulated_events_and_reset_after_a_new_range(spec):
    e = EmulatedEngine.load(MODEL, 0, 10, spec, block_size=16)
    prompt = list(range(1, 41))
    e.step([WorkItem("a", 0, 10, 0, prompt, None, None, sample=False)])
    assert e.take_cache_events() == CacheEvents(
        stored=block_hashes(prompt, 16, 0, 10), reset=True)
    # a prefix item whose length is not its position is refused
    with pytest.raises(InvalidWorkError, match="16 prefix tokens but position 32"):
        e.step([WorkItem("b", 0, 10, 32, [1], None, None, prefix_token_ids=prompt[:16])])
    e.release_memory()
    new = e.with_range(0, 8)
    new.allocate_kv()
    assert new.prefix_caching and new.take_cache_events() == CacheEvents(reset=True)
