"""Kubernetes manifests rendered from a placement (`helixserve deploy k8s`).

`k8s` builds each object as a plain dict, `render` checks the inputs and turns them into
deterministic YAML files, `gpu_labels` maps catalog GPU names to node labels. Control-plane
code only: no torch, grpc or fastapi.
"""

from helixserve.deploy.gpu_labels import (
    DEFAULT_GPU_PRODUCTS,
    gpu_product_label,
    parse_gpu_product_overrides,
)
from helixserve.deploy.k8s import RenderOptions, WorkerSpec
from helixserve.deploy.render import Rendering, render_k8s, write_manifests

__all__ = [
    "DEFAULT_GPU_PRODUCTS",
    "RenderOptions",
    "Rendering",
    "WorkerSpec",
    "gpu_product_label",
    "parse_gpu_product_overrides",
    "render_k8s",
    "write_manifests",
]
