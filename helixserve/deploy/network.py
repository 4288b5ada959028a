"""The NetworkPolicies (rendered unless `RenderOptions.network_policy` is off).

Worker ports admit only the coordinator and the other workers (their next hops): nothing else
in the cluster reaches a worker, before TLS is even checked. The API port admits pods of the
deployment's namespace and of the namespaces named in `api_namespaces` (an ingress
controller's, a client application's) only. Needs a network plugin that enforces
NetworkPolicy (Calico, Cilium, ...); elsewhere the objects are inert. Kubelet probes come
from the node, which these plugins admit by default.
"""

from __future__ import annotations

from helixserve.deploy.k8s import (
    HTTP_PORT,
    WORKER_PORT,
    Obj,
    RenderOptions,
    api_service_name,
    headless_service_name,
    metadata,
    selector_labels,
)


def worker_network_policy(opts: RenderOptions) -> Obj:
    """Ingress to worker pods: the worker port, from the coordinator and workers only."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(opts, headless_service_name(opts), "worker"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(opts, "worker")},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [
                    {"podSelector": {"matchLabels": selector_labels(opts, "coordinator")}},
                    {"podSelector": {"matchLabels": selector_labels(opts, "worker")}},
                ],
                "ports": [{"port": WORKER_PORT, "protocol": "TCP"}],
            }],
        },
    }


def api_network_policy(opts: RenderOptions) -> Obj:
    """Ingress to the coordinator: the API port, from this namespace and `api_namespaces`."""
    sources: list[Obj] = [{"podSelector": {}}]
    if opts.api_namespaces:
        sources.append({"namespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In",
            "values": sorted(opts.api_namespaces)}]}})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(opts, api_service_name(opts), "coordinator"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(opts, "coordinator")},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": [{"port": HTTP_PORT, "protocol": "TCP"}]}],
        },
    }
