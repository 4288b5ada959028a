"""The fork server the rehearsal's workers come from: each child runs the `helixserve`
command it is given in its own session, with its own log, and its exit code comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helixserve.rehearse.forkserver import COMMAND, ForkServer


@pytest.fixture
def server() -> ForkServer:
    proc = subprocess.Popen([sys.executable, "-m", "helixserve.rehearse.child", COMMAND,
                             "worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)
    fs = ForkServer(proc)
    yield fs
    fs.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_a_forked_command_logs_and_returns_its_exit_code(server: ForkServer,
                                                         tmp_path: Path) -> None:
    log = tmp_path / "worker-x.log"
    child = server.spawn(["worker", "--model", str(tmp_path), "--layers", "0:1", "--port",
                          "0", "--engine", "emulated"], log)
    assert child.wait(timeout=30) == 2  # a flag error: exit 2 with one line
    assert "--gpu: required with --engine emulated" in log.read_text()
    assert child.poll() == 2


def test_a_forked_worker_serves_in_its_own_session_until_sigterm(server: ForkServer,
                                                                  tmp_path: Path) -> None:
    data = Path(__file__).resolve().parents[2] / "data" / "shared"
    log = tmp_path / "worker-n0.log"
    child = server.spawn(["worker", "--engine", "emulated", "--gpu", "L4", "--profiles",
                          str(data / "profiles" / "helix-measured.csv"), "--model",
                          str(data / "models" / "llama-2-70b"), "--layers", "0:10", "--node",
                          "n0", "--port", "0", "--drain-timeout-s", "0.1"], log)
    def text() -> str:
        return log.read_text() if log.exists() else ""

    deadline = time.monotonic() + 60
    while "listening on" not in text() and time.monotonic() < deadline:
        assert child.poll() is None, text()
        time.sleep(0.1)
    assert "EMULATED engine" in log.read_text()
    assert os.getsid(child.pid) == child.pid != server.proc.pid  # its own session
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(timeout=30) == 0
    assert "EMULATED engine emulated 0 steps" in log.read_text()
