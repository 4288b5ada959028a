"""The API process and the coordinator run without torch: the coordinator's container need not
install it. A fresh interpreter with torch and vllm blocked imports them; any import of a
blocked package fails the test with its traceback."""

from __future__ import annotations

import subprocess
import sys

BLOCK_TORCH = (
    "import importlib.abc, sys\n"
    "class Block(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'vllm'):\n"
    "            raise ImportError(f'blocked by the test: {name}')\n"
    "sys.meta_path.insert(0, Block())\n"
)


def _import_blocked(*modules: str) -> subprocess.CompletedProcess[str]:
    code = BLOCK_TORCH + "".join(f"import {m}\n" for m in modules) + "print('ok')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_api_and_coordinator_import_without_torch() -> None:
    proc = _import_blocked(
        "helixserve.request",
        "helixserve.api.app",
        "helixserve.runtime.coordinator",
        "helixserve.runtime.transport",
        "helixserve.commands.serve",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_block_is_real() -> None:
    # The engine needs torch: if this imported, the block above would prove nothing.
    proc = _import_blocked("helixserve.engine")
    assert proc.returncode != 0 and "blocked by the test: torch" in proc.stderr
