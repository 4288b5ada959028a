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
                                           hosts=["worker.example.org", "10.1.2.3"])


def helixserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "helixserve", *args], capture_output=True,
                          text=True, timeout=60)


def test_dev_credentials_load_and_name_their_hosts(creds):
    from cryptography import x509

    for name, cfg in {"coordinator": creds.coordinator, **creds.nodes}.items():
        assert cfg.cert_path.name == f"{name}.crt"
        cert = x509.load_pem_x509_certificate(cfg.cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = set(sans.get_values_for_type(x509.DNSName))
        ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
        assert {"localhost", "worker.example.org", name} <= names
        assert {"127.0.0.1", "10.1.2.3"} <= ips
        assert oct(cfg.key_path.stat().st_mode & 0o777) == "0o600"
    assert security.load_tls(*creds.nodes["n1"].flags()[1::2]).cert_pem == creds.nodes["n1"].cert_pem


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
    proc = helixserve("certs", "create", "--out", str(out), "--nodes", "a,b", "--hosts", "h.x")
    assert proc.returncode == 0, proc.stderr
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


def test_security_imports_without_torch_or_grpc():
    code = ("import sys; import helixserve.runtime.security; "
            "assert 'torch' not in sys.modules and 'grpc' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parents[3])
