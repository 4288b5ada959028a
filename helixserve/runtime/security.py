"""Who may talk to a worker: TLS credentials, dev certificates, coordinator identities.

Worker traffic (coordinator -> worker, worker -> next hop, Info/Release/health) is mutual TLS
when credentials are configured: every side presents a certificate signed by the cluster's CA
and checks the other's. A worker with TLS opens only a secure port, so a client without a
certificate from that CA is refused at the handshake.

Roles come from the certificate, never from what a message claims. Every certificate the
CA signs carries exactly one identity as a subject-alternative-name URI:

    helixserve://coordinator        the coordinator: clientAuth only (it never serves)
    helixserve://worker/<node>      the worker of placement node <node>: serverAuth and
                                    clientAuth (it dials its next hops); DNS/IP names only of
                                    that node's own host

A worker reads the peer's certificate from the TLS session (`peer_identity`) and allows
`LoadRange`, `Release`, a coordinator stream and first-hop items only from a coordinator
certificate, and items at hop >= 1 only from the worker certificate of the route's previous
hop (runtime/worker.py, Trust). A certificate of the CA with no such URI has no role: it
passes the handshake and may call nothing but Info and health.

Coordinator id on the wire: a coordinator draws a random secret token and names itself
`coord-<first 32 hex of sha256(token)>`; it sends the token in its stream hello and in
Release. A worker checks that the token hashes to the id, so one coordinator cannot take
over another's results or requests. Anyone can mint such a pair: with TLS it only names
results, authority comes from the certificate; without TLS (`--insecure`, loopback only) the
token pair is all there is, which is why plaintext is development-only.

`OwnedMemory` is what a worker remembers per request (released ids, kept routes): bounded,
and filled by one coordinator without pushing out what another coordinator needs.

`create_dev_credentials` makes a CA, one certificate per worker node and one for the
coordinator, for local stacks and tests; `helixserve certs create` calls it. Imports
neither torch nor grpc at module level.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from helixserve.errors import UserError

#: length of the hash part of a coordinator id, in hex digits (128 bits: no feasible preimage)
COORDINATOR_ID_HEX = 32
#: the coordinator's certificate name in dev credentials
COORDINATOR_NAME = "coordinator"
#: validity of dev certificates
DEV_CERT_DAYS = 365
#: scheme of the identity URIs in certificates (module doc)
IDENTITY_SCHEME = "helixserve"
ROLE_COORDINATOR = "coordinator"
ROLE_WORKER = "worker"

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def coordinator_uri() -> str:
    return f"{IDENTITY_SCHEME}://{ROLE_COORDINATOR}"


def worker_uri(node: str) -> str:
    return f"{IDENTITY_SCHEME}://{ROLE_WORKER}/{node}"


# ---- identity from a certificate ------------------------------------------------------------


@dataclass(frozen=True)
class PeerIdentity:
    """Who a TLS peer is, by its certificate (module doc). `role` "" = no helixserve role."""

    role: str
    #: a worker's node name ("" for the coordinator)
    node: str = ""
    #: why the certificate has no role ("" when it has one)
    problem: str = ""

    @property
    def is_coordinator(self) -> bool:
        return self.role == ROLE_COORDINATOR

    def is_worker(self, node: str) -> bool:
        return self.role == ROLE_WORKER and self.node == node

    def describe(self) -> str:
        if self.role == ROLE_WORKER:
            return f"the worker certificate of node {self.node!r}"
        if self.role == ROLE_COORDINATOR:
            return "a coordinator certificate"
        return f"a certificate with no helixserve role ({self.problem})"


@functools.lru_cache(maxsize=1024)
def identity_of_cert(cert_pem: bytes) -> PeerIdentity:
    """The role a PEM certificate carries: its one `helixserve://` SAN URI, checked against
    its extended key usage (a coordinator certificate must not be a server's)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        return PeerIdentity("", problem=f"unparsable: {exc}")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                if u.startswith(f"{IDENTITY_SCHEME}://")]
    except x509.ExtensionNotFound:
        uris = []
    try:
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = set()
    if len(uris) != 1:
        return PeerIdentity("", problem=f"{len(uris)} {IDENTITY_SCHEME}:// URIs, need one")
    uri = uris[0]
    if uri == coordinator_uri():
        if ExtendedKeyUsageOID.SERVER_AUTH in usages:
            return PeerIdentity("", problem="a coordinator URI on a server certificate")
        return PeerIdentity(ROLE_COORDINATOR)
    prefix = f"{IDENTITY_SCHEME}://{ROLE_WORKER}/"
    if uri.startswith(prefix) and _name_ok(uri[len(prefix):]):
        return PeerIdentity(ROLE_WORKER, node=uri[len(prefix):])
    return PeerIdentity("", problem=f"unknown identity {uri!r}")


def peer_identity(context: Any) -> PeerIdentity | None:
    """The identity of a gRPC call's peer from its TLS session; None on a plaintext port."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        return None
    return identity_of_cert(bytes(pems[0]))


def check_own_identity(tls: TlsConfig, node: str) -> None:
    """A worker starts only with its own node's worker certificate (UserError otherwise)."""
    ident = identity_of_cert(tls.cert_pem)
    if not ident.is_worker(node):
        raise UserError(f"--tls-cert {tls.cert_path}: is {ident.describe()}, not the worker "
                        f"certificate of node {node!r} (SAN URI {worker_uri(node)}); issue "
                        "one per node (helixserve certs create, docs/security.md)")


# ---- coordinator identity -------------------------------------------------------------------


def coordinator_id_for(token: str) -> str:
    digest = hashlib.sha256(token.encode()).hexdigest()
    return f"coord-{digest[:COORDINATOR_ID_HEX]}"


def new_coordinator_identity() -> tuple[str, str]:
    """(coordinator id, secret token): the id is derived from the token (module doc)."""
    token = secrets.token_hex(32)
    return coordinator_id_for(token), token


def coordinator_token_ok(coordinator_id: str, token: str) -> bool:
    """True when `token` is the secret behind `coordinator_id`."""
    if not coordinator_id or not token:
        return False
    return hmac.compare_digest(coordinator_id_for(token), coordinator_id)


# ---- TLS files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsConfig:
    """One side's mutual-TLS material: its certificate chain and key, and the CA it trusts."""

    cert_path: Path
    key_path: Path
    ca_path: Path
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    ca_pem: bytes = field(repr=False)

    def flags(self) -> list[str]:
        """The CLI flags that load this config in another process."""
        return ["--tls-cert", str(self.cert_path), "--tls-key", str(self.key_path),
                "--tls-ca", str(self.ca_path)]


def _read_pem(path: Path, flag: str, marker: bytes) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{flag} {path}: is a directory, not a PEM file") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or marker not in data:
        what = "certificate" if marker == b"CERTIFICATE-----" else "private key"
        raise UserError(f"{flag} {path}: not a PEM {what} (no '-----BEGIN ...{marker.decode()}' block)")
    return data


def load_tls(cert: str | os.PathLike[str], key: str | os.PathLike[str],
             ca: str | os.PathLike[str]) -> TlsConfig:
    """Read and check a certificate, its key and the CA: UserError naming the flag and file
    when one is missing, unreadable, not PEM, unparsable, or the key does not match the
    certificate."""
    cert_path, key_path, ca_path = Path(cert), Path(key), Path(ca)
    cert_pem = _read_pem(cert_path, "--tls-cert", b"CERTIFICATE-----")
    key_pem = _read_pem(key_path, "--tls-key", b"PRIVATE KEY-----")
    ca_pem = _read_pem(ca_path, "--tls-ca", b"CERTIFICATE-----")
    _check_pair(cert_path, cert_pem, key_path, key_pem, ca_path, ca_pem)
    return TlsConfig(cert_path, key_path, ca_path, cert_pem, key_pem, ca_pem)


def _check_pair(cert_path: Path, cert_pem: bytes, key_path: Path, key_pem: bytes,
                ca_path: Path, ca_pem: bytes) -> None:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
    except ImportError:  # grpc still refuses a bad pair, at the first handshake
        return
    try:
        cert_obj = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise UserError(f"--tls-cert {cert_path}: cannot parse the certificate: {exc}") from None
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise UserError(f"--tls-ca {ca_path}: cannot parse the CA certificate: {exc}") from None
    try:
        key_obj = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise UserError(f"--tls-key {key_path}: cannot load the private key (encrypted keys "
                        f"are not supported): {exc}") from None
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key_obj.public_key().public_bytes(*raw) != cert_obj.public_key().public_bytes(*raw):
        raise UserError(f"--tls-key {key_path}: does not match the certificate --tls-cert "
                        f"{cert_path}")
    now = datetime.datetime.now(datetime.UTC)
    if cert_obj.not_valid_after_utc < now:
        raise UserError(f"--tls-cert {cert_path}: expired on {cert_obj.not_valid_after_utc:%Y-%m-%d}")


def tls_from_flags(cert: str | None, key: str | None, ca: str | None) -> TlsConfig | None:
    """--tls-cert/--tls-key/--tls-ca: all three or none (None = plaintext)."""
    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise UserError(f"{', '.join(missing)}: missing; TLS needs --tls-cert, --tls-key and "
                        "--tls-ca together")
    assert cert and key and ca
    return load_tls(cert, key, ca)


# ---- gRPC credentials and channels ----------------------------------------------------------


def server_credentials(tls: TlsConfig) -> Any:
    """Server side of mutual TLS: clients must present a certificate signed by the CA."""
    import grpc

    return grpc.ssl_server_credentials(
        [(tls.key_pem, tls.cert_pem)], root_certificates=tls.ca_pem, require_client_auth=True
    )


def channel_credentials(tls: TlsConfig) -> Any:
    """Client side of mutual TLS: trust the CA, present our certificate."""
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca_pem, private_key=tls.key_pem, certificate_chain=tls.cert_pem
    )


