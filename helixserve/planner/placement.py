"""`Placement`: which contiguous range of layers each node holds, and the flows through them.

This is the planner's output and the input of the scheduler, the simulator, the runtime and
the Kubernetes renderer. On disk it is the placement JSON of docs/formats.md
(`format: helixserve.placement/v1`); layer ranges are half-open `[start_layer, end_layer)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helixserve.errors import UserError, read_user_file

FORMAT = "helixserve.placement/v1"



def layer_gaps(ranges: Iterable[tuple[int, int]], num_layers: int) -> list[tuple[int, int]]:
    """The spans [a, b) of layers 0..num_layers-1 that no range [start, end) holds, in order:
    THE coverage check (a placement, the live workers, the API's health report)."""
    cover = [0] * (num_layers + 1)
    for start, end in ranges:
        start, end = max(0, start), min(num_layers, end)
        if start < end:
            cover[start] += 1
            cover[end] -= 1
    gaps: list[tuple[int, int]] = []
    depth = 0
    for layer in range(num_layers):
        depth += cover[layer]
        if depth > 0:
            continue
        if gaps and gaps[-1][1] == layer:
            gaps[-1] = (gaps[-1][0], layer + 1)
        else:
            gaps.append((layer, layer + 1))
    return gaps

@dataclass(frozen=True)
class NodeRange:
    """Layers `[start_layer, end_layer)` held by one node."""

    name: str
    start_layer: int
    end_layer: int

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer


@dataclass(frozen=True)
class Flow:
    """Tokens per second sent along one directed edge of the flow graph."""

    src: str
    dst: str
    tokens_per_s: float


@dataclass
class Placement:
    model: str
    cluster: str
    num_layers: int
    planner: str
    nodes: list[NodeRange]
    flows: list[Flow] = field(default_factory=list)
    throughput_tokens_per_s: float | None = None
    upper_bound_tokens_per_s: float | None = None
    solve_time_s: float | None = None
    #: routers keep a request inside its region wherever the flow continues there (a
    #: serving-selection choice for multi-region clusters; see helixserve.scheduler.maxflow)
    route_within_regions: bool = False
    #: the requests in flight the served objective scored it at (`plan --serve-concurrency`);
    #: None: saturated, or not scored by serving
    served_concurrency: int | None = None
    #: where it came from, the first word of its errors: the file it was read from, else
    #: "placement"
    source: str = field(default="placement", compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, source: str | None = None) -> None:
        """Check ranges are inside the model and names unique; raise UserError naming the field
        (after `source`, default `self.source`)."""
        seen: set[str] = set()
        for i, n in enumerate(self.nodes):
            where = f"{source or self.source}: nodes[{i}]"
            if n.name in seen:
                raise UserError(f"{where}.name: duplicate node {n.name!r}")
            seen.add(n.name)
            if not (0 <= n.start_layer < n.end_layer <= self.num_layers):
                raise UserError(
                    f"{where}: layer range [{n.start_layer}, {n.end_layer}) of node {n.name!r} "
                    f"is not inside [0, {self.num_layers})"
                )

    def range_of(self, name: str) -> NodeRange | None:
        for n in self.nodes:
            if n.name == name:
                return n
        return None

    def covers_all_layers(self) -> bool:
        """True when the union of the node ranges is [0, num_layers)."""
        return not layer_gaps(((n.start_layer, n.end_layer) for n in self.nodes),
                              self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "model": self.model,
            "cluster": self.cluster,
            "num_layers": self.num_layers,
            "planner": self.planner,
            "nodes": [
                {"name": n.name, "start_layer": n.start_layer, "end_layer": n.end_layer}
                for n in self.nodes
            ],
            "flows": [
                {"src": f.src, "dst": f.dst, "tokens_per_s": round(f.tokens_per_s, 6)}
                for f in self.flows
            ],
        }
        for key in ("throughput_tokens_per_s", "upper_bound_tokens_per_s", "solve_time_s"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(value, 6)
        if self.route_within_regions:
            out["route_within_regions"] = True
        if self.served_concurrency is not None:
            out["served_concurrency"] = self.served_concurrency
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: Any, source: str = "placement") -> Placement:
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if "format" not in data:  # docs/formats.md: required, so other JSON is not taken for one
            raise UserError(f"{source}: format: missing; expected {FORMAT!r}")
        fmt = data["format"]
        if fmt != FORMAT:
            raise UserError(f"{source}: format: unsupported {fmt!r}; expected {FORMAT!r}")

        def need(obj: dict[str, Any], key: str, typ: type, where: str) -> Any:
            if key not in obj:
                raise UserError(f"{source}: {where}{key}: missing")
            value = obj[key]
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise UserError(
                    f"{source}: {where}{key}: expected {typ.__name__}, got {value!r}"
                )
            if isinstance(value, float) and not math.isfinite(value):  # json reads NaN, Infinity
                raise UserError(f"{source}: {where}{key}: expected a finite number, got {value}")
            return value

        nodes_raw = need(data, "nodes", list, "")
        nodes = []
        for i, n in enumerate(nodes_raw):
            if not isinstance(n, dict):
                raise UserError(f"{source}: nodes[{i}]: expected an object, got {n!r}")
            nodes.append(
                NodeRange(
                    name=need(n, "name", str, f"nodes[{i}]."),
                    start_layer=need(n, "start_layer", int, f"nodes[{i}]."),
                    end_layer=need(n, "end_layer", int, f"nodes[{i}]."),
                )
            )
        flows = []
        for i, f in enumerate(data.get("flows") or []):
            if not isinstance(f, dict):
                raise UserError(f"{source}: flows[{i}]: expected an object, got {f!r}")
            flows.append(
                Flow(
                    src=need(f, "src", str, f"flows[{i}]."),
                    dst=need(f, "dst", str, f"flows[{i}]."),
                    tokens_per_s=need(f, "tokens_per_s", float, f"flows[{i}]."),
                )
            )
        optional: dict[str, float | None] = {}
        for key in ("throughput_tokens_per_s", "upper_bound_tokens_per_s", "solve_time_s"):
            optional[key] = need(data, key, float, "") if data.get(key) is not None else None
        placement = cls.__new__(cls)
        placement.model = need(data, "model", str, "")
        placement.cluster = need(data, "cluster", str, "")
        placement.num_layers = need(data, "num_layers", int, "")
        placement.planner = str(data.get("planner", "unknown"))
        placement.nodes = nodes
        placement.flows = flows
        placement.throughput_tokens_per_s = optional["throughput_tokens_per_s"]
        placement.upper_bound_tokens_per_s = optional["upper_bound_tokens_per_s"]
        placement.solve_time_s = optional["solve_time_s"]
        within = data.get("route_within_regions", False)
        if not isinstance(within, bool):
            raise UserError(f"{source}: route_within_regions: expected true or false, "
                            f"got {within!r}")
        placement.route_within_regions = within
        load = data.get("served_concurrency")
        if load is not None and (isinstance(load, bool) or not isinstance(load, int) or load < 1):
            raise UserError(f"{source}: served_concurrency: expected an integer >= 1 (or null), "
                            f"got {load!r}")
        placement.served_concurrency = load
        placement.source = source
        placement.validate()
        return placement


def load_placement(path: str | Path) -> Placement:
    """Read a placement JSON file; errors name the file and the field."""
    p = Path(path)
    text = read_user_file(p, "placement")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{p}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return Placement.from_dict(data, source=str(p))
