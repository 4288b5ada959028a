"""`helixserve profile --engine vllm`: per-layer prefill and decode times of the vLLM stage and
its head, in the profiles CSV the planner reads."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from vllm_procs import ENV, VLLM_MARKS

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]


def test_profile_vllm_writes_prompt_and_decode_rows(demo_model, tmp_path):
    out = tmp_path / "profiles.csv"
    cmd = [sys.executable, "-m", "helixserve", "profile", "--engine", "vllm",
           "--model", str(demo_model), "--out", str(out), "--threads", "1",
           "--prompt-tokens", "64,256", "--decode-batches", "1,8", "--repeats", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=800,
                         env=dict(os.environ, **ENV))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["part"], r["phase"], int(r["batch_tokens"])) for r in rows] == [
        ("layer", "prompt", 64), ("layer", "prompt", 256), ("layer", "decode", 1),
        ("layer", "decode", 8), ("head", "prompt", 1), ("head", "prompt", 8),
        ("head", "decode", 1), ("head", "decode", 8)]
    assert all(r["model"] == demo_model.name and float(r["layer_ms"]) > 0 for r in rows)
    # 4x the prompt tokens cost more than 1x: the stage really computes them
    assert float(rows[1]["layer_ms"]) > float(rows[0]["layer_ms"])
    # the head (49152 x 576 lm_head + sampling) is timed, not a floor value
    assert all(float(r["layer_ms"]) > 0.0001 for r in rows[4:])


READ_RANGE = r"""
import json, sys
from helixserve.engine.vllm_stage import VllmStageEngine, configure_vllm_process
configure_vllm_process(1)
eng = VllmStageEngine.load(sys.argv[1], 10, 20, kv_cache_bytes=32 << 20)
held = sorted({n.split(".")[2] for n, _ in eng.model.named_parameters() if ".layers." in n})
print(json.dumps({"read": eng.loaded_tensor_names, "held_layers": held,
                  "others": sorted(n for n, _ in eng.model.named_parameters()
                                   if ".layers." not in n)}))
"""


def test_a_middle_stage_reads_and_holds_only_its_layers(demo_model):
    res = subprocess.run([sys.executable, "-c", READ_RANGE, str(demo_model)], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, **ENV))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    layers = {int(n.split(".")[2]) for n in got["read"]}
    assert layers == set(range(10, 20)), sorted(layers)
    assert all(".layers." in n for n in got["read"]), got["read"]  # no embedding, norm, head
    assert len(got["read"]) == 10 * 9  # 9 tensors per Llama layer
    assert sorted(map(int, got["held_layers"])) == list(range(10, 20))
    assert got["others"] == [], got["others"]
