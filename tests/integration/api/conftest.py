"""The real demo stack (`helixserve demo`: 3 worker processes + coordinator + API) on free ports
on 127.0.0.1, with its files in a temp work dir, shared by this directory's tests.

Starting the stack is most of these tests' time (~25 s on a 2-core machine), so one stack
serves every test that leaves it as it found it (`demo`): they only send requests and read
/metrics, /health and the work dir, and each asserts on what its own requests did (metric
deltas, its own prompts), never on what the stack served before. A test that breaks the stack
(kills a worker, stops it) asks for `demo_to_break` instead: it gets a stack that the `demo`
tests will never see again (the next `demo` test gets a fresh one), so no result depends on
the order the tests run in. The breaking tests are moved after the others of this directory
(`pytest_collection_modifyitems`), so a full run starts one stack, not one per breaking test;
the stack stops when the last test here is done.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_demo_lib import API_KEY, DemoStack, processes_mentioning

from helixserve.local.launch import free_port

HERE = Path(__file__).resolve().parent


class DemoPool:
    """Hands out the shared stack, or a fresh one when the last was given to a breaking test."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, config: pytest.Config) -> None:
        self.tmp_path_factory = tmp_path_factory
        # the demo profiles this CPU once per work dir; reuse the last run's profile (pytest's
        # cache) so only the first stack pays for it (absent when pytest runs with
        # -p no:cacheprovider: then every run profiles once)
        cache = getattr(config, "cache", None)
        self.cached_profile = cache.mkdir("helixserve-api-demo") / "profiles.csv" if cache else None
        self.stack: DemoStack | None = None
        #: the stack was given to a breaking test: `demo` tests must not get it
        self.broken = False
        #: why the last start failed (then every later test fails at once, as a failed
        #: fixture does, instead of waiting out the start again)
        self.start_error: str | None = None

    def shared(self) -> DemoStack:
        if self.stack is not None and self.broken:
            self.close()
        return self._current()

    def to_break(self) -> DemoStack:
        # a stack an earlier breaking test left healthy (it recovers from a killed worker)
        # may serve the next breaking test; one that is stopped or unhealthy may not
        if self.stack is not None and self.broken and not _healthy(self.stack):
            self.close()
        stack = self._current()
        self.broken = True
        return stack

    def _current(self) -> DemoStack:
        if self.start_error is not None:
            pytest.fail(f"the demo stack failed to start earlier:\n{self.start_error}")
        if self.stack is None:
            try:
                self.stack = self._start()
            except BaseException as err:
                self.start_error = str(err)
                raise
            self.broken = False
        return self.stack

    def _start(self) -> DemoStack:
        workdir = self.tmp_path_factory.mktemp("demo")
        if self.cached_profile is not None and self.cached_profile.is_file():
            shutil.copy(self.cached_profile, workdir / "profiles.csv")
        port = free_port()
        log_path = workdir / "demo.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "helixserve", "demo", "--port", str(port),
                 "--workdir", str(workdir), "--api-key", API_KEY],
                stdout=log, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        stack = DemoStack(proc, f"http://127.0.0.1:{port}", workdir, log_path)
        try:
            deadline = time.monotonic() + 240
            while True:
                assert proc.poll() is None, f"demo exited early:\n{stack.log()}"
                assert time.monotonic() < deadline, f"demo not up after 240 s:\n{stack.log()}"
                # up = healthy and the banner printed (it follows uvicorn's start)
                if _healthy(stack) and "API ready at" in stack.log():
                    break
                time.sleep(0.5)
        except BaseException:
            _stop(stack)
            raise
        if self.cached_profile is not None and (workdir / "profiles.csv").is_file():
            shutil.copy(workdir / "profiles.csv", self.cached_profile)
        return stack

    def close(self) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            _stop(stack)


def _healthy(stack: DemoStack) -> bool:
    if stack.proc.poll() is not None:
        return False
    try:
        return httpx.get(stack.url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(stack: DemoStack) -> None:
    stack.stop()
    for pid in processes_mentioning(str(stack.workdir)):
        os.kill(pid, signal.SIGKILL)  # never leave workers behind, even on failure


POOL = pytest.StashKey[DemoPool]()


@pytest.fixture(scope="session")
def demo_pool(tmp_path_factory: pytest.TempPathFactory,
              request: pytest.FixtureRequest) -> Iterator[DemoPool]:
    pool = DemoPool(tmp_path_factory, request.config)
    request.config.stash[POOL] = pool
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def demo(demo_pool: DemoPool) -> DemoStack:
    """The shared stack: send requests, read its state; leave it as you found it."""
    return demo_pool.shared()


@pytest.fixture
def demo_to_break(demo_pool: DemoPool) -> DemoStack:
    """A stack this test may break (kill a worker, stop it): no `demo` test gets it after."""
    return demo_pool.to_break()


def _here(item: pytest.Item) -> bool:
    return HERE in Path(item.path).resolve().parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This directory's breaking tests after its other tests (in their order), in the same
    places of the whole run: the shared stack is then started once."""
    slots = [i for i, item in enumerate(items) if _here(item)]
    mine = [items[i] for i in slots]
    breaking = [item for item in mine if "demo_to_break" in getattr(item, "fixturenames", ())]
    ordered = [item for item in mine if item not in breaking] + breaking
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the stack after the last test of this directory (not at the end of the session:
    the tests after these would run beside its idle processes)."""
    if nextitem is None or not _here(nextitem):
        pool = item.config.stash.get(POOL, None)
        if pool is not None:
            pool.close()
