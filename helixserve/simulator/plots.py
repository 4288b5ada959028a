"""PNG plots of a simulation summary: latency CDFs, throughput over time, utilisation heat map.

matplotlib with the Agg backend (no display); imported only when `--plot` is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(
    summary: dict[str, Any], latencies: dict[str, list[float]], out_dir: Path
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    title = (
        f"{summary['planner']} + {summary['scheduler']} ({summary['mode']}) on {summary['cluster']}"
    )
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, label) in zip(
        axes,
        (
            ("ttft_s", "time to first token"),
            ("tpot_s", "time per output token"),
            ("e2e_s", "end-to-end latency"),
        ),
        strict=True,
    ):
        xs = sorted(latencies[key])
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_xlabel(f"{label} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "latency_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    tl = summary["timeline"]
    bucket_s = tl["bucket_s"]
    times = [(i + 0.5) * bucket_s for i in range(len(tl["decode_tokens_per_s"]))]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(times, tl["decode_tokens_per_s"], label="decode tokens/s")
    bound = summary.get("max_flow_tokens_per_s")
    peak = max(tl["decode_tokens_per_s"], default=0.0)
    if bound and bound <= 3 * peak:
        ax.axhline(bound, ls="--", c="gray", label="max-flow bound")
    elif bound:  # drawing it would squash the curve
        ax.plot([], [], ls="--", c="gray", label=f"max-flow bound {bound:.0f} (off scale)")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    names = list(tl["node_utilization"])
    if names:
        grid = [tl["node_utilization"][n] for n in names]
        fig, ax = plt.subplots(figsize=(9, 0.25 * len(names) + 1.5))
        im = ax.imshow(
            grid, aspect="auto", vmin=0, vmax=1, cmap="viridis",
            extent=(0, len(grid[0]) * bucket_s, len(names) - 0.5, -0.5),
        )  # fmt: skip
        gpu = {n["name"]: n["gpu"] for n in summary["nodes"]}
        ax.set_yticks(range(len(names)), [f"{n} ({gpu[n]})" for n in names], fontsize=7)
        ax.set_xlabel("simulated time (s)")
        ax.set_title(f"node utilisation: {title}", fontsize=9)
        fig.colorbar(im, ax=ax, label="busy fraction")
        fig.tight_layout()
        path = out_dir / "node_utilization.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
