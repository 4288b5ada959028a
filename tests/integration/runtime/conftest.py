"""Fixtures: real `helixserve worker` processes on 127.0.0.1 serving the real demo model.

Workers start once per module (each takes a few seconds to import torch and load weights);
the small-KV trio of the preemption tests once for all of them (`small_kv_workers`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_procs import (
    SMALL_KV_WORKERS,
    SharedWorkers,
    WorkerProc,
    start_worker,
    stop_workers,
    wait_ready,
)


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


SMALL_KV = pytest.StashKey[SharedWorkers]()


@pytest.fixture(scope="session")
def small_kv_pool(demo_model: Path, tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> Iterator[SharedWorkers]:
    pool = SharedWorkers(demo_model, tmp_path_factory.mktemp("small-kv"), SMALL_KV_WORKERS)
    request.config.stash[SMALL_KV] = pool
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def small_kv_workers(small_kv_pool: SharedWorkers) -> list[WorkerProc]:
    """a [0,10) b [10,20) c [20,30), b's KV the tightest (SMALL_KV_WORKERS), every KV empty;
    shared by the tests that run one after another (a fresh set takes 5-6 s to start)."""
    return small_kv_pool.get()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the small-KV workers after the last of the consecutive tests that use them."""
    if nextitem is None or "small_kv_workers" not in getattr(nextitem, "fixturenames", ()):
        pool = item.config.stash.get(SMALL_KV, None)
        if pool is not None:
            pool.close()
