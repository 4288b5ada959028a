"""Fixtures shared by the cost-model tests: LLaMA-2-70B and Helix's measured profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from helixserve.spec import load_model, load_profiles

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"


@pytest.fixture(scope="module")
def parts():  # type: ignore[no-untyped-def]
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return (load_model(SHARED / "models" / "llama-2-70b"),
            load_profiles(SHARED / "profiles" / "helix-measured.csv"))
