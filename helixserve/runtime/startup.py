"""What the coordinator reads and checks when it starts, and again when the placement
changes: one client per placed worker, the first answer of every worker, the model's facts
(tokenizer, context length, EOS ids, prefill chunk size) and what the router knows of the
cluster. Torch-free, like the coordinator."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helixserve.errors import UserError

if TYPE_CHECKING:
    from helixserve.costmodel import CostModel
    from helixserve.planner.placement import NodeRange, Placement
    from helixserve.runtime.node_client import NodeClient
    from helixserve.scheduler import RouterOptions
    from helixserve.scheduler.types import Router
    from helixserve.spec import ClusterSpec

log = logging.getLogger("helixserve.coordinator")


def client_per_node(cluster: ClusterSpec, placement: Placement,
                    make: Callable[[str, str, NodeRange], NodeClient]) -> dict[str, NodeClient]:
    """`make(name, address, range)` for every placed node, checked against the cluster file."""
    addresses = {n.name: getattr(n, "address", None) for n in cluster.nodes}
    nodes: dict[str, NodeClient] = {}
    for i, nr in enumerate(placement.nodes):
        if nr.name not in addresses:
            raise UserError(f"placement: nodes[{i}].name: node {nr.name!r} not in the cluster; "
                            f"known: {', '.join(sorted(addresses))}")
        address = addresses[nr.name]
        if not address:
            raise UserError(f"cluster: node {nr.name!r}: address: missing (host:port of its "
                            "worker)")
        nodes[nr.name] = make(nr.name, address, nr)
    return nodes


async def connect_all(nodes: Mapping[str, NodeClient], num_layers: int,
                      timeout_s: float) -> dict[str, str]:
    """Every worker's first Info. Returns {name: reason} of those that did not answer (down,
    retried later); a worker that answers with the wrong layers or model, or workers of
    different vLLM versions, are configuration errors (raised, every client closed)."""
    results = await asyncio.gather(*(n.connect(num_layers, timeout_s) for n in nodes.values()),
                                   return_exceptions=True)
    unreachable: dict[str, str] = {}
    try:
        for node, res in zip(nodes.values(), results, strict=True):
            if isinstance(res, ConnectionError) and node.info is None:
                unreachable[node.name] = str(res)
            elif isinstance(res, BaseException):
                raise res
        check_vllm_versions({n.name: n.info for n in nodes.values() if n.info})
    except BaseException:
        await asyncio.gather(*(n.close() for n in nodes.values()), return_exceptions=True)
        raise
    return unreachable


def check_vllm_versions(infos: dict[str, Any]) -> None:
    """Refuse workers of the vllm engine at different vLLM versions: a route through them would
    mix two versions' kernels and numerics (greedy outputs would depend on the route)."""
    versions: dict[str, list[str]] = {}
    for name, info in infos.items():
        if getattr(info, "engine", "") == "vllm":
            versions.setdefault(info.vllm_version or "unknown", []).append(name)
    if len(versions) > 1:
        found = "; ".join(f"{v} on {', '.join(sorted(n))}" for v, n in sorted(versions.items()))
        raise UserError(f"workers run different vLLM versions ({found}); the stages of a "
                        "route must run the same vLLM version: install one version everywhere")


def load_tokenizer(model_dir: Path) -> Any:
    from helixserve.engine.emulated_tokenizer import EmulatedTokenizer, has_tokenizer

    if not has_tokenizer(model_dir):  # a config-only directory: a rehearsal (docs/emulated.md)
        log.warning("EMULATED tokenizer: %s has no tokenizer files; text in and out is "
                    "emulated (one token per word piece, id i decodes to ' tok<i>')", model_dir)
        return EmulatedTokenizer.from_model_dir(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def config_max_len(model_dir: Path) -> int | None:
    """The model's context length from its config.json (None: not said)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = cfg.get("max_position_embeddings")
    return int(value) if value else None


def eos_token_ids(nodes: Iterable[NodeClient], num_layers: int, tokenizer: Any) -> list[int]:
    """The EOS ids the last stages report (their model's generation config), else the
    tokenizer's."""
    eos: set[int] = set()
    for n in nodes:
        if n.info is not None and n.end_layer == num_layers:
            eos |= set(n.info.eos_token_ids)
    if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return sorted(eos)


def chunk_tokens(nodes: Iterable[NodeClient], max_tokens: int) -> int:
    """The largest prefill chunk (at most `max_tokens`) whose hidden states fit a message
    (transport.py), from the first worker that answered."""
    from helixserve.runtime.transport import prefill_chunk_tokens

    info = next(n.info for n in nodes if n.info is not None)
    return prefill_chunk_tokens(info.hidden_size, info.dtype, max_tokens)


def make_live_router(scheduler: str, cluster: ClusterSpec, placement: Placement,
                     cost: CostModel, seed: int = 0, live: bool = False) -> Router:
    """The routing policy `scheduler` over `placement`, with `routing_inputs`."""
    from helixserve.scheduler import make_router

    return make_router(scheduler, placement, seed=seed,
                       **routing_inputs(cluster, placement, cost, live))


def routing_inputs(cluster: ClusterSpec, placement: Placement, cost: CostModel,
                   live: bool = False) -> RouterOptions:
    """What the router knows of the cluster, from the runtime's cost model (runtime/costs.py,
    the simulator's when the operator gives its profiles): the links it may use (so it never
    spreads work over a missing or slow link), each node's throughput, and the flows it
    routes over, evaluated here when the placement file has none (FORMATS.md lets an input
    placement omit them). `live`: ranges workers actually hold, which a memory check must
    not refuse."""
    from helixserve.scheduler.options import router_options

    model = cost.model
    if not placement.flows:
        from helixserve.planner import evaluate

        try:
            result = evaluate(cluster, model, cost, placement)
        except UserError:
            if not live:
                raise
            # a worker holds more layers than the cluster file says its memory fits: it
            # does, so evaluate the flow without the memory check
            cluster = dataclasses.replace(cluster, nodes=[
                dataclasses.replace(n, memory_gb=1e6) for n in cluster.nodes])
            result = evaluate(cluster, model, cost, placement)
        placement.flows = result.flows
        placement.throughput_tokens_per_s = result.throughput_tokens_per_s
    return router_options(cluster, model, placement, cost)
