"""Validated inputs: cluster YAML, model config.json, profiles CSV, GPU catalog.

Pure data and parsing; imports nothing else of helixserve but `errors`.
"""

from helixserve.spec.cluster import (
    COORDINATOR,
    DEFAULT_LINK,
    ClusterSpec,
    LinkSpec,
    NodeSpec,
    group_machines,
    load_cluster,
    machine_type,
    parse_cluster,
)
from helixserve.spec.gpus import GpuCatalog, GpuSpec, load_gpu_catalog
from helixserve.spec.model import DTYPE_BYTES, TOKEN_ID_BYTES, ModelSpec, load_model, parse_model
from helixserve.spec.profiles import Curve, ProfileTable, load_profiles

__all__ = [
    "COORDINATOR",
    "DEFAULT_LINK",
    "DTYPE_BYTES",
    "ClusterSpec",
    "Curve",
    "GpuCatalog",
    "GpuSpec",
    "LinkSpec",
    "ModelSpec",
    "NodeSpec",
    "ProfileTable",
    "TOKEN_ID_BYTES",
    "group_machines",
    "load_cluster",
    "load_gpu_catalog",
    "load_model",
    "load_profiles",
    "machine_type",
    "parse_cluster",
    "parse_model",
]
