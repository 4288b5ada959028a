"""Restart local worker processes that exit (the demo's, and any stack that starts its own).

A thread polls the `WorkerProcesses` every `poll_interval_s`. A worker that exited (killed,
crashed, out of memory) while the stack runs is started again on the same address with the
same flags, after a backoff that doubles from `initial_backoff_s` up to `max_backoff_s` and
resets once a worker has run `stable_after_s`. Each exit and restart is logged with the
worker's exit code and the tail of its log. The coordinator notices the new process (it
retries a down node every few seconds) and routes over the range it loaded; if a re-plan
moved that range elsewhere meanwhile, the restarted worker is an extra holder.

`stats()` gives per node: up, restarts, last exit code, for /metrics and /health.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("helixserve.local.supervisor")


@dataclass
class _NodeRecord:
    restarts: int = 0
    last_exit_code: int | None = None
    started_s: float = 0.0  # monotonic
    backoff_s: float = 0.0
    restart_at_s: float | None = None  # monotonic; set while a restart waits for its backoff


class Supervisor:
    def __init__(
        self,
        workers: Any,  # helixserve.local.launch.WorkerProcesses
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_after_s: float = 60.0,
        poll_interval_s: float = 0.2,
        say: Any = print,
    ) -> None:
        self.workers = workers
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.poll_interval_s = poll_interval_s
        self.say = say
        now = time.monotonic()
        self.records = {w.node: _NodeRecord(started_s=now) for w in workers.workers}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop restarting (call before stopping the workers)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.check()
            except Exception as exc:  # keep supervising whatever one restart did
                log.exception("supervisor: %s", exc)

    def check(self) -> None:
        """One pass: note exits, restart those whose backoff has passed."""
        now = time.monotonic()
        for node, proc in list(self.workers.procs.items()):
            rec = self.records.setdefault(node, _NodeRecord(started_s=now))
            code = proc.poll()
            if code is None:
                continue
            with self._lock:
                if rec.restart_at_s is None:
                    ran_s = now - rec.started_s
                    rec.last_exit_code = code
                    if ran_s >= self.stable_after_s or rec.backoff_s == 0.0:
                        rec.backoff_s = self.initial_backoff_s
                    else:
                        rec.backoff_s = min(self.max_backoff_s, 2 * rec.backoff_s)
                    rec.restart_at_s = now + rec.backoff_s
                    self.say(f"supervisor: worker {node} exited with code {code} after "
                             f"{ran_s:.1f} s; restarting in {rec.backoff_s:.1f} s "
                             f"(log {self.workers.log_dir}/worker-{node}.log)")
                    continue
                if now < rec.restart_at_s or self._stop.is_set():
                    continue
                rec.restart_at_s = None
                rec.restarts += 1
                rec.started_s = now
            self.workers.start_one(node)
            self.say(f"supervisor: restarted worker {node} (restart {rec.restarts})")

    def stats(self) -> dict[str, dict[str, Any]]:
        alive = self.workers.alive()
        with self._lock:
            return {
                node: {
                    "process_up": alive.get(node, False),
                    "restarts": rec.restarts,
                    "last_exit_code": rec.last_exit_code,
                }
                for node, rec in self.records.items()
            }


__all__ = ["Supervisor"]
