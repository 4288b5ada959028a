"""runtime/security.py and the flags around it: credential errors name the flag and file,
coordinator identities, the next-hop allowlist, `certs create`, `serve`'s exposure rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helixserve.commands.serve import check_exposure
from helixserve.errors import UserError
from helixserve.runtime import security


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> security.DevCredentials:
    return security.create_dev_credentials(tmp_path_factory.mktemp("certs"), ["n1", "n2"],
                                           node_hosts={"n1": ["worker.example.org", "10.1.2.3"],
                                                       "n2": ["w2.example.org"]})


def helixserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "helixserve", *args], capture_output=True,
                          text=True, timeout=60)


def _names(cfg: security.TlsConfig) -> tuple[set[str], set[str], list[str], set[str]]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cfg.cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    return (set(sans.get_values_for_type(x509.DNSName)),
            {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)},
            sans.get_values_for_type(x509.UniformResourceIdentifier),
            {u._name for u in usages})


def test_dev_credentials_carry_roles_and_only_their_own_hosts(creds):
    dns, ips, uris, usages = _names(creds.nodes["n1"])
    assert dns == {"n1", "localhost", "worker.example.org"} and ips == {"127.0.0.1", "10.1.2.3"}
    assert uris == ["helixserve://worker/n1"] and usages == {"serverAuth", "clientAuth"}
    dns, ips, uris, _ = _names(creds.nodes["n2"])
    assert dns == {"n2", "localhost", "w2.example.org"} and ips == {"127.0.0.1"}
    dns, ips, uris, usages = _names(creds.coordinator)
    assert (dns, ips, uris, usages) == (set(), set(), ["helixserve://coordinator"], {"clientAuth"})
    for name, cfg in {"coordinator": creds.coordinator, **creds.nodes}.items():
        assert cfg.cert_path.name == f"{name}.crt"
        assert oct(cfg.key_path.stat().st_mode & 0o777) == "0o600"
    assert security.load_tls(*creds.nodes["n1"].flags()[1::2]).cert_pem == creds.nodes["n1"].cert_pem
    assert security.identity_of_cert(creds.coordinator.cert_pem).is_coordinator
    n2 = security.identity_of_cert(creds.nodes["n2"].cert_pem)
    assert n2.is_worker("n2") and not n2.is_worker("n1") and not n2.is_coordinator


def test_identity_needs_exactly_one_role_uri_and_the_right_usage(tmp_path):
    """Certificates of the same CA without a helixserve role, or with a coordinator URI on a
    server certificate, have no role."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)

    def cert(uris: list[str], server: bool) -> bytes:
        from cryptography.hazmat.primitives import serialization

        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        b = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
             .public_key(key.public_key()).serial_number(1).not_valid_before(now)
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if uris:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
        return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    cases = {
        "no URI": ([], False),
        "two roles": (["helixserve://coordinator", "helixserve://worker/n1"], False),
        "coordinator that serves": (["helixserve://coordinator"], True),
        "unknown role": (["helixserve://admin"], False),
        "bad node name": (["helixserve://worker/a/b"], True),
    }
    for what, (uris, server) in cases.items():
        ident = security.identity_of_cert(cert(uris, server))
        assert ident.role == "" and ident.problem, what
    assert security.identity_of_cert(cert(["helixserve://worker/n7"], True)).is_worker("n7")


def test_a_worker_starts_only_with_its_own_certificate(creds):
    security.check_own_identity(creds.nodes["n1"], "n1")
    for cfg, node in ((creds.nodes["n2"], "n1"), (creds.coordinator, "n1")):
        with pytest.raises(UserError, match="not the worker certificate of node 'n1'"):
            security.check_own_identity(cfg, node)


