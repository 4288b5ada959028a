"""`deploy k8s --engine`: every worker runs the chosen engine; auto leaves the worker's default."""

from __future__ import annotations

from pathlib import Path

from k8s_testlib import load_docs, opts

from helixserve.deploy import render_k8s


def worker_commands(files: dict[str, str]) -> list[list[str]]:
    out = []
    for text in files.values():
        for doc in load_docs(text):
            if doc and doc.get("kind") == "StatefulSet":
                (c,) = doc["spec"]["template"]["spec"]["containers"]
                out.append(c["command"])
    return out


def test_engine_vllm_is_passed_to_every_worker(geo_cluster: Path, geo_placement: Path) -> None:
    commands = worker_commands(render_k8s(geo_cluster, geo_placement, opts(engine="vllm")).files)
    assert commands
    for cmd in commands:
        assert cmd[cmd.index("--engine") + 1] == "vllm"


def test_engine_auto_renders_no_flag(geo_cluster: Path, geo_placement: Path) -> None:
    for cmd in worker_commands(render_k8s(geo_cluster, geo_placement, opts()).files):
        assert "--engine" not in cmd
