"""The emulated clusters: machines of unequal speed and memory, in regions far apart.

A machine is a `helixserve worker` process on its own loopback address (127.0.0.x). Its speed
is a slowdown factor over one CPU thread of this host (2 = half as fast); its memory a budget
in GB (weights and KV cache, as the planner counts them). Each speed class is a pseudo-GPU type
`cpu-x<factor>` in a GPU catalog the rig writes beside the cluster YAML (a copy of the shipped
one plus these rows), with its own measured profile rows, so the planner and the simulator
tell the classes apart only through what was measured on them.

Links: `default` inside a region, `between_regions` across; the coordinator (the API) is a
machine of `coordinator_region`. The same table drives the link proxy
(helixserve/rehearse/links.py), read back through the project's loader so the two cannot
disagree.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from helixserve.spec.gpus import DEFAULT_CATALOG

#: first host byte of the machines' loopback addresses (127.0.0.<BASE + i>)
ADDRESS_BASE = 20


@dataclass(frozen=True)
class Machine:
    name: str
    #: compute slowdown over one CPU thread of this host (>= 1)
    slowdown: float
    #: memory budget, GB (the cluster YAML's memory_gb)
    memory_gb: float
    region: str = "default"

    @property
    def gpu(self) -> str:
        return gpu_class(self.slowdown)


@dataclass(frozen=True)
class LinkDef:
    bandwidth_gbps: float
    latency_ms: float


@dataclass(frozen=True)
class RigCluster:
    name: str
    machines: tuple[Machine, ...]
    #: links between machines of one region (and the coordinator's to them)
    lan: LinkDef
    #: symmetric links between regions: (region a, region b) -> link
    wan: dict[tuple[str, str], LinkDef] = field(default_factory=dict)
    coordinator_region: str = "default"
    description: str = ""

    def classes(self) -> list[float]:
        return sorted({m.slowdown for m in self.machines})


def gpu_class(slowdown: float) -> str:
    return f"cpu-x{slowdown:g}"


# SmolLM2-135M in float32: 30 layers of ~14 MB (weights fp32, as the CPU workers run it).
# Planners keep weights within half a node's memory, so 0.30 GB holds ~10 layers.
# Links carry activations of 576 x 4 bytes per token: 2.3 KB, so a few Mbit/s binds.
LAN = LinkDef(bandwidth_gbps=1.0, latency_ms=0.5)
WAN = LinkDef(bandwidth_gbps=0.004, latency_ms=25.0)

CLUSTERS: dict[str, RigCluster] = {
    c.name: c
    for c in (
        RigCluster(
            "one-region",
            (
                Machine("a1", 2.0, 0.45),
                Machine("a2", 2.0, 0.45),
                Machine("b1", 4.0, 0.30),
                Machine("b2", 4.0, 0.30),
            ),
            LAN,
            description="one region, fast LAN; 2 machines at 1/2 and 2 at 1/4 speed",
        ),
        RigCluster(
            "two-regions",
            (
                Machine("e1", 2.0, 0.45, "east"),
                Machine("e2", 3.0, 0.30, "east"),
                Machine("w1", 2.0, 0.45, "west"),
                Machine("w2", 3.0, 0.30, "west"),
            ),
            LAN,
            {("east", "west"): WAN},
            coordinator_region="east",
            description="two regions of 2 machines, 4 Mbit/s and 25 ms between them",
        ),
        RigCluster(
            "three-classes",
            (
                Machine("f1", 2.0, 0.60),
                Machine("m1", 4.0, 0.30),
                Machine("m2", 4.0, 0.30),
                Machine("s1", 8.0, 0.25),
                Machine("s2", 8.0, 0.25),
            ),
            LAN,
            description="3 speed classes (1/2, 1/4, 1/8 speed), memory falling with speed",
        ),
    )
}


def machine_host(index: int) -> str:
    return f"127.0.0.{ADDRESS_BASE + index}"


def write_cluster_yaml(cluster: RigCluster, path: Path, addresses: dict[str, str]) -> None:
    """The cluster YAML (FORMATS.md) of `cluster`, workers at `addresses` (node -> host:port)."""
    lines = [f"name: rig-{cluster.name}", "nodes:"]
    for m in cluster.machines:
        lines += [
            f"  - name: {m.name}",
            f"    gpu: {m.gpu}",
            f"    memory_gb: {m.memory_gb}",
            f"    region: {m.region}",
            f"    address: {addresses[m.name]}",
        ]
    lines += ["links:",
              f"  default: {{bandwidth_gbps: {cluster.lan.bandwidth_gbps}, "
              f"latency_ms: {cluster.lan.latency_ms}}}"]
    if cluster.wan:
        lines.append("  between_regions:")
        for (a, b), link in cluster.wan.items():
            lines.append(f"    - {{a: {a}, b: {b}, bandwidth_gbps: {link.bandwidth_gbps}, "
                         f"latency_ms: {link.latency_ms}}}")
    lines += ["coordinator:", f"  region: {cluster.coordinator_region}", ""]
    path.write_text("\n".join(lines))


def write_catalog(slowdowns: list[float], path: Path) -> None:
    """The shipped GPU catalog plus one `cpu-x<F>` row per speed class (copies of `cpu`)."""
    with DEFAULT_CATALOG.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, DEFAULT_CATALOG
    cpu = next(r for r in rows if r["gpu"] == "cpu")
    names = {r["gpu"] for r in rows}
    for s in slowdowns:
        if gpu_class(s) not in names:
            rows.append({**cpu, "gpu": gpu_class(s),
                         "note": f"benchmarks/rig: a CPU worker slowed {s:g}x (measured profile)"})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
