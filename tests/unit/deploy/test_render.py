"""The rendered manifests say what matters: layers, GPU selectors, resources, probes, ports,
and a ConfigMap that parses back into the same cluster and placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from k8s_testlib import GEO_RANGES, load_docs, opts, write_cluster, write_placement

from helixserve.deploy import render_k8s, write_manifests
from helixserve.deploy.render import HEADER
from helixserve.errors import UserError
from helixserve.planner import Placement, load_placement
from helixserve.spec import load_cluster, parse_cluster


def objects(files: dict[str, str]) -> dict[str, dict]:
    """file name -> its one object (every rendered file holds exactly one)."""
    out = {}
    for name, text in files.items():
        assert text.startswith(HEADER + "\n"), name
        if name == "kustomization.yaml":
            continue
        docs = load_docs(text)
        assert len(docs) == 1, name
        out[name] = docs[0]
    return out


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_one_statefulset_per_placement_node(geo_cluster: Path, geo_placement: Path) -> None:
    r = render_k8s(geo_cluster, geo_placement, opts())
    objs = objects(r.files)
    workers = {o["spec"]["template"]["metadata"]["labels"]["helixserve.io/node"]: o
               for o in objs.values() if o["kind"] == "StatefulSet"}
    assert set(workers) == set(GEO_RANGES)
    assert len(r.idle_nodes) == 24 - len(GEO_RANGES) and "n2" in r.idle_nodes
    cluster = load_cluster(geo_cluster)
    for node, (start, end) in GEO_RANGES.items():
        sts = workers[node]
        spec = cluster.node(node)
        assert sts["metadata"]["name"] == f"helixserve-worker-{node}"
        assert sts["spec"]["replicas"] == 1
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert (labels["helixserve.io/start-layer"], labels["helixserve.io/end-layer"]) == (
            str(start), str(end))
        assert labels["helixserve.io/gpu"] == spec.gpu
        assert labels["helixserve.io/region"] == spec.region
        # the selector is immutable: identity only, never the layer range
        assert "helixserve.io/start-layer" not in sts["spec"]["selector"]["matchLabels"]
        assert sts["spec"]["selector"]["matchLabels"]["helixserve.io/node"] == node
        pod = sts["spec"]["template"]["spec"]
        product = {"A100-40GB": "NVIDIA-A100-SXM4-40GB", "L4": "NVIDIA-L4", "T4": "Tesla-T4"}
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product[spec.gpu]}
        c = container(sts)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == spec.num_gpus
        assert c["resources"]["requests"]["nvidia.com/gpu"] == spec.num_gpus
        cmd = c["command"]
        assert cmd[:2] == ["helixserve", "worker"]
        assert flag(cmd, "--node") == node
        assert flag(cmd, "--placement") == "/etc/helixserve/placement.json"
        assert flag(cmd, "--model") == "/models/llama-2-70b"
        assert flag(cmd, "--host") == "0.0.0.0"
        assert flag(cmd, "--port") == "50051"
        assert flag(cmd, "--device") == "cuda"
        # T4 has no bfloat16 units
        assert flag(cmd, "--dtype") == ("float16" if spec.gpu == "T4" else "bfloat16")
        assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"}]
        # TLS by default: certificate from the Secret, peers from the cluster file, and the
        # gRPC health check over mutual TLS (the native gRPC probe is plaintext only)
        assert flag(cmd, "--cluster") == "/etc/helixserve/cluster.yaml"
        tls = ["--tls-cert", "/etc/helixserve-tls/tls.crt", "--tls-key",
               "/etc/helixserve-tls/tls.key", "--tls-ca", "/etc/helixserve-tls/ca.crt"]
        assert cmd[-6:] == tls
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"] == [
                "helixserve", "certs", "check", "--address", "127.0.0.1:50051", *tls], probe
        (secret,) = [v["secret"] for v in pod["volumes"] if v["name"] == "tls"]
        assert secret["secretName"] == "helixserve-tls"
        assert {i["key"] for i in secret["items"]} == {"ca.crt", f"{node}.crt", f"{node}.key"}
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
        (spread,) = pod["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        term = spread["podAffinityTerm"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= labels.items()
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/dev/shm"]["name"] == "shm"
        assert mounts["/models"]["readOnly"] and mounts["/etc/helixserve"]["readOnly"]


def test_addresses_are_stable_dns_names_of_the_worker_pods(
        geo_cluster: Path, geo_placement: Path) -> None:
    r = render_k8s(geo_cluster, geo_placement, opts(namespace="llm"))
    objs = objects(r.files)
    headless = objs["workers-service.yaml"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == 50051
    cm = objs["configmap.yaml"]
    rendered = parse_cluster(yaml.safe_load(cm["data"]["cluster.yaml"]), source="cm")
    for node in GEO_RANGES:
        sts = objs[f"worker-{node}.yaml"]
        assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
        # pod 0 of the StatefulSet, under the headless Service, in the namespace
        expected = (f"{sts['metadata']['name']}-0.{headless['metadata']['name']}.llm"
                    ".svc.cluster.local:50051")
        assert rendered.node(node).address == expected
        assert sts["metadata"]["annotations"]["helixserve.io/address"] == expected
        # the headless Service selects this pod
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert headless["spec"]["selector"].items() <= pod_labels.items()
    assert rendered.node("n2").address is None


def test_configmap_parses_back_into_the_same_cluster_and_placement(
        geo_cluster: Path, geo_placement: Path) -> None:
    objs = objects(render_k8s(geo_cluster, geo_placement, opts()).files)
    data = objs["configmap.yaml"]["data"]
    original = load_cluster(geo_cluster)
    rendered = parse_cluster(yaml.safe_load(data["cluster.yaml"]), source="cm")
    assert rendered.name == original.name
    assert rendered.coordinator_region == original.coordinator_region
    strip = [(n.name, n.gpu, n.num_gpus, n.region, n.nic_gbps, n.memory_gb)
             for n in original.nodes]
    assert [(n.name, n.gpu, n.num_gpus, n.region, n.nic_gbps, n.memory_gb)
            for n in rendered.nodes] == strip
    assert rendered.explicit == original.explicit and len(rendered.explicit) == 600
    assert rendered.default_link == original.default_link
    placement = Placement.from_dict(json.loads(data["placement.json"]))
    original_placement = load_placement(geo_placement)
    assert original_placement.solve_time_s == 4.5
    original_placement.solve_time_s = None  # dropped: not part of the plan
    assert placement == original_placement


def test_coordinator_and_api_service(geo_cluster: Path, geo_placement: Path) -> None:
    objs = objects(render_k8s(geo_cluster, geo_placement, opts()).files)
    dep = objs["coordinator-deployment.yaml"]
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 1
    c = container(dep)
    cmd = c["command"]
    assert cmd[:2] == ["helixserve", "serve"]
    assert flag(cmd, "--cluster") == "/etc/helixserve/cluster.yaml"
    assert flag(cmd, "--placement") == "/etc/helixserve/placement.json"
    assert flag(cmd, "--model") == "/models/llama-2-70b"
    assert (flag(cmd, "--host"), flag(cmd, "--port")) == ("0.0.0.0", "8000")
    assert flag(cmd, "--kv-allocation") == "on-demand"
    reserve = objects(render_k8s(geo_cluster, geo_placement, opts(kv_allocation="reserve")).files)
    assert flag(container(reserve["coordinator-deployment.yaml"])["command"],
                "--kv-allocation") == "reserve"
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # no probe depends on the workers (a worker outage makes /health 503, and a one-replica
    # Service without a ready endpoint would refuse connections instead of answering 503)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/ready", "port": "http"}, probe
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    svc = objs["coordinator-service.yaml"]
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    config = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == objs["configmap.yaml"]["metadata"]["name"]
    pdb = objs["workers-pdb.yaml"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    pdb = objs["coordinator-pdb.yaml"]
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"][
        "metadata"]["labels"].items()
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "llm"


def test_rendering_is_deterministic(geo_cluster: Path, geo_placement: Path) -> None:
    a = render_k8s(geo_cluster, geo_placement, opts()).files
    b = render_k8s(geo_cluster, geo_placement, opts()).files
    assert a == b
    assert list(a) == list(b)


def test_replan_of_one_node_changes_only_its_worker_and_the_config(
        geo_cluster: Path, tmp_path: Path) -> None:
    before = write_placement(tmp_path / "a.json", GEO_RANGES, "helix-geo-24")
    moved = dict(GEO_RANGES, n12=(38, 60))  # n12 now also holds layers 38 and 39
    after = write_placement(tmp_path / "b.json", moved, "helix-geo-24")
    out = tmp_path / "out"
    write_manifests(render_k8s(geo_cluster, before, opts()), out)
    old = {p.name: p.read_text() for p in out.iterdir()}
    written, removed = write_manifests(render_k8s(geo_cluster, after, opts()), out)
    new = {p.name: p.read_text() for p in out.iterdir()}
    changed = {name for name in new if new[name] != old.get(name)}
    assert changed == set(written) == {
        "worker-n12.yaml", "configmap.yaml", "coordinator-deployment.yaml"}
    assert removed == []
    # the coordinator changes only by the config hash that rolls it onto the new placement
    dep_old, dep_new = (load_docs(x["coordinator-deployment.yaml"])[0] for x in (old, new))
    key = "helixserve.io/config-sha256"
    assert dep_old["spec"]["template"]["metadata"]["annotations"][key] != \
        dep_new["spec"]["template"]["metadata"]["annotations"][key]
    for d in (dep_old, dep_new):
        del d["spec"]["template"]["metadata"]["annotations"][key]
    assert dep_old == dep_new
    n12 = load_docs(new["worker-n12.yaml"])[0]
    assert n12["spec"]["template"]["metadata"]["labels"]["helixserve.io/start-layer"] == "38"


def test_stale_worker_files_are_removed_and_foreign_files_kept(
        geo_cluster: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    full = write_placement(tmp_path / "a.json", GEO_RANGES, "helix-geo-24")
    write_manifests(render_k8s(geo_cluster, full, opts()), out)
    (out / "my-patch.yaml").write_text("kind: Something\n")
    fewer = {k: v for k, v in GEO_RANGES.items() if k != "n13"}
    fewer["n12"] = (40, 80)
    smaller = write_placement(tmp_path / "b.json", fewer, "helix-geo-24")
    _, removed = write_manifests(render_k8s(geo_cluster, smaller, opts()), out)
    assert removed == ["worker-n13.yaml"]
    assert (out / "my-patch.yaml").exists()
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert "worker-n13.yaml" not in kustomization["resources"]
    assert sorted(kustomization["resources"] + ["kustomization.yaml", "my-patch.yaml"]) == \
        sorted(p.name for p in out.iterdir())


def test_multi_gpu_cpu_nodes_overrides_and_regions(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "c.yaml", "mini", [
        {"name": "big", "gpu": "A100-40GB", "num_gpus": 4, "region": "us-east1"},
        {"name": "t4s", "gpu": "T4", "num_gpus": 2, "region": "us-east1"},
        {"name": "box", "gpu": "cpu", "region": "default"},
    ])
    placement = write_placement(tmp_path / "p.json",
                                {"big": (0, 20), "t4s": (10, 30), "box": (20, 32)},
                                "mini", num_layers=32)
    r = render_k8s(cluster, placement, opts(
        gpu_products={"A100-40GB": "NVIDIA-A100-PCIE-40GB"},
        region_label="topology.kubernetes.io/region", dtype="auto",
        model_volume="hostpath:/srv/models", service_monitor=True,
        coordinator_image="helixserve:0.1.0-cpu", api_key_secret="helix-api"))
    objs = objects(r.files)
    big, t4s, box = (objs[f"worker-{n}.yaml"] for n in ("big", "t4s", "box"))
    assert big["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-A100-PCIE-40GB",
        "topology.kubernetes.io/region": "us-east1"}
    assert container(big)["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert container(t4s)["resources"]["requests"] == {"nvidia.com/gpu": 2}
    assert t4s["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "Tesla-T4"
    # a CPU node: no GPU selector or resource, --device cpu, and no region pin for "default"
    box_pod = box["spec"]["template"]["spec"]
    assert "nodeSelector" not in box_pod and "tolerations" not in box_pod
    assert "resources" not in container(box)
    assert flag(container(box)["command"], "--device") == "cpu"
    assert "--dtype" not in container(box)["command"]
    models = next(v for v in box_pod["volumes"] if v["name"] == "models")
    assert models["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    coord = container(objs["coordinator-deployment.yaml"])
    assert coord["image"] == "helixserve:0.1.0-cpu"
    assert container(big)["image"] == "registry.example.com/helixserve:0.1.0-cuda"
    assert coord["env"][0] == {"name": "HELIXSERVE_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "helix-api", "key": "api-key"}}}
    sm = objs["servicemonitor.yaml"]
    assert sm["kind"] == "ServiceMonitor"
    assert sm["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}
    api = objs["coordinator-service.yaml"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= api["metadata"]["labels"].items()
    # layers 20..31 are held only by "box"... and t4s; 0..9 only by "big"
    assert any("big" in w for w in r.warnings)


@pytest.mark.parametrize(("change", "message"), [
    ({"namespace": "Bad_NS"}, "--namespace: bad value 'Bad_NS'"),
    ({"model_volume": "nfs:/x"}, "--model-volume: bad value 'nfs:/x'"),
    ({"model_path": "models/x"}, "--model-path: bad value 'models/x'"),
    ({"dtype": "fp8"}, "--dtype: bad value 'fp8'; known: auto, bfloat16"),
    ({"image": ""}, "--image: bad value ''"),
    ({"gpu_products": {"T4": "NVIDIA T4"}}, "--gpu-product T4: bad label value 'NVIDIA T4'"),
    ({"name": "a-very-long-instance-name-that-does-not-fit-in-a-pod"}, "longer than 52"),
])
def test_bad_options_are_user_errors(geo_cluster: Path, geo_placement: Path,
                                     change: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render_k8s(geo_cluster, geo_placement, opts(**change))


def test_mismatched_inputs_are_user_errors(geo_cluster: Path, tmp_path: Path) -> None:
    stray = write_placement(tmp_path / "stray.json", dict(GEO_RANGES, n99=(0, 80)),
                            "helix-geo-24")
    with pytest.raises(UserError, match=r"nodes\[6\]\.name: node 'n99' is not in cluster"):
        render_k8s(geo_cluster, stray, opts())
    flows = write_placement(tmp_path / "flows.json", GEO_RANGES, "helix-geo-24",
                            flows=[("coordinator", "n0", 1.0), ("n0", "n7", 1.0)])
    with pytest.raises(UserError, match=r"flows\[1\]: node 'n7' holds no layers"):
        render_k8s(geo_cluster, flows, opts())
    other = write_placement(tmp_path / "other.json", GEO_RANGES, "helix-single-24")
    with pytest.raises(UserError, match="planned for cluster 'helix-single-24'"):
        render_k8s(geo_cluster, other, opts())
    gap = write_placement(tmp_path / "gap.json", {"n0": (0, 40), "n1": (41, 80)}, "helix-geo-24")
    with pytest.raises(UserError, match="no node holds layer 40 of 80"):
        render_k8s(geo_cluster, gap, opts())
    with pytest.raises(UserError, match="cannot read placement"):
        render_k8s(geo_cluster, tmp_path / "missing.json", opts())
    with pytest.raises(UserError, match="cannot read cluster file"):
        render_k8s(tmp_path / "missing.yaml", stray, opts())
    unknown = write_cluster(tmp_path / "u.yaml", "u", [{"name": "x", "gpu": "MI300X"}])
    with pytest.raises(UserError, match="unknown GPU 'MI300X'"):
        render_k8s(unknown, write_placement(tmp_path / "u.json", {"x": (0, 80)}, "u"), opts())


def test_rendered_commands_parse_with_the_real_cli(geo_cluster: Path, tmp_path: Path) -> None:
    """The flags in the manifests are the ones `helixserve worker` and `serve` accept today."""
    from helixserve.cli import build_parser

    cluster = write_cluster(tmp_path / "c.yaml", "mini", [
        {"name": "gpu0", "gpu": "L4"}, {"name": "box", "gpu": "cpu"}])
    placement = write_placement(tmp_path / "p.json", {"gpu0": (0, 20), "box": (10, 32)},
                                "mini", num_layers=32)
    objs = objects(render_k8s(cluster, placement, opts()).files)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = {"worker", "serve"} - set(sub.choices)
    if missing:  # tests/unit/test_cli.py fails for a command that is not built
        pytest.skip(f"commands not built yet: {', '.join(sorted(missing))}")
    parsed = {}
    for name in ("worker-gpu0.yaml", "worker-box.yaml", "coordinator-deployment.yaml"):
        cmd = container(objs[name])["command"]
        assert cmd[0] == "helixserve"
        parsed[name] = parser.parse_args(cmd[1:])  # argparse exits (SystemExit) on a bad flag
    gpu0 = parsed["worker-gpu0.yaml"]
    assert (gpu0.node, gpu0.port, gpu0.host, gpu0.device, gpu0.dtype) == (
        "gpu0", 50051, "0.0.0.0", "cuda", "bfloat16")
    assert str(gpu0.placement) == "/etc/helixserve/placement.json"
    assert parsed["worker-box.yaml"].device == "cpu"
    serve = parsed["coordinator-deployment.yaml"]
    assert (str(serve.cluster), serve.port) == ("/etc/helixserve/cluster.yaml", 8000)


def test_network_policy_admits_only_coordinator_and_workers(geo_cluster: Path,
                                                            geo_placement: Path) -> None:
    objs = objects(render_k8s(geo_cluster, geo_placement, opts()).files)
    policy = objs["workers-networkpolicy.yaml"]
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    worker_labels = next(o for o in objs.values() if o["kind"] == "StatefulSet")[
        "spec"]["template"]["metadata"]["labels"]
    coordinator_labels = objs["coordinator-deployment.yaml"]["spec"]["template"]["metadata"][
        "labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    selectors = [f["podSelector"]["matchLabels"] for f in rule["from"]]
    assert len(selectors) == 2
    assert any(s.items() <= coordinator_labels.items() for s in selectors)
    assert any(s.items() <= worker_labels.items() for s in selectors)
    # nothing but those two may match: no namespaceSelector / ipBlock rules
    assert all(set(f) == {"podSelector"} for f in rule["from"])


def test_api_network_policy_admits_the_namespace_and_named_ones(geo_cluster: Path,
                                                                geo_placement: Path) -> None:
    objs = objects(render_k8s(geo_cluster, geo_placement, opts()).files)
    policy = objs["api-networkpolicy.yaml"]
    coordinator_labels = objs["coordinator-deployment.yaml"]["spec"]["template"]["metadata"][
        "labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= coordinator_labels.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule == {"from": [{"podSelector": {}}], "ports": [{"port": 8000, "protocol": "TCP"}]}
    wider = objects(render_k8s(geo_cluster, geo_placement,
                               opts(api_namespaces=("ingress-nginx",))).files)
    (rule,) = wider["api-networkpolicy.yaml"]["spec"]["ingress"]
    assert rule["from"][1] == {"namespaceSelector": {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ingress-nginx"]}]}}
    off = objects(render_k8s(geo_cluster, geo_placement, opts(network_policy=False)).files)
    assert "api-networkpolicy.yaml" not in off


def test_the_api_choice_is_explicit(geo_cluster: Path, geo_placement: Path) -> None:
    from helixserve.deploy import RenderOptions

    plain = dict(image="img", model_path="/models/x")
    with pytest.raises(UserError, match="--api-key-secret: missing"):
        render_k8s(geo_cluster, geo_placement, RenderOptions(**plain))
    with pytest.raises(UserError, match="cannot be combined"):
        render_k8s(geo_cluster, geo_placement, RenderOptions(
            **plain, api_key_secret="k", allow_unauthenticated=True))
    with pytest.raises(UserError, match="--api-from-namespace: bad namespace 'Bad_NS'"):
        render_k8s(geo_cluster, geo_placement, opts(api_namespaces=("Bad_NS",)))


def test_plaintext_workers_are_told_insecure(geo_cluster: Path, geo_placement: Path) -> None:
    objs = objects(render_k8s(geo_cluster, geo_placement, opts(tls_secret=None)).files)
    cmd = container(objs["worker-n0.yaml"])["command"]
    assert "--insecure" in cmd and "--tls-cert" not in cmd
    tls = objects(render_k8s(geo_cluster, geo_placement, opts()).files)
    assert "--insecure" not in container(tls["worker-n0.yaml"])["command"]


def test_coordinator_tls_and_open_api_flags(geo_cluster: Path, geo_placement: Path) -> None:
    objs = objects(render_k8s(geo_cluster, geo_placement, opts()).files)
    c = container(objs["coordinator-deployment.yaml"])
    assert flag(c["command"], "--tls-cert") == "/etc/helixserve-tls/tls.crt"
    assert "--allow-unauthenticated" in c["command"]  # opts() chose it explicitly
    pod = objs["coordinator-deployment.yaml"]["spec"]["template"]["spec"]
    (secret,) = [v["secret"] for v in pod["volumes"] if v["name"] == "tls"]
    assert {i["key"] for i in secret["items"]} == {"ca.crt", "coordinator.crt", "coordinator.key"}
    keyed = objects(render_k8s(geo_cluster, geo_placement, opts(api_key_secret="k")).files)
    assert "--allow-unauthenticated" not in container(keyed["coordinator-deployment.yaml"])[
        "command"]
    plain = render_k8s(geo_cluster, geo_placement, opts(tls_secret=None, network_policy=False))
    plain_objs = objects(plain.files)
    assert "workers-networkpolicy.yaml" not in plain_objs
    assert "--tls-cert" not in container(plain_objs["coordinator-deployment.yaml"])["command"]
    assert any("plaintext" in w for w in plain.warnings)
