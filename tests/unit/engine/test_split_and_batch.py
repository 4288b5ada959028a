"""Pipelines of shards, partial inference, and mixed continuous batches equal the whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_testlib import GREEDY, greedy_run

from helixserve.engine import ShardEngine, WorkItem


def _to_bytes_and_back(hidden: torch.Tensor) -> torch.Tensor:
    """What crosses the wire between workers: raw bytes + dtype + shape."""
    raw = hidden.numpy().tobytes()
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).reshape(hidden.shape).copy())


@pytest.fixture(scope="module")
def three_stages(demo_dir):
    return [
        ShardEngine.load(demo_dir, a, b, kv_cache_bytes=16 << 20)
        for a, b in ((0, 10), (10, 20), (20, 30))
    ]


def _pipeline_step(stages, rid, position, token_ids):
    hidden = None
    for st in stages:
        item = WorkItem(rid, st.start_layer, st.end_layer, position, token_ids, hidden, GREEDY)
        (out,) = st.step([item])
        if st.is_last:
            return out, st.last_logits[0]
        assert out.token_id is None and out.hidden.shape == (len(token_ids), st.hidden_size)
        hidden = _to_bytes_and_back(out.hidden)
    raise AssertionError("no last stage")


def test_three_stage_split_equals_whole(demo_engine, three_stages, demo_prompt):
    whole = greedy_run(demo_engine, "split-whole", demo_prompt, steps=12)
    assert [s.is_first for s in three_stages] == [True, False, False]
    assert [s.is_last for s in three_stages] == [False, False, True]
    out, logits = _pipeline_step(three_stages, "split", 0, demo_prompt)
    tokens, all_logits = [out.token_id], [logits]
    for i in range(12):
        out, logits = _pipeline_step(three_stages, "split", len(demo_prompt) + i, [tokens[-1]])
        tokens.append(out.token_id)
        all_logits.append(logits)
    assert tokens == whole.tokens
    torch.testing.assert_close(
        torch.stack(all_logits), torch.stack(whole.logits), atol=1e-3, rtol=0
    )
    for st in three_stages:
        st.free("split")
        assert st.kv_stats()["used_blocks"] == 0


def test_partial_inference_item_subrange(demo_dir, demo_engine, demo_prompt):
    """A shard holding [0, 30) runs only [10, 30) for an item whose route reached layer 10."""
    first = ShardEngine.load(demo_dir, 0, 10, kv_cache_bytes=16 << 20)
    whole = greedy_run(demo_engine, "partial-whole", demo_prompt, steps=5)
    tokens = []
    token_ids, pos = demo_prompt, 0
    for _ in range(6):
        (h,) = first.step([WorkItem("partial", 0, 10, pos, token_ids, None, None)])
        item = WorkItem("partial", 10, 30, pos, token_ids, _to_bytes_and_back(h.hidden), GREEDY)
        (out,) = demo_engine.step([item])
        tokens.append(out.token_id)
        pos += len(token_ids)
        token_ids = [out.token_id]
    assert tokens == whole.tokens
    demo_engine.free("partial")
    first.free("partial")


def test_mixed_batch_equals_each_alone(demo_engine, demo_tokenizer):
    """Prefills of different lengths, chunked prefill and decodes in the same steps."""
    prompts = {
        name: demo_tokenizer(text)["input_ids"]
        for name, text in {
            "a": "The quick brown fox",
            "b": "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of",
            "c": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
            "d": "Water boils at a temperature of one hundred degrees",
        }.items()
    }
    steps = 8
    alone = {k: greedy_run(demo_engine, f"alone-{k}", p, steps) for k, p in prompts.items()}

    n = demo_engine.num_model_layers
    tokens: dict[str, list[int]] = {k: [] for k in prompts}
    pos: dict[str, int] = {k: 0 for k in prompts}
    logits: dict[str, list[torch.Tensor]] = {k: [] for k in prompts}
    c_chunks = [prompts["c"][:7], prompts["c"][7:]]  # "c" prefills in two chunks

    def item(k: str) -> WorkItem:
        if not tokens[k]:
            ids = prompts[k] if k != "c" else c_chunks[0 if pos[k] == 0 else 1]
            sample = k != "c" or pos[k] > 0
        else:
            ids, sample = [tokens[k][-1]], True
        return WorkItem(f"mix-{k}", 0, n, pos[k], ids, None, GREEDY, sample=sample)

    # Arrivals: a at step 0, b and c at step 2 (while a decodes), d at step 3.
    arrivals = {"a": 0, "b": 2, "c": 2, "d": 3}
    for step in range(3 + steps + 2):
        batch = [item(k) for k in prompts if step >= arrivals[k] and len(tokens[k]) < steps + 1]
        if not batch:
            break
        outs = demo_engine.step(batch)
        sampled = 0
        for it, out in zip(batch, outs, strict=True):
            k = it.request_id.removeprefix("mix-")
            pos[k] += len(it.token_ids)
            if it.sample:
                tokens[k].append(out.token_id)
                logits[k].append(demo_engine.last_logits[sampled].clone())
                sampled += 1
            else:
                assert out.token_id is None
    for k in prompts:
        assert tokens[k] == alone[k].tokens, k
        torch.testing.assert_close(
            torch.stack(logits[k]), torch.stack(alone[k].logits), atol=1e-3, rtol=0
        )
        demo_engine.free(f"mix-{k}")
    assert demo_engine.kv_stats()["used_blocks"] == 0


def test_decode_batches_that_change_between_steps_equal_each_alone(demo_engine, demo_tokenizer):
    """The engine's dense decode copy must be rebuilt whenever the decode batch changes:
    a request sitting out a step, one freed mid-run, one joining, one rewound."""
    prompts = {
        k: demo_tokenizer(t)["input_ids"]
        for k, t in {
            "a": "The quick brown fox",
            "b": "Water boils at",
            "c": "List three colors:",
            "d": "Once upon a time",
        }.items()
    }
    steps = 12
    alone = {k: greedy_run(demo_engine, f"solo-{k}", p, steps).tokens for k, p in prompts.items()}
    n = demo_engine.num_model_layers
    tokens: dict[str, list[int]] = {}

    def run(batch: list[str], rewind: str | None = None) -> None:
        items = []
        for k in batch:
            if k not in tokens:  # prefill
                items.append(WorkItem(f"chg-{k}", 0, n, 0, prompts[k], None, GREEDY))
                continue
            if k == rewind:  # re-send the last decode step: KV rewinds one position
                tokens[k].pop()
            pos = len(prompts[k]) + len(tokens[k]) - 1
            items.append(WorkItem(f"chg-{k}", 0, n, pos, [tokens[k][-1]], None, GREEDY))
        for k, out in zip(batch, demo_engine.step(items), strict=True):
            tokens.setdefault(k, []).append(out.token_id)

    run(["a", "b", "c"])
    for _ in range(3):
        run(["a", "b", "c"])  # steady batch: the dense copy is built and extended
    run(["a", "c"])  # b sits out one step
    run(["a", "b", "c"])
    demo_engine.free("chg-c")  # c leaves early
    run(["a", "b", "d"])  # d prefills while a and b decode
    run(["a", "b", "d"])
    run(["a", "b", "d"], rewind="a")  # a's last step again
    for _ in range(3):
        run(["a", "b", "d"])
    for k in ("a", "b", "d"):
        demo_engine.free(f"chg-{k}")
        got = tokens[k]
        assert got == alone[k][: len(got)], k
    assert tokens["c"] == alone["c"][: len(tokens["c"])]
    assert demo_engine.kv_stats()["used_blocks"] == 0


def test_dense_decode_contexts_grow_in_place_equal_each_alone(
    demo_engine, demo_tokenizer, monkeypatch
):
    """Five requests of different lengths decode together (the batched oneDNN path with
    fused post-ops, >= 4 rows) while their dense contexts grow every 4 positions: tokens
    and logits equal each request alone, and the paged cache stays the source of truth
    (a later batch change rebuilds the dense copy from it)."""
    import helixserve.engine.shard as shard_mod

    monkeypatch.setattr(shard_mod, "DENSE_DECODE_CAP_STEP", 4)
    texts = [
        "Hi",
        "The capital of France is",
        "1, 2, 3, 4, 5,",
        "Roses are red,",
        "A long time ago in a galaxy far, far away there was",
    ]
    prompts = {f"g{i}": demo_tokenizer(t)["input_ids"] for i, t in enumerate(texts)}
    steps = 10
    alone = {k: greedy_run(demo_engine, f"alone-{k}", p, steps) for k, p in prompts.items()}
    n = demo_engine.num_model_layers
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {k: [] for k in prompts}
    outs = demo_engine.step([WorkItem(k, 0, n, 0, p, None, GREEDY) for k, p in prompts.items()])
    for (k, _p), out in zip(prompts.items(), outs, strict=True):
        tokens[k] = [out.token_id]
    for i in range(steps):
        # The last request sits out step 7: the batch changes, the dense copy is rebuilt.
        batch = [k for k in prompts if not (i == 7 and k == "g4")]
        items = [
            WorkItem(k, 0, n, len(prompts[k]) + len(tokens[k]) - 1, [tokens[k][-1]], None, GREEDY)
            for k in batch
        ]
        for row, (k, out) in enumerate(zip(batch, demo_engine.step(items), strict=True)):
            tokens[k].append(out.token_id)
            logits[k].append(demo_engine.last_logits[row].clone())
    for k in prompts:
        want = steps + 1 if k != "g4" else steps
        assert tokens[k] == alone[k].tokens[:want], k
        torch.testing.assert_close(
            torch.stack(logits[k]), torch.stack(alone[k].logits[1:want]), atol=1e-3, rtol=0
        )
        demo_engine.free(k)
    assert demo_engine.kv_stats()["used_blocks"] == 0
