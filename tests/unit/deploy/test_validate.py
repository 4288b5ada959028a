"""Every manifest we render or ship passes `kubernetes-validate --strict`, the kustomize base
and overlay build with `kubectl kustomize`, and the base has not drifted from the renderer.

No Kubernetes cluster runs in CI: these are the offline checks. The validator runs once per
Kubernetes version over every file of the module (one process each: it is the slow part).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from k8s_testlib import GEO_RANGES, K8S_DIR, REPO, opts, write_cluster, write_placement

from helixserve.deploy import render_k8s, write_manifests
from helixserve.deploy.k8s import RUN_AS_UID, RenderOptions

# The oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27) and the
# newest the installed validator ships schemas for.
KUBE_VERSIONS = ("1.30.0", None)
KUBECTL = shutil.which("kubectl")
# Kinds without a schema in kubernetes-validate: a CRD (checked field by field in
# test_render) and kustomize's own files (checked by building them).
NO_SCHEMA = {"ServiceMonitor", "Kustomization", "Component"}

BASE_ARGS = dict(image="helixserve:0.1.0-cuda", model_path="/models/llama-30b",
                 namespace="helixserve", api_key_secret="helixserve-api-key")


def kustomize(path: Path) -> str:
    assert KUBECTL is not None
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory, geo_cluster: Path) -> list[Path]:
    """Every manifest file to validate: rendered variants, the shipped tree, kustomize builds."""
    tmp = tmp_path_factory.mktemp("k8s")
    geo = write_placement(tmp / "geo.json", GEO_RANGES, "helix-geo-24")
    mini = write_cluster(tmp / "mini.yaml", "mini", [
        {"name": "big", "gpu": "A100-80GB", "num_gpus": 4, "region": "us-east1"},
        {"name": "box", "gpu": "cpu"},
    ])
    mini_p = write_placement(tmp / "mini.json", {"big": (0, 24), "box": (16, 32)}, "mini",
                             num_layers=32)
    variants: list[tuple[str, Path, Path, RenderOptions]] = [
        ("geo", geo_cluster, geo, opts(service_monitor=True,
                                       region_label="topology.kubernetes.io/region")),
        ("mini", mini, mini_p, opts(model_volume="hostpath:/srv/models", dtype="float16",
                                    name="llm-a", namespace="prod", startup_timeout_s=600,
                                    api_key_secret="helix-api",
                                    coordinator_image="helixserve:0.1.0-cpu")),
    ]
    files: list[Path] = []
    for label, cluster, placement, o in variants:
        out = tmp / label
        write_manifests(render_k8s(cluster, placement, o), out)
        files += sorted(out.glob("*.yaml"))
    # the shipped tree, less the inputs (example/cluster.yaml) and kustomize patches
    files += [p for p in sorted(K8S_DIR.rglob("*.yaml")) if _is_manifest(p)]
    if KUBECTL is not None:
        for tree in ("base", "overlays/example", "model-volume"):
            built = tmp / f"built-{tree.replace('/', '-')}.yaml"
            built.write_text(kustomize(K8S_DIR / tree))
            files.append(built)
    return files


def _is_manifest(path: Path) -> bool:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return bool(docs) and all(isinstance(d, dict) and "apiVersion" in d and "kind" in d
                              for d in docs)


def _validate(files: list[Path], version: str | None) -> dict[str, list[str]]:
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict"]
    if version:
        cmd += ["-k", version]
    proc = subprocess.run(cmd + [str(f) for f in files], capture_output=True, text=True,
                          timeout=120)
    lines: dict[str, list[str]] = {"INFO": [], "WARN": [], "ERROR": []}
    for line in (proc.stdout + proc.stderr).splitlines():
        level = line.split(" ", 1)[0]
        lines.setdefault(level, []).append(line)
    assert proc.returncode == 0, "\n".join(lines["ERROR"]) or proc.stderr
    return lines


def _kinds(files: list[Path]) -> int:
    count = 0
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") not in NO_SCHEMA:
                count += 1
    return count


@pytest.mark.parametrize("version", KUBE_VERSIONS, ids=lambda v: v or "latest")
def test_every_manifest_passes_strict_validation(manifests: list[Path],
                                                 version: str | None) -> None:
    lines = _validate(manifests, version)
    assert lines["ERROR"] == []
    # every warning is a kind without a schema, never a skipped or unparsable file
    for warn in lines["WARN"]:
        assert re.search(r"Couldn't find schema for kind (ServiceMonitor|Kustomization|Component)",
                         warn), warn
    # ... and every other object was validated (one INFO line per object)
    assert len(lines["INFO"]) == _kinds(manifests)
    assert len(lines["INFO"]) > 30


def test_validator_rejects_a_broken_manifest(tmp_path: Path, geo_cluster: Path) -> None:
    """The check above can fail: an unknown field or a named gRPC port is an error."""
    out = tmp_path / "out"
    write_manifests(render_k8s(geo_cluster, write_placement(
        tmp_path / "p.json", GEO_RANGES, "helix-geo-24"), opts()), out)
    good = (out / "worker-n0.yaml").read_text()
    (out / "worker-n0.yaml").write_text(good.replace("containerPort: 50051", "containerPort: grpc"))
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.30.0",
           str(out / "worker-n0.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "is not of type 'integer'" in proc.stdout + proc.stderr


def test_base_is_the_renderer_output_for_the_example(tmp_path: Path) -> None:
    example = K8S_DIR / "example"
    rendering = render_k8s(example / "cluster.yaml", example / "placement.json",
                           RenderOptions(**BASE_ARGS))
    base = K8S_DIR / "base"
    shipped = {p.name: p.read_text() for p in base.iterdir()}
    assert shipped == rendering.files, (
        "deploy/kubernetes/base drifted from the renderer; regenerate it with the command in "
        "deploy/kubernetes/README.md")
    with_sm = render_k8s(example / "cluster.yaml", example / "placement.json",
                         RenderOptions(**BASE_ARGS, service_monitor=True))
    component = K8S_DIR / "components" / "servicemonitor" / "servicemonitor.yaml"
    assert component.read_text() == with_sm.files["servicemonitor.yaml"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed: kustomize builds not checked")
def test_overlay_builds_with_components() -> None:
    docs = [d for d in yaml.safe_load_all(kustomize(K8S_DIR / "overlays" / "example")) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("StatefulSet") == 5 and "ServiceMonitor" in kinds
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            pod = d["spec"]["template"]["spec"]
            models = next(v for v in pod["volumes"] if v["name"] == "models")
            assert models == {"name": "models",
                              "hostPath": {"path": "/srv/models", "type": "Directory"}}
            assert pod["containers"][0]["image"] == "registry.example.com/ml/helixserve:0.1.0-cuda"


def test_dockerfiles_match_the_package_and_the_manifests() -> None:
    """No Docker daemon in CI: check what can be checked without building the images."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (REPO / "deploy" / "docker" / name).read_text()
        # the uid the rendered pods run as exists in the image
        assert f"--uid {RUN_AS_UID}" in text and f"USER {RUN_AS_UID}" in text, name
        assert 'ENTRYPOINT ["helixserve"]' in text
        installs = re.findall(r'pip install "/src\[([^\]]+)\]"', text)
        assert installs, name
        for group in installs:
            for extra in group.split(","):
                assert extra in extras or extra.startswith("${"), (name, extra)
        # torch comes before helixserve, so the chosen torch build is the one that stays
        assert text.index('pip install "torch==') < text.index('pip install "/src[')
        ignore = (REPO / "deploy" / "docker" / f"{name}.dockerignore").read_text()
        for needed in ("pyproject.toml", "helixserve/"):
            assert f"!{needed}" in ignore
    cpu = (REPO / "deploy" / "docker" / "Dockerfile.cpu").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu
