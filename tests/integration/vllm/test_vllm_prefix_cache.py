"""Prefix caching on the vllm engine (docs/prefix-caching.md): vLLM's own BlockPool caching
under helixserve's block names, on the real demo model split over two VllmStageEngines
([0, 15) and [15, 30), each in a process of its own, driven with work items directly).

Greedy tokens of a request that takes its prefix from the cache (whole blocks, a prefix that
ends inside a block, a prefix holding generated tokens, two running requests sharing blocks)
are the tokens of the same prompt computed from token 0; each stage's cache events list
exactly the names of the blocks it filled and evicted; a tiny KV budget evicts cached blocks
least recently used before any step is refused; a prefix the cache lacks is refused with
PrefixMissError naming the missing blocks, changing nothing; `prefix_caching=False` caches
nothing. One pair of stage builds for the module: each test starts fresh engines (empty
pools) on the same runners.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_procs import VLLM_MARKS
from vllm_stage_procs import Run, Stage, StageError, generate, start_stages, stop_stages

from helixserve.engine.protocol import WorkItem
from helixserve.prefix import block_hashes, reusable_tokens

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]

BLOCK = 32
RANGES = [(0, 15), (15, 30)]
#: 15 fp32 layers of the demo model take 23,040 bytes per token: 737,280 per 32-token block.
#: 13 blocks = vLLM's null block + 12 usable (384 tokens) per stage.
KV_BYTES = 13 * 737_280
USABLE = 12
TEXT = ("You are a careful assistant. Answer briefly and truthfully, cite what you know, and say "
        "when you do not know. The user may ask about history, science, cooking or travel; "
        "keep every answer under five sentences and never invent facts or sources. ")


@pytest.fixture(scope="module")
def stages(demo_model: Path) -> Iterator[list[Stage]]:
    procs = start_stages(demo_model, RANGES, KV_BYTES, BLOCK)
    try:
        yield procs
    finally:
        stop_stages(procs)


@pytest.fixture(scope="module")
def words(demo_model: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(demo_model)).encode(TEXT * 8)
    assert len(ids) >= 400
    return ids


def fresh(stages: list[Stage], prefix_caching: bool = True) -> None:
    for s in stages:
        s.call("reset", prefix_caching)
        assert s.events() == ([], [], True)  # a new engine: the core forgets what it knew
        assert s.kv()["total_blocks"] == USABLE


def names(stage: Stage, tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, BLOCK, stage.start, stage.end)


def test_a_cached_prefix_gives_the_tokens_of_a_full_prefill_and_exact_events(stages, words):
    fresh(stages)
    system, q1, q2, q3 = words[:80], words[200:240], words[240:265], words[270:280]
    r1 = Run("t1-r1", system + q1)  # 120 prompt tokens
    generate(stages, [r1], 10)
    written1 = r1.prompt + r1.tokens[:-1]  # 129 tokens: 4 full blocks, prompt and generated
    for s in stages:
        assert s.events() == (names(s, written1), [], False)
        assert s.kv()["used_blocks"] == 5 and s.kv()["cached_blocks"] == 0
        s.call("free", r1.request_id)
        assert s.kv()["used_blocks"] == 0 and s.kv()["cached_blocks"] == 4
        assert s.events() == ([], [], False)

    # r2 shares the 80-token system prompt: 2 whole blocks, the third block only in part.
    # r3 is r1's next turn: its prefix is 4 blocks, the last of them mostly generated tokens.
    r2 = Run("t1-r2", system + q2, cached=64)
    r3 = Run("t1-r3", r1.prompt + r1.tokens + q3, cached=128)
    assert r2.cached == reusable_tokens(2, len(r2.prompt), BLOCK)
    assert r3.cached == reusable_tokens(4, len(r3.prompt), BLOCK)

    def shared(step: int) -> None:
        if step:
            return
        for s in stages:  # after the first step: both attached blocks 0 and 1
            assert s.call("seq_len", r2.request_id) == len(r2.prompt)
            assert s.call("seq_len", r3.request_id) == len(r3.prompt)
            # 4 attached + r3's 1 new + r2's 2 new (its block 2 shares only 16 tokens)
            assert s.kv()["used_blocks"] == 7 and s.kv()["cached_blocks"] == 0

    generate(stages, [r2, r3], 8, shared)
    written2 = r2.prompt + r2.tokens[:-1]  # 112: its block 2 (tokens 64-95) is new
    written3 = r3.prompt + r3.tokens[:-1]  # 147: nothing new full (block 4 ends at 160)
    for s in stages:
        assert s.events() == (names(s, written2)[2:3], [], False)
        assert names(s, written3)[:4] == names(s, written1)[:4]
        for r in (r2, r3):
            s.call("free", r.request_id)
        assert s.kv()["cached_blocks"] == 5 and s.kv()["used_blocks"] == 0

    # the same prompts from token 0, as without caching: the same greedy tokens
    ref2, ref3 = Run("t1-ref2", r2.prompt), Run("t1-ref3", r3.prompt)
    generate(stages, [ref2, ref3], 8)
    assert ref2.tokens == r2.tokens
    assert ref3.tokens == r3.tokens


def test_a_tiny_kv_budget_evicts_cached_blocks_lru_before_refusing_a_step(stages, words):
    fresh(stages)
    done = [Run(f"t2-{i}", words[100 * i:100 * i + 100]) for i in range(3)]
    for r in done:  # 103 tokens written each: 3 named blocks, then cached once freed
        generate(stages, [r], 4)
        for s in stages:
            s.call("free", r.request_id)
    for s in stages:
        assert s.events()[0] == [n for r in done for n in names(s, r.prompt)]
        assert s.kv()["cached_blocks"] == 9 and s.kv()["free_blocks"] == USABLE
    # 300 prompt tokens need 10 blocks: the 3 never named, then the cached ones least recently
    # used first (vLLM's order: the request freed first, its last block first)
    long = Run("t2-long", words[::-1][:300])  # no block in common with the others
    evicted: dict[str, list[bytes]] = {}

    def running(step: int) -> None:
        if step:
            return
        for s in stages:
            assert s.kv()["used_blocks"] == 10 and s.kv()["cached_blocks"] == 2
            stored, removed, _ = s.events()
            assert stored == names(s, long.prompt)  # 9 full blocks
            a, b, c = (names(s, r.prompt) for r in done)
            assert removed == [*a[::-1], *b[::-1], c[2]]
            evicted[s.start] = removed
        # c's first 2 blocks are still cached but a request on them needs 2 more blocks:
        # 4 in all (the cached ones count as free until attached), 2 free: refused as a whole
        again = Run("t2-c-again", done[2].prompt, cached=64)
        s0 = stages[0]
        first = WorkItem(again.request_id, s0.start, s0.end, 64, again.prompt[64:],
                         prefix_token_ids=again.prompt[:64])
        small = WorkItem("t2-small", s0.start, s0.end, 0, words[:16])  # one block of the 2
        assert s0.call("kv_fits", [first]) is False and s0.call("kv_fits", [small]) is True
        with pytest.raises(Exception) as err:
            generate(stages[:1], [again], 1)
        assert getattr(err.value, "kind", None) == "KvExhaustedError", err.value
        assert err.value.attrs["needed_blocks"] == 4 and err.value.attrs["free_blocks"] == 2
        assert stages[0].kv()["cached_blocks"] == 2 and stages[0].call("seq_len", again.request_id) == 0

    generate(stages, [long], 4, running)
    for s in stages:
        s.call("free", long.request_id)
        assert s.kv()["used_blocks"] == 0
    # what survived eviction still serves: c again from its 2 cached blocks, same tokens
    again = Run("t2-c-again2", done[2].prompt, cached=64)
    generate(stages, [again], 4)
    assert again.tokens == done[2].tokens
    # what was evicted is refused by name, changing nothing
    before = stages[0].kv()
    stages[0].events()
    with pytest.raises(Exception) as err:
        generate(stages, [Run("t2-a-again", done[0].prompt, cached=64)], 1)
    assert getattr(err.value, "kind", None) == "PrefixMissError", err.value
    assert err.value.attrs["missing"] == names(stages[0], done[0].prompt)[:2]
    assert stages[0].kv() == before and stages[0].events() == ([], [], False)


def test_a_missing_prefix_is_refused_naming_the_missing_blocks_changing_nothing(stages, words):
    import numpy as np

    fresh(stages)
    a = stages[0]
    prompt = words[:100]
    a.step([WorkItem("t3-r", a.start, a.end, 0, prompt)])
    a.call("free", "t3-r")
    a.events()
    before = a.kv()
    assert before["cached_blocks"] == 3
    wrong = prompt[:64] + words[300:332]  # blocks 0, 1 cached; block 2 is not
    items = [WorkItem("t3-new", a.start, a.end, 0, words[:10]),
             WorkItem("t3-p", a.start, a.end, 96, words[96:101], prefix_token_ids=wrong)]
    with pytest.raises(StageError) as err:
        a.step(items)
    assert err.value.kind == "PrefixMissError" and str(err.value).startswith("PrefixMissError: prefix miss")
    assert err.value.attrs["request_id"] == "t3-p"
    assert err.value.attrs["missing"] == [names(a, wrong)[2]]
    assert a.kv() == before and a.events() == ([], [], False)
    assert a.call("seq_len", "t3-new") == 0 and a.call("seq_len", "t3-p") == 0
    # a prefix is whole blocks, the tokens before the position
    with pytest.raises(StageError) as err:
        a.step([WorkItem("t3-odd", a.start, a.end, 50, words[50:55], prefix_token_ids=prompt[:50])])
    assert err.value.kind == "InvalidWorkError"
    assert a.kv() == before
    # the right prefix: attached, and the hidden states of the rest are a full prefill's
    hit = a.step([WorkItem("t3-p", a.start, a.end, 96, prompt[96:], prefix_token_ids=prompt[:96])])
    full = a.step([WorkItem("t3-full", a.start, a.end, 0, prompt)])
    assert a.call("seq_len", "t3-p") == 100 and hit[0].hidden.shape == (4, 576)
    np.testing.assert_allclose(hit[0].hidden, full[0].hidden[96:], rtol=1e-4, atol=1e-4)


def test_without_prefix_caching_nothing_is_cached_and_every_prefix_misses(stages, words):
    fresh(stages, prefix_caching=False)
    r = Run("t4-r", words[:100])
    generate(stages, [r], 4)
    for s in stages:
        s.call("free", r.request_id)
        assert s.kv()["cached_blocks"] == 0 and s.kv()["free_blocks"] == USABLE
        assert s.events() == ([], [], False)
    with pytest.raises(StageError) as err:
        generate(stages, [Run("t4-again", r.prompt, cached=64)], 1)
    assert err.value.kind == "PrefixMissError"
    assert err.value.attrs["missing"] == names(stages[0], r.prompt)[:2]


def test_the_runner_is_told_the_cached_prefix_as_computed_tokens():
    from vllm import SamplingParams

    from helixserve.engine.vllm_batch import BatchEntry, RunnerRequest, scheduler_output

    reqs = {"p": RunnerRequest(block_ids=[7, 8, 3], num_tokens=64,
                               prefix_token_ids=list(range(64)))}
    so = scheduler_output([BatchEntry("p", 64, [100, 101], [3], (0, 4))], reqs, set(),
                          SamplingParams(max_tokens=1))
    new = so.scheduled_new_reqs[0]
    assert new.prompt_token_ids == [*range(64), 100, 101] and new.num_computed_tokens == 64
    assert new.block_ids == ([7, 8, 3],)  # the shared cached blocks head the table
    assert so.num_scheduled_tokens == {"p": 2}  # only the tokens after the prefix run
    assert reqs["p"].known and reqs["p"].prefix_token_ids == []
