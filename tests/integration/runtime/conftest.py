"""Fixtures: real `helixserve worker` processes on 127.0.0.1 serving the real demo model.

Workers start once per module (each takes a few seconds to import torch and load weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_procs import WorkerProc, start_worker, stop_workers, wait_ready


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from helixserve.engine import prepare_demo_model

    return prepare_demo_model()


@pytest.fixture(scope="module")
def workers(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    """n0 [0,10) n1 [10,20) n2 [20,30) for the even pipeline, m [0,25) for the uneven one."""
    tmp = tmp_path_factory.mktemp("workers")
    specs = [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30), ("m", 0, 25)]
    procs = [start_worker(demo_model, name, a, b, tmp) for name, a, b in specs]
    try:
        wait_ready(procs)
        yield {w.name: w for w in procs}
    finally:
        stop_workers(procs)
