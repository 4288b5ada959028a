"""The runtime's cost model: the one the planner and the simulator use, from the same files.

The coordinator needs a cost model twice: to route (the placement's max flow, evaluated when
the placement file has none, and each node's throughput T(k), which the maxflow router's
spread uses to share a layer range's flow among the nodes holding it: the simulator's router
gets the same, `scheduler/options.py`) and to re-plan live (`runtime/replan.py`). Both take
it from `runtime_cost_model`, the one place that builds it:

    inputs = CostInputs.load(profiles_path, gpus_path, dtype_bytes)   # `serve --profiles ...`
    cost = runtime_cost_model(model_dir, placement.model, inputs)     # cost.model: the ModelSpec

Without profiles it is the analytic model (the catalog's roofline), as `simulate` without
`--profiles` is. The workload, GPU reserve and weight cap are the plan's (`plan --workload`,
`--gpu-reserve-gb`, `--weight-fraction`; the defaults are `plan`'s: note that `simulate`
with its default engine, vllm, reserves 4.5 GB per GPU). `dtype_bytes` must be what the plan counted (`load_model`'s default, 2,
unless the planner was told otherwise: the CPU rig plans fp32, 4): it sizes the activations
the router's link capacities are in and the KV and weights the flow is evaluated with.
Torch-free, like the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.costmodel import CostModel, Workload
from helixserve.costmodel.model import WEIGHT_FRACTION
from helixserve.errors import UserError
from helixserve.spec import GpuCatalog, ProfileTable, load_gpu_catalog, load_model, load_profiles

#: bytes per weight/activation element the planner counts unless told otherwise (bf16/fp16)
DEFAULT_DTYPE_BYTES = 2
#: element sizes a plan may count: fp8, bf16/fp16, fp32
DTYPE_BYTES = (1, 2, 4)


@dataclass(frozen=True)
class CostInputs:
    """What the runtime's cost model is built from; the defaults give the analytic model."""

    #: measured per-layer times (`helixserve profile`); None: the analytic roofline
    profiles: ProfileTable | None = None
    #: the GPU catalog the cluster's `gpu` names are looked up in; None: the shipped one
    catalog: GpuCatalog | None = None
    #: bytes per element the plan counted (module doc)
    dtype_bytes: int = DEFAULT_DTYPE_BYTES
    #: the mix the plan's flow is in (`plan --workload`); None: decode-only (the default)
    workload: Workload | None = None
    #: memory per GPU kept outside weights and KV (`--gpu-reserve-gb`); None: the cost model's
    reserved_gb_per_gpu: float | None = None
    #: the weight cap (`--weight-fraction`)
    weight_fraction: float = WEIGHT_FRACTION

    def __post_init__(self) -> None:
        if self.dtype_bytes not in DTYPE_BYTES:
            raise UserError(f"coordinator: cost: dtype_bytes: bad value {self.dtype_bytes!r}; "
                            f"known: {', '.join(map(str, DTYPE_BYTES))}")

    @classmethod
    def load(cls, profiles_path: str | Path | None = None, gpus_path: str | Path | None = None,
             dtype_bytes: int = DEFAULT_DTYPE_BYTES, *, profiles_flag: str = "--profiles",
             gpus_flag: str = "--gpus", **model_options: Any) -> CostInputs:
        """Read the files; a missing or bad one is a UserError naming the flag, the file and
        the problem (the loaders' messages name the file and the problem)."""
        profiles = catalog = None
        if profiles_path is not None:
            try:
                profiles = load_profiles(profiles_path)
            except UserError as exc:
                raise UserError(f"{profiles_flag}: {exc}") from None
        if gpus_path is not None:
            try:
                catalog = load_gpu_catalog(gpus_path)
            except UserError as exc:
                raise UserError(f"{gpus_flag}: {exc}") from None
        return cls(profiles, catalog, dtype_bytes, **model_options)

    def describe(self) -> str:
        """For the startup log: where the router's and re-plan's numbers come from."""
        source = (f"profiles {self.profiles.source}" if self.profiles is not None
                  else "the analytic model (no profiles)")
        catalog = f", GPU catalog {self.catalog.source}" if self.catalog is not None else ""
        mix = f", workload {self.workload.describe()}" if self.workload is not None else ""
        return f"cost model: {source}{catalog}, {self.dtype_bytes}-byte dtype{mix}"


def runtime_cost_model(model_dir: str | Path, model_name: str | None,
                       inputs: CostInputs | None = None) -> CostModel:
    """The cost model the coordinator routes and re-plans with (module doc); `model_name`:
    the placement's model, the name its profiles are looked up by (None: the directory's)."""
    inputs = inputs or CostInputs()
    model = load_model(model_dir, name=model_name or None, dtype_bytes=inputs.dtype_bytes)
    return CostModel(model, inputs.profiles, inputs.catalog, workload=inputs.workload,
                     reserved_gb_per_gpu=inputs.reserved_gb_per_gpu,
                     weight_fraction=inputs.weight_fraction)
