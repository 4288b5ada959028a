"""The simulated nodes: requests and prompt chunks moving along their routes, and each node's
iterations (`NodeSteps`: what one runs, how long it takes, where its outputs go).

- Nodes run continuous batching: when idle with work queued, an iteration takes the decode
  steps queued (up to `max_decode` sequences) and prompts in FIFO order (up to `max_prompt`
  tokens; one longer prompt runs alone) and lasts the cost model's time for that mixed batch.
  Requests whose route enters the node mid-range (partial inference) run fewer layers, so
  the time is summed over layer segments: segment `[s_k, s_k+1)` runs every request that
  starts at or before `s_k` (the cost model is per-layer additive).
- The head: an iteration of a node whose range ends at the model's last layer also runs the
  final norm, lm_head and sampler once, on one row per sequence sampled (every decode step,
  and each prompt whose last chunk ran), as the worker does (engine/shard.py); its time is
  the cost model's `head_ms` for those rows (docs/calibration.md "The head").
- Links carry a finished batch's requests to their next hop as one transfer: activations
  (`tokens x activation_bytes_per_token`) between nodes, token ids (4 bytes each) to and
  from the coordinator; links and NICs are modelled in `network.py`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.scheduler import NodeState
from helixserve.scheduler.batch import StepBudget, plan_step
from helixserve.scheduler.kv import NodeKv
from helixserve.simulator.config import SimConfig
from helixserve.spec import TOKEN_ID_BYTES, NodeSpec

#: one iteration's work: (prompts and chunks run, decode steps run)
Batch = tuple[list[Any], list[Any]]


class SimRequest:
    __slots__ = (
        "rid", "arrival_s", "prompt", "output", "nodes", "starts", "hop", "in_prompt",
        "generated", "admit_s", "first_s", "finish_s", "dead", "resumed", "left", "chunk", "replayed",
        "fill", "script", "names", "held",
    )  # fmt: skip

    def __init__(self, rid: str, arrival_s: float, prompt: int, output: int) -> None:
        self.rid = rid
        self.arrival_s = arrival_s
        self.prompt = prompt
        self.output = output
        self.nodes: tuple[SimNode, ...] = ()
        self.starts: tuple[int, ...] = ()  # first layer each hop runs
        self.hop = 0
        self.in_prompt = True
        self.generated = 0
        self.admit_s = math.nan
        self.first_s = math.nan
        self.finish_s = math.nan
        self.dead = False  # preempted: its pending events are dropped
        self.resumed = False  # re-admitted after a preemption: `prompt` includes its output
        self.left = 0  # prompt tokens still to prefill on the current hop
        self.replayed = 0  # generated tokens included in `prompt` (a resumed request)
        self.chunk = 0  # prompt tokens of the current hop in the running iteration
        #: prompt tokens its prefill computes: `prompt` less those taken from prefix cache
        self.fill = prompt
        #: its prompt then output token ids (TraceRequest.token_ids; None: unknown), its
        #: block names per layer span and the blocks it holds per hop (simulator/prefix.py)
        self.script: tuple[int, ...] | None = None
        self.names: Any = None
        self.held: list[int] = []


class Chunk:
    """One piece of a request's prompt moving along its route on its own
    (`SimConfig.prefill_chunk_tokens`): queued, run and sent on like a prompt of `prompt`
    tokens; the last one, back at the coordinator, is the request's first token."""

    __slots__ = ("req", "prompt", "fill", "left", "chunk", "hop", "last")

    def __init__(self, req: SimRequest, tokens: int, last: bool) -> None:
        self.req = req
        self.prompt = self.fill = tokens
        self.left = tokens
        self.chunk = 0
        self.hop = 0
        self.last = last

    @property
    def dead(self) -> bool:
        return self.req.dead

    @property
    def nodes(self) -> tuple[SimNode, ...]:
        return self.req.nodes

    @property
    def starts(self) -> tuple[int, ...]:
        return self.req.starts


def chunks(r: SimRequest, size: int) -> list[Chunk]:
    """`r`'s prompt (what its prefill computes: `fill`) cut into pieces of at most `size`
    tokens, in order."""
    return [Chunk(r, min(size, r.fill - at), at + size >= r.fill)
            for at in range(0, r.fill, size)]


def _prompt_left(r: SimRequest) -> int:
    return r.left


def _dead(r: SimRequest) -> bool:
    return r.dead


