"""The cluster file (YAML): machines, their GPUs, and the network between them.

Format: docs/formats.md ("Cluster"), with one optional node field, `memory_gb`, a memory
budget for the whole node that overrides the catalog (used by the local CPU demo).
A link between two endpoints resolves as: `explicit` (directed) > `between_regions`
(symmetric, endpoints in different regions) > `default`. Bandwidth 0 means no link.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from helixserve.errors import UserError, read_user_file
from helixserve.spec.gpus import GpuCatalog, load_gpu_catalog

COORDINATOR = "coordinator"
DEFAULT_REGION = "default"
#: the fields of a node entry
NODE_FIELDS = ("name", "gpu", "num_gpus", "region", "nic_gbps", "address", "memory_gb")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbps: float
    latency_ms: float = 0.0


#: used when a cluster file has no `links.default`: a plain datacenter LAN
DEFAULT_LINK = LinkSpec(bandwidth_gbps=10.0, latency_ms=1.0)


@dataclass(frozen=True)
class NodeSpec:
    name: str
    #: GPU type, a key of the GPU catalog
    gpu: str
    #: GPUs inside the machine (tensor parallel inside the node)
    num_gpus: int = 1
    region: str = DEFAULT_REGION
    #: NIC bandwidth per direction; None = unlimited
    nic_gbps: float | None = None
    #: where the node's worker listens at run time, host:port
    address: str | None = None
    #: memory budget of the whole node; None = catalog memory_gb x num_gpus
    memory_gb: float | None = None


K = TypeVar("K", bound=Hashable)


def machine_type(node: NodeSpec) -> tuple[str, int, float | None]:
    """What the cluster file says makes two machines alike: GPU, GPU count, memory budget."""
    return (node.gpu, node.num_gpus, node.memory_gb)


def group_machines(
    nodes: Sequence[NodeSpec],
    key: Callable[[int], K],
    indices: Iterable[int] | None = None,
) -> dict[K, list[int]]:
    """Indices of `nodes` (all, or `indices` in their order) grouped by `key(index)`, groups
    in order of first member. The one way the planner and the serving selection group
    machines; `key` is `machine_type` of the node, or its T(k) curve, its region, ..."""
    groups: dict[K, list[int]] = {}
    for i in range(len(nodes)) if indices is None else indices:
        groups.setdefault(key(i), []).append(i)
    return groups


@dataclass
class ClusterSpec:
    name: str
    nodes: list[NodeSpec]
    coordinator_region: str = DEFAULT_REGION
    coordinator_nic_gbps: float | None = None
    default_link: LinkSpec | None = DEFAULT_LINK
    #: frozenset({region_a, region_b}) -> link
    between_regions: dict[frozenset[str], LinkSpec] = field(default_factory=dict)
    #: (src, dst) -> link, directed
    explicit: dict[tuple[str, str], LinkSpec] = field(default_factory=dict)
    source: str = "cluster"

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}

    def node(self, name: str) -> NodeSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise UserError(
                f"{self.source}: unknown node {name!r}; known: {', '.join(self._by_name)}"
            ) from None

    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def region_of(self, name: str) -> str:
        return self.coordinator_region if name == COORDINATOR else self.node(name).region

    def nic_gbps_of(self, name: str) -> float | None:
        return self.coordinator_nic_gbps if name == COORDINATOR else self.node(name).nic_gbps

    def link(self, src: str, dst: str) -> LinkSpec | None:
        """The directed link src -> dst (either may be "coordinator"); None = no link."""
        found = self.explicit.get((src, dst))
        if found is None:
            ra, rb = self.region_of(src), self.region_of(dst)
            if ra != rb:
                found = self.between_regions.get(frozenset((ra, rb)))
            if found is None:
                found = self.default_link
        if found is None or found.bandwidth_gbps <= 0:
            return None
        return found

    def effective_bandwidth_gbps(self, src: str, dst: str) -> float:
        """Link bandwidth capped by both NICs; 0 when there is no link."""
        link = self.link(src, dst)
        if link is None:
            return 0.0
        bw = link.bandwidth_gbps
        for end in (src, dst):
            nic = self.nic_gbps_of(end)
            if nic is not None:
                bw = min(bw, nic)
        return bw


#: the largest value a number in a cluster file may take: far above any real machine or
#: link (1 PB of memory, 1 Pbit/s, 11 days of latency), far below float overflow
_MAX_NUMBER = 1e6
#: GPUs inside one machine
_MAX_GPUS_PER_NODE = 1024


def _num(value: Any, where: str, *, allow_zero: bool = True) -> float:
    """A finite number in [0, _MAX_NUMBER] (> 0 unless `allow_zero`). A string that reads
    as one is taken: YAML 1.1 reads `1e3` (no dot) as the string '1e3'."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise UserError(f"{where}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) \
            or value > _MAX_NUMBER:
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"{where}: bad value {value!r}; must be {bound} and <= {_MAX_NUMBER:g}")
    return float(value)


