"""`helixserve deploy k8s`: render Kubernetes manifests for exactly one placement."""

from __future__ import annotations

import argparse
import sys

from helixserve.spec.scheduling import KV_ALLOCATIONS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "deploy",
        help="render deployment manifests (Kubernetes) from a placement",
        description="Render deployment manifests for a cluster file and a placement.",
    )
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    k = targets.add_parser(
        "k8s",
        help="Kubernetes: one worker StatefulSet per placement node + the coordinator",
        description="Render plain Kubernetes YAML (one file per object, plus a "
        "kustomization.yaml) for exactly this placement: one worker StatefulSet per node that "
        "holds layers, selected onto its GPU type, and the coordinator with the cluster file "
        "and placement in a ConfigMap. Apply with `kubectl apply -k OUT`. Re-rendering after "
        "a re-plan changes only what must change.",
    )
    k.add_argument("--cluster", required=True, help="cluster YAML the placement was planned for")
    k.add_argument("--placement", required=True, help="placement JSON (helixserve plan --out)")
    k.add_argument("--model-path", required=True,
                   help="model directory inside the containers, e.g. /models/llama-2-70b; the "
                   "model volume is mounted at its parent directory")
    k.add_argument("--image", required=True, help="helixserve image (deploy/docker/)")
    k.add_argument("--namespace", default="default", help="namespace of every object")
    k.add_argument("--out", required=True, help="output directory (created; stale rendered "
                   "files in it are removed)")
    k.add_argument("--name", default="helixserve",
                   help="instance name: prefix of every object (default helixserve)")
    k.add_argument("--model-volume", default="pvc:helixserve-models",
                   help="pvc:CLAIM (existing claim holding the model directories) or "
                   "hostpath:/DIR (directory on every node); default pvc:helixserve-models")
    k.add_argument("--gpu-product", action="append", default=[], metavar="GPU=LABEL",
                   help="nvidia.com/gpu.product value for a catalog GPU, e.g. "
                   "A100-40GB=NVIDIA-A100-PCIE-40GB (repeatable)")
    k.add_argument("--dtype", default="auto",
                   help="worker dtype: auto (bfloat16, or float16 on GPUs without bf16), "
                   "bfloat16, float16, float32")
    k.add_argument("--region-label", default=None, metavar="KEY",
                   help="pin each worker to nodes whose label KEY equals its cluster region, "
                   "e.g. topology.kubernetes.io/region")
    k.add_argument("--coordinator-image", default=None,
                   help="image of the coordinator if not --image (e.g. the CPU image)")
    api = k.add_mutually_exclusive_group()
    api.add_argument("--api-key-secret", default=None, metavar="SECRET",
                     help="Secret whose key `api-key` the API requires as a Bearer token "
                     "(this or --allow-unauthenticated is required)")
    api.add_argument("--allow-unauthenticated", action="store_true",
                     help="serve the API without a key to every pod its NetworkPolicy admits")
    k.add_argument("--api-from-namespace", action="append", default=[], metavar="NS",
                   help="also admit pods of namespace NS to the API port (e.g. an ingress "
                   "controller's; repeatable); by default only the deployment's namespace")
    k.add_argument("--tls-secret", default="helixserve-tls", metavar="SECRET",
                   help="Secret with ca.crt, coordinator.crt/.key and <node>.crt/.key "
                   "(helixserve certs create; docs/security.md); default helixserve-tls")
    k.add_argument("--no-tls", action="store_true",
                   help="plaintext, unauthenticated worker traffic (no Secret needed)")
    k.add_argument("--no-network-policy", action="store_true",
                   help="do not render the NetworkPolicies that confine worker and API ports")
    k.add_argument("--service-monitor", action="store_true",
                   help="also render a Prometheus operator ServiceMonitor for /metrics")
    k.add_argument("--startup-timeout-s", type=int, default=1800,
                   help="time a pod may take to load weights before it is restarted")
    k.add_argument("--shm-size", default="8Gi", help="size of the memory-backed /dev/shm")
    k.add_argument("--cluster-domain", default="cluster.local")
    k.add_argument("--kv-allocation", choices=KV_ALLOCATIONS, default="on-demand",
                   help="the coordinator's KV accounting (helixserve serve --kv-allocation)")
    k.add_argument("--engine", choices=("torch", "vllm", "auto"), default="auto",
                   help="every worker's engine (helixserve worker --engine); vllm needs an "
                   "image built with the vllm extra (docs/vllm.md); default auto")
    k.set_defaults(func=run)


