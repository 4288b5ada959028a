"""The event loop every runtime process runs: uvloop where it is installed, else asyncio's.

A worker's event loop thread is most of its CPU at saturation (docs/benchmarks.md, "Where
the CPU goes"): turning the loop, reading and writing its TLS streams, running the tasks
that move items. uvloop (libuv under asyncio's API; vLLM's and uvicorn's choice) does the
loop's own part and the TLS streams' buffering in C. grpc.aio runs on it unchanged: its
completion queue is polled by gRPC's own thread, which hands events to whichever loop runs.

`HELIXSERVE_EVENT_LOOP` chooses, for every process started with it in its environment
(workers, `serve`, the rehearsal's children):
- `auto` (the default): uvloop when it can be imported, else asyncio's loop;
- `uvloop`: uvloop, and an error naming the variable when it is not installed;
- `asyncio`: asyncio's own loop (the reference; what the rehearsal compares against).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from helixserve.errors import UserError

EVENT_LOOP_ENV = "HELIXSERVE_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def chosen() -> str:
    """The loop this process runs: "uvloop" or "asyncio" (UserError for a bad setting)."""
    want = os.environ.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if want not in EVENT_LOOPS:
        raise UserError(f"{EVENT_LOOP_ENV}: bad value {want!r}; known: {', '.join(EVENT_LOOPS)}")
    if want == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:
        if want == "uvloop":
            raise UserError(f"{EVENT_LOOP_ENV}=uvloop, but uvloop is not installed ({exc}); "
                            "pip install uvloop, or unset it") from exc
        return "asyncio"
    return "uvloop"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What `asyncio.Runner` builds the loop with (None: asyncio's default)."""
    if chosen() == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    try:
        factory = loop_factory()
    except UserError:
        main.close()  # never awaited: no "coroutine was never awaited" warning on top
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
