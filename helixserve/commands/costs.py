"""The cost model of the commands, built in one place.

`plan`, `evaluate`, `simulate` and `serve` (and `demo`, the benchmarks' rig) take the same
cost flags, added by `add_cost_args`:

    --profiles CSV         measured per-layer times (default: the analytic model)
    --gpus CSV             GPU catalog (default: the shipped one)
    --gpu-reserve-gb GB    memory per GPU outside weights and KV
    --weight-fraction F    the weight cap
    --workload MIX         the request mix a unit of flow is in

`read_cost_flags` reads and checks them (files read now; a bad one is a UserError naming the
flag, the file and the problem) and `build_cost_model` makes the CostModel of a model and a
cluster from them, checking that the profiles time this model: a `--profiles` file with no
row for the model's name (the directory's name, or `--model-name`) is an error listing the
models it has, not a silent fall back to the analytic model; machines of the cluster it does
not time get a warning on stderr. `serve` builds the runtime's CostInputs from the same
flags (`commands/serve.py`), the coordinator making the model later.

Standard library only at module level, as every command module.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from helixserve.commands.args import finite_float


def add_reserve_arg(p: argparse.ArgumentParser) -> None:
    """--gpu-reserve-gb and --weight-fraction."""
    p.add_argument("--gpu-reserve-gb", type=finite_float, default=None, metavar="GB",
                   help="memory per GPU the serving engine keeps outside weights and KV "
                   "(CUDA context, activations, graphs); more means less KV on every node. "
                   "Default 1.07 (1 GiB); simulate (its default engine vllm): 4.5, fitted to "
                   "the KV vLLM 0.4.0 allocated in Helix's measurements. The weight cap per node "
                   "does not change")
    p.add_argument("--weight-fraction", type=finite_float, default=None, metavar="F",
                   help="most of a node's memory its weights may take (the weight cap; "
                   "default 0.5, Helix's rule). Higher lets fewer or smaller machines hold "
                   "the model, with less KV cache each, so lower throughput per node")


def add_workload_arg(p: argparse.ArgumentParser) -> None:
    """--workload."""
    from helixserve.simulator.mix import DEFAULT_WORKLOAD

    p.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="MIX",
                   help="the request mix the max flow counts (docs/planner.md, "
                   "\"Workload-aware planning\"): a unit of flow is one output token/s of it, "
                   "each bringing its prompt tokens' prefill and link bytes. decode (Helix's "
                   "decode-only flow: prompts cost nothing; measured to serve the conversation "
                   "trace best, docs/workload.md), conversation (the Azure conversation "
                   "trace's mean lengths, 763 prompt : 232 output tokens), "
                   "PROMPT:OUTPUT mean tokens (e.g. 2000:30, prefill-heavy) or an "
                   f"Azure-format trace CSV (its mean lengths). Default {DEFAULT_WORKLOAD}")


def add_cost_args(p: argparse.ArgumentParser, *, profiles_help: str | None = None,
                  gpus_help: str | None = None) -> None:
    """--profiles, --gpus, --gpu-reserve-gb, --weight-fraction and --workload."""
    p.add_argument("--profiles", metavar="CSV",
                   help=profiles_help or "measured per-layer times CSV (format: "
                   "docs/formats.md; its `model` column must have the model's name, the "
                   "model directory's or --model-name; default: none, the analytic roofline "
                   "model from the GPU catalog)")
    p.add_argument("--gpus", metavar="CSV",
                   help=gpus_help or "GPU catalog CSV, when the cluster's gpu names are not "
                   "in the shipped one (default: the one shipped in the package)")
    add_reserve_arg(p)
    add_workload_arg(p)


def weight_fraction(args: argparse.Namespace) -> float:
    """The --weight-fraction value, checked (UserError naming the flag)."""
    from helixserve.costmodel.model import MAX_WEIGHT_FRACTION, WEIGHT_FRACTION
    from helixserve.errors import UserError

    value = getattr(args, "weight_fraction", None)
    if value is None:
        return WEIGHT_FRACTION
    if not 0.0 < value <= MAX_WEIGHT_FRACTION:
        raise UserError(f"--weight-fraction: bad value {value}; must be in "
                        f"(0, {MAX_WEIGHT_FRACTION}] (a share of the node's memory)")
    return value


def reserve_gb(args: argparse.Namespace) -> float | None:
    """The --gpu-reserve-gb value, checked (UserError naming the flag)."""
    from helixserve.errors import UserError

    value = getattr(args, "gpu_reserve_gb", None)
    if value is not None and not 0.0 <= value < 1e4:
        raise UserError(f"--gpu-reserve-gb: bad value {value}; must be >= 0 (GB per GPU)")
    return value


def workload(args: argparse.Namespace) -> Any:
    """The --workload value parsed (None: decode-only); UserError naming the flag."""
    from helixserve.simulator.mix import DEFAULT_WORKLOAD, parse_workload

    return parse_workload(getattr(args, "workload", None) or DEFAULT_WORKLOAD)


@dataclass(frozen=True)
class CostFlags:
    """The cost flags, checked and their files read."""

    #: --profiles (None: the analytic model)
    profiles: Any
    #: --gpus (None: the shipped catalog)
    catalog: Any
    #: --gpu-reserve-gb (None: the cost model's, or the engine's in `simulate`)
    reserved_gb_per_gpu: float | None
    #: --weight-fraction
    weight_fraction: float
    #: --workload (None: decode-only)
    workload: Any


def read_cost_flags(args: argparse.Namespace) -> CostFlags:
    """The cost flags of `args`, checked, files read; UserError naming the flag and file."""
    from helixserve.errors import UserError
    from helixserve.spec import load_gpu_catalog, load_profiles

    mix = workload(args)  # a bad value fails before the files are read
    reserve = reserve_gb(args)
    fraction = weight_fraction(args)
    profiles = catalog = None
    for flag, attr, loader in (("--profiles", "profiles", load_profiles),
                               ("--gpus", "gpus", load_gpu_catalog)):
        path = getattr(args, attr, None)
        if path is None:
            continue
        try:
            value = loader(path)
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if attr == "profiles":
            profiles = value
        else:
            catalog = value
    return CostFlags(profiles, catalog, reserve, fraction, mix)


def check_profiles_model(profiles: Any, model_name: str, *,
                         named_by: str = "the model directory's name, or --model-name") -> None:
    """UserError when `profiles` has no row of `model_name`: its times would be ignored."""
    from helixserve.errors import UserError

    models = sorted({key[0] for key in profiles.curves} | {key[0] for key in profiles.head_curves})
    if model_name not in models:
        raise UserError(f"--profiles {profiles.source}: model: no rows for model "
                        f"{model_name!r} ({named_by}); models in the file: "
                        f"{', '.join(models) or 'none'}")


def unprofiled_machines(profiles: Any, model_name: str, cluster: Any) -> list[str]:
    """'T4 x2 (n4, n5)' for each machine type of `cluster` that `profiles` does not time for
    `model_name` (both phases): the analytic model times those."""
    groups: dict[tuple[str, int], list[str]] = {}
    for node in cluster.nodes:
        if not profiles.has(model_name, node.gpu, node.num_gpus):
            groups.setdefault((node.gpu, node.num_gpus), []).append(node.name)
    out = []
    for (gpu, num), names in groups.items():
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        out.append(f"{gpu} x{num} ({shown})")
    return out


def build_cost_model(flags: CostFlags, model: Any, cluster: Any = None, *,
                     reserved_gb_per_gpu: float | None = None, quiet: bool = False) -> Any:
    """The CostModel of `model` from the flags (`reserved_gb_per_gpu` given: instead of the
    flag's, as `simulate` resolves it with its engine's). With profiles, a model they have
    no row of is a UserError; machines of `cluster` they do not time are warned of."""
    from helixserve.costmodel import CostModel

    if flags.profiles is not None:
        check_profiles_model(flags.profiles, model.name)
        missing = unprofiled_machines(flags.profiles, model.name, cluster) if cluster else []
        if missing and not quiet:
            print(f"warning: --profiles {flags.profiles.source}: no {model.name} rows for "
                  f"{'; '.join(missing)}: the analytic model times them", file=sys.stderr)
    reserve = reserved_gb_per_gpu if reserved_gb_per_gpu is not None \
        else flags.reserved_gb_per_gpu
    return CostModel(model, flags.profiles, flags.catalog, reserved_gb_per_gpu=reserve,
                     weight_fraction=flags.weight_fraction, workload=flags.workload)
