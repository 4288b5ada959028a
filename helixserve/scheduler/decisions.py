"""What the scheduling core (scheduler/core.py) is told of a request and what it answers:
`CoreRequest` in, `Admission` | `Rejection` from `schedule()`, `Grown` | `Preempted` from
`on_token()`, and the errors it raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from helixserve.errors import UserError
from helixserve.scheduler.types import RequestInfo, Route


class NeverFitsError(UserError):
    """The request needs more KV than the roomiest route could give it on an idle cluster."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (the API answers 503/429)."""


class RerouteLimitError(RuntimeError):
    """A request failed on more routes than `SchedulerPolicy.max_reroutes` allows."""


@dataclass
class CoreRequest:
    """What the core knows of a request: its sizes and where it is in its life."""

    request_id: str
    prompt_tokens: int
    #: most tokens it may generate (max_tokens, or the trace's output length)
    max_new_tokens: int
    #: tokens generated so far (a replay prefills prompt + these)
    generated: int = 0
    #: admitted and without its first token yet
    prefilling: bool = False
    #: re-admitted after a preemption or a fault
    resumed: bool = False
    reroutes: int = 0

    def token_ids(self) -> Sequence[int] | None:
        """The tokens a prefill of it runs now (prompt + tokens generated so far), for prefix
        caching; None: contents unknown, nothing is taken from cache for it. The runtime's
        InFlight and the simulator's requests override it."""
        return None


@dataclass(frozen=True)
class Admission:
    """Run the request on `route`: prefill `info.prompt_tokens` (prompt + tokens so far)."""

    request_id: str
    route: Route
    info: RequestInfo
    resumed: bool
    #: tokens [0, cached_tokens) every hop of `route` holds in its prefix cache (whole
    #: blocks, never the last prompt token): the first item starts at this position
    cached_tokens: int = 0


@dataclass(frozen=True)
class Rejection:
    """The request left the queue without a route: `reason` says why."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Grown:
    """The request's next step has its KV slot on every node of its route."""


@dataclass(frozen=True)
class Preempted:
    """These requests were preempted (KV freed, requeued ahead of new ones) so the token's
    request can grow; when it is among them it was preempted itself. Replay each."""

    victims: tuple[str, ...]


GROWN = Grown()