class SimNode:
    __slots__ = (
        "name", "spec", "start", "end", "may_partial", "pq", "dq", "busy", "max_prompt",
        "max_decode", "kv_cap", "busy_s", "iters", "decode_iters", "prompt_iters",
        "prompt_tokens", "decode_tokens", "busy_timeline", "kv", "budget", "has_head", "cache",
    )  # fmt: skip

    def __init__(self, spec: NodeSpec, start: int, end: int, cost: CostModel, buckets: int):
        self.name = spec.name
        self.spec = spec
        self.start, self.end = start, end
        self.may_partial = False  # some route may enter mid-range
        #: the range ends at the model's last layer: every iteration runs the head too
        self.has_head = end == cost.model.num_layers
        self.pq: deque[SimRequest] = deque()  # prompts waiting
        self.dq: list[SimRequest] = []  # decode steps waiting
        self.busy = False
        self.max_prompt, self.max_decode = cost.batch_limits(spec)
        self.kv_cap = cost.kv_capacity_tokens(spec, end - start)
        #: what one iteration may take (scheduler/batch.py), set by Simulation
        self.budget: StepBudget
        #: this node's account in the run's KvBook (scheduler/kv.py), set by Simulation
        self.kv: NodeKv
        self.busy_s = 0.0
        self.iters = self.decode_iters = self.prompt_iters = 0
        self.prompt_tokens = self.decode_tokens = 0
        self.busy_timeline = [0.0] * buckets
        #: its prefix cache (simulator/prefix.py), when the run models one
        self.cache: Any = None

    # read-only views of the node's KV account (metrics, tests)
    @property
    def kv_used(self) -> int:
        return self.kv.used_tokens

    @property
    def kv_peak(self) -> int:
        return self.kv.peak_tokens

    @property
    def kv_area(self) -> float:
        return self.kv.area_token_s

    @property
    def kv_grown(self) -> int:
        return self.kv.grown_tokens

    @property
    def preempted(self) -> int:
        return self.kv.preempted

    @property
    def kv_promised(self) -> int:
        return self.kv.promised_tokens

    @property
    def kv_promised_layers(self) -> int:
        return self.kv.promised_token_layers

    @property
    def kv_mark(self) -> int:
        return self.kv.watermark_tokens

    @property
    def state(self) -> NodeState:
        """The router's view of this node."""
        return self.kv.state


