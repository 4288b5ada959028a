"""Cost model: batch time on a layer range, memory per node, node throughput T(k)."""

from helixserve.costmodel.model import (
    DEFAULT_CONTEXT_TOKENS,
    MEMORY_UTILIZATION,
    WEIGHT_FRACTION,
    CostModel,
    Efficiency,
)
from helixserve.costmodel.workload import Workload

__all__ = [
    "DEFAULT_CONTEXT_TOKENS",
    "MEMORY_UTILIZATION",
    "WEIGHT_FRACTION",
    "CostModel",
    "Efficiency",
    "Workload",
]
