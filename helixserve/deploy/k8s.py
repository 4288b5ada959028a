"""Kubernetes objects for one placement, as plain dicts (one function per object).

Shape of a deployment named NAME in namespace NS:

    NAME-config       ConfigMap: cluster.yaml (addresses rewritten to worker DNS names)
                      and placement.json, mounted read-only at /etc/helixserve
    NAME-coordinator  Deployment, 1 replica: `helixserve serve`, HTTP 8000
    NAME-api          Service (ClusterIP) in front of the coordinator: the OpenAI endpoint
    NAME-workers      headless Service: gives every worker pod a stable DNS name
    NAME-worker-NODE  StatefulSet, 1 replica, per placement node: `helixserve worker --node NODE`
                      on a `nvidia.com/gpu.product` node with `nvidia.com/gpu: num_gpus`
    NAME-workers      PodDisruptionBudget over the workers: one voluntary eviction at a time
    NAME-coordinator  PodDisruptionBudget: a drain never evicts the only coordinator unasked
    NAME-workers      NetworkPolicy: only the coordinator and peer workers reach worker ports
    NAME-api          NetworkPolicy: the API port only from this namespace (+ --api-from-namespace)
    NAME              ServiceMonitor (optional; needs the Prometheus operator CRDs)

A worker is a one-replica StatefulSet (not a Deployment) for its stable identity: the pod is
always `NAME-worker-NODE-0`, so its DNS name, which the coordinator reads from the cluster
file, survives restarts and reschedules. Selectors carry only identity labels (never the
layer range): a selector is immutable, and a re-plan must be a plain `kubectl apply`.
Nothing here reads files or clocks: same inputs, same objects.

Worker traffic is mutual TLS unless `tls_secret` is None: every pod mounts its own
certificate from that Secret (`helixserve certs create` writes exactly its keys: ca.crt,
coordinator.crt/.key, <node>.crt/.key; docs/security.md), workers forward only to the
placement's nodes (`--cluster`), and probe their TLS-only port with `helixserve certs check`
(the kubelet's native gRPC probe speaks plaintext only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from helixserve.deploy.gpu_labels import GPU_RESOURCE, PRODUCT_LABEL

WORKER_PORT = 50051
HTTP_PORT = 8000
CONFIG_DIR = "/etc/helixserve"
CLUSTER_FILE = "cluster.yaml"
PLACEMENT_FILE = "placement.json"
#: where a pod's TLS files from the Secret are mounted
TLS_DIR = "/etc/helixserve-tls"
#: uid/gid of the `helix` user the images in deploy/docker create.
RUN_AS_UID = 10001

Obj = dict[str, Any]


@dataclass(frozen=True)
class RenderOptions:
    """Everything about the deployment that is not in the cluster file or the placement."""

    #: container image holding helixserve (both the coordinator and the workers)
    image: str
    #: model directory inside the containers, e.g. /models/llama-2-70b; its parent directory
    #: is where the model volume is mounted
    model_path: str
    namespace: str = "default"
    #: instance name: prefix of every object and the app.kubernetes.io/instance label
    name: str = "helixserve"
    #: "pvc:CLAIM" (an existing PersistentVolumeClaim) or "hostpath:/DIR" (a directory present
    #: on every GPU node)
    model_volume: str = "pvc:helixserve-models"
    #: catalog GPU name -> nvidia.com/gpu.product label, overriding gpu_labels' defaults
    gpu_products: dict[str, str] = field(default_factory=dict)
    #: "auto" (bfloat16 where the GPU has it, else float16), or a dtype passed to every GPU worker
    dtype: str = "auto"
    cluster_domain: str = "cluster.local"
    #: time a pod may take to load its weights before its startup probe gives up
    startup_timeout_s: int = 1800
    #: size limit of the memory-backed /dev/shm volume (counts against the pod's memory)
    shm_size: str = "8Gi"
    #: node label that holds a machine's region; when set, every worker (and the coordinator)
    #: whose cluster node has a region other than "default" is pinned to nodes with that label
    region_label: str | None = None
    #: also render a Prometheus operator ServiceMonitor for the coordinator's /metrics
    service_monitor: bool = False
    image_pull_policy: str = "IfNotPresent"
    #: image of the coordinator when it differs from the workers' (e.g. the CPU image)
    coordinator_image: str | None = None
    #: Secret whose key `api-key` becomes HELIXSERVE_API_KEY of the coordinator (Bearer auth)
    api_key_secret: str | None = None
    #: serve the API without a key (`serve --allow-unauthenticated`); one of this and
    #: `api_key_secret` must be chosen explicitly (render.validate_options)
    allow_unauthenticated: bool = False
    #: namespaces (besides the deployment's own) whose pods may reach the API port, e.g. an
    #: ingress controller's; the API NetworkPolicy admits nothing else
    api_namespaces: tuple[str, ...] = ()
    #: the coordinator's `--kv-allocation` (reserve | on-demand; docs/runtime.md)
    kv_allocation: str = "on-demand"
    #: Secret holding ca.crt, coordinator.crt/.key and <node>.crt/.key for every worker
    #: (`helixserve certs create`); None = plaintext, unauthenticated worker traffic
    tls_secret: str | None = "helixserve-tls"
    #: render a NetworkPolicy that admits only the coordinator and workers to worker ports
    network_policy: bool = True
    #: every worker's `--engine` (torch | vllm | auto); "auto" renders no flag (the worker's
    #: default: vllm where the image has it and the pod a GPU). vllm needs an image built
    #: with the vllm extra (docs/vllm.md)
    engine: str = "auto"


@dataclass(frozen=True)
class WorkerSpec:
    """One worker pod: a cluster node that holds layers [start_layer, end_layer)."""

    node: str
    gpu: str
    num_gpus: int
    region: str
    start_layer: int
    end_layer: int
    #: nvidia.com/gpu.product value; None for a CPU node
    gpu_product: str | None
    #: --dtype passed to the worker; None leaves the worker's default
    dtype: str | None


# ---- names -------------------------------------------------------------------------------


def config_map_name(opts: RenderOptions) -> str:
    return f"{opts.name}-config"


def headless_service_name(opts: RenderOptions) -> str:
    return f"{opts.name}-workers"


def worker_name(opts: RenderOptions, node: str) -> str:
    return f"{opts.name}-worker-{node}"


def coordinator_name(opts: RenderOptions) -> str:
    return f"{opts.name}-coordinator"


def api_service_name(opts: RenderOptions) -> str:
    return f"{opts.name}-api"


def worker_address(opts: RenderOptions, node: str) -> str:
    """Stable DNS name of a worker: pod 0 of its StatefulSet under the headless Service."""
    return (
        f"{worker_name(opts, node)}-0.{headless_service_name(opts)}.{opts.namespace}"
        f".svc.{opts.cluster_domain}:{WORKER_PORT}"
    )


def model_mount_dir(opts: RenderOptions) -> str:
    parent = opts.model_path.rstrip("/").rsplit("/", 1)[0]
    return parent or "/"


# ---- shared pieces -------------------------------------------------------------------------


def base_labels(opts: RenderOptions, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "helixserve",
        "app.kubernetes.io/instance": opts.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "helixserve",
    }


def selector_labels(opts: RenderOptions, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "helixserve",
        "app.kubernetes.io/instance": opts.name,
        "app.kubernetes.io/component": component,
    }


def metadata(opts: RenderOptions, name: str, component: str, **extra: Any) -> Obj:
    meta: Obj = {"name": name, "namespace": opts.namespace, "labels": base_labels(opts, component)}
    meta.update(extra)
    return meta


def _model_volume(opts: RenderOptions) -> Obj:
    kind, _, where = opts.model_volume.partition(":")
    if kind == "pvc":
        return {"name": "models", "persistentVolumeClaim": {"claimName": where, "readOnly": True}}
    return {"name": "models", "hostPath": {"path": where, "type": "Directory"}}


def _volumes(opts: RenderOptions, with_shm: bool) -> list[Obj]:
    volumes: list[Obj] = [
        {
            "name": "config",
            "configMap": {
                "name": config_map_name(opts),
                "items": [
                    {"key": CLUSTER_FILE, "path": CLUSTER_FILE},
                    {"key": PLACEMENT_FILE, "path": PLACEMENT_FILE},
                ],
            },
        },
        _model_volume(opts),
    ]
    if with_shm:
        # PyTorch and NCCL use /dev/shm for inter-process buffers; the container runtime's
        # default is 64 MiB, far too small for tensor parallelism inside a node.
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}})
    return volumes


def _tls_volume(opts: RenderOptions, identity: str) -> Obj:
    """This pod's own certificate and key (as tls.crt/tls.key) and the CA, from the Secret;
    nothing of the other pods'."""
    return {"name": "tls", "secret": {"secretName": opts.tls_secret, "items": [
        {"key": "ca.crt", "path": "ca.crt"},
        {"key": f"{identity}.crt", "path": "tls.crt"},
        {"key": f"{identity}.key", "path": "tls.key"},
    ]}}