def test_key_files_replace_symlinks_and_loose_modes(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    (out / "n1.key").symlink_to(target)
    (out / "ca.key").write_text("old")
    (out / "ca.key").chmod(0o644)
    creds = security.create_dev_credentials(out, ["n1"])
    assert target.read_text() == "untouched"
    assert not creds.nodes["n1"].key_path.is_symlink()
    for key in ("ca.key", "n1.key"):
        assert oct((out / key).stat().st_mode & 0o777) == "0o600", key


def test_wildcards_and_unknown_nodes_are_refused(tmp_path):
    with pytest.raises(UserError, match="wildcard"):
        security.create_dev_credentials(tmp_path / "a", ["n1"], node_hosts={"n1": ["*.svc"]})
    with pytest.raises(UserError, match="--hosts: 'n9'"):
        security.create_dev_credentials(tmp_path / "b", ["n1"], node_hosts={"n9": ["h"]})


def test_bad_files_are_user_errors_naming_flag_and_file(creds, tmp_path):
    n1 = creds.nodes["n1"]
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    cases = [
        ((tmp_path / "missing.crt", n1.key_path, n1.ca_path), "--tls-cert", "no such file"),
        ((text, n1.key_path, n1.ca_path), "--tls-cert", "not a PEM certificate"),
        ((n1.cert_path, text, n1.ca_path), "--tls-key", "not a PEM private key"),
        ((n1.cert_path, n1.cert_path, n1.ca_path), "--tls-key", "not a PEM private key"),
        ((n1.cert_path, n1.key_path, tmp_path), "--tls-ca", "is a directory"),
        ((n1.cert_path, creds.nodes["n2"].key_path, n1.ca_path), "--tls-key",
         "does not match the certificate"),
    ]
    for (cert, key, ca), flag, message in cases:
        with pytest.raises(UserError) as err:
            security.load_tls(cert, key, ca)
        assert str(err.value).startswith(flag) and message in str(err.value), err.value
        bad = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}[flag]
        assert str(bad) in str(err.value)
    with pytest.raises(UserError, match="--tls-key, --tls-ca: missing"):
        security.tls_from_flags(str(n1.cert_path), None, None)
    assert security.tls_from_flags(None, None, None) is None


def test_coordinator_ids_are_bound_to_their_token():
    cid, token = security.new_coordinator_identity()
    other_id, other_token = security.new_coordinator_identity()
    assert cid.startswith("coord-") and len(cid) == len("coord-") + 32 and cid != other_id
    assert security.coordinator_token_ok(cid, token)
    assert not security.coordinator_token_ok(cid, other_token)
    assert not security.coordinator_token_ok(cid, "")
    assert not security.coordinator_token_ok("", token)
    assert not security.coordinator_token_ok(cid.upper(), token)


def test_peer_policy():
    policy = security.PeerPolicy.parse(["10.0.0.1:50051", " host-b:50052 ", "127.0.0.1:*"])
    assert policy.allows("10.0.0.1:50051") and policy.allows("host-b:50052")
    assert policy.allows("127.0.0.1:1") and policy.allows("127.0.0.1:65000")
    assert not policy.allows("10.0.0.1:50052") and not policy.allows("10.0.0.2:50051")
    assert not policy.allows("127.0.0.2:1") and not policy.allows("host-b")
    assert not security.PeerPolicy().allows("127.0.0.1:50051")
    assert security.PeerPolicy().describe() == "none"
    for bad in ("nohost", ":80", "h:0", "h:70000", "h:x"):
        with pytest.raises(UserError, match="--peers"):
            security.PeerPolicy.parse([bad])


def test_exposure_rule():
    assert check_exposure("127.0.0.1", None, False) is None
    assert check_exposure("127.0.0.5", None, False) is None
    assert check_exposure("localhost", None, False) is None
    assert check_exposure("::1", None, False) is None
    assert check_exposure("0.0.0.0", "key", False) is None
    for host in ("0.0.0.0", "10.0.0.5", "::", "api.example.org"):
        with pytest.raises(UserError, match="--allow-unauthenticated"):
            check_exposure(host, None, False)
        warning = check_exposure(host, None, True)
        assert warning is not None and warning.startswith("WARNING")


