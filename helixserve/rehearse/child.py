"""Entry point of a rehearsal's child processes: `python -m helixserve.rehearse.child
COMMAND ARGS...` runs `helixserve COMMAND ARGS...` (worker, serve) after asking the kernel to
SIGTERM it when the rehearsal dies (PR_SET_PDEATHSIG), so even a SIGKILLed rehearsal leaves
no process behind. Done here, in the child, rather than in a `preexec_fn`, by the local
stacks' `die_with_parent` (the rehearsal sets its `PARENT_PID_ENV`). `links CONFIG` runs the
link proxy; `forkserver worker` the fork server the emulated workers are forked from
(helixserve/rehearse/forkserver.py), each of which runs `run_command`.

Profiling: helixserve/rehearse/command.py.
"""

from __future__ import annotations

import sys

from helixserve.local.launch import die_with_parent
from helixserve.rehearse.command import run_command


def main() -> int:
    die_with_parent()
    args = sys.argv[1:]
    if args[:1] == ["links"]:
        import asyncio

        from helixserve.rehearse.links import run_proxy

        asyncio.run(run_proxy(args[1]))
        return 0
    from helixserve.rehearse import forkserver

    if args[:1] == [forkserver.COMMAND]:
        return int(forkserver.main(args[1:]) or 0)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