def _tls_flags(opts: RenderOptions) -> list[str]:
    if opts.tls_secret is None:
        return []
    return ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key",
            "--tls-ca", f"{TLS_DIR}/ca.crt"]


def _mounts(opts: RenderOptions, with_shm: bool) -> list[Obj]:
    mounts: list[Obj] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "models", "mountPath": model_mount_dir(opts), "readOnly": True},
    ]
    if opts.tls_secret is not None:
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    if with_shm:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return mounts


def _env() -> list[Obj]:
    # Weights come from the model volume only: never let a pod reach for a model hub.
    return [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
    ]


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_security() -> Obj:
    # No fsGroup: the pods only read the model volume, and an fsGroup would make the kubelet
    # walk (and chown) the whole model tree on every mount of a block-backed claim.
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _probes(opts: RenderOptions, action: Obj, liveness: Obj | None = None) -> Obj:
    """Startup probe that waits for the weights to load, then readiness and liveness.

    `liveness` (default: `action`) lets a pod whose readiness depends on others (the
    coordinator is unready while some layers have no live worker) be probed for its own
    responsiveness only, so a worker outage does not restart it too."""
    startup_period_s = 10
    return {
        "startupProbe": {
            **action,
            "periodSeconds": startup_period_s,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(opts.startup_timeout_s / startup_period_s)),
        },
        "readinessProbe": {**action, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        # Liveness is slower to give up than readiness: a busy pod drops out of service first
        # and is only restarted when it stays unresponsive for a minute.
        "livenessProbe": {
            **(liveness or action),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


# ---- objects -------------------------------------------------------------------------------


def config_map(opts: RenderOptions, cluster_yaml: str, placement_json: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(opts, config_map_name(opts), "config"),
        "data": {CLUSTER_FILE: cluster_yaml, PLACEMENT_FILE: placement_json},
    }


def worker_statefulset(opts: RenderOptions, w: WorkerSpec) -> Obj:
    name = worker_name(opts, w.node)
    identity = {**selector_labels(opts, "worker"), "helixserve.io/node": w.node}
    labels = {
        **base_labels(opts, "worker"),
        "helixserve.io/node": w.node,
        "helixserve.io/gpu": w.gpu,
        "helixserve.io/num-gpus": str(w.num_gpus),
        "helixserve.io/region": w.region,
        "helixserve.io/start-layer": str(w.start_layer),
        "helixserve.io/end-layer": str(w.end_layer),
    }
    annotations = {
        "helixserve.io/layers": f"[{w.start_layer}, {w.end_layer})",
        "helixserve.io/address": worker_address(opts, w.node),
    }
    command = [
        "helixserve", "worker",
        "--model", opts.model_path,
        "--placement", f"{CONFIG_DIR}/{PLACEMENT_FILE}",
        "--node", w.node,
        "--cluster", f"{CONFIG_DIR}/{CLUSTER_FILE}",
        "--host", "0.0.0.0",
        "--port", str(WORKER_PORT),
        "--device", "cpu" if w.gpu_product is None else "cuda",
    ]  # fmt: skip
    if w.dtype is not None:
        command += ["--dtype", w.dtype]
    # without TLS the worker binds 0.0.0.0 in plaintext only when told so explicitly
    command += _tls_flags(opts) or ["--insecure"]
    # Native gRPC probes (Kubernetes >= 1.27) call grpc.health.v1 Check on the worker's own
    # port, in plaintext; a TLS-only worker is probed by the same Check over mutual TLS.
    probe: Obj = {"grpc": {"port": WORKER_PORT}}
    if opts.tls_secret is not None:
        probe = {"exec": {"command": ["helixserve", "certs", "check",
                                      "--address", f"127.0.0.1:{WORKER_PORT}",
                                      *_tls_flags(opts)]}}
    if opts.engine != "auto":
        command += ["--engine", opts.engine]
    container: Obj = {
        "name": "worker",
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "command": command,
        "env": _env(),
        "ports": [{"name": "grpc", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        # the worker reports SERVING once its layers are loaded
        **_probes(opts, probe),
        "volumeMounts": _mounts(opts, with_shm=True),
        "securityContext": _container_security(),
    }
    pod_spec: Obj = {
        # The plan gives every node its own NIC and links: prefer one worker per machine.
        # Preferred, not required, so a cluster with fewer machines still schedules them all.
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {"matchLabels": selector_labels(opts, "worker")},
                "topologyKey": "kubernetes.io/hostname",
            },
        }]}},
        "containers": [container],
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        # Long enough for the worker's SIGTERM drain of in-flight batches.
        "terminationGracePeriodSeconds": 60,
        "volumes": _volumes(opts, with_shm=True),
    }
    if opts.tls_secret is not None:
        pod_spec["volumes"].append(_tls_volume(opts, w.node))
    node_selector: dict[str, str] = {}
    if w.gpu_product is not None:
        node_selector[PRODUCT_LABEL] = w.gpu_product
        container["resources"] = {
            "limits": {GPU_RESOURCE: w.num_gpus},
            "requests": {GPU_RESOURCE: w.num_gpus},
        }
        # GPU node pools are commonly tainted so that only GPU pods land there.
        pod_spec["tolerations"] = [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ]
    if opts.region_label and w.region != "default":
        node_selector[opts.region_label] = w.region
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(opts, name, "worker", annotations=annotations),
        "spec": {
            "serviceName": headless_service_name(opts),
            "replicas": 1,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": identity},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def headless_service(opts: RenderOptions) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(opts, headless_service_name(opts), "worker"),
        "spec": {
            "clusterIP": "None",
            # DNS names exist as soon as a pod has an IP, not only when it is ready: the
            # coordinator tracks worker health itself and must be able to dial a starting pod.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(opts, "worker"),
            "ports": [{"name": "grpc", "port": WORKER_PORT, "targetPort": "grpc", "protocol": "TCP"}],
        },
    }


