"""The KV ledger: how many KV slots each node holds for each admitted request, and who is
preempted when a node runs out. Pure and synchronous; the simulator and the coordinator
keep one `KvBook` each and do no KV arithmetic of their own (docs/scheduler.md).

Units: a slot is one token of KV on every layer the node runs for the request (a block
table is shared by the layers), so a node's capacity is in tokens.

What a request holds (`KvPolicy`):
- "reserve": prompt + remaining output (+ block slack) on every node of its route from
  admission to the end; a node never runs out.
- "on-demand" (vLLM's paged allocation): the prompt at admission, one more slot per
  generated token on every node of the route (`KvBook.grow`). The router is promised only
  the prompt (+ the expected output, Helix's KV expectation, when `expected_output_tokens`
  is set) and is told each node's capacity less a watermark kept free for growth and less
  what routed requests have grown into (`NodeKv.router_free_tokens`). When a node is full,
  a victim is preempted by recompute (`victim`).

Block rounding: a paged engine allocates `block_size` tokens at a time, so the router is
asked for `block_size - 1` tokens of slack on the output (reserve) and, on demand, for one
block beyond the prompt (the first token may open a block before the coordinator counts it
as grown). The simulator counts single slots (`block_size=1`: no slack).

Victim rules (`VICTIM_RULES`): "newest" preempts the most recently admitted request holding
KV on the full node (vLLM's scheduler; the simulator's default); "requester" preempts the
request whose step found the node full (the live coordinator: its worker has already failed
that request's step, see docs/scheduler.md for why the runtime keeps it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Reversible, Sequence
from dataclasses import dataclass, replace

from helixserve.errors import UserError
from helixserve.scheduler.types import NodeState, RequestInfo
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK, KV_ALLOCATIONS, VICTIM_RULES


class KvOverflowError(AssertionError):
    """An admission took more KV than a node has: a router or caller bug, never load."""


@dataclass(frozen=True)
class KvPolicy:
    """How requests take KV; one per simulator run or coordinator."""

    #: one of KV_ALLOCATIONS
    allocation: str = "reserve"
    #: on-demand: fraction of each node's KV kept free at admission (taken off what the
    #: router may promise), so running requests can grow before anything is preempted
    watermark: float = DEFAULT_KV_WATERMARK
    #: on-demand: promise every request prompt + this many tokens (Helix's KV expectation);
    #: the router's free KV then no longer counts growth (the promise covers it). None: off
    expected_output_tokens: int | None = None
    #: tokens per KV block of the nodes' engines (1: single slots, as the simulator counts)
    block_size: int = 1
    #: one of VICTIM_RULES
    victim_rule: str = "newest"

    def check(self) -> KvPolicy:
        """Raise UserError naming the bad field; return self."""
        if self.allocation not in KV_ALLOCATIONS:
            raise UserError(
                f"kv_allocation: {self.allocation!r}; known: {', '.join(KV_ALLOCATIONS)}")
        if self.on_demand and not 0 <= self.watermark < 1:
            raise UserError(f"kv_watermark: must be in [0, 1), got {self.watermark}")
        if self.expected_output_tokens is not None:
            if not self.on_demand:
                raise UserError("kv_expected_output_tokens: needs kv_allocation='on-demand' "
                                f"(got {self.allocation!r})")
            if self.expected_output_tokens < 0:
                raise UserError(f"kv_expected_output_tokens: must be >= 0, got "
                                f"{self.expected_output_tokens}")
        if self.block_size < 1:
            raise UserError(f"kv_block_size: must be >= 1, got {self.block_size}")
        if self.victim_rule not in VICTIM_RULES:
            raise UserError(f"victim_rule: {self.victim_rule!r}; known: {', '.join(VICTIM_RULES)}")
        return self

    @property
    def on_demand(self) -> bool:
        return self.allocation == "on-demand"

    def request_info(self, request_id: str, prompt_tokens: int,
                     remaining_output_tokens: int) -> RequestInfo:
        """What the router is asked for: `prompt_tokens` to prefill (a resumed request's
        prompt includes its generated tokens) and at most `remaining_output_tokens` more."""
        info = RequestInfo(request_id, prompt_tokens,
                           remaining_output_tokens + self.block_size - 1)
        if not self.on_demand:
            return info
        promise = prompt_tokens + (self.expected_output_tokens or 0)
        if self.block_size > 1:
            promise += self.block_size
        return RequestInfo(request_id, prompt_tokens, info.max_new_tokens, kv_tokens=promise)

    def held_tokens(self, info: RequestInfo) -> int:
        """Slots a request takes on each node of its route at admission."""
        if self.on_demand:
            return info.prompt_tokens
        return info.prompt_tokens + info.max_new_tokens


def victim(rule: str, holders: Reversible[str], requester: str) -> str:
    """THE preemption rule: which request a full node preempts so `requester` can grow.
    `holders`: the requests holding KV on that node, oldest admission first."""
    if rule == "requester":
        return requester
    if rule == "newest":
        return next(reversed(holders), requester)
    raise UserError(f"victim_rule: {rule!r}; known: {', '.join(VICTIM_RULES)}")


class NodeKv:
    """One node's KV account, in tokens (slots per layer it runs)."""

    __slots__ = (
        "name", "capacity_tokens", "watermark_tokens", "used_tokens", "peak_tokens",
        "grown_tokens", "promised_tokens", "promised_token_layers", "area_token_s",
        "updated_s", "preempted", "holders", "state", "_counts_growth",
    )  # fmt: skip

    def __init__(self, name: str, capacity_tokens: int, policy: KvPolicy) -> None:
        self.name = name
        self.used_tokens = self.peak_tokens = self.grown_tokens = 0
        #: slots promised by the router to the requests routed here (their `kv_tokens`)
        self.promised_tokens = 0
        #: the same in token-layers: a request entering mid-range counts only the layers it
        #: runs here (the unit of Helix's KV expectation and of the simulator's kv-feeder)
        self.promised_token_layers = 0
        self.area_token_s = self.updated_s = 0.0  # integral of used_tokens over time
        self.preempted = 0  # requests preempted because this node was full
        #: request ids holding KV here, in admission order (the "newest" rule takes the last)
        self.holders: dict[str, None] = {}
        #: the router's view of this node (its `kv_free_tokens`: what may still be promised
        #: here, capacity less watermark less growth not covered by promises less promises)
        self.state = NodeState(name, kv_free_tokens=0)
        self._counts_growth = policy.on_demand and policy.expected_output_tokens is None
        self.watermark_tokens = 0
        self.capacity_tokens = 0
        self.set_capacity(capacity_tokens, policy)

    def set_capacity(self, capacity_tokens: int, policy: KvPolicy) -> None:
        self.capacity_tokens = capacity_tokens
        self.watermark_tokens = int(policy.watermark * capacity_tokens) if policy.on_demand else 0
        self._update_state()

    @property
    def router_free_tokens(self) -> int:
        """What the router may promise here when nothing is promised: capacity less the
        watermark less growth not covered by promises."""
        grown = self.grown_tokens if self._counts_growth else 0
        return self.capacity_tokens - self.watermark_tokens - grown

    @property
    def full(self) -> bool:
        return self.used_tokens >= self.capacity_tokens

    def _update_state(self) -> None:
        self.state.kv_free_tokens = self.router_free_tokens - self.promised_tokens
        self.state.active_requests = len(self.holders)

    def advance(self, now_s: float) -> None:
        self.area_token_s += self.used_tokens * (now_s - self.updated_s)
        self.updated_s = now_s


