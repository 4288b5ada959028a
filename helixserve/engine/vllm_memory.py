"""How much of a CUDA device one vllm stage may take: pure arithmetic, no torch, no vLLM.

Several stages may share one GPU (two workers on one card, `benchmarks/vllm_route.py`). Each
vLLM worker checks at start that `gpu_memory_utilization x total` bytes are free, and a stage
that sized itself from "what is free now" would take what the next stage needs. So a
stage's budget is explicit whenever the device is shared:

- `--gpu-memory-fraction F`: the stage may use F x the device's total memory (weights, KV
  cache and activations); it must be free when the stage starts. Its KV cache is what is
  left after the range's weights (measured once loaded) and an activation reserve, unless
  `--kv-cache-bytes` also fixes it.
- `--kv-cache-bytes N` alone: the KV cache is N bytes; after the weights are loaded N plus
  the activation reserve must still be free.
- neither: allowed only on a device nobody else uses (at most `SHARED_THRESHOLD_BYTES` in use
  when the stage starts); the stage then takes `LONE_STAGE_FRACTION` of the device.
  On a device already in use the stage is refused, naming both flags.

Stages that share a device must start one after another (each sees the memory the earlier
ones hold); `benchmarks/vllm_route.py` and `benchmarks/gpu_check.py` do.
"""

from __future__ import annotations

from dataclasses import dataclass

from helixserve.errors import UserError

GIB = 1 << 30
LONE_STAGE_FRACTION = 0.9
"""Share of the device a stage takes when it is alone on it and no budget is given."""
MAX_FRACTION = 0.95
"""Largest --gpu-memory-fraction (CUDA context, allocator slack and NCCL need the rest)."""
SHARED_THRESHOLD_BYTES = 2 * GIB
"""More than this in use by others at start (beyond a CUDA context): the device is shared."""
MIN_RESERVE_BYTES = 1 * GIB
RESERVE_SHARE = 0.1
"""Activation reserve: max(MIN_RESERVE_BYTES, RESERVE_SHARE x the stage's budget), kept out
of the KV cache for the step's activations, logits and the allocator's slack."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class GpuBudget:
    """One stage's memory on one CUDA device, decided before vLLM starts."""

    utilization: float
    """vLLM's gpu_memory_utilization: vLLM checks at start that this x total is free."""
    stage_bytes: int | None
    """The stage's whole budget (weights + KV + activations); None with --kv-cache-bytes
    alone (then what is free after loading bounds it)."""
    kv_cache_bytes: int | None
    """Fixed KV bytes, or None: what `kv_after_load` leaves."""
    device: str
    """e.g. cuda:0, for messages."""


def plan_gpu_budget(total_bytes: int, free_bytes: int, fraction: float | None,
                    kv_cache_bytes: int | None, device: str) -> GpuBudget:
    """The stage's budget from the device's memory at start and the flags (module doc);
    UserError naming the flag and the numbers when it cannot fit."""
    in_use = total_bytes - free_bytes
    if fraction is not None:
        if not 0.0 < fraction <= MAX_FRACTION:
            raise UserError(f"--gpu-memory-fraction: bad value {fraction}; need 0 < F <= "
                            f"{MAX_FRACTION}")
        stage = int(fraction * total_bytes)
        if stage > free_bytes:
            raise UserError(
                f"--gpu-memory-fraction: {fraction} of {device} is {gib(stage)} but only "
                f"{gib(free_bytes)} of {gib(total_bytes)} is free (other stages or processes "
                "hold the rest); the fractions of the stages sharing a device must fit in it")
        if kv_cache_bytes is not None and kv_cache_bytes >= stage:
            raise UserError(f"--kv-cache-bytes: {kv_cache_bytes} ({gib(kv_cache_bytes)}) does "
                            f"not fit in --gpu-memory-fraction {fraction} of {device} "
                            f"({gib(stage)}) with the range's weights")
        return GpuBudget(fraction, stage, kv_cache_bytes, device)
    if kv_cache_bytes is not None:
        if kv_cache_bytes + MIN_RESERVE_BYTES > free_bytes:
            raise UserError(f"--kv-cache-bytes: {kv_cache_bytes} ({gib(kv_cache_bytes)}) but "
                            f"only {gib(free_bytes)} of {device} is free")
        # vLLM's start check asks for utilization x total free; ask for what is free now.
        return GpuBudget(MAX_FRACTION * free_bytes / total_bytes, None, kv_cache_bytes, device)
    if in_use > SHARED_THRESHOLD_BYTES:
        raise UserError(
            f"--device {device}: {gib(in_use)} of {gib(total_bytes)} is already in use (another "
            "stage or process); give each stage on a shared GPU an explicit budget: "
            "--gpu-memory-fraction F (weights + KV + activations) or --kv-cache-bytes N")
    stage = int(min(LONE_STAGE_FRACTION * total_bytes, MAX_FRACTION * free_bytes))
    return GpuBudget(stage / total_bytes, stage, None, device)


def activation_reserve(stage_bytes: int) -> int:
    return max(MIN_RESERVE_BYTES, int(RESERVE_SHARE * stage_bytes))


def kv_after_load(budget: GpuBudget, held_bytes: int, free_bytes: int) -> int:
    """KV bytes once the range's weights are loaded: `held_bytes` is what this process holds
    on the device now (weights, buffers), `free_bytes` what the device has free now."""
    if budget.stage_bytes is None:  # --kv-cache-bytes alone
        assert budget.kv_cache_bytes is not None
        if budget.kv_cache_bytes + MIN_RESERVE_BYTES > free_bytes:
            raise UserError(
                f"--kv-cache-bytes: {budget.kv_cache_bytes} ({gib(budget.kv_cache_bytes)}) does "
                f"not fit on {budget.device} after the range's weights: {gib(free_bytes)} free "
                f"now, {gib(MIN_RESERVE_BYTES)} kept for activations")
        return budget.kv_cache_bytes
    reserve = activation_reserve(budget.stage_bytes)
    left = budget.stage_bytes - held_bytes - reserve
    if budget.kv_cache_bytes is not None:
        if budget.kv_cache_bytes > left:
            raise UserError(
                f"--kv-cache-bytes: {budget.kv_cache_bytes} ({gib(budget.kv_cache_bytes)}) does "
                f"not fit in the stage's {gib(budget.stage_bytes)} on {budget.device} with the "
                f"range's weights ({gib(held_bytes)}) and activations ({gib(reserve)})")
        return budget.kv_cache_bytes
    if left <= 0:
        raise UserError(
            f"--gpu-memory-fraction: the stage's {gib(budget.stage_bytes)} on {budget.device} "
            f"holds the range's weights ({gib(held_bytes)}) and the activation reserve "
            f"({gib(reserve)}) but no KV cache; raise the fraction or give the stage fewer layers")
    return left
