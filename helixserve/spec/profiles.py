"""Measured per-layer times (CSV `model,gpu,num_gpus,phase,batch_tokens,layer_ms`).

A curve is the time of ONE layer as a function of the tokens in the batch, for one
(model, gpu, num_gpus, phase). Curves are kept sorted by batch_tokens; they are not
assumed monotone (the Helix measurements have dips).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from helixserve.errors import UserError

PHASES = ("prompt", "decode")
COLUMNS = ("model", "gpu", "num_gpus", "phase", "batch_tokens", "layer_ms")

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

    @classmethod
    def empty(cls) -> ProfileTable:
        return cls({}, source="(none)")

    def curve(self, model: str, gpu: str, num_gpus: int, phase: str) -> Curve | None:
        return self.curves.get((model, gpu, num_gpus, phase))

    def has(self, model: str, gpu: str, num_gpus: int) -> bool:
        """True when both phases are measured for this model on this machine."""
        return all((model, gpu, num_gpus, ph) in self.curves for ph in PHASES)

    def keys(self) -> list[CurveKey]:
        return sorted(self.curves)


def load_profiles(path: str | Path) -> ProfileTable:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"{p}: cannot read profiles: {exc.strerror}") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{p}: header: missing columns {', '.join(missing)}; expected "
                        f"{','.join(COLUMNS)}")
    points: dict[CurveKey, dict[int, float]] = {}
    for line_no, row in enumerate(reader, start=2):
        where = f"{p}: line {line_no}"
        phase = row["phase"]
        if phase not in PHASES:
            raise UserError(f"{where}: phase: bad value {phase!r}; known: prompt, decode")
        try:
            num_gpus = int(row["num_gpus"])
            tokens = int(row["batch_tokens"])
            ms = float(row["layer_ms"])
        except (TypeError, ValueError):
            raise UserError(f"{where}: bad number in {row!r}") from None
        if num_gpus < 1 or tokens < 1 or ms < 0:
            raise UserError(f"{where}: num_gpus/batch_tokens must be >= 1 and layer_ms >= 0, "
                            f"got {num_gpus}/{tokens}/{ms}")
        # a repeated point keeps the last value (a re-run of `helixserve profile` wins)
        points.setdefault((row["model"], row["gpu"], num_gpus, phase), {})[tokens] = ms
    curves = {
        key: Curve(tuple(sorted(pts)), tuple(pts[t] for t in sorted(pts)))
        for key, pts in points.items()
    }
    return ProfileTable(curves, source=str(p))
