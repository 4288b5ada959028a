"""The scheduler package loads its routers when first used: a worker imports `batch`, `queue`
and `kv` without maxflow, numpy or the cost model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import helixserve
import helixserve.scheduler as scheduler

ROOT = Path(helixserve.__file__).resolve().parent.parent


def _loaded_after(code: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )
    return set(out.stdout.split())


@pytest.mark.parametrize("code", ["import helixserve.scheduler.batch",
                                  "from helixserve.scheduler.queue import AdmissionQueue",
                                  "import helixserve.scheduler.kv",
                                  "import helixserve.runtime.worker"])
def test_a_submodule_does_not_load_the_routers(code: str) -> None:
    loaded = _loaded_after(code)
    assert not {"numpy", "helixserve.scheduler.maxflow", "helixserve.scheduler.spread",
                "helixserve.scheduler.options"} & loaded


def test_the_public_names_still_import() -> None:
    from helixserve.scheduler import ROUTERS, MaxFlowRouter, NodeState, make_router
    from helixserve.scheduler.maxflow import MaxFlowRouter as Defined
    from helixserve.scheduler.types import NodeState as DefinedState

    assert MaxFlowRouter is Defined and NodeState is DefinedState
    assert set(ROUTERS) == {"maxflow", "random", "shortest-queue", "swarm"}
    assert scheduler.ROUTERS is ROUTERS  # loaded once, then a plain module attribute
    for name in scheduler.__all__:
        assert getattr(scheduler, name) is not None
    assert make_router.__module__ == "helixserve.scheduler"
    with pytest.raises(AttributeError, match="no attribute 'MaxflowRouter'"):
        _ = scheduler.MaxflowRouter
    # `import *` takes the lazy names too
    names: dict[str, object] = {}
    exec("from helixserve.scheduler import *", names)
    assert names["MaxFlowRouter"] is Defined
    # the routers load when the table is first asked for, not before
    assert "helixserve.scheduler.maxflow" not in _loaded_after(
        "from helixserve.scheduler import make_router, NodeState")
    assert "helixserve.scheduler.maxflow" in _loaded_after(
        "from helixserve.scheduler import ROUTERS")
