"""A rehearsal's inputs, read and checked before any process starts.

Every check raises UserError with one line naming the file (or flag), the field and the
value: a placement node that is not in the cluster file, layer ranges that leave layers
uncovered, a machine the profiles do not time, a range that leaves a machine no KV, a trace
with no rows, a port that is in use. `helixserve rehearse` exits 2 on it before it has
started anything.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path

from helixserve.costmodel import CostModel
from helixserve.engine.emulated import DEFAULT_RESERVED_GB_PER_GPU
from helixserve.errors import UserError
from helixserve.planner.placement import Placement, layer_gaps
from helixserve.simulator.workload import LengthFilter, TraceRequest
from helixserve.spec import ClusterSpec, ModelSpec, ProfileTable

#: KV tokens a block holds on the emulated workers (their default)
KV_BLOCK_TOKENS = 16


@dataclass
class RehearsalInputs:
    """Everything a rehearsal runs from, checked."""

    cluster_path: Path
    cluster: ClusterSpec
    model_dir: Path
    model: ModelSpec
    profiles_path: Path
    profiles: ProfileTable
    placement_path: Path
    #: with flows (evaluated on the cluster when the file has none)
    placement: Placement
    trace_path: Path
    #: the trace after Helix's length filter, arrivals from 0 (rescaled with --rate)
    requests: list[TraceRequest]
    #: the cost model of the emulated workers, the simulator and the coordinator's router:
    #: the profiles, the shipped GPU catalog, 4.5 GB kept per GPU (the vllm engine model)
    cost: CostModel


def load_inputs(cluster_path: Path, model_dir: Path, profiles_path: Path, placement_path: Path,
                trace_path: Path, rate_per_s: float | None = None) -> RehearsalInputs:
    from helixserve.planner import evaluate, load_placement
    from helixserve.spec import load_cluster, load_model, load_profiles

    cluster = load_cluster(cluster_path)
    placement = load_placement(placement_path)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model {model_dir}: no config.json (the emulated workers need the "
                        "model's config.json, no weights)")
    model = load_model(model_dir, name=placement.model or None)
    if placement.num_layers != model.num_layers:
        raise UserError(f"{placement_path}: num_layers: {placement.num_layers}, but model "
                        f"{model.name!r} ({model_dir}) has {model.num_layers}")
    known = set(cluster.node_names())
    for i, r in enumerate(placement.nodes):
        if r.name not in known:
            names = ", ".join(cluster.node_names()[:12])
            raise UserError(f"{placement_path}: nodes[{i}].name: {r.name!r} is not a node of "
                            f"{cluster_path}; its nodes: {names}"
                            f"{', ...' if len(known) > 12 else ''}")
    gaps = layer_gaps(((r.start_layer, r.end_layer) for r in placement.nodes), model.num_layers)
    if gaps:
        spans = ", ".join(f"[{a}, {b})" for a, b in gaps[:4])
        raise UserError(f"{placement_path}: nodes: layers {spans} are held by no node (the "
                        f"ranges must cover [0, {model.num_layers}) of {model.name!r})")
    try:
        profiles = load_profiles(profiles_path)
    except UserError as exc:
        raise UserError(f"--profiles: {exc}") from None
    cost = CostModel(model, profiles, reserved_gb_per_gpu=DEFAULT_RESERVED_GB_PER_GPU)
    for i, r in enumerate(placement.nodes):
        node = cluster.node(r.name)
        if not profiles.has(model.name, node.gpu, node.num_gpus):
            timed = sorted({f"{g} x{n}" for (m, g, n, _ph) in profiles.curves if m == model.name})
            raise UserError(f"{profiles_path}: gpu: no prompt and decode rows for {node.gpu!r} "
                            f"x{node.num_gpus} (node {r.name!r} in {cluster_path}) and model "
                            f"{model.name!r}; profiled: {', '.join(timed) or 'none'}")
        if cost.kv_capacity_tokens(node, r.num_layers) < KV_BLOCK_TOKENS:
            raise UserError(f"{placement_path}: nodes[{i}]: node {r.name!r} ({node.gpu} "
                            f"x{node.num_gpus}) has no room for KV with {r.num_layers} layers "
                            f"of {model.name!r} loaded")
    if not placement.flows or placement.throughput_tokens_per_s is None:
        res = evaluate(cluster, model, cost, placement)
        placement.flows = res.flows
        placement.throughput_tokens_per_s = res.throughput_tokens_per_s
    if not placement.flows:
        raise UserError(f"{placement_path}: serves 0 tokens/s on {cluster_path} (no chain of "
                        "linked nodes from the coordinator back to it holds every layer)")
    requests = load_trace(trace_path, rate_per_s)
    return RehearsalInputs(cluster_path, cluster, model_dir, model, profiles_path, profiles,
                           placement_path, placement, trace_path, requests, cost)


def load_trace(path: Path, rate_per_s: float | None) -> list[TraceRequest]:
    """The Azure-format trace, Helix's length filter (prompt 4..2048, output 4..1024 tokens:
    what Helix serves, and within LLaMA-2's 4,096-token context), arrivals from 0,
    rescaled to a mean of `rate_per_s` when given."""
    from helixserve.simulator.workload import load_azure_trace, prepare_trace

    try:
        raw = load_azure_trace(path)
    except UserError as exc:
        raise UserError(f"--trace: {exc}") from None
    lengths = LengthFilter()
    kept = lengths.apply(raw)
    if not kept:
        raise UserError(f"--trace {path}: rows: none of its {len(raw)} requests is within "
                        f"prompt {lengths.min_tokens}..{lengths.max_prompt_tokens} and output "
                        f"{lengths.min_tokens}..{lengths.max_output_tokens} tokens")
    if rate_per_s is not None and len(kept) < 2:
        raise UserError(f"--rate {rate_per_s:g}: {path} has one request; rescaling arrivals "
                        "needs two or more")
    try:
        return prepare_trace(kept, lengths=None, rate_per_s=rate_per_s)
    except UserError as exc:
        raise UserError(f"--trace {path}: {exc}") from None


def reserve_ports(base_port: int, needs: list[str], host: str = "127.0.0.1") -> list[int]:
    """One port per entry of `needs` (what it is for): from `base_port` on, each checked free
    now; base 0: ports the OS picks. UserError naming the flag, the port and its use when one
    of the range is taken (there is a small race until the processes bind them)."""
    if base_port == 0:
        return free_ports(len(needs), host)
    if not 1024 <= base_port <= 65536 - len(needs):
        raise UserError(f"--base-port: bad value {base_port}; need 1024..{65536 - len(needs)} "
                        f"({len(needs)} ports from it)")
    ports = list(range(base_port, base_port + len(needs)))
    for port, use in zip(ports, needs, strict=True):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                raise UserError(f"--base-port {base_port}: port {port} on {host} ({use}) is in "
                                f"use; the rehearsal needs ports {ports[0]}..{ports[-1]}") from None
    return ports


#: lowest port `free_ports` draws from
LOW_PORT = 10_000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; else IANA's)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free now, drawn at random below the kernel's ephemeral range:
    the ports the OS picks for a bind to port 0 come from that range, which every outgoing
    connection on the host (a rehearsal's own gRPC and HTTP clients, and whatever else runs)
    also takes from, so one picked there is often taken again before the process that
    needs it binds it. Each is held until all are found (no duplicates); the OS picks when
    the range below holds too few."""
    lo, _ = ephemeral_range()
    rng = random.Random()
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        tries = 0
        while len(ports) < count:
            tries += 1
            if lo - LOW_PORT < 4 * count or tries > 50 * count:
                port = 0  # let the OS pick
            else:
                port = rng.randrange(LOW_PORT, lo)
                if port in ports:
                    continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            held.append(s)
            ports.append(int(s.getsockname()[1]))
    finally:
        for s in held:
            s.close()
    return ports
