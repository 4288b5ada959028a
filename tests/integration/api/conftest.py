"""The real demo stack (`helixserve demo`: 3 worker processes + coordinator + API), once per
module, on free ports on 127.0.0.1, with its files in a temp work dir."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from api_demo_lib import API_KEY, DemoStack, processes_mentioning

from helixserve.local.launch import free_port


@pytest.fixture(scope="module")
def demo(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[DemoStack]:
    workdir = tmp_path_factory.mktemp("demo")
    # the demo profiles this CPU once per work dir; reuse the last run's profile (pytest's
    # cache) so only the first run pays for it
    # (absent when pytest runs with -p no:cacheprovider: then every run profiles)
    cache = getattr(request.config, "cache", None)
    cached_profile = cache.mkdir("helixserve-api-demo") / "profiles.csv" if cache else None
    if cached_profile is not None and cached_profile.is_file():
        shutil.copy(cached_profile, workdir / "profiles.csv")
    port = free_port()
    log_path = workdir / "demo.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "helixserve",
                "demo",
                "--port",
                str(port),
                "--workdir",
                str(workdir),
                "--api-key",
                API_KEY,
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    stack = DemoStack(proc, f"http://127.0.0.1:{port}", workdir, log_path)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"demo exited early:\n{stack.log()}"
            assert time.monotonic() < deadline, f"demo not up after 240 s:\n{stack.log()}"
            try:
                # up = healthy and the banner printed (it follows uvicorn's start)
                healthy = httpx.get(stack.url + "/health", timeout=2).status_code == 200
                if healthy and "API ready at" in stack.log():
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if cached_profile is not None and (workdir / "profiles.csv").is_file():
            shutil.copy(workdir / "profiles.csv", cached_profile)
        yield stack
    finally:
        stack.stop()
        for pid in processes_mentioning(str(workdir)):
            os.kill(pid, signal.SIGKILL)  # never leave workers behind, even on failure
