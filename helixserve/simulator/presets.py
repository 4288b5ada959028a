"""Engine models: named presets of the `SimConfig` fields that say how a node's engine
allocates KV cache and batches prompts (see docs/simulator.md).

- `reserve`: every request reserves prompt + output KV on its route at admission, and a node
  prefills whole prompts up to its profile's largest batch (the `SimConfig` defaults).
- `vllm`: on-demand KV allocation with recompute preemption, as vLLM's paged KV cache;
  chunked prefill of 512 prompt tokens an iteration (vLLM's `max_num_batched_tokens`), the
  prompt sent in 512-token chunks that pipeline along the route (as the coordinator sends
  them); at most 64 admitted requests still prefilling (admission waits beyond that).
Both keep 1% of each node's KV cache free at admission (`kv_watermark`, vLLM's default
watermark; it matters only with on-demand allocation, where running requests grow into it).
- `helix-prototype`: what the Helix authors' prototype runs (`llm_sys/` of
  Thesys-lab/Helix-ASPLOS25; docs/calibration.md): vLLM 0.4.0 workers (on-demand KV, whole
  prompts of at most `max_num_batched_tokens` = 4096 tokens an iteration, no chunking); a
  host that admits a request when prompt + 240 tokens (its expected output) on every node of
  the route keep the node's promises under 85% of its KV, and routes by IWRR over the
  solver's flow (no spread; past full nodes it spills, where Helix's host makes the request
  wait: `HELIX_ROUTER` below and `helix-host` route as it does); offline, its feeder
  (`offline_feed="kv-feeder"`: 20 requests, then one per finished prompt or request while
  the busiest layer is at most 80% promised);
  and a per-layer cost of `HELIX_PROTOTYPE_LAYER_OVERHEAD_S` a layer and iteration that its
  engine and host pay beyond the per-layer profiles, fitted to the prototype's own online
  run on Helix's placement (`benchmarks/calibration.py`).

An engine also decides how much of each GPU's memory it keeps for itself outside weights
and KV (`ENGINE_GPU_RESERVE_GB`): `vllm` keeps the 4.5 GB fitted to the KV blocks vLLM 0.4.0
allocated in Helix's measurements (costmodel.VLLM_RESERVED_GB_PER_GPU); `reserve` keeps the
cost model's default (1 GiB). `--gpu-reserve-gb` overrides it; the cost model that plans
and simulates is built with it, so a placement is planned for the memory it will have.

`helixserve simulate --engine` and `benchmarks/serving_sim.py --engine` both read `ENGINES`,
and both default to `vllm`, the model of what the runtime serves (its coordinator's
on-demand KV, 1% watermark and 512-token prefill chunks: runtime/config.py).
"""

from __future__ import annotations

from typing import Any

from helixserve.costmodel.model import VLLM_RESERVED_GB_PER_GPU
from helixserve.errors import UserError
from helixserve.scheduler.maxflow import HELIX_MIN_FLOW_SHARE
from helixserve.spec.scheduling import (
    DEFAULT_KV_WATERMARK,
    DEFAULT_MAX_PREFILLING,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_STEP_PROMPT_TOKENS,
)

#: seconds a layer and iteration that Helix's prototype spends beyond the per-layer profiles,
#: fitted by `benchmarks/calibration.py` to its online run on Helix's single-24 placement
#: (the same arrivals replayed: 139.3 decode tokens/s measured); it stands for what the
#: profiles leave out under load (docs/calibration.md), not for a constant of the GPU
HELIX_PROTOTYPE_LAYER_OVERHEAD_S = 0.0035

#: SimConfig fields of each engine model, by name
ENGINES: dict[str, dict[str, Any]] = {
    "vllm": {
        "kv_allocation": "on-demand",
        "chunked_prefill": True,
        "prefill_chunk_tokens": DEFAULT_PREFILL_CHUNK_TOKENS,
        "max_prompt_tokens": DEFAULT_STEP_PROMPT_TOKENS,
        "max_prefilling": DEFAULT_MAX_PREFILLING,
        "kv_watermark": DEFAULT_KV_WATERMARK,
    },
    "reserve": {
        "kv_allocation": "reserve",
        "chunked_prefill": False,
        "prefill_chunk_tokens": None,
        "max_prompt_tokens": None,
        "max_prefilling": None,
        "kv_watermark": DEFAULT_KV_WATERMARK,
    },
    "helix-prototype": {
        "kv_allocation": "on-demand",
        "chunked_prefill": False,
        "prefill_chunk_tokens": None,
        "max_prompt_tokens": 4096,  # llm_sys/worker.py: EngineArgs(max_num_batched_tokens=4096)
        "max_prefilling": None,
        "kv_watermark": 0.15,  # promises up to KVParameters(expected_kv_hwm=0.85)
        "kv_expected_output_tokens": 240,  # AVG_OUTPUT_LEN x expected_output_length_ratio 1
        "offline_feed": "kv-feeder",  # run_maxflow_host_offline
        "feed_initial_requests": 20,
        "feed_interval_s": 0.1,
        "feed_kv_fraction": 0.8,  # feeding_hwm
        "router_spread": False,  # IWRR over the max-flow solution as solved
        "layer_overhead_s": HELIX_PROTOTYPE_LAYER_OVERHEAD_S,
    },
}

#: the maxflow router's knobs as Helix's scheduler has them (`--helix-router`): IWRR over the
#: solver's flow as given, edges under 5% of their vertex's outflow masked, no hop outside the
#: flow. helix-prototype keeps spread off but spills and masks at 1%: with the flows of our
#: LP, Helix's masks would idle nodes that Helix's own flow (over its own node capacities)
#: uses, e.g. 4 of the authors' 24 on helix-single-24 (docs/benchmarks.md, "Helix's router")
HELIX_ROUTER: dict[str, Any] = {
    "router_spread": False,
    "router_spill": False,
    "router_min_flow_share": HELIX_MIN_FLOW_SHARE,
}

#: helix-prototype routed as Helix's host routes (HELIX_ROUTER) over the placement's flows:
#: a node our LP's flow leaves at zero runs nothing. An experiment for the served objective's
#: second model (`plan --serve-also helix-host`; docs/benchmarks.md, "Helix's router")
ENGINES["helix-host"] = {**ENGINES["helix-prototype"], **HELIX_ROUTER}

#: GB per GPU each engine keeps outside weights and KV (None: the cost model's default)
ENGINE_GPU_RESERVE_GB: dict[str, float | None] = {
    "vllm": VLLM_RESERVED_GB_PER_GPU,
    "reserve": None,
    "helix-prototype": VLLM_RESERVED_GB_PER_GPU,  # the same vLLM 0.4.0 measurements
    "helix-host": VLLM_RESERVED_GB_PER_GPU,
}

def engine_gpu_reserve_gb(name: str, override: float | None = None) -> float | None:
    """GB per GPU a cost model for engine `name` keeps: `override` (--gpu-reserve-gb) when
    given, else the engine's (None: the cost model's default)."""
    return override if override is not None else ENGINE_GPU_RESERVE_GB[name]


def engine_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The SimConfig fields of engine `name` with `overrides` (None: keep the preset's value).

    Raises UserError for an unknown engine or field; bounds are checked by the caller, which
    knows what the user typed (a flag, a file field)."""
    if name not in ENGINES:
        raise UserError(f"engine: unknown engine model {name!r}; known: {', '.join(ENGINES)}")
    config = dict(ENGINES[name])
    for key, value in overrides.items():
        if key not in config:
            raise UserError(f"engine: unknown option {key!r}; known: {', '.join(config)}")
        if value is not None:
            config[key] = value
    return config
