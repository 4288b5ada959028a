"""Bad input on the command line: exit 2, exactly one line on stderr naming the flag or file
and the bad value, no traceback, and no output file left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from planner_factories import SHARED

from helixserve.cli import main

MODEL = str(SHARED / "models" / "llama-2-70b")
FORMAT = "helixserve.placement/v1"


@pytest.fixture
def cluster(tmp_path: Path) -> str:
    """4 H100s on 8 Gbit/s links: petals covers LLaMA-2-70B's 80 layers in a blink."""
    path = tmp_path / "tiny.yaml"
    path.write_text("name: tiny\nnodes:\n"
                    + "".join(f"  - {{name: h{i}, gpu: H100-80GB}}\n" for i in range(4))
                    + "links:\n  default: {bandwidth_gbps: 8.0, latency_ms: 1.0}\n")
    return str(path)


@pytest.fixture
def placement(tmp_path: Path, cluster: str) -> dict:
    """A valid placement of the tiny cluster, as JSON data."""
    out = tmp_path / "planned.json"
    assert main(["plan", "--planner", "petals", "--cluster", cluster, "--model", MODEL,
                 "--quiet", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    out.unlink()
    return data


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI in-process; assert exit 2 and one line on stderr; return that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def files_in(path: Path) -> set[str]:
    return {p.name for p in path.rglob("*")}


# --- argparse: one line, not the usage block ---------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["plan", "--time-limit", "abc"],
     "helixserve plan: error: argument --time-limit: invalid float value: 'abc'"),
    (["plan", "--seed", "x"], "helixserve plan: error: argument --seed: invalid int value: 'x'"),
    (["plan", "--serve-engine", "tgi"], "argument --serve-engine: invalid choice: 'tgi'"),
    (["simulate", "--rate", "fast"], "helixserve simulate: error: argument --rate: invalid float"),
    (["deploy", "k8s", "--startup-timeout-s", "x"], "helixserve deploy k8s: error: argument "
     "--startup-timeout-s: invalid int value: 'x'"),
    (["deploy"], "helixserve deploy: error: the following arguments are required: TARGET"),
    (["nosuch"], "helixserve: error: argument COMMAND: invalid choice: 'nosuch'"),
])
def test_usage_errors_are_one_line(argv: list[str], expected: str, capsys) -> None:
    assert expected in run_cli(argv, capsys)


def test_usage_error_one_line_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "helixserve", "plan", "--time-limit", "abc"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "helixserve plan: error: argument --time-limit: invalid float value: 'abc'"]


def test_help_is_still_the_full_help(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: helixserve plan") and "--time-limit SECONDS" in out
    assert len(out.splitlines()) > 20


# --- non-finite numbers --------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["plan", "--time-limit", "nan"],
    ["plan", "--time-limit", "inf"],
    ["plan", "--max-loss", "nan"],
    ["plan", "--gpu-reserve-gb", "inf"],
    ["plan", "--serve-duration", "Infinity"],
    ["evaluate", "--placement", "p.json", "--gpu-reserve-gb", "nan"],
    ["simulate", "--duration", "inf"],
    ["simulate", "--plan-time-limit", "nan"],
    ["simulate", "--kv-watermark", "nan"],
    ["serve", "--kv-watermark", "NaN"],
    ["demo", "--worker-link-fraction", "inf"],
    ["worker", "--drain-timeout-s", "inf"],
    ["bench", "--temperature", "nan"],
])
def test_non_finite_numbers_are_rejected(argv: list[str], capsys) -> None:
    flag, value = argv[-2], argv[-1]
    line = run_cli(argv, capsys)
    assert f"argument {flag}: invalid float value: '{value}'; need a finite number" in line


def test_bench_rate_takes_inf_but_not_nan(capsys) -> None:
    from helixserve.cli import build_parser

    assert build_parser().parse_args(["bench", "--request-rate", "inf"]).request_rate == float(
        "inf")
    assert "argument --request-rate: must be > 0 (or 'inf'), got 'nan'" in run_cli(
        ["bench", "--request-rate", "nan"], capsys)


