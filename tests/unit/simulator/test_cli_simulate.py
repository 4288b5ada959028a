"""`helixserve simulate` end to end on small inputs (shared cluster, real profiles)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helixserve.cli import main

KEYS = ("decode_throughput_tokens_per_s", "prompt_throughput_tokens_per_s", "requests_finished")


def args(shared: Path, *extra: str) -> list[str]:
    return [
        "simulate",
        "--cluster", str(shared / "clusters/helix-single-24.yaml"),
        "--model", str(shared / "models/llama-2-70b"),
        "--profiles", str(shared / "profiles/helix-measured.csv"),
        "--trace", str(shared / "traces/azure-llm-conv-2023.csv"),
        "--quiet",
        *extra,
    ]  # fmt: skip


def test_simulate_plans_and_writes_json_and_plots(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code = main(
        args(
            shared_data,
            "--placement",
            "separate",
            "--rate",
            "2",
            "--duration",
            "30",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        )
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "decode throughput" in table
    summary = json.loads(out.read_text())
    for key in KEYS:
        assert summary[key] > 0, key
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < summary[key]["p50"] <= summary[key]["p99"]
    # separate's per-type pipelines, planned with the default (vllm) engine's 4.5 GB per GPU,
    # use 12 of the 24 machines (all 24 with the reserve engine's 1 GiB)
    assert len(summary["nodes"]) == 12 and summary["links"]
    for name in ("latency_cdf.png", "throughput.png", "node_utilization.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_simulate_reads_a_placement_file_without_flows(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two pipelines of A100 + L4 + T4 machines, hand-written, flows left out.
    nodes = [
        ("n6", 0, 12),
        ("n9", 12, 24),
        ("n10", 24, 36),
        ("n17", 36, 48),
        ("n0", 48, 55),
        ("n3", 55, 62),
        ("n5", 62, 69),
        ("n11", 69, 76),
        ("n1", 76, 80),
    ]
    placement = {
        "format": "helixserve.placement/v1",
        "model": "llama-2-70b",
        "cluster": "helix-single-24",
        "num_layers": 80,
        "nodes": [{"name": n, "start_layer": s, "end_layer": e} for n, s, e in nodes],
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement))
    code = main(
        args(
            shared_data,
            "--placement",
            str(path),
            "--offline",
            "--duration",
            "20",
            "--scheduler",
            "shortest-queue",
            "--json",
        )
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["mode"] == "offline" and summary["max_flow_tokens_per_s"] > 0
    assert summary["decode_throughput_tokens_per_s"] > 0


def test_unknown_scheduler_is_a_one_line_user_error(
    shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        args(shared_data, "--placement", "separate", "--scheduler", "fifo", "--duration", "5")
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown routing policy 'fifo'" in err and "maxflow" in err


TINY_CLUSTER = """\
name: tiny
nodes:
  - {name: a0, gpu: A100-40GB}
  - {name: a1, gpu: A100-40GB}
  - {name: l0, gpu: L4}
  - {name: l1, gpu: L4}
links:
  default: {bandwidth_gbps: 8.0, latency_ms: 1.0}
