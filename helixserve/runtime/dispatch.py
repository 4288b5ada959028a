"""Step dispatch: what the coordinator sends to the workers for one request.

A request's steps all go to the first hop of its route; each worker forwards them on.

- **Prefill** (`prefill`): prompt + tokens generated so far (a replay) in chunks of at most
  `chunk_tokens`, all sent at once; workers run a request's chunks in order, so chunks
  pipeline along the route. Only the last chunk samples. These are full items: they carry the
  route and the sampling, which every hop keeps for the request's later steps. When the
  admission found the first `cached_tokens` tokens cached on every hop, the chunks start
  there and the first carries those tokens as `prefix_token_ids` (docs/prefix-caching.md).
- **Decode** (`decode`): one step per token, sent as soon as the token arrives: a continuation
  item (request id, step id, position, token) when every worker of the route takes them
  (wire version 2), else a full item.
- **Release** (`release`): free the request's KV on every hop of a route: its id rides the
  node's Work stream (the next message, wire version 3); a node believed down gets a
  Release call instead (if only the stream broke, the worker still holds the KV; a dead one
  fails the call at once).

Every step gets a step id unique on this coordinator, recorded in the request's `pending`
set until its result comes back (results.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from helixserve.runtime.transport import WireItem

if TYPE_CHECKING:
    from helixserve.planner.placement import NodeRange
    from helixserve.runtime.inflight import InFlight
    from helixserve.runtime.node_client import NodeClient


class Dispatch:
    """`nodes`: the coordinator's clients by node name (the same mapping, filled later);
    `spawn`: runs a coroutine as one of the coordinator's tasks."""

    def __init__(self, nodes: Mapping[str, NodeClient], coordinator_id: str,
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
                 chunk_tokens: int = 512) -> None:
        self.nodes = nodes
        self.coordinator_id = coordinator_id
        self.spawn = spawn
        #: most tokens per prefill item (startup.chunk_tokens: a chunk's hidden states fit
        #: half a message)
        self.chunk_tokens = chunk_tokens
        self._steps = itertools.count(1)
        self._releases: set[asyncio.Task[Any]] = set()

    def prefill(self, fl: InFlight) -> None:
        """The request's prompt and tokens so far, in chunks, to its route's first hop."""
        fl.continuation = all(getattr(self.nodes[h.name], "continuation_ok", False)
                              for h in fl.hops)
        token_ids = fl.replay_tokens
        # on a replay the last hop must know which tokens are generated ones (penalties)
        num_prompt = len(fl.req.prompt_token_ids) if fl.output_ids else None
        chunk = self.chunk_tokens
        cached = fl.cached_tokens
        if not 0 <= cached < len(token_ids):
            raise ValueError(f"request {fl.internal_id}: cached_tokens {cached} of "
                             f"{len(token_ids)} (the last token is always computed)")
        for start in range(cached, len(token_ids), chunk):
            self._send_full(fl, start, token_ids[start : start + chunk],
                            sample=start + chunk >= len(token_ids), num_prompt_tokens=num_prompt,
                            prefix_token_ids=token_ids[:cached] if start == cached > 0 else None)

    def decode(self, fl: InFlight) -> None:
        """The step after the request's last token: that token at its position."""
        position = len(fl.req.prompt_token_ids) + len(fl.output_ids) - 1
        token_ids = [fl.output_ids[-1]]
        if not fl.continuation:
            self._send_full(fl, position, token_ids, sample=True)
            return
        step_id = next(self._steps)
        fl.pending.add(step_id)
        self.nodes[fl.hops[0].name].send_continuation(fl.internal_id, step_id, position,
                                                      token_ids)

    def _send_full(self, fl: InFlight, position: int, token_ids: list[int], sample: bool,
                   num_prompt_tokens: int | None = None,
                   prefix_token_ids: list[int] | None = None) -> None:
        item = WireItem(
            request_id=fl.internal_id,
            coordinator_id=self.coordinator_id,
            step_id=next(self._steps),
            hop_index=0,
            route=fl.hops,
            addresses=fl.addresses,
            position=position,
            token_ids=token_ids,
            hidden=None,
            sampling=fl.sampling,
            sample=sample,
            num_prompt_tokens=num_prompt_tokens,
            prefix_token_ids=prefix_token_ids,
        )
        fl.pending.add(item.step_id)
        self.nodes[fl.hops[0].name].send(item)

    def release(self, internal_id: str, hops: tuple[NodeRange, ...]) -> None:
        """Free the request's KV on every hop of `hops`: with the next message on the
        node's Work stream, or a Release call in the background where the stream cannot
        carry it (NodeClient.release_on_stream)."""
        for h in hops:
            node = self.nodes[h.name]
            if node.release_on_stream(internal_id):
                continue
            task = self.spawn(node.release([internal_id]))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def settle(self, timeout_s: float) -> None:
        """Let the releases under way reach the workers (closing the coordinator)."""
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=timeout_s)


__all__ = ["Dispatch"]
