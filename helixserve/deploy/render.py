"""Render the Kubernetes manifests of one placement: inputs -> files, deterministic.

`render_k8s(cluster_path, placement_path, opts)` checks the inputs against each other,
rewrites the cluster file so every node that holds layers is addressed by its worker's
stable DNS name, and returns one YAML file per object (plus a kustomization.yaml listing
them). Keys are sorted and objects come in a fixed order, with no timestamps or input
paths in the output, so re-rendering after a re-plan changes exactly the objects whose
content changed: the moved node's StatefulSet, the ConfigMap, and the coordinator's
config-hash annotation.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from helixserve.deploy import k8s
from helixserve.deploy.gpu_labels import CPU_GPU, check_label_value, gpu_product_label
from helixserve.deploy.network import api_network_policy, worker_network_policy
from helixserve.errors import UserError
from helixserve.planner.placement import Placement, load_placement
from helixserve.spec import load_cluster, load_gpu_catalog
from helixserve.spec.cluster import COORDINATOR
from helixserve.spec.model import DTYPE_BYTES

#: first line of every file the renderer writes; `write_manifests` only ever deletes files
#: that start with it
HEADER = "# Rendered by `helixserve deploy k8s`; re-render instead of editing."
KUSTOMIZATION = "kustomization.yaml"
DTYPES = ("auto", *sorted(DTYPE_BYTES))
# A ConfigMap holds at most 1 MiB.
CONFIG_MAP_MAX_BYTES = 1024 * 1024
# DNS-1123 label: object names that become pod host names.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# DNS-1123 subdomain: names of Secrets, claims; the cluster domain.
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
# A StatefulSet's controller-revision-hash label is "<name>-<10 chars>", at most 63 characters.
_MAX_STATEFULSET_NAME = 52


@dataclass
class Rendering:
    """The rendered output: file name -> YAML text, plus what a user should be told."""

    files: dict[str, str]
    workers: list[k8s.WorkerSpec]
    #: node names of the cluster that hold no layers (no pod is rendered for them)
    idle_nodes: list[str]
    warnings: list[str] = field(default_factory=list)


# libyaml's emitter when present: the geo-24 cluster file alone is 600 link entries.
_BaseDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Dumper(_BaseDumper):  # type: ignore[valid-type,misc]
    """Block style, multi-line strings as `|` literals, no anchors: readable, stable YAML."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_representer(dumper: Any, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_representer)


