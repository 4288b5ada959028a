"""Validated inputs: cluster YAML, model config.json, profiles CSV, GPU catalog.

Pure data and parsing; imports nothing else of helixserve but `errors`.
"""

from helixserve.spec.cluster import (
    COORDINATOR,
    DEFAULT_LINK,
    ClusterSpec,
    LinkSpec,
    NodeSpec,
    load_cluster,
    parse_cluster,
)
from helixserve.spec.gpus import GpuCatalog, GpuSpec, load_gpu_catalog
from helixserve.spec.model import ModelSpec, load_model, parse_model
from helixserve.spec.profiles import Curve, ProfileTable, load_profiles

__all__ = [
    "COORDINATOR",
    "DEFAULT_LINK",
    "ClusterSpec",
    "Curve",
    "GpuCatalog",
    "GpuSpec",
    "LinkSpec",
    "ModelSpec",
    "NodeSpec",
    "ProfileTable",
    "load_cluster",
    "load_gpu_catalog",
    "load_model",
    "load_profiles",
    "parse_cluster",
    "parse_model",
]
