"""Paged KV cache: block accounting, freeing, capacity errors that change nothing."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import GREEDY, greedy_run

from helixserve.engine import KvExhaustedError, ShardEngine, WorkItem
from helixserve.engine.kv_cache import KVCacheLayout, PagedKVCache


@pytest.fixture(scope="module")
def small(random_models):
    """A 4-layer model with room for exactly 6 blocks of 16 tokens."""
    args_engine = ShardEngine.load(random_models["qwen2"], 0, 4, kv_cache_bytes=1 << 20)
    block = KVCacheLayout(
        4, args_engine.args.num_kv_heads, args_engine.args.head_dim, 16, torch.float32
    )
    return ShardEngine.load(random_models["qwen2"], 0, 4, kv_cache_bytes=6 * block.block_bytes)


def test_stats_and_growth(small):
    assert small.kv_stats() == {
        "block_size": 16, "total_blocks": 6, "used_blocks": 0, "free_blocks": 6,
        "capacity_tokens": 96, "cached_blocks": 0,
    }  # fmt: skip
    small.step([WorkItem("g", 0, 4, 0, list(range(3, 20)), None, GREEDY)])  # 17 tokens
    assert small.kv_stats()["used_blocks"] == 2
    for i in range(15):  # up to 32 tokens: still 2 blocks
        small.step([WorkItem("g", 0, 4, 17 + i, [5], None, GREEDY)])
    assert small.kv_stats()["used_blocks"] == 2 and small.seq_len("g") == 32
    small.step([WorkItem("g", 0, 4, 32, [5], None, GREEDY)])  # 33rd token: a third block
    assert small.kv_stats()["used_blocks"] == 3
    small.free("g")
    small.free("g")  # idempotent
    assert small.kv_stats()["used_blocks"] == 0 and small.seq_len("g") == 0


def test_all_blocks_freed_after_finish_and_cancel(small):
    small.step([WorkItem(r, 0, 4, 0, [3] * 20, None, GREEDY) for r in ("f1", "f2", "c1")])
    assert small.kv_stats()["used_blocks"] == 6
    small.free("c1")  # cancelled mid-way
    small.step([WorkItem(r, 0, 4, 20, [4], None, GREEDY) for r in ("f1", "f2")])
    small.free("f1")
    small.free("f2")
    assert small.kv_stats()["free_blocks"] == 6


def test_over_capacity_raises_and_changes_nothing(small, random_models):
    ref = ShardEngine.load(random_models["qwen2"], 0, 4, kv_cache_bytes=1 << 20)
    prompt = list(range(3, 40))  # 37 tokens = 3 blocks
    expected = greedy_run(ref, "ref", prompt, steps=3).tokens

    out = small.step([WorkItem("keep", 0, 4, 0, prompt, None, GREEDY)])
    tokens = [out[0].token_id]
    before = small.kv_stats()
    with pytest.raises(KvExhaustedError, match=r"needs 4 more blocks .* only 3 of 6 are free"):
        small.step([WorkItem("big", 0, 4, 0, [3] * 60, None, GREEDY)])  # 4 blocks > 3 free
    # A step that mixes a fitting and a non-fitting item is refused as a whole.
    with pytest.raises(KvExhaustedError) as err:
        small.step([
            WorkItem("keep", 0, 4, 37, [tokens[-1]], None, GREEDY),
            WorkItem("big", 0, 4, 0, [3] * 60, None, GREEDY),
        ])  # fmt: skip
    assert err.value.needed_blocks == 4 and err.value.free_blocks == 3
    assert small.kv_stats() == before and small.seq_len("keep") == 37
    # ... and the surviving request continues exactly as if nothing happened.
    for i in range(3):
        (o,) = small.step([WorkItem("keep", 0, 4, 37 + i, [tokens[-1]], None, GREEDY)])
        tokens.append(o.token_id)
    assert tokens == expected
    small.free("keep")


def test_rewind_and_position_gap(small):
    small.step([WorkItem("rw", 0, 4, 0, [3] * 40, None, GREEDY)])
    assert small.kv_stats()["used_blocks"] == 3
    # Re-prefill from 0 (e.g. after a failover elsewhere): old blocks are reused, not leaked.
    small.step([WorkItem("rw", 0, 4, 0, [3] * 10, None, GREEDY)])
    assert small.kv_stats()["used_blocks"] == 1 and small.seq_len("rw") == 10
    with pytest.raises(ValueError, match="position 12 but only 10"):
        small.step([WorkItem("rw", 0, 4, 12, [3], None, GREEDY)])
    small.free("rw")


def test_block_reuse_is_zeroed_and_bounded():
    layout = KVCacheLayout(
        num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32
    )
    cache = PagedKVCache(layout, num_blocks=3, device=torch.device("cpu"))
    assert cache.k.shape == (2, 1, 12, 4)  # preallocated: layers, kv heads, slots, head_dim
    cache.reserve({"a": 12})
    cache.k.fill_(float("nan"))
    cache.free("a")
    cache.reserve({"b": 5})
    slots = cache.context_slots(["b"], 8)[0]
    assert not torch.isnan(cache.k[:, :, slots]).any()
    with pytest.raises(KvExhaustedError):
        cache.reserve({"c": 5})
    assert cache.blocks_of("c") == [] and cache.free_blocks == 1
