"""`helixserve certs create`: a development CA and mutual-TLS certificates for a cluster.

    helixserve certs create --out certs --nodes n1,n2 [--hosts n1=w1.example.org,n2=10.0.0.5]
    helixserve certs create --out certs --cluster cluster.yaml

Writes `ca.crt`/`ca.key`, `coordinator.crt/.key` (role coordinator, client only) and
`<node>.crt/.key` per node (role worker of that node); a node's certificate names 127.0.0.1,
localhost, the node and its own hosts only: its `--hosts NODE=HOST` entries and, with
`--cluster`, its address's host. No wildcards (runtime/security.py). Then:

    helixserve worker ... --tls-cert certs/n1.crt --tls-key certs/n1.key --tls-ca certs/ca.crt
    helixserve serve  ... --tls-cert certs/coordinator.crt --tls-key certs/coordinator.key \\
                          --tls-ca certs/ca.crt

`helixserve certs check --address HOST:PORT --tls-...` health-checks a worker over mutual TLS
(the Kubernetes probe of TLS workers). Also `add_tls_arguments`/`tls_from_args`: the --tls-* flags of worker, serve and demo.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from helixserve.errors import UserError


def add_tls_arguments(p: argparse.ArgumentParser, local_default: bool = False) -> None:
    """--tls-cert/--tls-key/--tls-ca; with `local_default` (stacks that start their own
    workers) also --insecure, since dev credentials are generated when none are given."""
    g = p.add_argument_group("mutual TLS for worker traffic (see docs/security.md)")
    g.add_argument("--tls-cert", default=None, help="this process's certificate (PEM)")
    g.add_argument("--tls-key", default=None, help="its private key (PEM, unencrypted)")
    g.add_argument("--tls-ca", default=None, help="CA certificate that signed every peer's (PEM)")
    if local_default:
        g.add_argument("--insecure", action="store_true",
                       help="plaintext worker traffic, no authentication (debugging only); by "
                       "default dev credentials are generated and every worker port needs them")


def tls_from_args(args: argparse.Namespace) -> Any:
    """The TlsConfig the --tls-* flags name, or None (plaintext); a UserError naming the flag
    and file for a missing, unreadable, non-PEM or mismatched one."""
    from helixserve.runtime.security import tls_from_flags

    tls = tls_from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    if tls is not None and getattr(args, "insecure", False):
        raise UserError("--insecure: cannot be combined with --tls-cert/--tls-key/--tls-ca")
    return tls


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "certs",
        help="create a development CA and mutual-TLS certificates for workers and coordinator",
        description="Create a CA and certificates for the coordinator and each worker node.",
    )
    sub = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    c = sub.add_parser("create", help="write ca.crt, coordinator.crt and <node>.crt (+ keys)")
    c.add_argument("--out", required=True, type=Path, help="output directory")
    c.add_argument("--nodes", default=None, help="comma-separated worker node names")
    c.add_argument("--cluster", type=Path, default=None,
                   help="cluster YAML: one certificate per node, naming its address's host")
    c.add_argument("--hosts", default="",
                   help="comma-separated NODE=HOST: a DNS name or IP that node's certificate "
                   "names (one node's only; no wildcards)")
    c.add_argument("--force", action="store_true", help="overwrite existing files in --out")
    c.set_defaults(func=run_create)
    k = sub.add_parser("check", help="health-check a worker over mutual TLS (exit 0 = SERVING)",
                       description="Call grpc.health.v1 Check on a worker with these "
                       "credentials: the Kubernetes probe of TLS workers, and a test that a "
                       "certificate is accepted.")
    k.add_argument("--address", required=True, help="worker HOST:PORT")
    k.add_argument("--timeout-s", type=float, default=4.0)
    add_tls_arguments(k)
    k.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from helixserve.runtime.security import sync_channel

    tls = tls_from_args(args)
    with sync_channel(args.address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout_s)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def run_create(args: argparse.Namespace) -> int:
    from helixserve.commands.args import check_output

    nodes = _split(args.nodes)
    node_hosts: dict[str, list[str]] = {}
    for entry in _split(args.hosts):
        node, sep, host = entry.partition("=")
        if not sep or not node or not host:
            raise UserError(f"--hosts: {entry!r}: give NODE=HOST (each worker certificate "
                            "names only its own node's host)")
        node_hosts.setdefault(node, []).append(host)
    if args.cluster is not None:
        from helixserve.spec import load_cluster

        cluster = load_cluster(args.cluster)
        for n in cluster.nodes:
            nodes.append(n.name)
            if n.address:
                host = str(n.address).rpartition(":")[0] or str(n.address)
                node_hosts.setdefault(n.name, []).append(host.strip("[]"))
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        raise UserError("certs create: no nodes; give --nodes n1,n2,... or --cluster FILE")
    out = check_output("--out", args.out, directory=True)
    if (out / "ca.key").exists() and not args.force:
        raise UserError(f"--out {out}: already holds ca.key; pass --force to replace the CA")
    try:
        from helixserve.runtime.security import create_dev_credentials
    except ImportError:  # pragma: no cover - cryptography comes with the serve extra
        raise UserError("certs create: needs the 'cryptography' package "
                        "(pip install 'helixserve[serve]')") from None
    creds = create_dev_credentials(out, nodes, node_hosts=node_hosts)
    print(f"wrote a CA and {len(creds.nodes) + 1} certificates to {out}:")
    print(f"  CA           {creds.ca_path}  (keep {out / 'ca.key'} private)")
    print(f"  coordinator  {creds.coordinator.cert_path}  (role coordinator, client only)")
    for name, cfg in creds.nodes.items():
        names = ", ".join([name, "127.0.0.1", "localhost", *node_hosts.get(name, [])])
        print(f"  {name:<12} {cfg.cert_path}  (role worker {name}; names {names})")
    return 0
