"""GPU catalog names -> the `nvidia.com/gpu.product` node label that selects them.

NVIDIA GPU feature discovery (GFD, part of the GPU operator) labels every GPU node with
`nvidia.com/gpu.product`: the driver's product name (`nvidia-smi --query-gpu=name`) with
spaces replaced by dashes, e.g. "NVIDIA A100-SXM4-40GB" -> `NVIDIA-A100-SXM4-40GB`. The
catalog name says less than that (an A100-40GB may be SXM4 or PCIe), so the table below
holds the most common form and `--gpu-product NAME=LABEL` overrides it per cluster.
Check a node's real value with `kubectl get nodes -L nvidia.com/gpu.product`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from helixserve.errors import UserError

PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"

#: GPU type of nodes that run on CPU only: no GPU selector, no GPU resource, `--device cpu`.
CPU_GPU = "cpu"

#: Catalog GPU name -> default GFD product label (datacenter SKU of each catalog entry).
DEFAULT_GPU_PRODUCTS: dict[str, str] = {
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H100-PCIe": "NVIDIA-H100-PCIe",
    "H200-141GB": "NVIDIA-H200",
    "L40S": "NVIDIA-L40S",
    "L4": "NVIDIA-L4",
    "A10": "NVIDIA-A10",
    "A10G": "NVIDIA-A10G",
    "V100-16GB": "Tesla-V100-SXM2-16GB",
    "V100-32GB": "Tesla-V100-SXM2-32GB",
    "T4": "Tesla-T4",
    "RTX-4090": "NVIDIA-GeForce-RTX-4090",
}

# Kubernetes label value: at most 63 characters, alphanumeric at both ends, [-_.] inside.
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def check_label_value(value: str, where: str) -> str:
    if not value or not _LABEL_VALUE.match(value):
        raise UserError(
            f"{where}: bad label value {value!r}; a Kubernetes label value is 1-63 characters "
            "[A-Za-z0-9-_.], starting and ending with a letter or digit"
        )
    return value


def parse_gpu_product_overrides(items: Iterable[str]) -> dict[str, str]:
    """`["A100-40GB=NVIDIA-A100-PCIE-40GB", ...]` -> {catalog name: label}; UserError if malformed."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, label = item.partition("=")
        name, label = name.strip(), label.strip()
        if not sep or not name or not label:
            raise UserError(
                f"--gpu-product: bad value {item!r}; expected GPU=LABEL, "
                "e.g. A100-40GB=NVIDIA-A100-PCIE-40GB"
            )
        out[name] = check_label_value(label, f"--gpu-product {name}")
    return out


def gpu_product_label(gpu: str, overrides: Mapping[str, str] | None = None) -> str:
    """The `nvidia.com/gpu.product` value for catalog GPU `gpu`; overrides win."""
    if overrides and gpu in overrides:
        return overrides[gpu]
    if gpu in DEFAULT_GPU_PRODUCTS:
        return DEFAULT_GPU_PRODUCTS[gpu]
    known = ", ".join(sorted(DEFAULT_GPU_PRODUCTS))
    raise UserError(
        f"no nvidia.com/gpu.product label known for GPU {gpu!r}; known: {known}; "
        f"pass --gpu-product {gpu}=LABEL (see `kubectl get nodes -L nvidia.com/gpu.product`)"
    )
