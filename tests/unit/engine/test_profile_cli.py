"""`helixserve profile` writes per-layer times in the profiles CSV format."""

from __future__ import annotations

import csv

from helixserve.cli import main


def test_profile_writes_profiles_csv(random_models, tmp_path, capsys):
    out = tmp_path / "profiles.csv"
    code = main([
        "profile", "--model", str(random_models["mistral"]), "--device", "cpu",
        "--out", str(out), "--prompt-tokens", "16,64", "--decode-batches", "1,4",
        "--layers", "2", "--repeats", "2", "--model-name", "tiny-mistral",
    ])  # fmt: skip
    assert code == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["model", "gpu", "num_gpus", "phase", "batch_tokens", "layer_ms"]
    assert [(r["phase"], int(r["batch_tokens"])) for r in rows] == [
        ("prompt", 16), ("prompt", 64), ("decode", 1), ("decode", 4),
    ]  # fmt: skip
    assert all(
        r["model"] == "tiny-mistral" and r["gpu"] == "cpu" and r["num_gpus"] == "1" for r in rows
    )
    assert all(float(r["layer_ms"]) > 0 for r in rows)
    assert "wrote 4 rows" in capsys.readouterr().out


def test_profile_bad_input_is_one_line_error(tmp_path, capsys):
    code = main(["profile", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "p.csv")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("helixserve profile: error:") and err.count("\n") == 1
    code = main(["profile", "--model", str(tmp_path), "--device", "tpu", "--out", "x.csv"])
    assert code == 2 and "unknown 'tpu'; known: cpu, cuda" in capsys.readouterr().err