# --- output paths: checked before the work, nothing written when one is bad ----------------

@pytest.mark.parametrize("out, plot, expected", [
    ("outdir", None, "--out {tmp}/outdir: is a directory"),
    ("nodir/out.json", None, "--out {tmp}/nodir/out.json: directory {tmp}/nodir does not exist"),
    ("out.json", "nodir/p.png", "--plot {tmp}/nodir/p.png: directory {tmp}/nodir does not exist"),
    ("out.json", "outdir", "--plot {tmp}/outdir: is a directory"),
    ("out.json", "p.json", "--plot {tmp}/p.json: unknown image format '.json'; known: "),
    ("cluster.yaml/out.json", None, "--out {tmp}/cluster.yaml/out.json: {tmp}/cluster.yaml is "
     "not a directory"),
])
def test_plan_bad_output_path(tmp_path: Path, cluster: str, out: str, plot: str | None,
                              expected: str, capsys) -> None:
    work = tmp_path / "work"
    (work / "outdir").mkdir(parents=True)
    (work / "cluster.yaml").write_text("")
    argv = ["plan", "--planner", "petals", "--cluster", cluster, "--model", MODEL, "--quiet",
            "--out", str(work / out)]
    if plot:
        argv += ["--plot", str(work / plot)]
    before = files_in(work)
    assert expected.format(tmp=work) in run_cli(argv, capsys)
    assert files_in(work) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_plan_unwritable_plot_writes_no_placement_either(tmp_path: Path, cluster: str,
                                                         capsys) -> None:
    """/proc/x passes every check a path allows before the work; the write itself fails,
    and then the placement is not written either."""
    out = tmp_path / "out.json"
    line = run_cli(["plan", "--planner", "petals", "--cluster", cluster, "--model", MODEL,
                    "--quiet", "--out", str(out), "--plot", "/proc/x.png"], capsys)
    assert "--plot /proc/x.png: " in line
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.yaml"]
    line = run_cli(["plan", "--planner", "petals", "--cluster", cluster, "--model", MODEL,
                    "--quiet", "--out", "/proc/x"], capsys)
    assert "--out /proc/x: " in line


def test_plan_writes_out_and_plot_when_both_are_good(tmp_path: Path, cluster: str) -> None:
    out, png = tmp_path / "out.json", tmp_path / "p.png"
    assert main(["plan", "--planner", "petals", "--cluster", cluster, "--model", MODEL,
                 "--quiet", "--out", str(out), "--plot", str(png)]) == 0
    assert json.loads(out.read_text())["format"] == FORMAT
    assert png.read_bytes()[:4] == b"\x89PNG"
    # nothing left over from writing through a staging directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "p.png", "tiny.yaml"]


def test_evaluate_bad_plot_path(tmp_path: Path, cluster: str, placement: dict, capsys) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement))
    line = run_cli(["evaluate", "--cluster", cluster, "--model", MODEL, "--placement", str(path),
                    "--plot", str(tmp_path / "nodir" / "p.png")], capsys)
    assert f"--plot {tmp_path}/nodir/p.png: directory {tmp_path}/nodir does not exist" in line


def test_simulate_bad_output_paths(tmp_path: Path, cluster: str, placement: dict,
                                   capsys) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement))
    base = ["simulate", "--cluster", cluster, "--model", MODEL, "--placement", str(path),
            "--offline", "--duration", "10", "--quiet"]
    before = files_in(tmp_path)
    line = run_cli(base + ["--json", str(tmp_path)], capsys)
    assert f"--json {tmp_path}: is a directory" in line
    line = run_cli(base + ["--json", str(tmp_path / "s.json"), "--plot", str(path)], capsys)
    assert f"--plot {path}: exists and is not a directory" in line
    assert files_in(tmp_path) == before


