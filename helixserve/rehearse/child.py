"""Entry point of a rehearsal's child processes: `python -m helixserve.rehearse.child
COMMAND ARGS...` runs `helixserve COMMAND ARGS...` (worker, serve) after asking the kernel to
SIGTERM it when the rehearsal dies (PR_SET_PDEATHSIG), so even a SIGKILLed rehearsal leaves no
process behind. Done here, in the child, rather than in a `preexec_fn`, by the local stacks' `die_with_parent` (the rehearsal sets
its `PARENT_PID_ENV`)."""

from __future__ import annotations

import sys

from helixserve.local.launch import die_with_parent


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
