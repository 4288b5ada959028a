"""Waiting for admission: the coordinator's side of `SchedulerCore.schedule()`.

The scheduling core decides who is admitted, in which order and on which route
(scheduler/core.py); this module turns its decisions into wake-ups of the requests that
wait. A request that arrived (`core.arrive`) or was requeued (a replay) waits in
`AdmissionWait.admit` on a future of its own; `pump()` asks the core to `schedule()` and
resolves each future with the core's `Admission`, or fails it with `QueueFullError` when the
core refused the request. The coordinator pumps at the admission points it knows of (a request
finishing, a worker back, a re-plan installed; `pump_soon` once the results already received
have been taken in, as the simulator admits after a batch's last token), and each waiting
request pumps once per `retry_s` (worker reports may have made room).

While no route covers the model, `admit` calls `while_uncovered(since_s)`, which raises
(NoRouteError) when the request should stop waiting for a re-plan or a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from helixserve.scheduler.core import Admission, QueueFullError, SchedulerCore


class NoRouteError(RuntimeError):
    """No route over the live workers covers the whole model (the API answers 503, with
    Retry-After when `retry_after_s` is set)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionWait:
    """`sync`: hands the core the workers' latest reports before it decides."""

    def __init__(self, core: SchedulerCore, sync: Callable[[], None], retry_s: float) -> None:
        self.core = core
        self.sync = sync
        self.retry_s = retry_s
        #: requests waiting for the core's answer, by internal id
        self._waiters: dict[str, asyncio.Future[Admission]] = {}
        self._pump_due = False

    def pump(self) -> None:
        """Carry out the core's decisions: wake the requests it admitted, fail those it
        refused."""
        self._pump_due = False
        self.sync()
        for d in self.core.schedule():
            waiter = self._waiters.pop(d.request_id, None)
            if waiter is None or waiter.done():
                continue
            if isinstance(d, Admission):
                waiter.set_result(d)
            else:
                waiter.set_exception(QueueFullError(d.reason))

    def pump_soon(self) -> None:
        """`pump` once the results already received have been taken in (a step's tokens come
        together)."""
        if not self._pump_due:
            self._pump_due = True
            asyncio.get_running_loop().call_soon(self.pump)

    async def admit(self, request_id: str, covered: Callable[[], bool],
                    while_uncovered: Callable[[float], None], timeout_s: float) -> Admission:
        """Wait until the core admits the request (known to it already: arrived or
        requeued). While the model is covered it waits at most `timeout_s` in all for KV room
        (then QueueFullError); while it is not, `while_uncovered` decides. Giving up (no
        route, queue full, cancelled) takes it out of the queue, or frees its KV if it was
        admitted as it gave up; the next head may fit then."""
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[Admission] = loop.create_future()
        self._waiters[request_id] = admitted
        uncovered_since: float | None = None
        covered_wait_s, last = 0.0, loop.time()
        try:
            self.pump()
            while not admitted.done():
                now = loop.time()
                if not covered():
                    uncovered_since = uncovered_since or now
                    while_uncovered(uncovered_since)
                else:
                    covered_wait_s += now - last
                    if covered_wait_s > timeout_s:
                        raise QueueFullError(f"no KV room for the request within "
                                             f"{timeout_s:g} s (admission_timeout_s)")
                last = now
                await asyncio.wait({admitted}, timeout=min(self.retry_s, timeout_s))
                if not admitted.done():
                    self.core.wake()  # worker reports may have made room
                    self.pump()
            return admitted.result()
        except BaseException:
            self._waiters.pop(request_id, None)
            self.core.finish(request_id)
            self.pump()
            raise


__all__ = ["AdmissionWait", "NoRouteError"]
