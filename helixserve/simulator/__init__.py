"""Discrete-event simulation of a placement serving a request stream (see docs/simulator.md).

sim = Simulation(cluster, model, cost, placement, requests, SimConfig(duration_s=600))
summary = summarize(sim.run())
"""

from helixserve.simulator.metrics import format_table, latencies, percentiles, summarize
from helixserve.simulator.presets import ENGINES, engine_config
from helixserve.simulator.sim import SimConfig, SimResult, Simulation
from helixserve.simulator.workload import (
    LengthFilter,
    TraceRequest,
    load_azure_trace,
    multi_turn,
    poisson_arrivals,
    prepare_trace,
)
from helixserve.spec.scheduling import KV_ALLOCATIONS

__all__ = [
    "ENGINES",
    "KV_ALLOCATIONS",
    "LengthFilter",
    "SimConfig",
    "SimResult",
    "Simulation",
    "TraceRequest",
    "engine_config",
    "format_table",
    "latencies",
    "load_azure_trace",
    "multi_turn",
    "percentiles",
    "poisson_arrivals",
    "prepare_trace",
    "summarize",
]
