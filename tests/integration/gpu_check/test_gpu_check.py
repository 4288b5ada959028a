"""`benchmarks/gpu_check.py --device cpu`: the GPU check runs in CI on the CPU so it cannot
rot: a random Llama through two real torch workers over gRPC equals transformers (float32
exactly, bfloat16 >= 90%), decode speed measured, at most three result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[3]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=850,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_gpu_check_passes_on_cpu_and_writes_three_files(tmp_path):
    res = run("--device", "cpu", "--skip-vllm", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.txt",
                                                          "workers.log"]
    got = json.loads((tmp_path / "gpu_check.json").read_text())
    torch_res = got["torch_engine"]
    assert got["pass"] and torch_res["pass"] and torch_res["float32_agreement"] == 1.0
    assert torch_res["bfloat16_agreement"] >= 0.9
    assert torch_res["decode_tokens_per_s"] > 0 and torch_res["streams"] == 8
    assert "ALL PASS" in (tmp_path / "gpu_check.txt").read_text()
    assert "listening on" in (tmp_path / "workers.log").read_text()


def test_cuda_without_a_gpu_is_one_line_and_exit_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    res = run("--device", "cuda", "--out", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "sees no CUDA device" in res.stderr