def coordinator_deployment(
    opts: RenderOptions, config_sha256: str, coordinator_region: str | None
) -> Obj:
    name = coordinator_name(opts)
    command = [
        "helixserve", "serve",
        "--cluster", f"{CONFIG_DIR}/{CLUSTER_FILE}",
        "--placement", f"{CONFIG_DIR}/{PLACEMENT_FILE}",
        "--model", opts.model_path,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--kv-allocation", opts.kv_allocation,
        *_tls_flags(opts),
    ]  # fmt: skip
    if opts.allow_unauthenticated:
        # Chosen explicitly (render.validate_options): the API then takes requests from every
        # pod its NetworkPolicy admits.
        command.append("--allow-unauthenticated")
    env = _env()
    if opts.api_key_secret:
        env.insert(0, {
            "name": "HELIXSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": opts.api_key_secret, "key": "api-key"}},
        })
    container: Obj = {
        "name": "coordinator",
        "image": opts.coordinator_image or opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "command": command,
        "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        # Ready = the process serves HTTP (/ready). Not /health: it is 503 while a layer has
        # no live worker, and with one replica the Service would then have no endpoint, so
        # clients would get connection errors instead of the documented wait or a 503 with
        # Retry-After. /health's detail stays for monitoring.
        **_probes(opts, {"httpGet": {"path": "/ready", "port": "http"}}),
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
        "volumeMounts": _mounts(opts, with_shm=False),
        "securityContext": _container_security(),
    }
    pod_spec: Obj = {
        "containers": [container],
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": 60,
        "volumes": _volumes(opts, with_shm=False),
    }
    if opts.tls_secret is not None:
        pod_spec["volumes"].append(_tls_volume(opts, "coordinator"))
    if opts.region_label and coordinator_region and coordinator_region != "default":
        pod_spec["nodeSelector"] = {opts.region_label: coordinator_region}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(opts, name, "coordinator"),
        "spec": {
            # One coordinator: it owns the routing state (KV bookkeeping of every request).
            "replicas": 1,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "selector": {"matchLabels": selector_labels(opts, "coordinator")},
            "template": {
                "metadata": {
                    "labels": base_labels(opts, "coordinator"),
                    # The coordinator reads cluster + placement at start; a new config (a
                    # re-plan) must roll it, so the pod template carries the config's hash.
                    "annotations": {"helixserve.io/config-sha256": config_sha256},
                },
                "spec": pod_spec,
            },
        },
    }


def api_service(opts: RenderOptions) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(opts, api_service_name(opts), "coordinator"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(opts, "coordinator"),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def worker_pdb(opts: RenderOptions) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(opts, headless_service_name(opts), "worker"),
        "spec": {
            # A drain evicts one worker at a time; the coordinator re-routes around it.
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(opts, "worker")},
        },
    }


def coordinator_pdb(opts: RenderOptions) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(opts, coordinator_name(opts), "coordinator"),
        "spec": {
            # One coordinator holds every request's state: a node drain waits (for an operator
            # to move it, e.g. `kubectl rollout restart`, which surges a new pod first) rather
            # than evicting it and dropping the API.
            "minAvailable": 1,
            "selector": {"matchLabels": selector_labels(opts, "coordinator")},
        },
    }


def service_monitor(opts: RenderOptions) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(opts, opts.name, "coordinator"),
        "spec": {
            "selector": {"matchLabels": selector_labels(opts, "coordinator")},
            "namespaceSelector": {"matchNames": [opts.namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
