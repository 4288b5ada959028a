"""How a machine is made slower: `helixserve worker/profile --slowdown F`, or a cgroup CPU quota.

- `slowdown` (the default): each engine step sleeps (F - 1) x its compute time
  (helixserve/engine/slowdown.py). Deterministic per step and needs no privileges; the
  profiles measure exactly what the worker does.
- `cgroup`: a cgroup-v1 `cpu` controller group per machine with a CFS quota of 1/F of one
  CPU (period 10 ms). Real throttling by the kernel, but bursty: a step shorter than the
  quota left in the period runs at full speed, so a profile's median of short steps can miss
  the throttling a long run sees. Needs root and a writable /sys/fs/cgroup/cpu.

`SpeedControl.preexec(machine)` returns what a child process runs before exec to join its
group; `close()` removes every group it made (after their processes have exited).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")
#: CFS period of the quota groups: short, so throttling is spread over a step's time
CFS_PERIOD_US = 10_000
SPEED_MODES = ("slowdown", "cgroup")


def cgroup_writable(root: Path = CGROUP_CPU_ROOT) -> bool:
    return (root / "cpu.cfs_quota_us").is_file() and os.access(root, os.W_OK)


class SpeedControl:
    def __init__(self, mode: str, tag: str, root: Path = CGROUP_CPU_ROOT) -> None:
        if mode not in SPEED_MODES:
            raise ValueError(f"--speed: unknown mode {mode!r}; known: {', '.join(SPEED_MODES)}")
        if mode == "cgroup" and not cgroup_writable(root):
            raise ValueError(f"--speed cgroup: {root} is not a writable cgroup-v1 cpu controller "
                             "(needs root); use --speed slowdown")
        self.mode = mode
        self.base = root / f"helixserve-rig-{tag}"
        self.groups: list[Path] = []

    def worker_args(self, slowdown: float) -> list[str]:
        """Extra `helixserve worker`/`profile` flags for a machine of this slowdown."""
        return ["--slowdown", f"{slowdown:g}"] if self.mode == "slowdown" else []

    def group(self, name: str, slowdown: float) -> Path | None:
        """The quota group of `name` (created once); None in slowdown mode."""
        if self.mode != "cgroup":
            return None
        path = self.base / name
        if path not in self.groups:
            path.mkdir(parents=True, exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(CFS_PERIOD_US / slowdown))))
            self.groups.append(path)
        return path

    def preexec(self, name: str, slowdown: float) -> Callable[[], None] | None:
        """Run in the child before exec: join the machine's group (cgroup mode)."""
        path = self.group(name, slowdown)
        if path is None:
            return None
        tasks = str(path / "cgroup.procs")

        def join() -> None:
            with open(tasks, "w") as f:
                f.write(str(os.getpid()))

        return join

    def close(self) -> list[str]:
        """Remove the groups; returns the ones that could not be removed."""
        left = []
        for path in reversed(self.groups):
            if not _remove_group(path):
                left.append(str(path))
        self.groups.clear()
        if self.base.is_dir() and not _remove_group(self.base):
            left.append(str(self.base))
        return left


def _remove_group(path: Path) -> bool:
    """rmdir a cgroup, first moving any process still in it to the root group."""
    for _ in range(50):
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (CGROUP_CPU_ROOT / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False
