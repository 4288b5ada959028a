"""Emulate a slower device: every engine step's wall time is stretched to `factor` x its
compute time, by sleeping (factor - 1) x the step's measured time after it.

Used by `helixserve worker --slowdown F` and `helixserve profile --slowdown F`, so that an
emulated cluster of CPU workers (benchmarks/rig) can have machines of unequal speed and the
profiles the planner reads are measured through the same stretch. Sleeping, not spinning: a
slowed worker leaves the CPU to the others, as a separate slower machine would.
"""

from __future__ import annotations

import math
import time
from typing import Any


def check_slowdown(factor: float, flag: str = "--slowdown") -> float:
    """`factor` if it is a finite number >= 1, else ValueError naming the flag."""
    if not math.isfinite(factor) or factor < 1.0:
        raise ValueError(f"{flag}: bad value {factor}; need a finite number >= 1")
    return factor


class SlowedEngine:
    """Delegates everything to `engine`; `step` takes `factor` x its compute time."""

    def __init__(self, engine: Any, factor: float) -> None:
        self._engine = engine
        self.factor = check_slowdown(factor)

    def step(self, items: list[Any]) -> list[Any]:
        t0 = time.perf_counter()
        try:
            return self._engine.step(items)  # type: ignore[no-any-return]
        finally:
            # also after a failed step: the emulated device spent the time too
            time.sleep((self.factor - 1.0) * (time.perf_counter() - t0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def slowed(engine: Any, factor: float) -> Any:
    """`engine` itself at factor 1, else wrapped in a SlowedEngine."""
    return engine if check_slowdown(factor) == 1.0 else SlowedEngine(engine, factor)
