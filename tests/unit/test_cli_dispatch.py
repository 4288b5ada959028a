"""The CLI dispatcher: help lists every built command, bad usage exits 2 with one line."""

import subprocess
import sys

from helixserve.cli import COMMAND_MODULES, build_parser


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


def test_cli_kv_allocation_choices_are_the_schedulers():
    from helixserve.commands.serve import KV_ALLOCATION_CHOICES
    from helixserve.scheduler.types import KV_ALLOCATIONS
    from helixserve.simulator.engines import KV_ALLOCATIONS as SIM_KV_ALLOCATIONS

    assert KV_ALLOCATION_CHOICES == KV_ALLOCATIONS == SIM_KV_ALLOCATIONS