def dump_yaml(obj: Any, sort_keys: bool = True, flow_leaves: bool = False) -> str:
    """`flow_leaves`: innermost lists/mappings on one line each (compact link tables)."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=sort_keys,
                     default_flow_style=None if flow_leaves else False,
                     allow_unicode=True, width=100)


def validate_options(opts: k8s.RenderOptions) -> None:
    """Bad flags -> UserError naming the flag and the value."""
    for flag, value in (("--namespace", opts.namespace), ("--name", opts.name)):
        if not _DNS_LABEL.match(value) or len(value) > 63:
            raise UserError(f"{flag}: bad value {value!r}; use a DNS label: [a-z0-9-], "
                            "at most 63 characters, starting and ending with a letter or digit")
    for flag, image in (("--image", opts.image), ("--coordinator-image", opts.coordinator_image)):
        if image is not None and (not image or any(c.isspace() for c in image)):
            raise UserError(f"{flag}: bad value {image!r}; expected an image reference "
                            "such as ghcr.io/org/helixserve:0.1.0-cuda")
    if opts.api_key_secret is not None and not _DNS_NAME.match(opts.api_key_secret):
        raise UserError(f"--api-key-secret: bad Secret name {opts.api_key_secret!r}")
    if not opts.api_key_secret and not opts.allow_unauthenticated:
        raise UserError("--api-key-secret: missing; the API needs a key Secret (its key "
                        "`api-key`), or pass --allow-unauthenticated to serve every pod the "
                        "API NetworkPolicy admits without one")
    if opts.api_key_secret and opts.allow_unauthenticated:
        raise UserError("--allow-unauthenticated: cannot be combined with --api-key-secret")
    for ns in opts.api_namespaces:
        if not _DNS_LABEL.match(ns) or len(ns) > 63:
            raise UserError(f"--api-from-namespace: bad namespace {ns!r}")
    if opts.tls_secret is not None and not _DNS_NAME.match(opts.tls_secret):
        raise UserError(f"--tls-secret: bad Secret name {opts.tls_secret!r}")
    if not opts.model_path.startswith("/") or opts.model_path.rstrip("/") == "":
        raise UserError(f"--model-path: bad value {opts.model_path!r}; expected an absolute "
                        "directory inside the container, e.g. /models/llama-2-70b")
    kind, sep, where = opts.model_volume.partition(":")
    if not sep or kind not in ("pvc", "hostpath") or not where:
        raise UserError(f"--model-volume: bad value {opts.model_volume!r}; expected "
                        "pvc:CLAIM or hostpath:/DIR")
    if kind == "pvc" and not _DNS_NAME.match(where):
        raise UserError(f"--model-volume: bad claim name {where!r}; use [a-z0-9-.]")
    if kind == "hostpath" and not where.startswith("/"):
        raise UserError(f"--model-volume: bad host path {where!r}; expected an absolute path")
    for gpu, label in opts.gpu_products.items():
        check_label_value(label, f"--gpu-product {gpu}")
    if opts.dtype not in DTYPES:
        raise UserError(f"--dtype: bad value {opts.dtype!r}; known: {', '.join(DTYPES)}")
    if not _DNS_NAME.match(opts.cluster_domain):
        raise UserError(f"--cluster-domain: bad value {opts.cluster_domain!r}")
    if opts.startup_timeout_s < 10:
        raise UserError(f"--startup-timeout-s: bad value {opts.startup_timeout_s}; must be >= 10")
    if not re.match(r"^[0-9]+(Ki|Mi|Gi|Ti)?$", opts.shm_size):
        raise UserError(f"--shm-size: bad value {opts.shm_size!r}; expected e.g. 8Gi or 512Mi")
    if opts.region_label is not None and not re.match(
            r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", opts.region_label):
        raise UserError(f"--region-label: bad label key {opts.region_label!r}; "
                        "e.g. topology.kubernetes.io/region")


def _worker_dtype(gpu: str, opts: k8s.RenderOptions, bf16_tflops: float | None) -> str | None:
    if gpu == CPU_GPU:
        return None if opts.dtype == "auto" else opts.dtype
    if opts.dtype != "auto":
        return opts.dtype
    # T4 and V100 have no bfloat16 units: serve them in float16 (the catalog says 0 TFLOP/s).
    return "bfloat16" if (bf16_tflops is None or bf16_tflops > 0) else "float16"


def _check_against_cluster(placement: Placement, cluster: Any, placement_src: str) -> None:
    names = set(cluster.node_names())
    for i, n in enumerate(placement.nodes):
        if n.name not in names:
            known = ", ".join(cluster.node_names()[:20])
            raise UserError(
                f"{placement_src}: nodes[{i}].name: node {n.name!r} is not in cluster "
                f"{cluster.name!r} ({cluster.source}); known: {known}"
            )
    holders = {n.name for n in placement.nodes}
    for i, f in enumerate(placement.flows):
        for end in (f.src, f.dst):
            if end != COORDINATOR and end not in holders:
                raise UserError(
                    f"{placement_src}: flows[{i}]: node {end!r} holds no layers in this "
                    f"placement; known: coordinator, {', '.join(sorted(holders))}"
                )
    if placement.cluster != cluster.name:
        raise UserError(
            f"{placement_src}: cluster: placement was planned for cluster {placement.cluster!r}, "
            f"but {cluster.source} is cluster {cluster.name!r}"
        )
    if not placement.covers_all_layers():
        covered = [False] * placement.num_layers
        for n in placement.nodes:
            for layer in range(n.start_layer, n.end_layer):
                covered[layer] = True
        first = covered.index(False)
        raise UserError(
            f"{placement_src}: nodes: no node holds layer {first} of {placement.num_layers}; "
            "no route would cover the model"
        )


def _single_holders(placement: Placement) -> list[str]:
    """Nodes that alone hold some layer: losing one of them stops serving until it is back."""
    holders: dict[int, list[str]] = {}
    for n in placement.nodes:
        for layer in range(n.start_layer, n.end_layer):
            holders.setdefault(layer, []).append(n.name)
    return sorted({names[0] for names in holders.values() if len(names) == 1})


def rewrite_cluster(raw: dict[str, Any], addresses: dict[str, str]) -> dict[str, Any]:
    """The cluster document with each node's address set to its worker's DNS name.

    Nodes that hold no layers get no pod, so any address they had is dropped. Everything
    else (links, regions, comments aside) is kept as the user wrote it.
    """
    out = dict(raw)
    nodes = []
    for node in raw["nodes"]:
        node = dict(node)
        if node["name"] in addresses:
            node["address"] = addresses[node["name"]]
        else:
            node.pop("address", None)
        nodes.append(node)
    out["nodes"] = nodes
    return out


def render_k8s(cluster_path: str | Path, placement_path: str | Path,
               opts: k8s.RenderOptions) -> Rendering:
    """Check the inputs and render every manifest; raises UserError on bad input."""
    validate_options(opts)
    cluster = load_cluster(cluster_path)
    placement = load_placement(placement_path)
    _check_against_cluster(placement, cluster, str(placement_path))
    catalog = load_gpu_catalog()
    raw = yaml.load(Path(cluster_path).read_text(),
                    Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))

    workers: list[k8s.WorkerSpec] = []
    order = {name: i for i, name in enumerate(cluster.node_names())}
    # Cluster-file order: stable across re-plans, and the order a user reads the cluster in.
    for n in sorted(placement.nodes, key=lambda r: order[r.name]):
        node = cluster.node(n.name)
        name = k8s.worker_name(opts, node.name)
        if len(name) > _MAX_STATEFULSET_NAME:
            raise UserError(
                f"{cluster.source}: node {node.name!r}: StatefulSet name {name!r} is longer than "
                f"{_MAX_STATEFULSET_NAME} characters; use a shorter --name or node name"
            )
        check_label_value(node.gpu, f"{cluster.source}: node {node.name!r}: gpu")
        check_label_value(node.region, f"{cluster.source}: node {node.name!r}: region")
        gpu_spec = catalog.gpus.get(node.gpu)
        workers.append(k8s.WorkerSpec(
            node=node.name,
            gpu=node.gpu,
            num_gpus=node.num_gpus,
            region=node.region,
            start_layer=n.start_layer,
            end_layer=n.end_layer,
            gpu_product=None if node.gpu == CPU_GPU else gpu_product_label(
                node.gpu, opts.gpu_products),
            dtype=_worker_dtype(node.gpu, opts,
                                gpu_spec.bf16_dense_tflops if gpu_spec else None),
        ))
    holders = {w.node for w in workers}
    idle = [name for name in cluster.node_names() if name not in holders]

    cluster_yaml = dump_yaml(
        rewrite_cluster(raw, {w.node: k8s.worker_address(opts, w.node) for w in workers}),
        sort_keys=False, flow_leaves=True)
    # The solver's wall time is not part of the plan: without it, re-running the planner to
    # the same result re-renders byte for byte (and does not roll the coordinator).
    served = placement.to_dict()
    served.pop("solve_time_s", None)
    placement_json = json.dumps(served, indent=2) + "\n"
    config_sha256 = hashlib.sha256(
        (cluster_yaml + "\0" + placement_json).encode()).hexdigest()
    config_bytes = len(cluster_yaml.encode()) + len(placement_json.encode())
    if config_bytes > CONFIG_MAP_MAX_BYTES:
        raise UserError(f"{cluster.source}: cluster + placement are {config_bytes} bytes; a "
                        f"ConfigMap holds at most {CONFIG_MAP_MAX_BYTES}")

    # Reading order: config, workers, coordinator. (`kubectl apply -k` sorts by kind itself:
    # ConfigMap and Services first, so every pod starts with its config in place.)
    objects: list[tuple[str, dict[str, Any]]] = [
        ("configmap.yaml", k8s.config_map(opts, cluster_yaml, placement_json)),
        ("workers-service.yaml", k8s.headless_service(opts)),
        ("workers-pdb.yaml", k8s.worker_pdb(opts)),
    ]
    if opts.network_policy:
        objects.append(("workers-networkpolicy.yaml", worker_network_policy(opts)))
    objects += [(f"worker-{w.node}.yaml", k8s.worker_statefulset(opts, w)) for w in workers]
    objects += [
        ("coordinator-deployment.yaml",
         k8s.coordinator_deployment(opts, config_sha256, cluster.coordinator_region)),
        ("coordinator-service.yaml", k8s.api_service(opts)),
        ("coordinator-pdb.yaml", k8s.coordinator_pdb(opts)),
    ]
    if opts.network_policy:
        objects.append(("api-networkpolicy.yaml", api_network_policy(opts)))
    if opts.service_monitor:
        objects.append(("servicemonitor.yaml", k8s.service_monitor(opts)))

    files = {fname: f"{HEADER}\n{dump_yaml(obj)}" for fname, obj in objects}
    files[KUSTOMIZATION] = HEADER + "\n" + dump_yaml({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [fname for fname, _ in objects],
    }, sort_keys=False)

    warnings = []
    single = _single_holders(placement)
    if single:
        warnings.append(
            "no other node holds some of the layers of " + ", ".join(single)
            + ": while one of these pods is down, no route covers the model and requests fail"
        )
    if opts.tls_secret is None:
        warnings.append("--no-tls: worker traffic is plaintext and unauthenticated; only the "
                        "NetworkPolicy (if your cluster enforces one) keeps others out")
    if opts.allow_unauthenticated:
        warnings.append("--allow-unauthenticated: the API takes requests without a key from "
                        "any pod that reaches its Service" + (
                            " (the API NetworkPolicy admits this namespace's pods"
                            + (" and " + ", ".join(opts.api_namespaces) if opts.api_namespaces
                               else "") + ")" if opts.network_policy else
                            "; --no-network-policy: from any pod of the cluster"))
    return Rendering(files=files, workers=workers, idle_nodes=idle, warnings=warnings)


def write_manifests(rendering: Rendering, out_dir: str | Path) -> tuple[list[str], list[str]]:
    """Write the files; delete earlier rendered files that are gone now (a node that lost its
    layers). Returns (written, removed) file names. Files not written by the renderer are
    left alone."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        removed = []
        for old in sorted(out.glob("*.yaml")):
            if old.name in rendering.files:
                continue
            with old.open() as f:
                first = f.readline().rstrip("\n")
            if first == HEADER:
                old.unlink()
                removed.append(old.name)
        written = []
        for fname, text in rendering.files.items():
            path = out / fname
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                written.append(fname)
    except OSError as exc:
        raise UserError(f"--out: cannot write {out}: {exc.strerror}") from None
    return written, removed