"""


def simulate_tiny(
    shared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> dict[str, Any]:
    """Offline JSON summary of llama-30b on 2 A100 + 2 L4 (uniform placement, 20 s)."""
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text(TINY_CLUSTER)
    argv = [
        "simulate",
        "--cluster", str(cluster),
        "--model", str(shared / "models/llama-30b"),
        "--profiles", str(shared / "profiles/helix-measured.csv"),
        "--trace", str(shared / "traces/azure-llm-conv-2023.csv"),
        "--placement", "uniform",
        "--offline", "--duration", "20", "--quiet", "--json",
        *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_engine_vllm_is_recorded_and_changes_the_simulation(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reserve = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "reserve")
    vllm = simulate_tiny(shared_data, tmp_path, capsys)
    # Without --engine the CLI models what the runtime serves (vllm: on-demand KV, as the
    # coordinator's default; 512-token prefill chunks, as its prefill_chunk_tokens).
    from helixserve.runtime.config import CoordinatorConfig

    runtime = CoordinatorConfig()
    assert vllm["engine"] == "vllm" and vllm["kv_allocation"] == runtime.kv_allocation
    assert vllm["engine_config"]["max_prompt_tokens"] == runtime.prefill_chunk_tokens
    assert vllm["engine_config"]["prefill_chunk_tokens"] == runtime.prefill_chunk_tokens
    assert vllm["engine_config"]["kv_watermark"] == runtime.kv_watermark
    assert reserve["engine"] == "reserve" and reserve["kv_allocation"] == "reserve"
    assert reserve["engine_config"] == {
        "kv_allocation": "reserve",
        "chunked_prefill": False,
        "prefill_chunk_tokens": None,
        "max_prompt_tokens": None,
        "max_prefilling": None,
        "kv_watermark": 0.01,
    }
    assert vllm["engine"] == "vllm" and vllm["kv_allocation"] == "on-demand"
    assert vllm["engine_config"] == {
        "kv_allocation": "on-demand",
        "chunked_prefill": True,
        "prefill_chunk_tokens": 512,
        "max_prompt_tokens": 512,
        "max_prefilling": 64,
        "kv_watermark": 0.01,
    }
    # Whole prompts (thousands of tokens a batch) vs chunks of at most 512 tokens.
    assert max(n["mean_prompt_batch_tokens"] for n in reserve["nodes"]) > 512
    assert max(n["mean_prompt_batch_tokens"] for n in vllm["nodes"]) <= 512
    assert vllm["decode_throughput_tokens_per_s"] != reserve["decode_throughput_tokens_per_s"]
    # vllm keeps the GPU memory fitted to vLLM's measured KV; reserve the cost model's 1 GiB
    assert vllm["gpu_reserve_gb"] == 4.5
    assert reserve["gpu_reserve_gb"] == pytest.approx(2**30 / 1e9)
    assert sum(n["kv_capacity_tokens"] for n in vllm["nodes"]) < sum(
        n["kv_capacity_tokens"] for n in reserve["nodes"])


def test_engine_flags_override_the_preset(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = simulate_tiny(
        shared_data,
        tmp_path,
        capsys,
        "--engine", "reserve",
        "--kv-allocation", "on-demand",
        "--chunked-prefill",
        "--max-batched-prompt-tokens", "128",
        "--max-prefilling", "4",
        "--kv-watermark", "0.2",
    )  # fmt: skip
    assert summary["engine"] == "reserve"
    assert summary["engine_config"] == {
        "kv_allocation": "on-demand",
        "chunked_prefill": True,
        "prefill_chunk_tokens": None,
        "max_prompt_tokens": 128,
        "max_prefilling": 4,
        "kv_watermark": 0.2,
    }
    assert summary["kv_allocation"] == "on-demand"
    assert max(n["mean_prompt_batch_tokens"] for n in summary["nodes"]) <= 128
    assert summary["gpu_reserve_gb"] == pytest.approx(2**30 / 1e9)
    mine = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "vllm", "--gpu-reserve-gb", "2")
    assert mine["gpu_reserve_gb"] == 2.0
    off = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "vllm", "--no-chunked-prefill")
    assert off["engine_config"]["chunked_prefill"] is False
    assert off["engine_config"]["max_prompt_tokens"] == 512


def test_layer_overhead_flag_sets_the_prototype_models_per_layer_cost(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # helix-prototype's fitted 3.5 ms a layer and iteration (docs/calibration.md); 0 runs the
    # same rules without it, as Helix's own simulator does
    fitted = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "helix-prototype")
    zero = simulate_tiny(
        shared_data, tmp_path, capsys, "--engine", "helix-prototype", "--layer-overhead-ms", "0")
    more = simulate_tiny(
        shared_data, tmp_path, capsys, "--engine", "helix-prototype", "--layer-overhead-ms", "10")
    assert fitted["engine_config"]["layer_overhead_s"] == 0.0035
    assert zero["engine_config"]["layer_overhead_s"] == 0.0
    assert more["engine_config"]["layer_overhead_s"] == 0.01
    rates = [s["decode_throughput_tokens_per_s"] for s in (zero, fitted, more)]
    assert rates[0] > rates[1] > rates[2] > 0
    # any engine takes it: the vllm model with a per-layer cost serves less than without
    vllm = simulate_tiny(shared_data, tmp_path, capsys)
    slow = simulate_tiny(shared_data, tmp_path, capsys, "--layer-overhead-ms", "10")
    assert "layer_overhead_s" not in vllm["engine_config"]
    assert slow["decode_throughput_tokens_per_s"] < vllm["decode_throughput_tokens_per_s"]


def test_helix_router_flag_sets_helix_schedulers_routing_rules(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "helix-prototype")
    helix = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "helix-prototype",
                          "--helix-router")
    assert "router_spill" not in plain["engine_config"]
    assert plain["engine_config"]["router_spread"] is False
    assert {k: helix["engine_config"][k] for k in
            ("router_spread", "router_spill", "router_min_flow_share")} == {
        "router_spread": False, "router_spill": False, "router_min_flow_share": 0.05}
    assert helix["decode_throughput_tokens_per_s"] > 0
    # helix-host: the prototype model routed so, a name for plan's --serve-also
    host = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "helix-host")
    assert host["engine"] == "helix-host"
    assert host["engine_config"] == helix["engine_config"]
    assert host["decode_throughput_tokens_per_s"] == helix["decode_throughput_tokens_per_s"]


def test_helix_router_needs_the_maxflow_scheduler(
    shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(args(shared_data, "--placement", "separate", "--offline", "--scheduler",
                     "swarm", "--helix-router"))
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "helixserve simulate: error: --helix-router: routes over the max flow; --scheduler "
        "is 'swarm', not maxflow")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-batched-prompt-tokens", "0", "--max-batched-prompt-tokens: must be >= 1, got 0"),
        ("--max-prefilling", "-3", "--max-prefilling: must be >= 1, got -3"),
        ("--kv-watermark", "1.5", "--kv-watermark: must be in [0, 1), got 1.5"),
        ("--layer-overhead-ms", "-1", "--layer-overhead-ms: must be >= 0, got -1.0"),
        ("--engine", "sglang", "--engine: unknown engine model 'sglang'; known: helix-host, helix-prototype, reserve, vllm"),
        (
            "--kv-allocation",
            "lazy",
            "--kv-allocation: unknown mode 'lazy'; known: reserve, on-demand",
        ),
    ],
)
def test_bad_engine_flag_is_a_one_line_user_error(
    shared_data: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    code = main(args(shared_data, "--placement", "separate", "--offline", flag, value))
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"helixserve simulate: error: {message}"
    assert "planning" not in captured.err  # checked before the cluster is planned


def test_summary_table_names_the_engine_model(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helixserve.simulator.metrics import format_table

    vllm = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "vllm")
    row = next(line for line in format_table(vllm).splitlines() if "engine model" in line)
    assert "vllm: KV on-demand, chunked prefill 512 tokens, <= 64 prefilling" in row
    assert f"{vllm['preemptions']} preemptions" in row
    reserve = simulate_tiny(shared_data, tmp_path, capsys, "--engine", "reserve")
    row = next(line for line in format_table(reserve).splitlines() if "engine model" in line)
    assert "reserve: KV reserve, 0 preemptions" in row and "chunked" not in row


def test_route_within_regions_flag_is_recorded_and_changes_geo_routing(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On helix-geo-24, routing `separate`'s pipelines within regions keeps requests off the
    slow links the flow would otherwise send some of them over: the simulation changes."""
    runs = {}
    for flag in ((), ("--route-within-regions",)):
        out = tmp_path / f"sim{len(flag)}.json"
        argv = args(shared_data, "--placement", "separate", "--offline", "--duration", "60",
                    "--engine", "vllm", "--json", str(out), *flag)
        argv[argv.index("--cluster") + 1] = str(shared_data / "clusters/helix-geo-24.yaml")
        assert main(argv) == 0
        runs[bool(flag)] = json.loads(out.read_text())
    capsys.readouterr()
    assert runs[False]["route_within_regions"] is False
    assert runs[True]["route_within_regions"] is True
    from helixserve.spec import load_cluster

    geo = load_cluster(shared_data / "clusters/helix-geo-24.yaml")

    def region(name: str) -> str:
        return "coordinator" if name == "coordinator" else geo.node(name).region

    def crossing(run: dict) -> int:  # type: ignore[type-arg]
        return sum(k["bytes"] for k in run["links"]
                   if "coordinator" not in (k["src"], k["dst"])
                   and region(k["src"]) != region(k["dst"]))

    # the pipelines that must cross (L4s and T4s span two regions) still do, but less
    assert 0 < crossing(runs[True]) < crossing(runs[False])


