"""The runtime's thread names and the CPU of a process's threads by kind (runtime/threads.py),
on this test's own process: a thread named as a worker's engine thread burns CPU."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from helixserve.runtime.threads import (
    ENGINE_THREAD,
    THREAD_KINDS,
    name_os_thread,
    thread_cpu_seconds,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def _burn(seconds: float, named: list[bool], ready: threading.Event, burnt: threading.Event,
          done: threading.Event) -> None:
    named.append(name_os_thread(ENGINE_THREAD))
    ready.set()
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    burnt.set()
    done.wait()  # stay alive (and named) until read


def test_an_engine_named_thread_s_cpu_is_counted_as_the_engine_s() -> None:
    named: list[bool] = []
    ready, burnt, done = threading.Event(), threading.Event(), threading.Event()
    before = thread_cpu_seconds(os.getpid())
    t = threading.Thread(target=_burn, args=(0.3, named, ready, burnt, done), daemon=True)
    t.start()
    ready.wait()
    assert named == [True]
    assert t.native_id is not None
    comm = Path(f"/proc/{os.getpid()}/task/{t.native_id}/comm").read_text().strip()
    assert comm == ENGINE_THREAD
    assert burnt.wait(30)
    after = thread_cpu_seconds(os.getpid())
    done.set()
    t.join()
    assert before is not None and after is not None and set(after) == set(THREAD_KINDS)
    assert after["engine"] - before["engine"] >= 0.25
    # the kinds add up to the process's CPU (the rest counted as "other")
    total = sum(after.values())
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    assert abs(total - (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")) < 0.05


def test_a_gone_process_has_no_threads() -> None:
    assert thread_cpu_seconds(2**22 + 12345) is None
