"""`helixserve profile` writes per-layer times in the profiles CSV format."""

from __future__ import annotations

import csv

from helixserve.cli import main
from helixserve.spec.profiles import load_profiles


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
    assert list(rows[0]) == ["model", "gpu", "num_gpus", "phase", "batch_tokens", "layer_ms",
                             "part"]
    # layer rows at the asked points; head rows at 1 and 4 sampled rows for both phases
    assert [(r["part"], r["phase"], int(r["batch_tokens"])) for r in rows] == [
        ("layer", "prompt", 16), ("layer", "prompt", 64), ("layer", "decode", 1),
        ("layer", "decode", 4), ("head", "prompt", 1), ("head", "prompt", 4),
        ("head", "decode", 1), ("head", "decode", 4),
    ]  # fmt: skip
    assert all(
        r["model"] == "tiny-mistral" and r["gpu"] == "cpu" and r["num_gpus"] == "1" for r in rows
    )
    assert all(float(r["layer_ms"]) > 0 for r in rows)
    assert "wrote 8 rows" in capsys.readouterr().out
    # the file reads back with the head rows apart from the layer curves
    table = load_profiles(out)
    assert table.has("tiny-mistral", "cpu", 1)
    head = table.head_curve("tiny-mistral", "cpu", 1, "decode")
    assert head is not None and head.batch_tokens == (1, 4) and min(head.layer_ms) > 0


def test_profile_head_rows_time_the_head(demo_dir):
    """On the demo model (vocab 49152 x hidden 576) the head is several layers' time: its rows
    measure the lm_head, not noise, and grow with the rows sampled."""
    import torch

    from helixserve.engine.profiler import ProfileSettings, profile_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = profile_model(demo_dir, settings=ProfileSettings(
            prompt_batch_tokens=(32,), decode_batch_tokens=(1, 16), num_layers=1, repeats=3))
    finally:
        torch.set_num_threads(threads)
    ms = {(r.part, r.phase, r.batch_tokens): r.layer_ms for r in rows}
    layer = ms[("layer", "decode", 1)]
    assert ms[("head", "decode", 1)] > layer  # a 49152 x 576 matmul vs one 576-wide layer
    assert ms[("head", "decode", 16)] > ms[("head", "decode", 1)]
    assert ms[("head", "prompt", 1)] > layer


def test_profile_bad_input_is_one_line_error(tmp_path, capsys):
    code = main(["profile", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "p.csv")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("helixserve profile: error:") and err.count("\n") == 1
    code = main(["profile", "--model", str(tmp_path), "--device", "tpu", "--out", "x.csv"])
    assert code == 2 and "unknown 'tpu'; known: cpu, cuda" in capsys.readouterr().err
