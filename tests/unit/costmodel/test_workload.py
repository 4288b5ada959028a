"""The workload a plan is built for: parsing `--workload`, the capacities in output tokens/s
of its mix (node T(k) and links), and the opt-in serving-aware T(k) of a workload with a
pipeline depth (it was `ServingLoad`)."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from helixserve.cli import main
from helixserve.costmodel import CostModel, Workload
from helixserve.errors import UserError
from helixserve.planner import FlowNetwork
from helixserve.simulator.mix import parse_workload
from helixserve.simulator.workload import load_azure_trace, prepare_trace
from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"
TRACE = SHARED / "traces" / "azure-llm-conv-2023.csv"


def write_trace(path: Path, rows: list[tuple[int, int]]) -> Path:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i:02d}.0000000,{p},{o}\n" for i, (p, o) in enumerate(rows)))
    return path


# ---- parsing ------------------------------------------------------------------------------

def test_named_and_pair_values() -> None:
    assert parse_workload("decode") is None
    conv = parse_workload("conversation")
    assert conv == Workload.conversation()
    pair = parse_workload("2000:30")
    assert pair is not None and (pair.prompt_tokens, pair.output_tokens) == (2000.0, 30.0)
    assert pair.prompt_tokens_per_output_token == pytest.approx(2000 / 30)
    assert pair.requests_per_s(300.0) == pytest.approx(10.0)
    assert parse_workload("0:128") == Workload(0.0, 128.0, "0:128")


def test_trace_gives_the_means_after_the_simulators_length_filter(tmp_path: Path) -> None:
    # the 5000-token prompt is outside Helix's filter (<= 2048), as `simulate --trace` drops it
    path = write_trace(tmp_path / "t.csv", [(1000, 10), (3000 // 2, 30), (5000, 20)])
    mix = parse_workload(str(path))
    assert mix is not None and mix.source == "t.csv"
    assert (mix.prompt_tokens, mix.output_tokens) == (1250.0, 20.0)


def test_conversation_constants_are_the_trace_means() -> None:
    if not TRACE.is_file():
        pytest.skip(f"trace not found at {TRACE}")
    reqs = prepare_trace(load_azure_trace(TRACE))
    conv = Workload.conversation()
    assert conv.prompt_tokens == pytest.approx(statistics.fmean(r.prompt_tokens for r in reqs),
                                               abs=0.01)
    assert conv.output_tokens == pytest.approx(statistics.fmean(r.output_tokens for r in reqs),
                                               abs=0.01)
    assert conv.prompt_tokens_per_output_token == pytest.approx(3.28, abs=0.01)


@pytest.mark.parametrize("value, expected", [
    ("abc:30", "--workload: bad value 'abc:30': prompt tokens 'abc' is not a number"),
    ("2000:x", "--workload: bad value '2000:x': output tokens 'x' is not a number"),
    ("2000:nan", "output tokens 'nan' is not a number"),
    ("1:2:3", "--workload: bad value '1:2:3'; need PROMPT:OUTPUT"),
    ("-5:30", "--workload: bad value '-5:30'; need prompt >= 0 and output > 0"),
    ("100:0", "--workload: bad value '100:0'; need prompt >= 0 and output > 0"),
    ("nosuch.csv", "--workload: bad value 'nosuch.csv'; need decode, conversation, a pair"),
])
def test_bad_values_name_the_flag_and_value(value: str, expected: str) -> None:
    with pytest.raises(UserError) as info:
        parse_workload(value)
    assert expected in str(info.value)


def test_bad_trace_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,Prompt\n2023-11-16 18:15:10,5\n")
    with pytest.raises(UserError, match=rf"--workload: {bad}: header: missing column"):
        parse_workload(str(bad))
    row = write_trace(tmp_path / "row.csv", [(100, 10)])
    row.write_text(row.read_text() + "2023-11-16 18:15:20.0,many,3\n")
    with pytest.raises(UserError, match=rf"{row}: line 3: bad row"):
        parse_workload(str(row))


@pytest.mark.parametrize("field, value", [("prompt_tokens", -1.0), ("output_tokens", 0.0),
                                          ("output_tokens", float("nan"))])
def test_workload_fields_are_checked(field: str, value: float) -> None:
    args = {"prompt_tokens": 10.0, "output_tokens": 5.0, field: value}
    with pytest.raises(UserError, match=f"workload: {field}: bad value"):
        Workload(**args)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="workload: pipeline_depth: bad value 0.5"):
        Workload(700.0, 300.0, pipeline_depth=0.5)
    with pytest.raises(UserError, match="pipeline_depth: bad value nan"):
        Workload(700.0, 300.0, pipeline_depth=float("nan"))
    with pytest.raises(UserError, match="need one prompt and one output length"):
        Workload.from_lengths([], [], pipeline_depth=2.0)


@pytest.mark.parametrize("command", ["plan", "evaluate", "simulate"])
def test_cli_bad_workload_is_exit_2_and_one_line(command: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = {"plan": ["plan", "--example"],
            "evaluate": ["evaluate", "--example", "--placement", "x.json"],
            "simulate": ["simulate", "--cluster", "c.yaml", "--model", "m",
                         "--placement", "milp", "--offline"]}[command]
    code = main([*argv, "--workload", "2000:thirty"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"helixserve {command}: error: --workload: bad value '2000:thirty': output tokens 'thirty' is not "
                   "a number; need PROMPT:OUTPUT mean tokens, e.g. 2000:30"]


# ---- capacities ---------------------------------------------------------------------------

NODES = [NodeSpec("a", "A100-40GB"), NodeSpec("l", "L4"), NodeSpec("t", "T4")]


def test_r_zero_is_the_decode_only_throughput_exactly(parts) -> None:  # type: ignore[no-untyped-def]
    model, profiles = parts
    decode = CostModel(model, profiles)
    zero = CostModel(model, profiles, workload=Workload(0.0, 1024.0))
    assert zero.context_tokens == decode.context_tokens == 1024
    for node in NODES:
        for k in range(1, decode.loadable_layers(node) + 2):
            assert (zero.node_throughput_tokens_per_s(node, k)
                    == decode.node_throughput_tokens_per_s(node, k))


def test_workload_throughput_is_the_documented_formula(parts) -> None:  # type: ignore[no-untyped-def]
    model, profiles = parts
    mix = Workload(1500.0, 50.0)  # r = 30
    cost = CostModel(model, profiles, workload=mix)
    assert cost.context_tokens == 1550
    decode_only = CostModel(model, profiles, context_tokens=1550)
    for node in NODES:
        p = min(1500, cost.batch_limits(node)[0])
        for k in (1, 3, cost.max_layers(node)):
            b = cost.decode_batch(node, k)
            s_per_token = k / 1000 * (cost.layer_time_ms(node.gpu, 1, 0, b) / b
                                      + 30.0 * cost.layer_time_ms(node.gpu, 1, p, 0) / p)
            got = cost.node_throughput_tokens_per_s(node, k)
            assert got == pytest.approx(1.0 / s_per_token, rel=1e-12)
            # prompts only add work: fewer output tokens/s than decode tokens/s alone
            assert got < decode_only.node_throughput_tokens_per_s(node, k)


def test_links_carry_one_plus_r_tokens_per_output_token(parts) -> None:  # type: ignore[no-untyped-def]
    model, profiles = parts
    cluster = ClusterSpec("c", NODES, default_link=LinkSpec(8.0, 1.0),
                          explicit={("a", "l"): LinkSpec(0.1, 50.0)})
    mix = Workload(700.0, 200.0)  # 1 + r = 4.5
    plain = FlowNetwork(cluster, model, CostModel(model, profiles))
    aware = FlowNetwork(cluster, model, CostModel(model, profiles, workload=mix))
    np.testing.assert_allclose(aware.link_cap * 4.5, plain.link_cap, rtol=1e-12)
    np.testing.assert_allclose(aware.source_cap * 4.5, plain.source_cap, rtol=1e-12)
    # the way back carries the sampled token only
    np.testing.assert_allclose(aware.sink_cap, plain.sink_cap, rtol=1e-12)


# ---- serving-aware T(k) (a pipeline depth) -------------------------------------------------

def test_from_lengths_with_a_depth_takes_the_means() -> None:
    load = Workload.from_lengths([700, 900], [100, 300], pipeline_depth=4)
    assert load.serving_aware and load.pipeline_depth == 4
    assert load.request_kv_tokens == pytest.approx(1000.0)
    assert load.prompt_tokens_per_output_token == pytest.approx(4.0)
    assert load.prompt_batch_tokens == 800
    assert not Workload(700.0, 300.0).serving_aware


def test_from_lengths_is_the_fmean_the_serving_load_took() -> None:
    # ServingLoad.from_lengths took statistics.fmean: for token counts the same float as
    # sum / len, so the serving-aware plans of the benchmarks are unchanged
    if not TRACE.is_file():
        pytest.skip(f"trace not found at {TRACE}")
    reqs = prepare_trace(load_azure_trace(TRACE))
    prompts, outputs = [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs]
    load = Workload.from_lengths(prompts, outputs, pipeline_depth=14)
    p, o = statistics.fmean(prompts), statistics.fmean(outputs)
    assert load.request_kv_tokens == p + o
    assert load.prompt_tokens_per_output_token == p / o
    assert load.prompt_batch_tokens == max(1, round(p))


def test_serving_throughput_is_the_documented_formula(parts) -> None:  # type: ignore[no-untyped-def]
    model, profiles = parts
    load = Workload(750.0, 250.0, pipeline_depth=10.0)  # P + O = 1000, r = 3
    cost = CostModel(model, profiles, workload=load)
    assert cost.serving is load
    node = NodeSpec("x", "L4")
    for k in (2, 5, 7):
        requests = cost.kv_capacity_tokens(node, k) / 1000.0
        b = min(cost.batch_limits(node)[1], int(requests / 10.0))
        per_token_ms = k * (cost.layer_time_ms("L4", 1, 0, b) / b
                            + 3.0 * cost.layer_time_ms("L4", 1, 750, 0) / 750)
        assert cost.node_throughput_tokens_per_s(node, k) == pytest.approx(1000.0 / per_token_ms)
    assert cost.node_throughput_tokens_per_s(node, cost.loadable_layers(node) + 1) == 0.0


def test_serving_throughput_is_below_the_decode_only_one(parts) -> None:  # type: ignore[no-untyped-def]
    # prompts add work and the batch is split over the pipeline: below decode-only
    model, profiles = parts
    plain = CostModel(model, profiles)
    for depth in (1.0, 14.0):
        serving = CostModel(model, profiles, workload=Workload(763.0, 232.0, pipeline_depth=depth))
        for gpu in ("A100-40GB", "L4", "T4"):
            node = NodeSpec("x", gpu)
            for k in range(1, plain.max_layers(node) + 1):
                t = serving.node_throughput_tokens_per_s(node, k)
                assert 0 < t < plain.node_throughput_tokens_per_s(node, k), (depth, gpu, k)


def test_serving_aware_flow_keeps_the_decode_only_units(parts) -> None:  # type: ignore[no-untyped-def]
    # as ServingLoad did: links carry one token per unit of flow and the decode batch's KV
    # per sequence stays the default context (the benchmarks' numbers were measured so)
    model, profiles = parts
    cluster = ClusterSpec("c", NODES, default_link=LinkSpec(8.0, 1.0),
                          explicit={("a", "l"): LinkSpec(0.1, 50.0)})
    plain = CostModel(model, profiles)
    serving = CostModel(model, profiles, workload=Workload(700.0, 200.0, pipeline_depth=4.0))
    assert serving.context_tokens == plain.context_tokens
    assert serving.activation_tokens_per_flow_unit == 1.0
    a, b = FlowNetwork(cluster, model, plain), FlowNetwork(cluster, model, serving)
    np.testing.assert_array_equal(a.link_cap, b.link_cap)
    np.testing.assert_array_equal(a.source_cap, b.source_cap)
