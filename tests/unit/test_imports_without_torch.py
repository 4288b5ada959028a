"""The API process and the coordinator run without torch: the coordinator's container need not
install it. A fresh interpreter with torch and vllm blocked imports them; any import of a
blocked package fails the test with its traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_the_emulated_engine_and_its_worker_import_and_step_without_torch() -> None:
    """`worker --engine emulated` runs where torch is absent: the engine, the worker and the
    command import without it, and a step over real-size activations runs."""
    proc = _import_blocked(
        "helixserve.engine",
        "helixserve.engine.emulated",
        "helixserve.engine.emulated_tokenizer",
        "helixserve.runtime.worker",
        "helixserve.commands.worker",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    shared = Path(__file__).resolve().parents[1] / "data" / "shared"
    step = (
        BLOCK_TORCH
        + "from helixserve.engine.emulated import EmulatedEngine, EmulationSpec\n"
        + "from helixserve.engine.protocol import WorkItem\n"
        + f"spec = EmulationSpec.load('L4', {str(shared / 'profiles' / 'helix-measured.csv')!r},"
        + " time_scale=1e-4)\n"
        + f"e = EmulatedEngine.load({str(shared / 'models' / 'llama-2-70b')!r}, 0, 10, spec)\n"
        + "(out,) = e.step([WorkItem('r', 0, 10, 0, [1, 2, 3])])\n"
        + "print(len(out.hidden.data), 'torch' in __import__('sys').modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", step], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.split() == [str(3 * 8192 * 2), "False"], run.stderr


def test_the_block_is_real() -> None:
    # The torch engine needs torch: if this imported, the block above would prove nothing.
    proc = _import_blocked("helixserve.engine.shard")
    assert proc.returncode != 0 and "blocked by the test: torch" in proc.stderr