def aio_channel(address: str, tls: TlsConfig | None,
                options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A grpc.aio channel to a worker: mutual TLS with `tls`, else plaintext."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))


def sync_channel(address: str, tls: TlsConfig | None,
                 options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A blocking grpc channel to a worker (health waits, tests): as `aio_channel`."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=list(options))


def add_port(server: Any, address: str, tls: TlsConfig | None) -> int:
    """Bind the server: a TLS port only, when `tls` is set (no plaintext port exists then)."""
    if tls is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, server_credentials(tls)))


# ---- next-hop allowlist ---------------------------------------------------------------------


@dataclass(frozen=True)
class PeerPolicy:
    """The addresses a worker may forward to: exact `host:port`s, or `host:*` for any port
    of a host (test harnesses whose ports appear later). Empty: forward to nobody."""

    addresses: frozenset[str] = frozenset()
    any_port_hosts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str], where: str = "--peers") -> PeerPolicy:
        exact: set[str] = set()
        hosts: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            host, sep, port = entry.rpartition(":")
            if not sep or not host:
                raise UserError(f"{where}: bad address {entry!r}; expected HOST:PORT or HOST:*")
            if port == "*":
                hosts.add(host)
            elif port.isdigit() and 0 < int(port) < 65536:
                exact.add(entry)
            else:
                raise UserError(f"{where}: bad port in {entry!r}; expected 1..65535 or *")
        return cls(frozenset(exact), frozenset(hosts))

    def allows(self, address: str) -> bool:
        if address in self.addresses:
            return True
        host, sep, _ = address.rpartition(":")
        return bool(sep) and host in self.any_port_hosts

    def describe(self) -> str:
        shown = sorted(self.addresses) + sorted(f"{h}:*" for h in self.any_port_hosts)
        return ", ".join(shown) if shown else "none"


