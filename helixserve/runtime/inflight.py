"""Request bookkeeping: what the coordinator keeps of each request it serves.

`InFlight` is the coordinator's one request type between the API's `GenerationRequest` and the
wire. It *is* the scheduling core's `CoreRequest` (its sizes, tokens generated, re-route count):
the core holds this very object in its queue and ledger, and renames it when it is replayed
under a fresh id. On top it keeps what the network side needs: the API's request (read, never
changed), the sampling the last hop applies, the route with each hop's address, the tokens
generated so far (a replay prefills prompt + these), the steps sent and not yet answered, and
the queue in which its driver receives the results that `results.py` let through.

    fl = InFlight.of(req, internal_id, eos_token_ids)   # after GenerationRequest.validate
    core.arrive(fl); ...; fl.admitted(admission.route, addresses, epoch)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from helixserve.request import GenerationRequest, SamplingParams
from helixserve.scheduler.core import CoreRequest

if TYPE_CHECKING:
    from helixserve.planner.placement import NodeRange
    from helixserve.runtime.node_client import NodeFailure
    from helixserve.runtime.transport import WireResult
    from helixserve.scheduler.types import Route


@dataclass(kw_only=True, eq=False)
class InFlight(CoreRequest):
    """One request from its arrival at the coordinator to its end. `request_id` (the core's)
    is the internal id the workers know it by: `<api id>#<coordinator>.<n>`, new on every
    replay, so workers drop late items of an old attempt."""

    #: the API's request: prompt, limits, stop conditions
    req: GenerationRequest
    #: what the route's last hop samples with: the request's, with the stop ids that
    #: `min_tokens` masks folded in; `prompt_logprobs` cleared once the prompt was scored
    sampling: SamplingParams
    #: the current route and each hop's worker address (host:port); () while waiting
    hops: tuple[NodeRange, ...] = ()
    addresses: tuple[str, ...] = ()
    #: tokens generated so far, in order
    output_ids: list[int] = field(default_factory=list)
    #: step ids sent on the current route whose result (token or ack) has not come back
    pending: set[int] = field(default_factory=set)
    #: results let through for this request's driver (results.py), and route failures
    results: asyncio.Queue[WireResult | NodeFailure] = field(default_factory=asyncio.Queue)
    #: the coordinator's placement epoch when the current route was made (replan.py)
    epoch: int = 0
    #: every worker of the route takes continuation items (decode steps without the route
    #: and sampling, which went with the prefill); set when the prefill is sent
    continuation: bool = False
    #: tokens [0, cached_tokens) of `replay_tokens` the current route's hops take from their
    #: prefix caches (Admission.cached_tokens; docs/prefix-caching.md)
    cached_tokens: int = 0

    @classmethod
    def of(cls, req: GenerationRequest, internal_id: str,
           eos_token_ids: list[int]) -> InFlight:
        """A checked request (`GenerationRequest.validate`) as the coordinator serves it."""
        sampling = req.sampling
        if req.min_tokens > 0:
            # the last hop's sampler masks these until min_tokens are generated
            stop_ids = set(req.stop_token_ids)
            if not req.ignore_eos:
                stop_ids |= set(eos_token_ids)
            sampling = dataclasses.replace(sampling, min_tokens=req.min_tokens,
                                           stop_token_ids=tuple(sorted(stop_ids)))
        return cls(internal_id, len(req.prompt_token_ids), req.max_tokens, req=req,
                   sampling=sampling)

    @property
    def internal_id(self) -> str:
        return self.request_id

    @property
    def replay_tokens(self) -> list[int]:
        """What a prefill on a new route runs: the prompt and the tokens generated so far."""
        return self.req.prompt_token_ids + self.output_ids

    def token_ids(self) -> Sequence[int] | None:
        """What the core matches against cached prefixes: prompt + tokens so far; None (no
        reuse) while the prompt is to be scored (prompt_logprobs need every prompt token's
        logits computed)."""
        if self.sampling.prompt_logprobs is not None:
            return None
        return self.replay_tokens

    def admitted(self, route: Route, addresses: tuple[str, ...], epoch: int,
                 cached_tokens: int = 0) -> None:
        """The core gave it `route`, with its first `cached_tokens` tokens cached on every
        hop; its steps go there from now on."""
        self.hops, self.addresses, self.epoch = route.hops, addresses, epoch
        self.cached_tokens = cached_tokens

    def restart(self) -> None:
        """Its route was given up (re-route, preemption): nothing of the old one is awaited."""
        self.results = asyncio.Queue()
        self.pending.clear()

    def on_route(self, node: str) -> bool:
        return any(h.name == node for h in self.hops)


__all__ = ["InFlight"]