def _check_gpu_products(overrides: dict[str, str], cluster_path: str) -> None:
    """An override for a GPU no node of the cluster has is a typo (`A100-40G`) that would
    leave the default label on the real one, and its pods Pending: UserError naming it."""
    from helixserve.errors import UserError
    from helixserve.spec import load_cluster

    if not overrides:
        return
    cluster = load_cluster(cluster_path)
    gpus = sorted({n.gpu for n in cluster.nodes})
    for name in overrides:
        if name not in gpus:
            raise UserError(f"--gpu-product {name}={overrides[name]}: no node of {cluster_path} "
                            f"has GPU {name!r}; its GPUs: {', '.join(gpus)}")


def run(args: argparse.Namespace) -> int:
    from helixserve.commands.args import check_output
    from helixserve.deploy import (
        RenderOptions,
        parse_gpu_product_overrides,
        render_k8s,
        write_manifests,
    )
    from helixserve.deploy.k8s import worker_address

    check_output("--out", args.out, directory=True)  # before rendering: fails at once
    gpu_products = parse_gpu_product_overrides(args.gpu_product)
    _check_gpu_products(gpu_products, args.cluster)
    opts = RenderOptions(
        image=args.image,
        model_path=args.model_path,
        namespace=args.namespace,
        name=args.name,
        model_volume=args.model_volume,
        gpu_products=gpu_products,
        dtype=args.dtype,
        cluster_domain=args.cluster_domain,
        startup_timeout_s=args.startup_timeout_s,
        shm_size=args.shm_size,
        region_label=args.region_label,
        service_monitor=args.service_monitor,
        coordinator_image=args.coordinator_image,
        api_key_secret=args.api_key_secret,
        allow_unauthenticated=args.allow_unauthenticated,
        api_namespaces=tuple(args.api_from_namespace),
        kv_allocation=args.kv_allocation,
        tls_secret=None if args.no_tls else args.tls_secret,
        network_policy=not args.no_network_policy,
        engine=args.engine,
    )
    rendering = render_k8s(args.cluster, args.placement, opts)
    written, removed = write_manifests(rendering, args.out)

    print(f"{'node':<12} {'gpu':<12} {'gpus':>4} {'layers':<11} {'gpu.product':<24} address")
    for w in rendering.workers:
        layers = f"[{w.start_layer}, {w.end_layer})"
        print(f"{w.node:<12} {w.gpu:<12} {w.num_gpus:>4} {layers:<11} "
              f"{w.gpu_product or '-':<24} {worker_address(opts, w.node)}")
    if rendering.idle_nodes:
        print(f"no pod for nodes without layers: {', '.join(rendering.idle_nodes)}")
    print(f"{args.out}: {len(rendering.files)} files, {len(written)} changed"
          + (f" ({', '.join(written)})" if written else "")
          + (f", {len(removed)} removed ({', '.join(removed)})" if removed else ""))
    if opts.tls_secret is not None:
        nodes = ",".join(w.node for w in rendering.workers)
        # one certificate per worker naming its own pod's DNS name only (no wildcard: a
        # worker's certificate must not let it pose as another)
        hosts = ",".join(f"{w.node}={worker_address(opts, w.node).rpartition(':')[0]}"
                         for w in rendering.workers)
        print(f"TLS: create the Secret {opts.tls_secret} first (docs/security.md):\n"
              f"  helixserve certs create --out certs --nodes {nodes} \\\n"
              f"      --hosts {hosts}\n"
              f"  kubectl -n {opts.namespace} create secret generic {opts.tls_secret} "
              "--from-file=certs/ca.crt --from-file=certs/coordinator.crt "
              "--from-file=certs/coordinator.key "
              + " ".join(f"--from-file=certs/{w.node}.crt --from-file=certs/{w.node}.key"
                         for w in rendering.workers))
    if opts.api_key_secret is not None:
        print(f"API key: create the Secret {opts.api_key_secret} (clients send "
              "'Authorization: Bearer $KEY'):\n"
              f"  kubectl -n {opts.namespace} create secret generic {opts.api_key_secret} "
              '--from-literal=api-key="$KEY"')
    print(f"apply: kubectl apply -k {args.out}")
    for warning in rendering.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0