class NodeSteps:
    """Every node's iterations, timed by the cost model (one object per run)."""

    def __init__(self, cost: CostModel, cfg: SimConfig, buckets: int, bucket_s: float,
                 act_bytes: int, on_demand: bool) -> None:
        self.cost, self.cfg = cost, cfg
        self.buckets, self.bucket_s = buckets, bucket_s
        self.act_bytes = act_bytes
        self.on_demand = on_demand
        #: (node, layers, prompt tokens, decode sequences) -> seconds; batches repeat a lot
        self._batch_time: dict[tuple[str, int, int, int], float] = {}

    def enqueue(self, node: SimNode, reqs: list[SimRequest]) -> None:
        """`reqs` arrive at `node`: prompts (and chunks) and decode steps join its queues."""
        for r in reqs:
            if r.dead:
                continue
            if type(r) is Chunk or r.in_prompt:
                r.left = r.fill
                node.pq.append(r)
            else:
                node.dq.append(r)
        node.state.queue_len = len(node.pq) + len(node.dq)

    def start(self, node: SimNode, now: float) -> tuple[float, Batch] | None:
        """The node's next iteration (scheduler/batch.py's plan) and its duration; None: no
        work. The node is busy until the caller hands the batch to `done`."""
        pq = node.pq
        if self.on_demand:  # drop requests preempted while queued here (prompts: at the head)
            node.dq = [r for r in node.dq if not r.dead]
            while pq and pq[0].dead:
                pq.popleft()
        plan = plan_step(node.dq, pq, node.budget, _prompt_left, _dead)
        decode, node.dq = plan.decode, node.dq[len(plan.decode) :]
        for _ in range(plan.prompts_popped):
            pq.popleft()
        prompts: list[SimRequest] = []
        for r, take in plan.prompts:
            r.chunk = take
            r.left -= take
            prompts.append(r)
        prompt_tokens = plan.prompt_tokens
        if not decode and not prompts:
            return None
        node.state.queue_len = len(pq) + len(node.dq)
        if node.may_partial:
            dt = self._partial_batch_time(node, prompts, decode)
        else:
            dt = self._time(node, node.end - node.start, prompt_tokens, len(decode))
        if node.has_head:
            dt += self._head_time(node, sum(1 for r in prompts if not r.left), len(decode))
        node.busy = True
        node.iters += 1
        if prompts:
            node.prompt_iters += 1
            node.prompt_tokens += prompt_tokens
        if decode:
            node.decode_iters += 1
            node.decode_tokens += len(decode)
        self._account_busy(node, now, dt)
        return dt, (prompts, decode)

    def _partial_batch_time(
        self, node: SimNode, prompts: list[SimRequest], decode: list[SimRequest]
    ) -> float:
        # start layer -> [prompt tokens, decode sequences] entering there
        by_start: dict[int, list[int]] = {}
        for r in prompts:
            by_start.setdefault(r.starts[r.hop], [0, 0])[0] += r.chunk
        for r in decode:
            by_start.setdefault(r.starts[r.hop], [0, 0])[1] += 1
        starts = sorted(by_start)
        total_s, p, d = 0.0, 0, 0
        for k, s in enumerate(starts):
            p += by_start[s][0]
            d += by_start[s][1]
            seg_end = starts[k + 1] if k + 1 < len(starts) else node.end
            total_s += self._time(node, seg_end - s, p, d)
        return total_s

    def _time(self, node: SimNode, layers: int, prompt_tokens: int, decode: int) -> float:
        key = (node.name, layers, prompt_tokens, decode)
        t = self._batch_time.get(key)
        if t is None:
            t = self.cost.batch_time_s(node.spec, layers, prompt_tokens, decode)
            t += self.cfg.layer_overhead_s * layers
            self._batch_time[key] = t
        return t

    def _head_time(self, node: SimNode, prompts_done: int, decode: int) -> float:
        """The head over one row per sequence sampled: the decode sequences and the prompts
        whose last chunk ran (a chunk before it samples nothing). One call for all rows, as
        the worker runs it; timed by the decode curve when decode rows are in it."""
        rows = prompts_done + decode
        if rows == 0:
            return 0.0
        key = (node.name, -1, prompts_done, decode)  # layers -1: not a layer time
        t = self._batch_time.get(key)
        if t is None:
            t = self.cost.head_time_s(node.spec, "decode" if decode else "prompt", rows)
            self._batch_time[key] = t
        return t

    def _account_busy(self, node: SimNode, t0: float, dt: float) -> None:
        end = self.cfg.duration_s
        t1 = min(t0 + dt, end)
        node.busy_s += max(0.0, t1 - t0)
        b = int(t0 / self.bucket_s)
        while t0 < t1 and b < self.buckets:
            edge = min((b + 1) * self.bucket_s, t1)
            node.busy_timeline[b] += edge - t0
            t0 = edge
            b += 1

    def done(self, node: SimNode, batch: Batch) -> list[tuple[SimNode | None, int, list[Any]]]:
        """The iteration ended: where each request goes next, as (next node or None for the
        coordinator, bytes to send, requests), one transfer per next hop."""
        node.busy = False
        # next hop (None: the coordinator) -> [requests, token activations carried]
        out: dict[SimNode | None, list[Any]] = {}
        prompts, decode = batch
        for r in prompts:
            if r.dead or r.left:  # preempted, or more of its prompt to prefill here
                continue
            h = r.hop + 1
            r.hop = h
            nxt = r.nodes[h] if h < len(r.nodes) else None
            if nxt is None and type(r) is Chunk:
                # the last node ran a chunk: only the last one samples the first token
                if not r.last:
                    continue
                r = r.req
            group = out.get(nxt)
            if group is None:
                out[nxt] = [[r], r.fill]
            else:
                group[0].append(r)
                group[1] += r.fill
        for r in decode:
            if r.dead:
                continue
            h = r.hop + 1
            r.hop = h
            nxt = r.nodes[h] if h < len(r.nodes) else None
            group = out.get(nxt)
            if group is None:
                out[nxt] = [[r], 1]
            else:
                group[0].append(r)
                group[1] += 1
        # to the coordinator: the sampled token id of each request; else activations
        return [(nxt, TOKEN_ID_BYTES * len(reqs) if nxt is None else tokens * self.act_bytes, reqs)
                for nxt, (reqs, tokens) in out.items()]