def test_offline_concurrency_keeps_that_many_requests_in_flight(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--offline --concurrency N`: the closed loop `plan --serve-concurrency N` scores, so a
    lighter load serves less, and the JSON and the table say which load ran."""
    placement = str(Path(__file__).resolve().parents[3] / "benchmarks" / "helix-placements"
                    / "helix-single-24-llama-2-70b.json")
    summaries: dict[int, dict[str, Any]] = {}
    for n in (4, 48):
        out = tmp_path / f"c{n}.json"
        assert main(args(shared_data, "--placement", placement, "--offline", "--concurrency",
                         str(n), "--duration", "90", "--warmup", "30", "--json",
                         str(out))) == 0
        assert f"{n} requests in flight (a closed loop)" in capsys.readouterr().out
        summaries[n] = json.loads(out.read_text())
    for n, s in summaries.items():
        assert s["offline_concurrency"] == n
        assert s["engine_config"]["offline_feed"] == "closed"
        assert s["engine_config"]["feed_initial_requests"] == n
        assert 0 < s["requests_in_flight"] <= n  # a finished request is replaced, no more
    light, heavy = (summaries[n]["decode_throughput_tokens_per_s"] for n in (4, 48))
    assert 0 < 3 * light < heavy


@pytest.mark.parametrize(("extra", "message"), [
    (("--offline", "--concurrency", "0"),
     "--concurrency: bad value 0; need an integer >= 1 (requests in flight)"),
    (("--rate", "1", "--concurrency", "8"),
     "--concurrency: 8 needs --offline (online, the trace's arrivals set the load)"),
])
def test_bad_concurrency_is_a_one_line_user_error(
    shared_data: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    assert main(args(shared_data, "--placement", "separate", *extra)) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"helixserve simulate: error: {message}"
    assert "planning" not in captured.err
