"""Prefix caching in the torch engine on the real demo weights (SmolLM2-135M): a request
that takes its prefix's KV from the cache gives the greedy tokens (and logits) of one that
computes everything, on one shard and on a 2-stage pipeline; only whole blocks are reused;
under a tiny KV budget cached blocks are evicted (LRU) before anything is refused and blocks
in use never are; a prefix whose blocks were evicted is refused with PrefixMissError,
changing nothing; rewinds into shared blocks copy them; the cache events are exact."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import GREEDY

from helixserve.engine import InvalidWorkError, KvExhaustedError, ShardEngine, WorkItem
from helixserve.engine.errors import PrefixMissError
from helixserve.engine.kv_cache import KVCacheLayout
from helixserve.prefix import CacheEvents, block_hashes
from helixserve.request import SamplingParams

BS = 8
SPLIT = 12  # the pipeline's stages: layers [0, 12) and [12, 30)
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def text_ids(demo_tokenizer) -> list[int]:
    text = ("You are a careful assistant for a team of astronomers. Answer in short, plain "
            "sentences, name your sources, and say so when you are not sure. The team studies "
            "the planets of the solar system, their moons and the small bodies between them. "
            "Mars has two small moons, Phobos and Deimos; Jupiter has more than ninety, and "
            "its four large ones were found by Galileo in 1610. Saturn's rings are made of "
            "ice and rock, and Titan, its largest moon, has lakes of liquid methane.")
    ids = list(demo_tokenizer(text)["input_ids"])
    assert len(ids) >= 90
    return ids


@pytest.fixture(scope="module")
def engines(demo_dir) -> dict[str, ShardEngine]:
    """Whole model with and without caching; a 2-stage pipeline with caching. Each test
    gives them a fresh cache of the size it needs (`fresh`)."""
    return {
        "plain": ShardEngine.load(demo_dir, 0, 30, block_size=BS, kv_cache_bytes=16 << 20,
                                  prefix_caching=False),
        "whole": ShardEngine.load(demo_dir, 0, 30, block_size=BS, kv_cache_bytes=16 << 20),
        "first": ShardEngine.load(demo_dir, 0, SPLIT, block_size=BS, kv_cache_bytes=8 << 20),
        "last": ShardEngine.load(demo_dir, SPLIT, 30, block_size=BS, kv_cache_bytes=8 << 20),
    }


def fresh(*stages: ShardEngine, blocks: int = 64) -> None:
    for e in stages:
        layout = KVCacheLayout(e.end_layer - e.start_layer, e.args.num_kv_heads,
                               e.args.head_dim, BS, e.dtype)
        e.allocate_kv(blocks * layout.block_bytes)
        assert e.kv_stats()["total_blocks"] == blocks
        assert e.take_cache_events() == CacheEvents(reset=True)


class Run:
    """One request through a pipeline of shards, greedy: its prompt (the first `cached`
    tokens taken from the cache), then one token at a time."""

    def __init__(self, stages: list[ShardEngine], rid: str, prompt: list[int],
                 cached: int = 0) -> None:
        self.stages, self.rid, self.prompt = stages, rid, prompt
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.step(cached, prompt[cached:], prompt[:cached] or None)

    def step(self, position: int, token_ids: list[int], prefix: list[int] | None = None) -> None:
        hidden = None
        for e in self.stages:
            item = WorkItem(self.rid, e.start_layer, e.end_layer, position, token_ids, hidden,
                            GREEDY if e.is_last else None, prefix_token_ids=prefix)
            (out,) = e.step([item])
            hidden = out.hidden
        assert out.token_id is not None and self.stages[-1].last_logits is not None
        self.tokens.append(out.token_id)
        self.logits.append(self.stages[-1].last_logits[0].clone())

    def decode(self, n: int) -> Run:
        for _ in range(n):
            self.step(len(self.prompt) + len(self.tokens) - 1, [self.tokens[-1]])
        return self

    def written(self) -> list[int]:
        """Tokens whose KV the stages hold: the prompt and the generated ones fed back."""
        return self.prompt + self.tokens[:-1]

    def free(self) -> None:
        for e in self.stages:
            e.free(self.rid)


def assert_same(got: Run, want: Run) -> None:
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        assert torch.allclose(a, b, atol=LOGIT_ATOL), (a - b).abs().max()


def names(tokens: list[int], start: int = 0, end: int = 30) -> list[bytes]:
    return block_hashes(tokens, BS, start, end)


def block_kv(e: ShardEngine, blocks: list[int]) -> list[torch.Tensor]:
    return [e.kv.kv[:, :, :, b * BS:(b + 1) * BS].clone() for b in blocks]


@pytest.mark.parametrize("pipeline", [False, True], ids=["one-shard", "two-stages"])
def test_a_shared_prefix_is_attached_and_the_outputs_match(engines, text_ids, pipeline):
    stages = [engines["first"], engines["last"]] if pipeline else [engines["whole"]]
    fresh(*stages, engines["plain"])
    system = text_ids[:40]
    first = system + text_ids[40:52]
    second = system + text_ids[60:70]
    Run(stages, "r1", first).decode(2).free()
    spans = [(e.start_layer, e.end_layer) for e in stages]
    cached = 40  # 5 whole blocks
    held = [[e.kv.cached_block(h) for h in names(second[:cached], *s)]
            for e, s in zip(stages, spans, strict=True)]
    assert all(b is not None for blocks in held for b in blocks)
    before = [block_kv(e, blocks) for e, blocks in zip(stages, held, strict=True)]  # type: ignore[arg-type]
    for e in stages:
        e.take_cache_events()

    want = Run([engines["plain"]], "p2", second).decode(4)
    got = Run(stages, "r2", second, cached=cached)
    for e, blocks in zip(stages, held, strict=True):
        # every stage attached the cached blocks (shared, not copied, not recomputed)
        assert e.kv.blocks_of("r2")[:5] == blocks and e.seq_len("r2") == len(second)
    got.decode(4)
    assert_same(got, want)
    # the attached blocks' KV is untouched (not zeroed, not overwritten)
    for e, blocks, kv in zip(stages, held, before, strict=True):
        for a, b in zip(block_kv(e, blocks), kv, strict=True):  # type: ignore[arg-type]
            assert torch.equal(a, b)
    # the request's own full blocks were named as they filled, with each stage's span
    for e, s in zip(stages, spans, strict=True):
        assert e.take_cache_events() == CacheEvents(stored=names(got.written(), *s)[5:])
    got.free()
    want.free()


def test_only_whole_blocks_of_a_partial_block_prefix_are_reused(engines, text_ids):
    e, plain = engines["whole"], engines["plain"]
    fresh(e, plain)
    first = text_ids[:30]
    second = text_ids[:13] + text_ids[40:60]  # shares 13 tokens: block 0 whole, block 1 not
    Run([e], "r1", first).free()
    e.take_cache_events()
    before = e.kv_stats()
    with pytest.raises(PrefixMissError) as err:
        Run([e], "r2", second, cached=16)
    assert err.value.request_id == "r2" and err.value.missing == names(second[:16])[1:]
    with pytest.raises(InvalidWorkError, match="not whole blocks"):
        Run([e], "r2", second, cached=13)
    assert e.kv_stats() == before and not e.seq_len("r2") and not e.kv.has("r2")
    assert not e.take_cache_events()
    got = Run([e], "r2", second, cached=8).decode(4)
    assert_same(got, Run([plain], "p2", second).decode(4))


def test_eviction_under_pressure_keeps_blocks_in_use_and_outputs(engines, text_ids):
    e, plain = engines["whole"], engines["plain"]
    fresh(e, blocks=10)  # 80 tokens
    fresh(plain)
    p1, p3, p2 = text_ids[:30], text_ids[30:48], text_ids[48:84]
    r1 = Run([e], "r1", p1).decode(3)  # 33 tokens written: 4 full blocks and 1 partial
    r1.free()
    assert e.kv_stats()["cached_blocks"] == 4 and e.kv_stats()["free_blocks"] == 10
    r3 = Run([e], "r3", p3)  # running: 3 blocks, 2 of them full and cached
    e.take_cache_events()
    r3_named = names(p3)
    # r2 needs 5 blocks: the 3 never-cached ones, then r1's 2 least recently released (its
    # tail: a request's last blocks are released first)
    r2 = Run([e], "r2", p2)
    r1_names = names(r1.written())
    assert e.take_cache_events() == CacheEvents(stored=names(p2),
                                                removed=[r1_names[3], r1_names[2]])
    assert all(e.kv.is_cached(h) for h in r3_named + r1_names[:2])
    # a step needing more than the free and evictable blocks is refused, changing nothing
    stats = e.kv_stats()
    assert (stats["free_blocks"], stats["cached_blocks"]) == (2, 2)
    big = [WorkItem("r4", 0, 30, 0, text_ids[:17], None, GREEDY),
           WorkItem("r3", 0, 30, len(p3), [r3.tokens[-1]], None, GREEDY)]
    assert not e.kv_fits(big) and e.kv_fits(big[1:])  # said without changing anything
    with pytest.raises(KvExhaustedError) as err:
        e.step(big)
    assert (err.value.needed_blocks, err.value.free_blocks) == (3, 2)
    assert e.kv_stats() == stats and not e.take_cache_events()
    # a prefix whose blocks were evicted is refused before anything changes
    p5 = r1.written()[:32] + [5]  # r1's prompt and output, then another token
    with pytest.raises(PrefixMissError) as miss:
        Run([e], "r5", p5, cached=32)
    assert miss.value.missing == r1_names[2:4]
    assert e.kv_stats() == stats and not e.kv.has("r5") and not e.take_cache_events()
    # ... the blocks still cached serve; everyone's outputs are those computed without a cache
    r3.decode(3)
    r2.decode(3)
    assert_same(r3, Run([plain], "p3", p3).decode(3))
    assert_same(r2, Run([plain], "p2", p2).decode(3))
    r2.free()
    r5 = Run([e], "r5", p5, cached=16).decode(2)
    assert e.kv.blocks_of("r5")[:2] == [e.kv.cached_block(h) for h in r1_names[:2]]
    assert_same(r5, Run([plain], "p5", p5).decode(2))
    r3.free()
    r5.free()


def test_shared_blocks_are_counted_and_a_rewind_into_one_copies_it(engines, text_ids):
    e, plain = engines["whole"], engines["plain"]
    fresh(e, plain)
    p1 = text_ids[:33]
    p2 = text_ids[:28] + text_ids[50:58]
    r1 = Run([e], "r1", p1)
    shared = e.kv.blocks_of("r1")[:3]
    r2 = Run([e], "r2", p2, cached=24)
    assert e.kv.blocks_of("r2")[:3] == shared
    assert [e.kv.refcount(b) for b in shared] == [2, 2, 2]
    kv_before = block_kv(e, shared)
    # r2 is rewound into its third block, which r1 holds too: r2 gets its own copy
    r2.tokens.clear()
    r2.logits.clear()
    r2.step(20, p2[20:])
    own = e.kv.blocks_of("r2")[2]
    assert own != shared[2] and e.kv.blocks_of("r2")[:2] == shared[:2]
    assert [e.kv.refcount(b) for b in shared] == [2, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(block_kv(e, shared), kv_before, strict=True))
    r2.decode(3)
    r1.decode(3)
    assert_same(r2, Run([plain], "p2", p2).decode(3))
    assert_same(r1, Run([plain], "p1", p1).decode(3))
    r1.free()
    assert [e.kv.refcount(b) for b in shared] == [1, 1, 0]
    assert e.kv.used_blocks == len(e.kv.blocks_of("r2"))
    r2.free()
    assert e.kv.used_blocks == 0 and e.kv_stats()["cached_blocks"] > 0


def test_penalties_see_the_prefix_tokens(engines, text_ids):
    """The last stage's history (repetition penalty, prompt length) holds the prefix's
    tokens as if they had been computed."""
    e, plain = engines["whole"], engines["plain"]
    fresh(e, plain)
    prompt = text_ids[:24] + text_ids[:16]  # repeats itself: the penalty matters
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0)

    def run(engine: ShardEngine, rid: str, cached: int) -> list[int]:
        out = engine.step([WorkItem(rid, 0, 30, cached, prompt[cached:], None, params,
                                    prefix_token_ids=prompt[:cached] or None)])
        tokens = [out[0].token_id]
        for i in range(5):
            out = engine.step([WorkItem(rid, 0, 30, len(prompt) + i, [tokens[-1]], None,
                                        params)])
            tokens.append(out[0].token_id)
        engine.free(rid)
        return tokens  # type: ignore[return-value]

    run(e, "warm", 0)
    assert run(e, "hit", 24) == run(plain, "ref", 0)
    e.step([WorkItem("h", 0, 30, 24, prompt[24:], None, params, prefix_token_ids=prompt[:24])])
    plain.step([WorkItem("h", 0, 30, 0, prompt, None, params)])
    assert history(e, "h") == history(plain, "h")


def test_events_reset_and_caching_off(engines, text_ids):
    e, plain = engines["whole"], engines["plain"]
    fresh(e, plain)
    r = Run([e], "r", text_ids[:20]).decode(5)  # 24 tokens written: 3 full blocks
    assert e.take_cache_events() == CacheEvents(stored=names(text_ids[:20] + r.tokens[:4]))
    assert not e.take_cache_events()
    r.free()
    assert not e.take_cache_events()  # freed blocks stay cached: nothing removed
    fresh(e)  # a new cache: the next report says reset (checked in `fresh`)
    # without caching: nothing is named, nothing kept, every prefix misses
    Run([plain], "q", text_ids[:20]).decode(5).free()
    assert not plain.take_cache_events() and plain.kv_stats()["cached_blocks"] == 0
    with pytest.raises(PrefixMissError) as err:
        Run([plain], "q2", text_ids[:20], cached=16)
    assert err.value.missing == names(text_ids[:16])


def test_prompt_logprobs_are_not_taken_from_the_cache(engines, text_ids):
    e = engines["whole"]
    fresh(e)
    Run([e], "r", text_ids[:20]).free()
    item = WorkItem("x", 0, 30, 16, text_ids[16:20], None,
                    SamplingParams(temperature=0.0, prompt_logprobs=1),
                    prefix_token_ids=text_ids[:16])
    with pytest.raises(InvalidWorkError, match="prompt logprobs"):
        e.step([item])
    assert not e.kv.has("x")


def test_a_preempted_request_resumes_from_its_own_cached_blocks(engines, text_ids):
    """Preempted (freed) and run again as prompt + output so far: the prefix it takes from
    the cache holds generated tokens too, which the penalties count as generated."""
    e, plain = engines["whole"], engines["plain"]
    fresh(e, plain)
    prompt = text_ids[:20]
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)

    def decode(engine: ShardEngine, rid: str, tokens: list[int], n: int) -> None:
        for _ in range(n):
            (o,) = engine.step([WorkItem(rid, 0, 30, len(prompt) + len(tokens) - 1,
                                         [tokens[-1]], None, params)])
            tokens.append(o.token_id)  # type: ignore[arg-type]

    want = [plain.step([WorkItem("p", 0, 30, 0, prompt, None, params)])[0].token_id]
    decode(plain, "p", want, 8)  # type: ignore[arg-type]
    got = [e.step([WorkItem("r", 0, 30, 0, prompt, None, params)])[0].token_id]
    decode(e, "r", got, 4)  # type: ignore[arg-type]
    e.free("r")  # preempted: prompt + 4 generated tokens written, 3 full blocks cached
    again = prompt + got  # type: ignore[operator]
    (o,) = e.step([WorkItem("r", 0, 30, 24, again[24:], None, params, num_prompt_tokens=20,
                            prefix_token_ids=again[:24])])
    got.append(o.token_id)
    decode(e, "r", got, 3)  # type: ignore[arg-type]
    assert got == want
    assert history(e, "r") == history(plain, "p")
    e.free("r")
    plain.free("p")


def history(e: ShardEngine, rid: str) -> tuple:
    """What the last stage's sampler knows of a request's tokens."""
    h = e._history[rid]
    return h.prompt_ids, dict(h.output_counts), h.num_generated, h.sampled_once
