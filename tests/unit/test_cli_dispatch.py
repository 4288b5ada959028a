"""The CLI dispatcher: help lists every built command, bad usage exits 2 with one line."""

import subprocess
import sys

import pytest

from helixserve.cli import COMMAND_MODULES, build_parser
from helixserve.errors import UserError


def test_every_command_module_registers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    # every command listed in the dispatcher is built and registered
    assert set(COMMAND_MODULES) <= set(sub.choices)


def test_unknown_flag_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "helixserve", "plan", "--no-such-flag"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "--no-such-flag" in proc.stderr


def test_every_kv_allocation_is_taken_by_the_cli_and_the_coordinator():
    # KV_ALLOCATIONS is defined once (helixserve.spec.scheduling); what must agree is the behaviour:
    # each value is accepted by `serve`'s parser and the coordinator's config, and any other
    # value is refused by both
    from helixserve.runtime.config import CoordinatorConfig
    from helixserve.spec.scheduling import KV_ALLOCATIONS

    parser = build_parser()
    files = ["--cluster", "c.yaml", "--placement", "p.json", "--model", "m"]
    for value in KV_ALLOCATIONS:
        args = parser.parse_args(["serve", *files, "--kv-allocation", value])
        assert args.kv_allocation == value
        assert CoordinatorConfig(kv_allocation=value).check().kv_allocation == value
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", *files, "--kv-allocation", "lazy"])
    with pytest.raises(UserError, match="kv_allocation: bad value 'lazy'"):
        CoordinatorConfig(kv_allocation="lazy").check()
