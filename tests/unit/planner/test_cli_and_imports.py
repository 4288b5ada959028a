from __future__ import annotations

import json
import subprocess
import sys

from planner_factories import SHARED

from helixserve.cli import main


def test_control_plane_imports_no_torch_grpc_fastapi():
    code = (
        "import sys\n"
        "import helixserve.spec, helixserve.costmodel, helixserve.planner\n"
        "import helixserve.planner.milp, helixserve.commands.plan, helixserve.commands.evaluate\n"
        "bad = [m for m in ('torch', 'grpc', 'fastapi') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_plan_example_then_evaluate(tmp_path, capsys):
    out = tmp_path / "p.json"
    png = tmp_path / "p.png"
    # the max-flow objective: `evaluate` gives its throughput back with the same memory
    assert main(["plan", "--example", "--objective", "flow", "--time-limit", "3", "--quiet",
                 "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "throughput" in text and "a100-0" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    planned = json.loads(out.read_text())
    assert planned["format"] == "helixserve.placement/v1" and planned["num_layers"] == 80
    assert main(["evaluate", "--example", "--placement", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert abs(result["throughput_tokens_per_s"] - planned["throughput_tokens_per_s"]) < 1e-3
    assert {"src", "dst", "tokens_per_s"} <= set(result["flows"][0])
    # a larger per-GPU reserve leaves less KV, smaller decode batches: never more throughput
    assert main(["evaluate", "--example", "--placement", str(out), "--json",
                 "--gpu-reserve-gb", "4.5"]) == 0
    reserved = json.loads(capsys.readouterr().out)["throughput_tokens_per_s"]
    assert 0 < reserved < result["throughput_tokens_per_s"]
    assert main(["evaluate", "--example", "--placement", str(out),
                 "--gpu-reserve-gb", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-reserve-gb: bad value -1.0" in err[0]


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - {name: a, gpu: A1000}\n")
    assert main(["plan", "--cluster", str(bad), "--model", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nodes[0].gpu: unknown GPU 'A1000'" in err[0]
    assert main(["plan", "--example", "--planner", "gurobi", "--quiet"]) == 2
    assert "known: milp, uniform, petals, swarm, separate" in capsys.readouterr().err


def test_plan_picks_the_placement_that_serves_best(tmp_path, capsys):
    """--serve-trace: the planned placement and the stacked tilings are simulated serving
    the trace; the one with the most simulated decode tokens/s is written."""
    out = tmp_path / "p.json"
    trace = SHARED / "traces" / "azure-llm-conv-2023.csv"
    assert main(["plan", "--example", "--objective", "flow", "--time-limit", "3", "--quiet",
                 "--out", str(out), "--serve-trace", str(trace), "--serve-duration", "80"]) == 0
    text = capsys.readouterr().out
    assert "serving selection (vllm engine, 80 s offline, the first 20 s not counted" in text
    table = [line.split() for line in
             text[text.index("serving selection"):text.index("cluster ")].splitlines()[3:]
             if line.strip()]
    # rows: [*] max-flow served source stages...; the example has two regions, so every
    # candidate is simulated twice, the second time routed within regions
    served = {}
    for cells in table:
        cells = cells[1:] if cells[0] == "*" else cells
        served[cells[2]] = max(served.get(cells[2], 0.0), float(cells[1].replace(",", "")))
    assert {"given:milp", "stacked-tiling"} <= set(served)
    kept = [cells for cells in table if cells[0] == "*"]
    assert len(kept) == 1 and float(kept[0][2].replace(",", "")) == max(served.values())
    planned = json.loads(out.read_text())
    assert planned["planner"] == "milp-serving" and planned["num_layers"] == 80
    assert "planner milp-serving" in text
    # the time of the planning and the selection, not the chosen candidate's missing one
    assert planned["solve_time_s"] > 0 and "solved in 0.0s" not in text


def test_plan_serve_flags_are_checked(tmp_path, capsys):
    assert main(["plan", "--example", "--quiet", "--serve-trace", "x.csv",
                 "--serve-duration", "0"]) == 2
    assert "--serve-duration: bad value 0.0; must be > 0" in capsys.readouterr().err
    assert main(["plan", "--example", "--quiet", "--serve-trace",
                 str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.csv" in err[0]


def test_planner_imports_neither_simulator_nor_scheduler():
    # the layering of docs/architecture.md: the serving selection sits above the planner
    code = (
        "import importlib, pkgutil, sys\n"
        "import helixserve.planner as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module('helixserve.planner.' + m.name)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('helixserve.simulator',"
        " 'helixserve.scheduler')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