# ---- dev credentials ------------------------------------------------------------------------


@dataclass(frozen=True)
class DevCredentials:
    """Files written by `create_dev_credentials`."""

    directory: Path
    ca_path: Path
    coordinator: TlsConfig
    nodes: dict[str, TlsConfig]


def _name_ok(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_." for c in name) and not name.startswith(".")


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write `data` as a new file of `mode` (0600 for keys): an existing file (whatever its
    mode) or a symlink at `path` is removed first, never written through."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _check_dev_names(nodes: Sequence[str], hosts: Sequence[str],
                     node_hosts: Mapping[str, Sequence[str]]) -> None:
    """UserError naming the first bad node or host name of a dev CA's certificates."""
    unknown = sorted(set(node_hosts) - set(nodes))
    if unknown:
        raise UserError(f"--hosts: {unknown[0]!r} is not one of the nodes ({', '.join(nodes)})")
    every = [*hosts, *(h for hs in node_hosts.values() for h in hs)]
    bad = [n for n in [*nodes, *every] if not n or any(c.isspace() or c in "/*" for c in n)]
    if bad:
        raise UserError(f"certs: bad node or host name {bad[0]!r} (no spaces, '/' or "
                        "wildcards: each certificate names its own node's host)")
    bad_nodes = [n for n in nodes if not _name_ok(n) or n in (COORDINATOR_NAME, "ca")]
    if bad_nodes:
        raise UserError(f"--nodes: bad node name {bad_nodes[0]!r}; use letters, digits, - _ . "
                        f"(not 'coordinator' or 'ca')")


