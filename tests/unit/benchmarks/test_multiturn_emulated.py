"""benchmarks/multiturn.py's EMULATED cluster mode: per setup, rehearse's processes started with
the setup's flags, the conversations through their API, the rows labelled EMULATED. The
plumbing against a stand-in cluster (a fake chat server), then once against the real 6-node
emulated cluster (off and aware)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import multiturn
from tests.unit.api.api_testlib import ServerThread
from tests.unit.benchmarks.test_multiturn_run import FakeChat

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "tests/data/rehearse/six-nodes.yaml"
PLACEMENT = ROOT / "tests/data/rehearse/six-nodes.json"
PROFILES = ROOT / "tests/data/shared/profiles/helix-measured.csv"
MODEL = ROOT / "tests/data/shared/models/llama-2-70b"
TRACE = ROOT / "tests/data/rehearse/small-trace.csv"
EMULATED = ["--emulated-cluster", str(CLUSTER), "--placement", str(PLACEMENT),
            "--profiles", str(PROFILES), "--model", str(MODEL), "--trace", str(TRACE)]
SMALL = ["--conversations", "2", "--turns", "2", "--system-tokens", "200", "--user-tokens", "8",
         "--output-tokens", "4"]


def test_each_setup_gets_its_flags_and_vllm_has_no_emulated_counterpart() -> None:
    assert multiturn.emulated_flags("off") == (["--no-prefix-caching"], ["--no-prefix-caching"])
    assert multiturn.emulated_flags("plain") == ([], ["--no-cache-aware-routing"])
    assert multiturn.emulated_flags("aware") == ([], [])
    assert multiturn.emulated_flags("vllm") is None


def test_bad_emulated_flags_exit_2_with_one_line(capsys, tmp_path) -> None:
    bad_placement = tmp_path / "p.json"
    bad_placement.write_text(PLACEMENT.read_text().replace('"a0"', '"zz"'))
    cases = [
        (["--emulated-cluster", str(CLUSTER), "--model", str(MODEL)], "--emulated-cluster needs"),
        ([*EMULATED, "--url", "aware=http://127.0.0.1:1"], "--emulated-cluster and --url"),
        ([*EMULATED, "--time-scale", "0"], "--time-scale"),
        ([*EMULATED[:2], "--placement", str(bad_placement), *EMULATED[4:]], str(bad_placement)),
    ]
    for argv, what in cases:
        assert multiturn.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and what in err and "\n" not in err, err


class _StandIn:
    """In place of EmulatedCluster: a fake chat server at api_url; records its flags."""

    made: list[_StandIn] = []

    def __init__(self, inputs: Any, workdir: Path, *, time_scale: float,
                 worker_args: list[str], serve_args: list[str]) -> None:
        self.inputs, self.time_scale = inputs, time_scale
        self.worker_args, self.serve_args = worker_args, serve_args
        self.server = ServerThread(FakeChat().app())
        self.api_url = f"http://127.0.0.1:{self.server.port}"
        self.emulated: dict[str, dict[str, float]] = {}
        self.made.append(self)

    def __enter__(self) -> _StandIn:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__()
        self.emulated = {"a0": {"prompt_tokens": 30, "cached_tokens": 12}}


def test_the_script_starts_a_cluster_per_setup_with_its_flags(monkeypatch, tmp_path,
                                                              capsys) -> None:
    import helixserve.rehearse.cluster

    _StandIn.made = []
    monkeypatch.setattr(helixserve.rehearse.cluster, "EmulatedCluster", _StandIn)
    out = tmp_path / "mt.json"
    rc = multiturn.main([*EMULATED, *SMALL, "--time-scale", "2", "--workdir", str(tmp_path),
                         "--json", str(out)])
    assert rc == 0
    # off, plain, aware: one cluster each, in that order, with their flags; vllm none
    assert [(c.worker_args, c.serve_args) for c in _StandIn.made] == [
        (["--no-prefix-caching"], ["--no-prefix-caching"]), ([], ["--no-cache-aware-routing"]),
        ([], [])]
    assert all(c.time_scale == 2.0 and c.inputs.model.name == "llama-2-70b"
               for c in _StandIn.made)
    report = json.loads(out.read_text())
    assert report["emulated"]["label"].startswith("EMULATED")
    assert report["emulated"]["time_scale"] == 2.0
    setups = report["setups"]
    assert [setups[k]["status"] for k in ("off", "plain", "aware", "vllm")] == \
        ["ok", "ok", "ok", "skipped"]
    for k in ("off", "plain", "aware"):
        assert setups[k]["description"].startswith("EMULATED cluster")
        assert setups[k]["summary"]["completed"] == 4
        assert "30 prompt tokens computed, 12 from the prefix cache" in setups[k]["note"]
    assert "EMULATED cluster" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.integration
def test_off_and_aware_on_the_real_emulated_cluster(tmp_path) -> None:
    """Six emulated workers, the link proxy and `helixserve serve`, twice (~40 s): caching off
    takes nothing from a cache anywhere; aware's second turns reuse their history."""
    out = tmp_path / "mt.json"
    rc = multiturn.main([*EMULATED, *SMALL, "--setups", "off", "aware",
                         "--workdir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    setups = json.loads(out.read_text())["setups"]
    off, aware = setups["off"], setups["aware"]
    assert off["status"] == aware["status"] == "ok", (off["note"], aware["note"])
    assert off["summary"]["completed"] == aware["summary"]["completed"] == 4
    assert off["summary"]["hit_rate_responses"] == 0.0
    # the workers' --no-prefix-caching: none of them took a token from a cache
    assert "computed, 0 from the prefix cache" in off["note"]
    assert aware["summary"]["hit_rate_responses"] > 0.3
