"""Human-readable views of a placement: the per-node summary table and the flow-graph PNG."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.planner.placement import Flow, Placement
from helixserve.spec import ClusterSpec
from helixserve.spec.cluster import COORDINATOR


@dataclass(frozen=True)
class NodeRow:
    name: str
    gpu: str
    start_layer: int
    end_layer: int
    flow_tokens_per_s: float
    capacity_tokens_per_s: float

    @property
    def utilisation(self) -> float:
        return self.flow_tokens_per_s / self.capacity_tokens_per_s if self.capacity_tokens_per_s else 0.0


def node_rows(cluster: ClusterSpec, cost: CostModel, placement: Placement,
              flows: list[Flow]) -> list[NodeRow]:
    inflow: dict[str, float] = {}
    for f in flows:
        if f.dst != COORDINATOR:
            inflow[f.dst] = inflow.get(f.dst, 0.0) + f.tokens_per_s
    rows = []
    for r in sorted(placement.nodes, key=lambda r: (r.start_layer, r.end_layer, r.name)):
        node = cluster.node(r.name)
        gpu = node.gpu if node.num_gpus == 1 else f"{node.gpu} x{node.num_gpus}"
        cap = cost.node_throughput_tokens_per_s(node, r.num_layers,
                                                r.end_layer == placement.num_layers)
        rows.append(NodeRow(r.name, gpu, r.start_layer, r.end_layer, inflow.get(r.name, 0.0), cap))
    return rows


def format_table(rows: list[NodeRow], unused: list[str]) -> str:
    head = f"{'node':<12} {'gpu':<16} {'layers':<12} {'k':>3} {'flow tok/s':>11} {'T(k) tok/s':>11} {'util':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.name:<12} {r.gpu:<16} {f'[{r.start_layer}, {r.end_layer})':<12} "
            f"{r.end_layer - r.start_layer:>3} {r.flow_tokens_per_s:>11,.1f} "
            f"{r.capacity_tokens_per_s:>11,.1f} {r.utilisation:>6.0%}"
        )
    if unused:
        lines.append(f"unused: {', '.join(unused)}")
    return "\n".join(lines)


def format_selection(report: list[dict[str, Any]]) -> str:
    """The serving selection's candidates (`simulator.selection.select_placement`'s report)."""
    head = f"  {'max flow':>10} {'served tok/s':>12}  {'candidate':<34} stages"
    lines = [head, "-" * len(head)]
    for r in report:
        lines.append(
            f"{'*' if r['chosen'] else ' '} {r['max_flow_tokens_per_s'] or 0:>10,.1f} "
            f"{r['simulated_tokens_per_s'] or 0:>12,.1f}  {r['source']:<34} {r['stages']}"
        )
    return "\n".join(lines)


def plot_placement(cluster: ClusterSpec, placement: Placement, flows: list[Flow],
                   path: str | Path) -> None:
    """PNG of the flow graph: x = layer position, nodes coloured by GPU type and labelled
    with their layer range, edge width proportional to the flow it carries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = placement.num_layers
    ranges = sorted(placement.nodes, key=lambda r: (r.start_layer, r.end_layer, r.name))
    # stack nodes with overlapping ranges in rows so boxes do not cover each other
    row_end: list[int] = []
    pos: dict[str, tuple[float, float]] = {}
    for r in ranges:
        row = next((k for k, e in enumerate(row_end) if e <= r.start_layer), None)
        if row is None:
            row = len(row_end)
            row_end.append(0)
        row_end[row] = r.end_layer
        pos[r.name] = ((r.start_layer + r.end_layer) / 2, -row)
    depth = max(len(row_end), 1)
    src = (-0.08 * L, -(depth - 1) / 2)
    snk = (1.08 * L, -(depth - 1) / 2)
    gpus = sorted({cluster.node(r.name).gpu for r in ranges})
    cmap = plt.get_cmap("tab10")
    colour = {g: cmap(k % 10) for k, g in enumerate(gpus)}
    fig, ax = plt.subplots(figsize=(max(8.0, L / 6), max(3.0, 0.9 * depth + 1.5)))
    top = max((f.tokens_per_s for f in flows), default=1.0) or 1.0
    end_of = {r.name: r.end_layer for r in ranges}
    # an edge is drawn at its hand-off layer: from the end of the sender's box to the same
    # layer inside the receiver's box (partial inference hands off mid-range)
    for f in flows:
        if f.tokens_per_s <= 0:
            continue
        a: tuple[float, float]
        b: tuple[float, float]
        if f.src == COORDINATOR and f.dst in pos:
            a, b = src, (0.0, pos[f.dst][1])
        elif f.dst == COORDINATOR and f.src in pos:
            a, b = (float(L), pos[f.src][1]), snk
        elif f.src in pos and f.dst in pos:
            # a short arc across the hand-off layer, visible between boxes of one row too
            hand_off = float(end_of[f.src])
            a, b = (hand_off - 0.6, pos[f.src][1] + 0.15), (hand_off + 0.6, pos[f.dst][1] + 0.15)
        else:
            continue
        ax.annotate("", xy=b, xytext=a, zorder=3, arrowprops={
            "arrowstyle": "-|>", "lw": 0.3 + 5.0 * f.tokens_per_s / top, "color": "0.15",
            "alpha": 0.6, "shrinkA": 2, "shrinkB": 2, "connectionstyle": "arc3,rad=0.25"})
    for r in ranges:
        x, y = pos[r.name]
        node = cluster.node(r.name)
        ax.add_patch(plt.Rectangle((r.start_layer, y - 0.3), r.num_layers, 0.6,
                                   color=colour[node.gpu], alpha=0.85))
        # a machine of several GPUs is the GPU's colour, marked with its count
        name = r.name if node.num_gpus == 1 else f"{r.name} x{node.num_gpus}"
        ax.text(x, y, f"{name}\n[{r.start_layer},{r.end_layer})", ha="center", va="center",
                fontsize=7)
    for xy, label in ((src, "coordinator\n(source)"), (snk, "coordinator\n(sink)")):
        ax.plot(*xy, marker="s", markersize=14, color="black")
        ax.text(xy[0], xy[1] - 0.45, label, ha="center", va="top", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[g]) for g in gpus]
    ax.legend(handles, gpus, loc="upper right", fontsize=7, ncol=min(len(gpus), 4))
    thr = placement.throughput_tokens_per_s
    ax.set_title(f"{placement.cluster} / {placement.model} / {placement.planner}: "
                 f"{thr or 0:,.1f} tokens/s (edge width = flow)")
    ax.set_xlim(src[0] - 0.05 * L, snk[0] + 0.05 * L)
    ax.set_ylim(-depth + 0.2, 1.0)
    ax.set_xlabel("layer")
    ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
