"""`helixserve deploy k8s` end to end: files written, table printed, bad input -> one line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from k8s_testlib import GEO_RANGES, write_placement


def helixserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "helixserve", *args], capture_output=True,
                          text=True, timeout=120)


def test_deploy_k8s_writes_the_manifests(geo_cluster: Path, tmp_path: Path) -> None:
    placement = write_placement(tmp_path / "p.json", GEO_RANGES, "helix-geo-24")
    out = tmp_path / "k8s"
    proc = helixserve("deploy", "k8s", "--cluster", str(geo_cluster), "--placement",
                      str(placement), "--model-path", "/models/llama-2-70b", "--image",
                      "helixserve:test", "--namespace", "llm", "--out", str(out),
                      "--gpu-product", "A100-40GB=NVIDIA-A100-PCIE-40GB",
                      "--allow-unauthenticated")
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in out.iterdir()}
    assert {f"worker-{n}.yaml" for n in GEO_RANGES} < names
    assert {"configmap.yaml", "coordinator-deployment.yaml", "kustomization.yaml"} < names
    assert "NVIDIA-A100-PCIE-40GB" in (out / "worker-n0.yaml").read_text()
    table = {line.split()[0]: line for line in proc.stdout.splitlines()[1:len(GEO_RANGES) + 1]}
    assert set(table) == set(GEO_RANGES)
    assert "[40, 60)" in table["n12"] and "Tesla-T4" in table["n12"]
    assert f"kubectl apply -k {out}" in proc.stdout
    # every layer is held by two nodes (two full pipelines): no single point of failure
    assert "no other node holds" not in proc.stderr and "--allow-unauthenticated" in proc.stderr
    # per-node certificates in the printed instructions, never a wildcard
    assert ("--hosts n0=helixserve-worker-n0-0.helixserve-workers.llm.svc.cluster.local,"
            in proc.stdout) and "*" not in proc.stdout
    # a second run with the same inputs changes nothing
    again = helixserve("deploy", "k8s", "--cluster", str(geo_cluster), "--placement",
                       str(placement), "--model-path", "/models/llama-2-70b", "--image",
                       "helixserve:test", "--namespace", "llm", "--out", str(out),
                       "--gpu-product", "A100-40GB=NVIDIA-A100-PCIE-40GB",
                       "--allow-unauthenticated")
    assert f"{len(names)} files, 0 changed" in again.stdout
    # one pipeline only: every node is a single point of failure, and the user is told
    single = write_placement(tmp_path / "one.json", {"n0": (0, 40), "n1": (40, 80)},
                             "helix-geo-24")
    proc = helixserve("deploy", "k8s", "--cluster", str(geo_cluster), "--placement",
                      str(single), "--model-path", "/models/llama-2-70b", "--image",
                      "helixserve:test", "--out", str(out), "--api-key-secret", "k")
    assert proc.returncode == 0
    assert ("kubectl -n default create secret generic k --from-literal=api-key=\"$KEY\""
            in proc.stdout)
    assert proc.stderr.startswith("warning: no other node holds some of the layers of n0, n1")
    assert "4 removed" in proc.stdout  # n4, n5, n12, n13 lost their layers


def test_bad_input_is_one_line_and_exit_2(geo_cluster: Path, tmp_path: Path) -> None:
    placement = write_placement(tmp_path / "p.json", dict(GEO_RANGES, ghost=(0, 80)),
                                "helix-geo-24")
    proc = helixserve("deploy", "k8s", "--cluster", str(geo_cluster), "--placement",
                      str(placement), "--model-path", "/models/x", "--image", "img",
                      "--out", str(tmp_path / "out"), "--gpu-product", "T4")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "helixserve deploy: error: --gpu-product: bad value 'T4'; expected GPU=LABEL, "
        "e.g. A100-40GB=NVIDIA-A100-PCIE-40GB")
    proc = helixserve("deploy", "k8s", "--cluster", str(geo_cluster), "--placement",
                      str(placement), "--model-path", "/models/x", "--image", "img",
                      "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("--api-key-secret: missing; the API needs a key Secret "
                                        "(its key `api-key`), or pass --allow-unauthenticated "
                                        "to serve every pod the API NetworkPolicy admits "
                                        "without one")
    proc = helixserve("deploy", "k8s", "--cluster", str(geo_cluster), "--placement",
                      str(placement), "--model-path", "/models/x", "--image", "img",
                      "--out", str(tmp_path / "out"), "--allow-unauthenticated")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "node 'ghost' is not in cluster 'helix-geo-24'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_renderer_imports_no_runtime_stack() -> None:
    """Rendering runs on a laptop or in CI without torch, grpc or fastapi being imported."""
    code = ("import sys, helixserve.deploy, helixserve.commands.deploy\n"
            "heavy = sorted(m for m in ('torch', 'grpc', 'fastapi') if m in sys.modules)\n"
            "print(','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
