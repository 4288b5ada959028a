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
    with pytest.raises(UserError, match="need one prompt and one output length"):
        Workload.from_lengths([], [])


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
