"""Helpers for the deploy tests (imported by module name; tests/ has no packages)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from helixserve.deploy import RenderOptions

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO / "tests" / "data" / "shared"
CLUSTERS = SHARED / "clusters"
K8S_DIR = REPO / "deploy" / "kubernetes"

# LLaMA-2-70B (80 layers) on six machines of helix-geo-24: two A100s in region-0 hold the
# whole model between them, and an L4/T4 pipeline in region-1 holds it a second time.
# n2, n3 and the other 16 nodes hold nothing.
GEO_RANGES = {
    "n0": (0, 40), "n1": (40, 80),
    "n4": (0, 20), "n5": (20, 40), "n12": (40, 60), "n13": (60, 80),
}  # fmt: skip


def placement_dict(ranges: dict[str, tuple[int, int]], cluster: str,
                   num_layers: int = 80, model: str = "llama-2-70b",
                   flows: list[tuple[str, str, float]] | None = None) -> dict[str, Any]:
    """A placement; `flows` default: none (the renderer passes flows through untouched)."""
    return {
        "format": "helixserve.placement/v1",
        "model": model,
        "cluster": cluster,
        "num_layers": num_layers,
        "planner": "test",
        "nodes": [{"name": n, "start_layer": s, "end_layer": e} for n, (s, e) in ranges.items()],
        "flows": [{"src": a, "dst": b, "tokens_per_s": t} for a, b, t in flows or []],
        "throughput_tokens_per_s": 12.5,
        "solve_time_s": 4.5,
    }


def write_placement(path: Path, ranges: dict[str, tuple[int, int]], cluster: str,
                    **kw: Any) -> Path:
    path.write_text(json.dumps(placement_dict(ranges, cluster, **kw), indent=2))
    return path


def write_cluster(path: Path, name: str, nodes: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"name": name, "nodes": nodes,
                                    "links": {"default": {"bandwidth_gbps": 10.0}}}))
    return path


def opts(**kw: Any) -> RenderOptions:
    base: dict[str, Any] = dict(image="registry.example.com/helixserve:0.1.0-cuda",
                                model_path="/models/llama-2-70b", namespace="llm")
    if not kw.get("api_key_secret"):  # the API choice is explicit (render.validate_options)
        base["allow_unauthenticated"] = True
    base.update(kw)
    return RenderOptions(**base)


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