class KvHold:
    """What one admitted request holds: the same slots on every node of its route."""

    __slots__ = ("request_id", "nodes", "layers", "held_tokens", "promised_tokens",
                 "grown_tokens")

    def __init__(self, request_id: str, nodes: tuple[NodeKv, ...], layers: tuple[int, ...],
                 held_tokens: int, promised_tokens: int) -> None:
        self.request_id = request_id
        self.nodes = nodes
        self.layers = layers  # layers the request runs on each node
        self.held_tokens = held_tokens  # taken at admission
        self.promised_tokens = promised_tokens  # the router's promise
        self.grown_tokens = 0  # on-demand: generated since admission


class KvBook:
    """Every node's `NodeKv` and every admitted request's `KvHold`.

    `strict`: an admission past a node's capacity raises KvOverflowError (the simulator,
    whose capacities are exact); the coordinator's capacities are worker reports that may
    change under it, so its book only counts."""

    def __init__(self, policy: KvPolicy, capacities: Mapping[str, int],
                 strict: bool = True) -> None:
        self.policy = policy.check()
        self.strict = strict
        self.nodes: dict[str, NodeKv] = {
            name: NodeKv(name, cap, self.policy) for name, cap in capacities.items()}
        #: admitted requests, in admission order
        self.holds: dict[str, KvHold] = {}

    def set_capacity(self, node: str, capacity_tokens: int) -> NodeKv:
        """A node's capacity (a worker's report); adds the node when new."""
        n = self.nodes.get(node)
        if n is None:
            n = self.nodes[node] = NodeKv(node, capacity_tokens, self.policy)
        elif n.capacity_tokens != capacity_tokens:
            n.set_capacity(capacity_tokens, self.policy)
        return n

    def set_block_size(self, block_size: int) -> None:
        """The nodes' KV block size (known once workers report it)."""
        if block_size != self.policy.block_size:
            self.policy = replace(self.policy, block_size=block_size).check()

    def request_info(self, request_id: str, prompt_tokens: int,
                     remaining_output_tokens: int) -> RequestInfo:
        return self.policy.request_info(request_id, prompt_tokens, remaining_output_tokens)

    def fits(self, info: RequestInfo, nodes: Iterable[str]) -> bool:
        """Whether every node has the slots `info` takes now. The router checks promises; with
        an expected output the requests there may have grown past theirs, so check this too."""
        held = self.policy.held_tokens(info)
        return all(self.nodes[j].used_tokens + held <= self.nodes[j].capacity_tokens
                   for j in nodes)

    def admit(self, info: RequestInfo, hops: Sequence[tuple[str, int]],
              now_s: float = 0.0) -> KvHold:
        """Take `info`'s slots on each hop (node name, layers it runs there)."""
        held = self.policy.held_tokens(info)
        promised = info.kv_tokens if info.kv_tokens is not None else held
        nodes = tuple(self.nodes[name] for name, _ in hops)
        hold = KvHold(info.request_id, nodes, tuple(layers for _, layers in hops), held,
                      promised)
        for n, layers in zip(nodes, hold.layers, strict=True):
            n.advance(now_s)
            n.used_tokens += held
            n.promised_tokens += promised
            n.promised_token_layers += promised * layers
            n.holders[info.request_id] = None
            n.state.kv_free_tokens -= promised
            n.state.active_requests += 1
            if n.used_tokens > n.capacity_tokens and self.strict:
                raise KvOverflowError(f"admission overfilled the KV cache of {n.name}: "
                                      f"{n.used_tokens} > {n.capacity_tokens} tokens")
            if n.used_tokens > n.peak_tokens:
                n.peak_tokens = n.used_tokens
        self.holds[info.request_id] = hold
        return hold

    def grow(self, request_id: str, now_s: float = 0.0) -> None:
        """On-demand: one more slot on every node of the request's route (its next token).
        The caller has made room (see `victim`) where its capacities are exact. Reserve:
        nothing (the admission took the whole request)."""
        if not self.policy.on_demand:
            return
        hold = self.holds.get(request_id)
        if hold is None:
            if self.strict:
                raise KeyError(f"request {request_id!r} holds no KV")
            return  # the coordinator's book only counts; a late token changes nothing
        # the simulator's hottest path (every token, every hop): `advance` and
        # `router_free_tokens` inlined; the state loses the slot grown into
        for n in hold.nodes:
            used = n.used_tokens
            n.area_token_s += used * (now_s - n.updated_s)
            n.updated_s = now_s
            used += 1
            n.used_tokens = used
            n.grown_tokens += 1
            if used > n.peak_tokens:
                n.peak_tokens = used
            if n._counts_growth:
                n.state.kv_free_tokens -= 1
        hold.grown_tokens += 1

    def release(self, request_id: str, now_s: float = 0.0) -> KvHold | None:
        """Free what the request holds (finished, cancelled or preempted); None: not held."""
        hold = self.holds.pop(request_id, None)
        if hold is None:
            return None
        total = hold.held_tokens + hold.grown_tokens
        for n, layers in zip(hold.nodes, hold.layers, strict=True):
            n.advance(now_s)
            n.used_tokens -= total
            n.promised_tokens -= hold.promised_tokens
            n.promised_token_layers -= hold.promised_tokens * layers
            del n.holders[request_id]
            n.state.kv_free_tokens += hold.promised_tokens
            n.state.active_requests -= 1
            if hold.grown_tokens:
                n.grown_tokens -= hold.grown_tokens
                if n._counts_growth:
                    n._update_state()
        return hold

    def victim(self, node: str, requester: str) -> str:
        """The request to preempt so that `requester` can grow on the full `node`."""
        return victim(self.policy.victim_rule, self.nodes[node].holders, requester)

    def states(self) -> dict[str, NodeState]:
        """The router's view of every node (the same objects, kept up to date)."""
        return {name: n.state for name, n in self.nodes.items()}
