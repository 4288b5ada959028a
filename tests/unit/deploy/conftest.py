"""Fixtures for the deploy tests: real cluster files (tests/data/shared), small placements."""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_testlib import CLUSTERS, GEO_RANGES, write_placement


@pytest.fixture(scope="session")
def geo_cluster() -> Path:
    path = CLUSTERS / "helix-geo-24.yaml"
    if not path.exists():
        pytest.skip(f"shared data not found at {path}")
    return path


@pytest.fixture
def geo_placement(tmp_path: Path) -> Path:
    return write_placement(tmp_path / "placement.json", GEO_RANGES, "helix-geo-24")