def test_other_commands_check_output_paths_first(tmp_path: Path, capsys) -> None:
    line = run_cli(["profile", "--model", "m", "--out", str(tmp_path / "no" / "p.csv")], capsys)
    assert f"--out {tmp_path}/no/p.csv: directory {tmp_path}/no does not exist" in line
    line = run_cli(["bench", "--json", str(tmp_path)], capsys)
    assert f"--json {tmp_path}: is a directory" in line
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = run_cli(["deploy", "k8s", "--cluster", "c", "--placement", "p", "--model-path", "/m",
                    "--image", "i", "--out", str(afile)], capsys)
    assert f"--out {afile}: exists and is not a directory" in line
    line = run_cli(["model", "prepare-demo", "--out", str(tmp_path)], capsys)
    assert f"--out {tmp_path}: directory is not empty and holds no prepared demo model" in line
    assert afile.read_text() == "x"


# --- placement files: errors name the file and the field ------------------------------------

@pytest.mark.parametrize("edit, expected", [
    (lambda d: d["nodes"][1].update(name="zz"),
     "{file}: nodes[1].name: node 'zz' is not in cluster 'tiny'; known: h0, h1, h2, h3"),
    (lambda d: d.update(nodes=[{"name": "h2", "start_layer": 0, "end_layer": 80}]),
     "{file}: nodes[0]: node 'h2' holds 80 layers [0, 80) but its memory fits at most "),
    (lambda d: d.pop("format"), "{file}: format: missing; expected 'helixserve.placement/v1'"),
    (lambda d: d.update(num_layers=100), "{file}: num_layers: 100 but model 'llama-2-70b' has 80"),
    (lambda d: d.update(throughput_tokens_per_s=float("nan")),
     "{file}: throughput_tokens_per_s: expected a finite number, got nan"),
])
def test_evaluate_placement_errors_name_file_and_field(tmp_path: Path, cluster: str,
                                                       placement: dict, edit, expected: str,
                                                       capsys) -> None:
    edit(placement)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement))
    line = run_cli(["evaluate", "--cluster", cluster, "--model", MODEL, "--placement", str(path)],
                   capsys)
    assert expected.format(file=path) in line


@pytest.mark.parametrize("command, flag", [
    (["evaluate"], "--placement"),
    (["plan", "--planner", "petals", "--quiet"], "--from"),
])
def test_non_utf8_placement_file(tmp_path: Path, cluster: str, command: list[str], flag: str,
                                 capsys) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(b'{"format": "\xff"}')
    line = run_cli(command + ["--cluster", cluster, "--model", MODEL, flag, str(path)], capsys)
    assert f"{path}: cannot read placement: not UTF-8 text (byte 0xff" in line


# --- traces ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, expected", [
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xe9,1,2\n",
     "{file}: cannot read trace: not UTF-8 text (byte 0xe9"),
    (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5\n",
     "{file}: line 2: bad row"),
])
def test_bad_trace_file(tmp_path: Path, cluster: str, placement: dict, body: bytes,
                        expected: str, capsys) -> None:
    trace = tmp_path / "t.csv"
    trace.write_bytes(body)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement))
    line = run_cli(["simulate", "--cluster", cluster, "--model", MODEL, "--placement", str(path),
                    "--trace", str(trace), "--quiet"], capsys)
    assert expected.format(file=trace) in line
    line = run_cli(["plan", "--planner", "petals", "--cluster", cluster, "--model", MODEL,
                    "--quiet", "--serve-trace", str(trace)], capsys)
    assert expected.format(file=trace) in line


def test_a_bundled_model_name_points_to_its_config(cluster, capsys, tmp_path, monkeypatch):
    """`--model llama-2-70b` from a directory without it: the error gives the bundled path."""
    from helixserve.commands.plan import EXAMPLE_DIR

    monkeypatch.chdir(tmp_path)
    line = run_cli(["plan", "--cluster", cluster, "--model", "llama-2-70b"], capsys)
    assert f"--model {EXAMPLE_DIR / 'llama-2-70b'}" in line and "--example" in line
    line = run_cli(["plan", "--cluster", cluster, "--model", "no-such-model"], capsys)
    assert "'no-such-model'" in line and str(EXAMPLE_DIR / "llama-2-70b") in line
