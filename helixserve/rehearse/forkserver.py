"""Emulated workers forked from one pre-imported process: 42 of them fit in memory.

A fresh `helixserve worker` process is ~35 MB of PSS before it serves anything (the
interpreter, gRPC, protobuf, numpy and helixserve's modules, each process its own copy);
at 42 workers that is 1.5 GiB of the rehearsal's 4 GiB. The fork server imports all of that
once, then forks one child per worker: the children share those pages copy-on-write (~5 MB
of PSS each when idle), and each child is still a separate process running the unchanged
`helixserve worker` command line, with its own gRPC server, port, log and process group.

    rehearse --stdin/stdout--> forkserver (imports, no threads, no gRPC object yet)
                                 |-- fork: worker-n0 (setsid, log, `helixserve worker ...`)
                                 |-- fork: worker-n1 ...

Protocol: the rehearsal writes one JSON line per worker, `{"argv": [...], "log": PATH}`; the
server answers with the child's pid. It reaps its children and writes each one's exit code to
`PATH.exit`; `ForkedProcess` is the rehearsal's handle on a child (poll, wait, pid), as a
`subprocess.Popen` is for the other processes. Each child dies with the fork server
(PR_SET_PDEATHSIG), which dies with the rehearsal; a closed stdin ends the server.

No gRPC object (channel, server) and no thread exists in the server when it forks: gRPC's
core starts threads and opens files only when the first one is made, in the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

#: the command word that makes `helixserve.rehearse.child` a fork server of `worker`s
COMMAND = "forkserver"


def exit_path(log: str | Path) -> Path:
    return Path(f"{log}.exit")


def _preload() -> None:
    """Everything an emulated worker imports, imported now (shared by the children)."""
    import gc

    import grpc  # noqa: F401
    from grpc_health.v1 import health  # noqa: F401

    import helixserve.commands.worker  # noqa: F401
    import helixserve.engine.emulated  # noqa: F401
    import helixserve.runtime.worker  # noqa: F401
    from helixserve.cli import build_parser

    build_parser()  # imports every command module, as each child's `helixserve` does
    gc.collect()
    gc.freeze()  # the imported objects are never scanned again: no copy-on-write by gc


def _reap(*_: object) -> None:
    """SIGCHLD: reap every child that exited; its exit code goes to its log's `.exit`."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log = _LOGS.pop(pid, None)
        if log is not None:
            with contextlib.suppress(OSError):
                exit_path(log).write_text(str(os.waitstatus_to_exitcode(status)))


#: child pid -> its log path (fork server only)
_LOGS: dict[int, str] = {}


def _child(argv: list[str], log: str) -> None:
    """In the forked child: a session of its own, the log as stdout and stderr, the fork
    server as the parent to die with; then `helixserve ARGV` (never returns)."""
    from helixserve.local.launch import PARENT_PID_ENV

    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.environ[PARENT_PID_ENV] = str(os.getppid())  # die_with_parent: the fork server
        from helixserve.rehearse.command import run_command

        code = run_command(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(stdin: IO[str], stdout: IO[str]) -> int:
    """The fork server's loop (module doc)."""
    import threading

    _preload()
    if threading.active_count() != 1:
        print(f"rehearse forkserver: {threading.active_count()} threads after the imports; "
              "forking needs one", file=sys.stderr, flush=True)
        return 1
    signal.signal(signal.SIGCHLD, _reap)
    stdout.write("ready\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        argv, log = [str(a) for a in request["argv"]], str(request["log"])
        with contextlib.suppress(OSError):
            exit_path(log).unlink()
        # SIGCHLD waits until the child's log is known (a child may exit at once)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _child(argv, log)
        _LOGS[pid] = log
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        stdout.write(f"{pid}\n")
        stdout.flush()
    return 0


class ForkServer:
    """The rehearsal's side: start the server, fork workers from it."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._in, self._out = proc.stdin, proc.stdout
        if self._out.readline().strip() != b"ready":
            raise RuntimeError("rehearse: the worker fork server did not start")

    def spawn(self, argv: list[str], log: Path) -> ForkedProcess:
        self._in.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
        self._in.flush()
        answer = self._out.readline().strip()
        if not answer.isdigit():
            raise RuntimeError(f"rehearse: the worker fork server answered {answer!r}")
        return ForkedProcess(int(answer), log)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._in.close()
        with contextlib.suppress(OSError):
            self._out.close()


class ForkedProcess:
    """A forked worker, as much of `subprocess.Popen` as the rehearsal uses: `pid`, `poll`,
    `wait`, `returncode` (from the fork server's `.exit` file: the rehearsal is not the
    parent, the server reaps it)."""

    def __init__(self, pid: int, log: Path) -> None:
        self.pid = pid
        self.log = log
        self.returncode: int | None = None

    def _alive(self) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2:].split()[0] != "Z"

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._alive():
            return None
        deadline = time.monotonic() + 1.0  # the server writes the code as it reaps
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                self.returncode = int(exit_path(self.log).read_text())
                return self.returncode
            time.sleep(0.02)
        self.returncode = -1  # gone, code unknown (the server died first)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def main(args: list[str]) -> Any:
    del args
    return serve(sys.stdin, sys.stdout)
