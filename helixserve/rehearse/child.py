"""Entry point of a rehearsal's child processes: `python -m helixserve.rehearse.child
COMMAND ARGS...` runs `helixserve COMMAND ARGS...` (worker, serve) after asking the kernel to
SIGTERM it when the rehearsal dies (PR_SET_PDEATHSIG), so even a SIGKILLed rehearsal leaves no
process behind. Done here, in the child, rather than in a `preexec_fn`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

#: the pid a child must not outlive
PARENT_PID_ENV = "HELIXSERVE_REHEARSE_PARENT"


def die_with_parent() -> None:
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    die_with_parent()
    if sys.argv[1:2] == ["links"]:
        import asyncio

        from helixserve.rehearse.links import run_proxy

        asyncio.run(run_proxy(sys.argv[2]))
        return 0
    from helixserve.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
