"""runtime/eventloop.py: which loop a runtime process runs, chosen by HELIXSERVE_EVENT_LOOP."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from helixserve.errors import UserError
from helixserve.runtime import eventloop


async def _loop_class() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_asyncios_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.EVENT_LOOP_ENV, "asyncio")
    assert eventloop.chosen() == "asyncio"
    assert eventloop.run(_loop_class()).startswith("asyncio")


def test_auto_and_uvloop_run_uvloop_where_it_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")  # a dependency of helixserve[serve] where it installs
    for value in ("auto", "uvloop", " UVLOOP ", ""):
        monkeypatch.setenv(eventloop.EVENT_LOOP_ENV, value)
        assert eventloop.chosen() == "uvloop"
        assert eventloop.run(_loop_class()).startswith("uvloop")
    monkeypatch.delenv(eventloop.EVENT_LOOP_ENV)
    assert eventloop.chosen() == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error_naming_the_variable() -> None:
    # a child where `import uvloop` fails, as on a machine without it
    code = (
        "import sys, os\n"
        "sys.modules['uvloop'] = None\n"
        "from helixserve.runtime import eventloop\n"
        "from helixserve.errors import UserError\n"
        "os.environ['HELIXSERVE_EVENT_LOOP'] = 'auto'\n"
        "print(eventloop.chosen())\n"
        "os.environ['HELIXSERVE_EVENT_LOOP'] = 'uvloop'\n"
        "try:\n"
        "    eventloop.chosen()\n"
        "except UserError as exc:\n"
        "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "asyncio"
    assert out[1].startswith("HELIXSERVE_EVENT_LOOP=uvloop, but uvloop is not installed")


def test_a_bad_value_names_the_variable_and_runs_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.EVENT_LOOP_ENV, "tokio")
    ran = []

    async def work() -> None:
        ran.append(1)

    with pytest.raises(UserError, match=r"HELIXSERVE_EVENT_LOOP: bad value 'tokio'; known: "
                                        r"auto, uvloop, asyncio"):
        eventloop.run(work())
    assert ran == []