def create_dev_credentials(out_dir: str | os.PathLike[str], nodes: Sequence[str],
                           hosts: Sequence[str] = (),
                           node_hosts: Mapping[str, Sequence[str]] | None = None
                           ) -> DevCredentials:
    """A fresh CA and certificates in `out_dir`: `ca.crt`/`ca.key`, `coordinator.crt/.key`
    (client auth only; identity URI helixserve://coordinator) and `<node>.crt/.key` per node
    (server + client auth; identity URI helixserve://worker/<node>; DNS/IP names 127.0.0.1,
    localhost, the node name, that node's `node_hosts` and `hosts`, never a wildcard). `hosts`
    goes into every worker's certificate: for local stacks whose workers share loopback
    aliases; a real cluster gives each node its own (`node_hosts`). Keys are written 0600. Not for production: the CA key sits next to the certificates."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    node_hosts = dict(node_hosts or {})
    _check_dev_names(nodes, hosts, node_hosts)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    until = now + datetime.timedelta(days=DEV_CERT_DAYS)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "helixserve dev"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        _write_new(path, key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), 0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(name("helixserve dev CA"))
        .issuer_name(name("helixserve dev CA")).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = out / "ca.crt"
    _write_new(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    write_key(out / "ca.key", ca_key)

    def issue(cn: str, uri: str, sans: Sequence[str], server: bool) -> TlsConfig:
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)]
        for s in dict.fromkeys(sans):
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(s)))
            except ValueError:
                alt.append(x509.DNSName(s))
        cert = (
            x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server
                else [ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = out / f"{cn}.crt", out / f"{cn}.key"
        _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        write_key(key_path, key)
        return load_tls(cert_path, key_path, ca_path)

    local = ["127.0.0.1", "localhost"]
    coordinator = issue(COORDINATOR_NAME, coordinator_uri(), [], server=False)
    node_cfgs = {n: issue(n, worker_uri(n), [n, *local, *hosts, *node_hosts.get(n, ())], server=True)
                 for n in nodes}
    return DevCredentials(out, ca_path, coordinator, node_cfgs)


class OwnedMemory(Generic[K, V]):
    """At most `limit` entries, each owned by a coordinator id, for what a worker remembers
    per request (docs/security.md, "Flooding a worker").

    A flat map answers lookups by key; per-owner order decides what goes when it is full:
    the oldest entry of the owner used longest ago that is not connected (`connected(owner)`:
    it has no open stream here, e.g. an identity minted only to call Release), else, when
    every owner is connected, the oldest entry of the connected owner holding the most. So a
    caller that fills the memory pushes out its own entries first: with at most C connected
    owners, each keeps at least its latest `limit / C` entries however much another puts.
    Entries are put and removed by one thread; lookups from another are single dict reads.
    """

    def __init__(self, limit: int, connected: Callable[[str], bool]) -> None:
        if limit < 1:
            raise ValueError(f"OwnedMemory limit {limit}: need >= 1")
        self.limit = limit
        self._connected = connected
        self._items: dict[K, tuple[str, V]] = {}
        #: owner -> its keys, oldest first; owners in the order they last put
        self._owners: OrderedDict[str, OrderedDict[K, None]] = OrderedDict()
        #: entries pushed out because the memory was full, since start
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        got = self._items.get(key)
        return None if got is None else got[1]

    def owner_of(self, key: K) -> str | None:
        got = self._items.get(key)
        return None if got is None else got[0]

    def owned(self, owner: str) -> int:
        keys = self._owners.get(owner)
        return 0 if keys is None else len(keys)

    def put(self, key: K, owner: str, value: V) -> None:
        self.pop(key)
        self._items[key] = (owner, value)
        keys = self._owners.get(owner)
        if keys is None:
            keys = self._owners[owner] = OrderedDict()
        else:
            self._owners.move_to_end(owner)
        keys[key] = None
        while len(self._items) > self.limit:
            self._evict()

    def pop(self, key: K) -> V | None:
        got = self._items.pop(key, None)
        if got is None:
            return None
        owner, value = got
        keys = self._owners[owner]
        del keys[key]
        if not keys:
            del self._owners[owner]
        return value

    def keys_of(self, owner: str) -> list[K]:
        return list(self._owners.get(owner, ()))

    def _evict(self) -> None:
        victim = next((o for o in self._owners if not self._connected(o)), None)
        if victim is None:  # every owner is connected: the one holding the most gives
            victim = max(self._owners, key=lambda o: len(self._owners[o]))
        keys = self._owners[victim]
        key = next(iter(keys))
        self.pop(key)
        self.evicted += 1


def dev_credentials_dir(root: Path) -> Path:
    """Where a local stack keeps its generated credentials: `<root>/tls`."""
    return root / "tls"


__all__ = [
    "DevCredentials",
    "OwnedMemory",
    "PeerIdentity",
    "PeerPolicy",
    "TlsConfig",
    "add_port",
    "aio_channel",
    "check_own_identity",
    "coordinator_id_for",
    "coordinator_token_ok",
    "create_dev_credentials",
    "identity_of_cert",
    "load_tls",
    "new_coordinator_identity",
    "peer_identity",
    "server_credentials",
    "sync_channel",
    "tls_from_flags",
]
