"""The NetworkPolicy of the worker pods (rendered unless `RenderOptions.network_policy` is off).

Worker ports admit only the coordinator and the other workers (their next hops): nothing else
in the cluster reaches a worker, before TLS is even checked. Needs a network plugin that
enforces NetworkPolicy (Calico, Cilium, ...); elsewhere the object is inert.
"""

from __future__ import annotations

from helixserve.deploy.k8s import (
    WORKER_PORT,
    Obj,
    RenderOptions,
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
