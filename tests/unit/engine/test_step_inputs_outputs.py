"""A step's way in and out of the device: one embedding call and one scatter for its inputs,
one copy for the hidden states leaving it; the same rows as item by item."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_testlib import GREEDY

from helixserve.engine import ShardEngine, WorkItem
from helixserve.engine import shard as shard_module


def _engines(model_dir):
    first = ShardEngine.load(model_dir, 0, 2, kv_cache_bytes=4 << 20)
    whole = ShardEngine.load(model_dir, 0, 4, kv_cache_bytes=4 << 20)
    return first, whole


def test_one_embedding_call_per_step(random_models, monkeypatch):
    first, _ = _engines(random_models["qwen2"])
    calls = []
    real = F.embedding
    monkeypatch.setattr(shard_module.F, "embedding",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    items = [WorkItem(f"r{i}", 0, 2, 0, [5 + i, 6, 7, 8][: 2 + i], None) for i in range(3)]
    outs = first.step(items)
    assert calls == [torch.Size([9])]
    # hidden states leaving: one host tensor, each item's rows a view of it
    bases = {o.hidden.untyped_storage().data_ptr() for o in outs}
    assert len(bases) == 1 and [o.hidden.shape[0] for o in outs] == [2, 3, 4]


def test_mixed_first_stage_inputs_equal_each_alone(random_models):
    """Items embedded here and items bringing hidden states (partial inference from layer
    2) in one step: the same tokens as each alone."""
    first, whole = _engines(random_models["qwen2"])
    prompt = [11, 12, 13, 14, 15]
    (h,) = first.step([WorkItem("h", 0, 2, 0, prompt, None)])
    alone_late = whole.step([WorkItem("late", 2, 4, 0, prompt, h.hidden.clone(), GREEDY)])
    alone_early = whole.step([WorkItem("early", 0, 4, 0, [21, 22, 23], None, GREEDY)])
    for rid in ("late", "early"):
        whole.free(rid)
    mixed = whole.step([WorkItem("early", 0, 4, 0, [21, 22, 23], None, GREEDY),
                        WorkItem("late", 2, 4, 0, prompt, h.hidden.clone(), GREEDY)])
    assert [o.token_id for o in mixed] == [alone_early[0].token_id, alone_late[0].token_id]