def _check_keys(raw: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """UserError naming the first unknown key, the known ones closest to it first."""
    import difflib

    unknown = sorted(str(k) for k in set(raw) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"{where}: unknown field {unknown[0]!r}{hint}; known: {', '.join(known)}")


def _link(raw: Any, where: str, ends: tuple[str, ...] = ()) -> LinkSpec:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping, got {raw!r}")
    _check_keys(raw, (*ends, "bandwidth_gbps", "latency_ms"), where)
    if "bandwidth_gbps" not in raw:
        raise UserError(f"{where}.bandwidth_gbps: missing")
    return LinkSpec(
        bandwidth_gbps=_num(raw["bandwidth_gbps"], f"{where}.bandwidth_gbps"),
        latency_ms=_num(raw.get("latency_ms", 0.0), f"{where}.latency_ms"),
    )


def parse_cluster(data: Any, source: str = "cluster",
                  catalog: GpuCatalog | None = None) -> ClusterSpec:
    """Validate a parsed cluster YAML document; errors name `source`, the field path, the value."""
    catalog = catalog or load_gpu_catalog()
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    _check_keys(data, ("name", "nodes", "links", "coordinator"), source)
    nodes_raw = data.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise UserError(f"{source}: nodes: expected a non-empty list, got {nodes_raw!r}")
    nodes: list[NodeSpec] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(nodes_raw):
        where = f"{source}: nodes[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{where}: expected a mapping, got {raw!r}")
        # unknown keys first: a misspelled `gpu` must be named, not reported missing
        _check_keys(raw, NODE_FIELDS, where)
        name = raw.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name) or name == COORDINATOR:
            raise UserError(f"{where}.name: bad value {name!r}; use [a-z0-9-], not 'coordinator'")
        if name in seen:
            raise UserError(f"{where}.name: duplicate node name {name!r} (also nodes[{seen[name]}])")
        seen[name] = i
        gpu = raw.get("gpu")
        if not isinstance(gpu, str) or gpu not in catalog:
            raise UserError(f"{where}.gpu: unknown GPU {gpu!r}; known: {', '.join(catalog.names())}")
        num_gpus = raw.get("num_gpus", 1)
        if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or not (
                1 <= num_gpus <= _MAX_GPUS_PER_NODE):
            raise UserError(f"{where}.num_gpus: bad value {num_gpus!r}; must be an integer "
                            f"from 1 to {_MAX_GPUS_PER_NODE}")
        region = raw.get("region", DEFAULT_REGION)
        if not isinstance(region, str):
            raise UserError(f"{where}.region: bad value {region!r}; expected a string")
        nic = raw.get("nic_gbps")
        address = raw.get("address")
        if address is not None and not isinstance(address, str):
            raise UserError(f"{where}.address: bad value {address!r}; expected host:port")
        mem = raw.get("memory_gb")
        nodes.append(NodeSpec(
            name=name, gpu=gpu, num_gpus=num_gpus, region=region,
            nic_gbps=None if nic is None else _num(nic, f"{where}.nic_gbps", allow_zero=False),
            address=address,
            memory_gb=None if mem is None else _num(mem, f"{where}.memory_gb", allow_zero=False),
        ))

    coord = data.get("coordinator") or {}
    if not isinstance(coord, dict):
        raise UserError(f"{source}: coordinator: expected a mapping, got {coord!r}")
    _check_keys(coord, ("region", "nic_gbps"), f"{source}: coordinator")
    coord_region = coord.get("region", DEFAULT_REGION)
    if not isinstance(coord_region, str):
        raise UserError(f"{source}: coordinator.region: bad value {coord_region!r}")
    coord_nic = coord.get("nic_gbps")

    links = data.get("links") or {}
    if not isinstance(links, dict):
        raise UserError(f"{source}: links: expected a mapping, got {links!r}")
    _check_keys(links, ("default", "between_regions", "explicit"), f"{source}: links")
    regions = {n.region for n in nodes} | {coord_region}
    default_link: LinkSpec | None = DEFAULT_LINK
    if "default" in links:
        default_link = _link(links["default"], f"{source}: links.default")
    between: dict[frozenset[str], LinkSpec] = {}
    for i, raw in enumerate(links.get("between_regions") or []):
        where = f"{source}: links.between_regions[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("a"), str) or not isinstance(
                raw.get("b"), str):
            raise UserError(f"{where}: expected {{a: REGION, b: REGION, bandwidth_gbps: ...}}, "
                            f"got {raw!r}")
        for key in ("a", "b"):
            if raw[key] not in regions:
                raise UserError(f"{where}.{key}: no node or coordinator is in region "
                                f"{raw[key]!r}; regions: {', '.join(sorted(regions))}")
        pair = frozenset((raw["a"], raw["b"]))
        if pair in between:
            raise UserError(f"{where}: a second link between regions {raw['a']!r} and "
                            f"{raw['b']!r}")
        between[pair] = _link(raw, where, ("a", "b"))
    explicit: dict[tuple[str, str], LinkSpec] = {}
    # 600 entries per shared cluster: one dict lookup per endpoint, no per-entry scans
    for i, raw in enumerate(links.get("explicit") or []):
        where = f"{source}: links.explicit[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{where}: expected a mapping, got {raw!r}")
        ends = []
        for key in ("src", "dst"):
            end = raw.get(key)
            if end != COORDINATOR and end not in seen:
                raise UserError(f"{where}.{key}: unknown node {end!r}; known: coordinator, "
                                f"{', '.join(list(seen)[:20])}{', ...' if len(seen) > 20 else ''}")
            ends.append(end)
        if ends[0] == ends[1]:
            raise UserError(f"{where}: src and dst are the same node {ends[0]!r}")
        if (ends[0], ends[1]) in explicit:
            raise UserError(f"{where}: a second link {ends[0]} -> {ends[1]}")
        explicit[(ends[0], ends[1])] = _link(raw, where, ("src", "dst"))

    name = data.get("name", Path(source).stem)
    if not isinstance(name, str | int | float) or isinstance(name, bool):
        raise UserError(f"{source}: name: bad value {name!r}; expected text")
    return ClusterSpec(
        name=str(name), nodes=nodes, coordinator_region=coord_region,
        coordinator_nic_gbps=None if coord_nic is None else _num(
            coord_nic, f"{source}: coordinator.nic_gbps", allow_zero=False),
        default_link=default_link, between_regions=between, explicit=explicit, source=source,
    )


def load_cluster(path: str | Path, catalog: GpuCatalog | None = None) -> ClusterSpec:
    """Read and validate a cluster YAML file."""
    p = Path(path)
    text = read_user_file(p, "cluster file")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{p}: bad YAML{at}: {problem}") from None
    return parse_cluster(data, source=str(p), catalog=catalog)