def test_certs_create_cli(tmp_path):
    out = tmp_path / "certs"
    proc = helixserve("certs", "create", "--out", str(out), "--nodes", "a,b", "--hosts", "a=h.x")
    assert proc.returncode == 0, proc.stderr
    assert "role worker a; names a, 127.0.0.1, localhost, h.x" in proc.stdout
    bare = helixserve("certs", "create", "--out", str(tmp_path / "z"), "--nodes", "a",
                      "--hosts", "h.x")
    assert bare.returncode == 2 and "NODE=HOST" in bare.stderr
    assert {p.name for p in out.iterdir()} == {
        "ca.crt", "ca.key", "coordinator.crt", "coordinator.key", "a.crt", "a.key", "b.crt", "b.key"}
    again = helixserve("certs", "create", "--out", str(out), "--nodes", "a")
    assert again.returncode == 2 and "--force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    nothing = helixserve("certs", "create", "--out", str(tmp_path / "x"))
    assert nothing.returncode == 2 and "--nodes" in nothing.stderr
    bad = helixserve("certs", "create", "--out", str(tmp_path / "y"), "--nodes", "a/b")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_worker_and_serve_flag_errors(creds, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    n1 = creds.nodes["n1"]
    proc = helixserve("worker", "--model", str(model), "--layers", "0:2", "--port", "0",
                      "--tls-cert", str(n1.cert_path), "--tls-key", str(tmp_path / "nope.key"),
                      "--tls-ca", str(n1.ca_path))
    assert proc.returncode == 2 and "--tls-key" in proc.stderr and "nope.key" in proc.stderr
    proc = helixserve("worker", "--model", str(model), "--layers", "0:2", "--port", "0",
                      "--cluster", str(tmp_path / "c.yaml"))
    assert proc.returncode == 2 and "--cluster: needs --placement" in proc.stderr
    proc = helixserve("serve", "--cluster", "c.yaml", "--placement", "p.json", "--model",
                      str(model), "--host", "0.0.0.0")
    assert proc.returncode == 2 and "--allow-unauthenticated" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = helixserve("demo", "--insecure", "--tls-cert", str(n1.cert_path), "--tls-key",
                      str(n1.key_path), "--tls-ca", str(n1.ca_path), "--port", "1")
    assert proc.returncode == 2 and "--insecure" in proc.stderr


def test_safe_defaults_of_demo_and_worker(tmp_path):
    """demo on a reachable address: serve's exposure rule, and no plaintext worker ports;
    a worker binds a non-loopback address in plaintext only with --insecure."""
    workdir = tmp_path / "never-made"
    for extra, message in (
        ([], "--host 0.0.0.0: serving without an API key"),
        (["--api-key", "k", "--insecure"], "--insecure: plaintext worker ports on the "
                                           "non-loopback --host 0.0.0.0"),
    ):
        proc = helixserve("demo", "--host", "0.0.0.0", "--workdir", str(workdir), *extra)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not workdir.exists()  # refused before anything was prepared
    model = tmp_path / "model"
    model.mkdir()
    proc = helixserve("worker", "--model", str(model), "--layers", "0:2", "--port", "0",
                      "--host", "0.0.0.0")
    assert proc.returncode == 2 and "--host 0.0.0.0: a plaintext worker port" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = helixserve("worker", "--model", str(model), "--layers", "0:2", "--port", "0",
                      "--host", "0.0.0.0", "--insecure", "--engine-stall-s", "0")
    assert proc.returncode == 2 and "--engine-stall-s: bad value 0" in proc.stderr
    proc = helixserve("worker", "--model", str(model), "--layers", "0:2", "--port", "0",
                      "--insecure", "--batch-wait", "11")
    assert proc.returncode == 2 and "--batch-wait: bad value 11" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = helixserve("worker", "--model", str(model), "--layers", "0:2", "--port", "0",
                      "--insecure", "--dataplane", "udp")
    assert proc.returncode == 2 and "--dataplane: invalid choice: 'udp'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_security_imports_without_torch_or_grpc():
    code = ("import sys; import helixserve.runtime.security; "
            "assert 'torch' not in sys.modules and 'grpc' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parents[3])
