"""`helixserve worker` flag errors: exit 2 with one line naming the flag and the bad value."""

import json

import pytest

from helixserve.cli import main
from helixserve.commands.worker import parse_layers


def placement_file(tmp_path):
    p = tmp_path / "placement.json"
    p.write_text(json.dumps({
        "format": "helixserve.placement/v1", "model": "m", "cluster": "c", "num_layers": 30,
        "planner": "test",
        "nodes": [{"name": "n0", "start_layer": 0, "end_layer": 12},
                  {"name": "n1", "start_layer": 12, "end_layer": 30}],
    }))
    return p


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--layers", "5"], "--layers: bad value '5'"),
        (["--layers", "a:b"], "--layers: bad value 'a:b'"),
        (["--layers", "9:3"], "--layers: bad range '9:3'"),
        (["--placement", "{placement}"], "--placement needs --node"),
        (["--placement", "{placement}", "--node", "n7"], "no node 'n7' holds layers; known: n0, n1"),
        (["--layers", "0:10", "--model", "{tmp}/nope"], "is not a directory"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    placement = placement_file(tmp_path)
    argv = [a.format(placement=placement, tmp=tmp_path) for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(tmp_path)]
    assert main(["worker", *argv, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_layers_and_placement_resolve_the_same_range(tmp_path):
    import argparse

    from helixserve.commands.worker import resolve_range

    args = argparse.Namespace(layers=None, placement=placement_file(tmp_path), node="n1")
    assert resolve_range(args) == ("n1", 12, 30)
    assert parse_layers("12:30") == (12, 30)
