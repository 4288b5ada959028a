"""The worker-start self-check (engine/selfcheck.py) on the torch engine over a tiny random
Llama: a correct engine passes on every kind of range; a decode path that goes wrong, an engine
that raises, or a disagreement with the reference fails with one line naming the engine, the
device and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import make_random_model

from helixserve.engine import ShardEngine
from helixserve.engine.protocol import ItemOutput, WorkItem
from helixserve.engine.selfcheck import SelfCheckError, load_reference, self_check
from helixserve.errors import UserError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("selfcheck") / "llama", "llama")


def load(model: Path, a: int, b: int, dtype: torch.dtype = torch.float32) -> ShardEngine:
    return ShardEngine.load(model, a, b, "cpu", dtype, kv_cache_bytes=8 << 20)


class Faulty:
    """An engine whose single-token (decode) steps go wrong, as a GPU decode path might;
    reports itself as `name`."""

    def __init__(self, inner: ShardEngine, name: str = "vllm", raise_on_decode: bool = False,
                 always: bool = False) -> None:
        self.inner, self.engine_name = inner, name
        self.raise_on_decode, self.always = raise_on_decode, always

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def step(self, items: list[WorkItem]) -> list[ItemOutput]:
        outs = self.inner.step(items)
        for it, out in zip(items, outs, strict=True):
            if len(it.token_ids) != 1 and not self.always:
                continue
            if self.raise_on_decode:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if out.hidden is not None:
                out.hidden = out.hidden * 1.5
            elif out.token_id is not None:
                out.token_id = (out.token_id + 1) % self.inner.vocab_size
        return outs


@pytest.mark.parametrize("layers", [(0, 4), (0, 2), (1, 3), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_correct_engine_passes_and_frees_its_requests(tiny: Path, layers: tuple[int, int],
                                                        dtype: torch.dtype) -> None:
    eng = load(tiny, *layers, dtype)
    report = self_check(eng, "cpu")
    assert report.engine == "torch" and report.reference is None
    assert report.max_rel_diff <= (1e-3 if dtype == torch.float32 else 0.15)
    assert "self-check passed: engine torch on cpu" in report.line()
    assert eng.kv_stats()["used_blocks"] == 0 and eng.seq_len("helix-selfcheck-a") == 0


@pytest.mark.parametrize("layers", [(1, 3), (2, 4)])
def test_a_wrong_decode_path_fails_naming_engine_device_and_fix(tiny: Path,
                                                                layers: tuple[int, int]) -> None:
    eng = load(tiny, *layers)
    with pytest.raises(SelfCheckError) as err:
        self_check(Faulty(eng), "cuda:0")
    msg = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in msg
    assert msg.startswith("self-check failed: engine vllm on cuda:0: prefill + 2 decode steps")
    assert msg.endswith("start the worker with --engine torch (helixserve's own engine)")
    assert eng.kv_stats()["used_blocks"] == 0


def test_an_engine_that_raises_fails_with_its_error(tiny: Path) -> None:
    with pytest.raises(SelfCheckError, match="raised RuntimeError: CUDA error: an illegal"):
        self_check(Faulty(load(tiny, 0, 2), raise_on_decode=True), "cuda:0")


def test_the_reference_path_passes_when_engines_agree_and_fails_when_not(tiny: Path) -> None:
    eng = load(tiny, 1, 4)
    ref = load_reference("vllm", tiny, 1, "cpu", torch.float32)
    assert ref is not None and (ref.start_layer, ref.end_layer) == (1, 2)
    report = self_check(eng, "cpu", reference=ref)
    assert report.reference == "engine torch on layers [1, 2)"
    assert report.reference_rel_diff is not None and report.reference_rel_diff < 1e-5
    # an engine that is consistent with itself but wrong on every step: only the reference
    # catches it
    with pytest.raises(SelfCheckError, match=r"layers \[1, 2\) vs helixserve's torch engine"):
        self_check(Faulty(eng, always=True), "cpu", reference=ref)
    assert eng.kv_stats()["used_blocks"] == 0 and ref.kv_stats()["used_blocks"] == 0


def test_the_last_layer_reference_compares_tokens(tiny: Path) -> None:
    eng = load(tiny, 3, 4)
    ref = load_reference("vllm", tiny, 3, "cpu", torch.float32)
    assert self_check(eng, "cpu", reference=ref).reference == "engine torch on layers [3, 4)"
    with pytest.raises(SelfCheckError, match="greedy token"):
        self_check(Faulty(eng, always=True), "cpu", reference=ref)


def test_torch_and_emulated_have_no_reference(tiny: Path) -> None:
    assert load_reference("torch", tiny, 0, "cpu", torch.float32) is None
    assert load_reference("emulated", tiny, 0, "cpu", None) is None


def test_auto_without_vllm_takes_torch_and_says_why(tiny: Path, monkeypatch) -> None:
    from helixserve.engine import registry

    monkeypatch.setattr(registry, "vllm_installed", lambda: False)
    choice = registry.load_checked("auto", tiny, 0, 2, device="cpu", dtype=torch.float32,
                                   kv_cache_bytes=8 << 20)
    assert choice.name == "torch" and choice.engine.engine_name == "torch"
    assert choice.reason.startswith("engine auto: torch on cpu (vLLM is not installed); "
                                    "self-check passed")


def test_auto_falls_back_to_torch_when_vllm_fails_its_self_check(tiny: Path,
                                                                 monkeypatch) -> None:
    """vLLM 'installed' on 'CUDA' (both faked) whose stage decodes wrongly: auto serves with
    torch and names the failure; asked for by name, the same failure is one UserError line."""
    from helixserve.engine import registry

    real_load = registry.load_engine

    def load_engine(name: str, *args: Any, **kw: Any) -> Any:
        if name == "vllm":
            return Faulty(load(tiny, 0, 2))
        return real_load(name, *args, **kw)

    def load_reference(name: str, model_dir: Any, start: int, device: str, dtype: Any) -> Any:
        return None

    monkeypatch.setattr(registry, "vllm_installed", lambda: True)
    monkeypatch.setattr(registry, "engine_version", lambda name: "0.32.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(registry, "load_engine", load_engine)
    monkeypatch.setattr("helixserve.engine.selfcheck.load_reference", load_reference)
    monkeypatch.setattr(registry, "_release_device_memory", lambda: None)
    choice = registry.load_checked("auto", tiny, 0, 2, device="cpu", dtype=torch.float32,
                                   kv_cache_bytes=8 << 20)
    assert choice.name == "torch" and choice.engine.engine_name == "torch"
    assert choice.reason.startswith("engine auto: torch on cpu (vLLM 0.32.0 failed its "
                                    "self-check: prefill + 2 decode steps")
    with pytest.raises(SelfCheckError, match="engine vllm on cpu: .*--engine torch"):
        registry.load_checked("vllm", tiny, 0, 2, device="cpu", dtype=torch.float32)


def test_auto_keeps_vllm_when_it_passes_and_says_so(tiny: Path, monkeypatch) -> None:
    from helixserve.engine import registry

    real_load = registry.load_engine
    loaded: list[str] = []

    def load_engine(name: str, *args: Any, **kw: Any) -> Any:
        loaded.append(name)
        if name == "vllm":  # a correct engine that calls itself vllm
            return _Named(load(tiny, 0, 2), "vllm")
        return real_load(name, *args, **kw)

    monkeypatch.setattr(registry, "vllm_installed", lambda: True)
    monkeypatch.setattr(registry, "engine_version", lambda name: "0.32.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(registry, "load_engine", load_engine)
    choice = registry.load_checked("auto", tiny, 0, 2, device="cpu", dtype=torch.float32,
                                   kv_cache_bytes=8 << 20)
    assert loaded == ["vllm"] and choice.name == "vllm"
    assert choice.reason.startswith("engine auto: vllm on cpu (vLLM 0.32.0 installed, CUDA "
                                    "present, self-check passed); self-check passed: engine "
                                    "vllm on cpu")
    assert "vs engine torch on layers [0, 1)" in choice.reason  # the reference ran


class _Named:
    """A correct engine reporting itself as `name`."""

    def __init__(self, inner: ShardEngine, name: str) -> None:
        self.inner, self.engine_name = inner, name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)
