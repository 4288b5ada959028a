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


def _ingress_policy(opts: RenderOptions, name: str, component: str, sources: list[Obj],
                    port: int) -> Obj:
    """A NetworkPolicy letting `sources` reach `port` of the `component` pods, and nothing
    else in."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(opts, name, component),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(opts, component)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": [{"port": port, "protocol": "TCP"}]}],
        },
    }


def worker_network_policy(opts: RenderOptions) -> Obj:
    """Ingress to worker pods: the worker port, from the coordinator and workers only."""
    sources: list[Obj] = [
        {"podSelector": {"matchLabels": selector_labels(opts, "coordinator")}},
        {"podSelector": {"matchLabels": selector_labels(opts, "worker")}},
    ]
    return _ingress_policy(opts, headless_service_name(opts), "worker", sources, WORKER_PORT)


def api_network_policy(opts: RenderOptions) -> Obj:
    """Ingress to the coordinator: the API port, from this namespace and `api_namespaces`."""
    sources: list[Obj] = [{"podSelector": {}}]
    if opts.api_namespaces:
        sources.append({"namespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In",
            "values": sorted(opts.api_namespaces)}]}})
    return _ingress_policy(opts, api_service_name(opts), "coordinator", sources, HTTP_PORT)
