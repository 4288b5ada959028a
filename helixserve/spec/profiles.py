"""Measured per-layer times (CSV `model,gpu,num_gpus,phase,batch_tokens,layer_ms[,part]`).

A curve is the time of ONE layer as a function of the tokens in the batch, for one
(model, gpu, num_gpus, phase). Curves are kept sorted by batch_tokens; they are not
assumed monotone (the Helix measurements have dips).

The optional column `part` says what a row times: `layer` (the default, and every row of a
file without the column) or `head`: the last stage's final norm + lm_head + sampling, run
once per step on the rows it samples. A head row's `batch_tokens` is the number of those
rows (the decode batch; for a prompt step the sequences whose prompt ends in it, one row
each) and its `layer_ms` the head's whole time for them.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helixserve.errors import UserError, read_user_file

PHASES = ("prompt", "decode")
COLUMNS = ("model", "gpu", "num_gpus", "phase", "batch_tokens", "layer_ms")
#: optional columns (docs/formats.md: added fields are optional; a file without them reads as before)
PART_COLUMN = "part"
PARTS = ("layer", "head")

CurveKey = tuple[str, str, int, str]  # (model, gpu, num_gpus, phase)


@dataclass(frozen=True)
class Curve:
    #: strictly increasing batch sizes
    batch_tokens: tuple[int, ...]
    layer_ms: tuple[float, ...]


@dataclass
class ProfileTable:
    curves: dict[CurveKey, Curve] = field(default_factory=dict)
    source: str = "profiles"
    #: rows with part=head: the head's time (not per layer) vs rows sampled in the step
    head_curves: dict[CurveKey, Curve] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ProfileTable:
        return cls({}, source="(none)")

    def curve(self, model: str, gpu: str, num_gpus: int, phase: str) -> Curve | None:
        return self.curves.get((model, gpu, num_gpus, phase))

    def head_curve(self, model: str, gpu: str, num_gpus: int, phase: str) -> Curve | None:
        return self.head_curves.get((model, gpu, num_gpus, phase))

    def has(self, model: str, gpu: str, num_gpus: int) -> bool:
        """True when both phases are measured for this model on this machine."""
        return all((model, gpu, num_gpus, ph) in self.curves for ph in PHASES)

    def keys(self) -> list[CurveKey]:
        return sorted(self.curves)


def _field(row: dict[str, str], column: str, kind: type[int] | type[float], where: str) -> Any:
    try:
        return kind(row[column])
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise UserError(f"{where}: {column}: bad value {row[column]!r}; expected {what}") from None


def load_profiles(path: str | Path) -> ProfileTable:
    p = Path(path)
    text = read_user_file(p, "profiles")
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{p}: header: missing columns {', '.join(missing)}; expected "
                        f"{','.join(COLUMNS)}")
    points: dict[str, dict[CurveKey, dict[int, float]]] = {part: {} for part in PARTS}
    for line_no, row in enumerate(reader, start=2):
        where = f"{p}: line {line_no}"
        phase = row["phase"]
        if phase not in PHASES:
            raise UserError(f"{where}: phase: bad value {phase!r}; known: prompt, decode")
        part = (row.get(PART_COLUMN) or "").strip() or "layer"
        if part not in PARTS:
            raise UserError(f"{where}: {PART_COLUMN}: bad value {part!r}; known: "
                            f"{', '.join(PARTS)}")
        num_gpus = _field(row, "num_gpus", int, where)
        tokens = _field(row, "batch_tokens", int, where)
        ms = _field(row, "layer_ms", float, where)
        if num_gpus < 1:
            raise UserError(f"{where}: num_gpus: bad value {num_gpus}; must be >= 1")
        if tokens < 1:
            raise UserError(f"{where}: batch_tokens: bad value {tokens}; must be >= 1")
        if not (math.isfinite(ms) and ms > 0):
            raise UserError(f"{where}: layer_ms: bad value {row['layer_ms']!r}; must be a "
                            "finite number > 0")
        # a repeated point keeps the last value (a re-run of `helixserve profile` wins)
        points[part].setdefault((row["model"], row["gpu"], num_gpus, phase), {})[tokens] = ms

    def curves(part: str) -> dict[CurveKey, Curve]:
        return {key: Curve(tuple(sorted(pts)), tuple(pts[t] for t in sorted(pts)))
                for key, pts in points[part].items()}

    return ProfileTable(curves("layer"), source=str(p), head_curves=curves("head"))
