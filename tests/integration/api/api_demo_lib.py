"""Helpers for the demo-stack tests: the stack handle and an orphan finder."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

API_KEY = "sk-integration"


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (to find orphans of a work dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


@dataclass
class DemoStack:
    proc: subprocess.Popen[str]
    url: str
    workdir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def worker_addresses(self) -> dict[str, str]:
        from helixserve.planner import load_placement
        from helixserve.spec import load_cluster

        cluster = load_cluster(self.workdir / "cluster.yaml")
        held = {n.name for n in load_placement(self.workdir / "placement.json").nodes}
        return {n.name: str(n.address) for n in cluster.nodes if n.name in held}

    def coordinator_tls(self):  # -> helixserve.runtime.security.TlsConfig
        """The dev credentials the demo generated for its coordinator (launch.py)."""
        from helixserve.runtime.security import load_tls

        tls = self.workdir / "logs" / "tls"
        return load_tls(tls / "coordinator.crt", tls / "coordinator.key", tls / "ca.crt")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
