"""The GPU catalog: memory, memory bandwidth and dense tensor throughput per GPU type.

The rows of `examples/gpus.csv` ship in `helixserve/data/gpus.csv`, plus a `cpu`
pseudo-GPU so a local CPU cluster (the demo) can be planned too.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from helixserve.errors import UserError, read_user_file

DEFAULT_CATALOG = Path(__file__).resolve().parents[1] / "data" / "gpus.csv"


@dataclass(frozen=True)
class GpuSpec:
    name: str
    #: memory of one GPU, GB as on the datasheet
    memory_gb: float
    memory_bandwidth_gbytes_per_s: float
    #: dense (no 2:4 sparsity) tensor-core rate; 0 where the GPU has no bf16
    bf16_dense_tflops: float
    fp16_dense_tflops: float

    @property
    def dense_tflops(self) -> float:
        """Rate of the serving dtype: bf16 where supported, else fp16."""
        return self.bf16_dense_tflops if self.bf16_dense_tflops > 0 else self.fp16_dense_tflops


@dataclass
class GpuCatalog:
    gpus: dict[str, GpuSpec]
    source: str = "gpus.csv"

    def get(self, name: str, where: str | None = None) -> GpuSpec:
        """The GPU named `name`; an unknown name raises UserError listing the known ones."""
        gpu = self.gpus.get(name)
        if gpu is None:
            prefix = f"{where}: " if where else ""
            raise UserError(
                f"{prefix}unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}"
            )
        return gpu

    def __contains__(self, name: object) -> bool:
        return name in self.gpus

    def names(self) -> list[str]:
        return sorted(self.gpus)


def load_gpu_catalog(path: str | Path | None = None) -> GpuCatalog:
    """Read a catalog CSV (columns: docs/formats.md, "GPU catalog"); default: the shipped copy."""
    p = Path(path) if path is not None else DEFAULT_CATALOG
    text = read_user_file(p, "GPU catalog")
    reader = csv.DictReader(text.splitlines())
    need = ("gpu", "memory_gb", "memory_bandwidth_gbytes_per_s", "bf16_dense_tflops",
            "fp16_dense_tflops")
    missing = [c for c in need if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{p}: header: missing columns {', '.join(missing)}")
    gpus: dict[str, GpuSpec] = {}
    for line_no, row in enumerate(reader, start=2):
        name = (row["gpu"] or "").strip()
        values: list[float] = []
        for col in need[1:]:
            try:
                values.append(float(row[col]))
            except (TypeError, ValueError):
                raise UserError(f"{p}: line {line_no}: {col}: bad number {row[col]!r}") from None
            # memory, bandwidth and fp16 FLOP/s must be > 0; bf16 0 means "no bf16"
            positive = col != "bf16_dense_tflops"
            if not math.isfinite(values[-1]) or values[-1] < 0 or (positive and values[-1] == 0):
                raise UserError(f"{p}: line {line_no}: {col}: bad value {row[col]!r}; must be "
                                f"a finite number {'> 0' if positive else '>= 0'}")
        if name in gpus:
            raise UserError(f"{p}: line {line_no}: gpu: duplicate {name!r}")
        gpus[name] = GpuSpec(name, *values)
    return GpuCatalog(gpus, source=str(p))
