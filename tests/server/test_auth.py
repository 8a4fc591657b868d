"""Secure by default, on real servers: token authorization (keys, 401s, probes, rotation,
expiry), model API control and TLS on every listener (a self-signed certificate made here)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import stat
import subprocess
from collections.abc import Callable
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from server.auth import open_warning
from tests.server.conftest import MSERVE, Reply, Server, http, wait_until

SECURE = {"disable_token_authorization": False, "enable_model_api": False}
INVALID_KEY = "InvalidKeyException"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def secure_server(make_archive: Callable[..., Path], start_server: Callable[..., Server]) -> Server:
    make_archive("echo_fn", "echo", "echo")
    return start_server("echo=echo.mar", config=SECURE)


def test_keys_are_written_for_the_owner_only_in_torchserves_layout(secure_server: Server) -> None:
    path = secure_server.run_dir / "key_file.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = json.loads(path.read_text())
    assert set(keys) == {"management", "inference", "API"}
    values = [keys[k]["key"] for k in keys]
    assert len(set(values)) == 3
    assert all(len(v) >= 43 for v in values)  # 32 random bytes in URL-safe base64
    for kind in ("management", "inference"):
        expires = datetime.datetime.strptime(
            keys[kind]["expiration time"], "%Y-%m-%dT%H:%M:%S.%fZ"
        ).replace(tzinfo=datetime.timezone.utc)
        left = expires - datetime.datetime.now(datetime.timezone.utc)
        assert datetime.timedelta(minutes=58) < left <= datetime.timedelta(minutes=60)
    assert "expiration time" not in keys["API"]
    status = secure_server.cli("--status")
    assert f"keys       {path}" in status.stdout
    assert "WARNING" not in status.stderr
    secure_server.cli("--stop")
    assert not path.exists()  # the keys die with the server, as in TorchServe


def test_calls_without_the_right_key_get_401(secure_server: Server) -> None:
    s = secure_server
    predict = s.url("inference", "/predictions/echo")
    missing = http("POST", predict, b"hi")
    assert missing.status == 401
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="mserve inference API"'
    assert missing.json() == {
        "code": 401, "type": INVALID_KEY,
        "message": "token authorization is on: send the inference key as 'Authorization:"
                   " Bearer <key>' (the keys are in <run_dir>/key_file.json)",
    }  # fmt: skip
    for sent in ("wrong", s.key("management"), s.key("API"), s.key("inference") + "x"):
        reply = http("POST", predict, b"hi", _bearer(sent))
        assert reply.status == 401
        assert reply.json()["message"] == "the key sent is not the inference key"
        assert reply.headers["WWW-Authenticate"] == (
            'Bearer realm="mserve inference API", error="invalid_token"'
        )
    basic = http("POST", predict, b"hi", {"Authorization": f"Basic {s.key('inference')}"})
    assert basic.status == 401
    ok = http("POST", predict, b"hi", {"Authorization": f"bearer  {s.key('inference')} "})
    assert (ok.status, ok.body) == (200, b"hi")
    for path in ("/models", "/v2/models/echo", "/v2"):
        assert http("GET", s.url("inference", path)).status == 401, path
    manage = http("GET", s.url("management", "/models"))
    assert manage.status == 401
    assert manage.json()["message"].startswith("token authorization is on: send the management")
    assert manage.headers["WWW-Authenticate"] == 'Bearer realm="mserve management API"'
    wrong_port = http("GET", s.url("management", "/models"), None, _bearer(s.key("inference")))
    assert wrong_port.status == 401
    assert s.manage("GET", "/models").json()["models"][0]["modelName"] == "echo"


def test_probes_metrics_and_the_description_need_no_key(secure_server: Server) -> None:
    s = secure_server
    for path in ("/ping", "/v2/health/live", "/v2/health/ready", "/api-description"):
        assert http("GET", s.url("inference", path)).status == 200, path
    assert http("OPTIONS", s.url("inference", "/")).status == 200
    assert http("GET", s.url("management", "/api-description")).status == 200
    metrics = http("GET", s.url("metrics", "/metrics"))
    assert metrics.status == 200 and b"ts_inference_requests_total" in metrics.body
    # a 401 is an answer like any other: counted, and logged with its status
    http("POST", s.url("inference", "/predictions/echo"), b"hi")
    log = s.run_dir / "logs" / "access.log"
    wait_until(lambda: '"POST /predictions/echo HTTP/1.1" 401' in log.read_text(), 10,
               "the 401 in access.log (written within a second)")  # fmt: skip


def test_model_api_is_off_unless_enabled(secure_server: Server) -> None:
    s = secure_server
    reply = s.manage("POST", "/models?url=echo.mar&model_name=again")
    assert reply.status == 405
    assert reply.json() == {
        "code": 405, "type": "MethodNotAllowedException",
        "message": "registering models through the API is disabled (model API control): start"
                   " mserve with --enable-model-api or set enable_model_api to true; models given"
                   " at start (--models, load_models, the snapshot) load either way",
    }  # fmt: skip
    assert reply.headers["Allow"] == "GET"
    gone = s.manage("DELETE", "/models/echo")
    assert gone.status == 405 and gone.json()["message"].startswith("unregistering models")
    assert gone.headers["Allow"] == "GET, PUT"
    # scaling and describing stay with the management key; the model is still served
    assert s.manage("PUT", "/models/echo?min_worker=2&synchronous=true").status == 200
    assert len(s.manage("GET", "/models/echo").json()[0]["workers"]) == 2
    assert s.predict("echo", b"still here").body == b"still here"


def test_the_api_key_rotates_the_others(secure_server: Server) -> None:
    s = secure_server
    old = s.key("inference")
    token = s.url("management", "/token?type=inference")
    refused = http("GET", token, None, _bearer(s.key("management")))
    assert refused.status == 401 and refused.json()["message"] == "the key sent is not the API key"
    rotated = http("GET", token, None, _bearer(s.key("API")))
    assert rotated.status == 200
    new = rotated.json()["inference"]["key"]
    assert new != old and s.key("inference") == new  # the key file holds the new one
    assert http("POST", s.url("inference", "/predictions/echo"), b"x", _bearer(old)).status == 401
    assert s.predict("echo", b"x").status == 200  # reads the key file again
    bad = http("GET", s.url("management", "/token?type=admin"), None, _bearer(s.key("API")))
    assert bad.status == 400
    assert bad.json()["message"] == (
        "parameter 'type' should be one of management, inference, found 'admin'"
    )
    management = http("GET", s.url("management", "/token?type=management"), None,
                      _bearer(s.key("API")))  # fmt: skip
    assert management.json()["management"]["key"] == s.key("management")
    assert s.manage("GET", "/models").status == 200


def test_expired_keys_are_refused_until_rotated(
    make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    make_archive("echo_fn", "echo", "echo")
    s = start_server(
        "echo=echo.mar", config={**SECURE, "inference_token_expiration_min": 0.02}
    )  # 1.2 s for the inference key; the management key keeps the 60 min default
    expired: list[Reply] = []

    def refused() -> bool:
        reply = s.predict("echo", b"x")
        expired.append(reply)
        return reply.status == 401

    wait_until(refused, 10, "the inference key to expire")
    message = expired[-1].json()["message"]
    assert message.startswith("the inference key expired at ")
    assert message.endswith(
        "; get a new one with GET /token?type=inference on the management port, sending the API key"
    )
    assert s.manage("GET", "/models").status == 200
    assert http("GET", s.url("management", "/token?type=inference"), None,
                _bearer(s.key("API"))).status == 200  # fmt: skip
    assert s.predict("echo", b"x").status == 200


def test_metrics_can_require_the_management_key(
    start_server: Callable[..., Server],
) -> None:
    s = start_server(config={**SECURE, "metrics_need_token": True, "token_exempt_paths": []})
    assert http("GET", s.url("metrics", "/metrics")).status == 401
    got = http("GET", s.url("metrics", "/metrics"), None, _bearer(s.key("management")))
    assert got.status == 200
    assert http("GET", s.url("inference", "/ping")).status == 401  # no exemptions now
    assert http("GET", s.url("inference", "/ping"), None, _bearer(s.key("inference"))).status == 200


def test_auth_off_is_said_when_listening_beyond_loopback() -> None:
    urls = {"inference": "http://0.0.0.0:8080", "management": "http://127.0.0.1:8081",
            "metrics": "http://[::1]:8082"}  # fmt: skip
    assert open_warning(urls, model_api=True) == (
        "token authorization is OFF and the inference (http://0.0.0.0:8080) API listens beyond"
        " this machine: anyone who reaches it can call it without a key and register models,"
        " which runs their code here; remove --disable-token-auth /"
        " disable_token_authorization to require keys"
    )
    assert "register models" not in (open_warning(urls, model_api=False) or "")
    assert open_warning({"inference": "http://localhost:1"}, model_api=True) is None


def test_handlers_never_see_the_inference_key(
    make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    make_archive("probe", "probe:handle", "probe")
    s = start_server("probe=probe.mar", config=SECURE)
    reply = s.predict("probe", {"hi": 1}, headers={"X-Test": "seen"})
    assert reply.status == 200, reply.body
    assert reply.json()["x_test"] == "seen"  # other headers travel as sent
    assert reply.json()["authorization"] is None


def test_disable_token_auth_serves_without_keys(
    make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    make_archive("echo_fn", "echo", "echo")
    make_archive("probe", "probe:handle", "probe")
    s = start_server("echo=echo.mar", "probe=probe.mar", config={"enable_model_api": False},
                     extra=("--disable-token-auth",))  # fmt: skip
    assert not (s.run_dir / "key_file.json").exists()
    assert http("POST", s.url("inference", "/predictions/echo"), b"hi").status == 200
    # with keys off, an Authorization header is the client's own, for the handler to read
    mine = http(
        "POST",
        s.url("inference", "/predictions/probe"),
        b"{}",
        {"Authorization": "Bearer the-clients-own", "Content-Type": "application/json"},
    )
    assert mine.json()["authorization"] == "Bearer the-clients-own"
    token = http("GET", s.url("management", "/token?type=inference"))
    assert token.status == 404 and "token authorization is off" in token.json()["message"]
    assert "WARNING" not in s.start_output  # loopback only: nothing to warn about


# --- TLS ------------------------------------------------------------------------------------


def _self_signed(folder: Path, rsa_bits: int | None = None) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (EC P-256, or RSA of ``rsa_bits``), made here
    (never a fixed file)."""
    key: Any = (ec.generate_private_key(ec.SECP256R1()) if rsa_bits is None
                else rsa.generate_private_key(public_exponent=65537, key_size=rsa_bits))  # fmt: skip
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mserve test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))  # fmt: skip
    return cert_path, key_path


def _https(server: Server, api: str, method: str, path: str, context: ssl.SSLContext,
           headers: dict[str, str] | None = None, body: bytes | None = None) -> Reply:  # fmt: skip
    host, port = server.status[api].rsplit(":", 1)
    conn = HTTPSConnection(host, int(port), context=context, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Reply(resp.status, dict(resp.headers), resp.read())
    finally:
        conn.close()


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated")
def test_tls_on_every_listener(
    tmp_path: Path, make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    cert, key = _self_signed(tmp_path)
    make_archive("echo_fn", "echo", "echo")
    s = start_server("echo=echo.mar", config={
        **SECURE, "certificate_file": str(cert), "private_key_file": str(key),
        "inference_address": "https://127.0.0.1:0", "management_address": "https://127.0.0.1:0",
        "metrics_address": "https://127.0.0.1:0",
    })  # fmt: skip
    http_apis = ("inference", "management", "metrics")  # gRPC's TLS: test_grpc.py
    assert all(s.status["urls"][api].startswith("https://127.0.0.1:") for api in http_apis)
    assert "inference  https://127.0.0.1:" in s.start_output
    trusting = ssl.create_default_context(cafile=str(cert))
    reply = _https(s, "inference", "POST", "/predictions/echo", trusting,
                   _bearer(s.key("inference")), b"over tls")  # fmt: skip
    assert (reply.status, reply.body) == (200, b"over tls")
    described = _https(s, "management", "GET", "/models/echo", trusting,
                       _bearer(s.key("management")))  # fmt: skip
    assert described.json()[0]["modelName"] == "echo"
    assert _https(s, "metrics", "GET", "/metrics", trusting).status == 200
    # a client that does not trust the certificate, or speaks plain HTTP, gets nothing
    with pytest.raises(ssl.SSLCertVerificationError):
        _https(s, "inference", "GET", "/ping", ssl.create_default_context())
    host, port = s.status["inference"].rsplit(":", 1)
    plain = HTTPConnection(host, int(port), timeout=10)
    with pytest.raises((ConnectionError, HTTPException)):
        plain.request("GET", "/ping")
        plain.getresponse()
    plain.close()
    # TLS 1.1 is refused; 1.2 and 1.3 work
    old = ssl.create_default_context(cafile=str(cert))
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError):
        _https(s, "inference", "GET", "/ping", old)
    tls12 = ssl.create_default_context(cafile=str(cert))
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    assert _https(s, "inference", "GET", "/ping", tls12).status == 200
    # the server still answers after all that
    again = _https(s, "inference", "POST", "/predictions/echo", trusting,
                   _bearer(s.key("inference")), b"again")  # fmt: skip
    assert again.body == b"again"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ("missing", "certificate_file {cert}x does not exist or is not a file"),
        ("not_pem", "certificate_file {cert} holds no PEM certificate"),
        ("other_key", "private_key_file {other} does not belong to certificate_file {cert}"),
        ("key_is_cert", "private_key_file {cert} is not a usable PEM private key"),
    ],
)
def test_bad_certificate_files_stop_the_start(tmp_path: Path, files: str, message: str) -> None:
    cert, key = _self_signed(tmp_path)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    _, other = _self_signed(other_dir)
    chosen = {
        "missing": (f"{cert}x", key),
        "not_pem": (cert, key),
        "other_key": (cert, other),
        "key_is_cert": (cert, cert),
    }[files]
    if files == "not_pem":
        cert.write_text("not a certificate\n")
    config = tmp_path / "tls.yaml"
    config.write_text(
        "inference_address: https://127.0.0.1:0\nmanagement_address: 127.0.0.1:0\n"
        f"metrics_address: 127.0.0.1:0\ncertificate_file: {chosen[0]}\n"
        "grpc_inference_address: 127.0.0.1:0\ngrpc_management_address: 127.0.0.1:0\n"
        f"private_key_file: {chosen[1]}\n"
    )
    out = subprocess.run(
        [MSERVE, "--start", "--config", str(config), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert message.format(cert=cert, other=other) in out.stderr, out.stderr
    assert not (tmp_path / "run" / "mserve.pid").exists()  # nothing left running


def test_a_1024_bit_key_names_the_setting_that_accepts_it(tmp_path: Path) -> None:
    """TorchServe serves a 1024-bit RSA key; OpenSSL's usual level refuses it: the start says
    which setting accepts it, and with it the listener serves over that key."""
    cert, key = _self_signed(tmp_path, rsa_bits=1024)
    config = tmp_path / "tls.yaml"
    settings = (
        "inference_address: https://127.0.0.1:0\nmanagement_address: 127.0.0.1:0\n"
        "metrics_address: 127.0.0.1:0\ngrpc: false\ndisable_token_authorization: true\n"
        f"certificate_file: {cert}\nprivate_key_file: {key}\n"
    )
    config.write_text(settings)
    start = [MSERVE, "--start", "--config", str(config), "--run-dir", str(tmp_path / "run")]
    out = subprocess.run(start, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert (
        f"certificate_file {cert}: its key or signature is too weak for OpenSSL's security level"
        " (EE_KEY_TOO_SMALL; an RSA key under 2048 bits, at the usual level 2): make a 2048-bit"
        " or larger key, or set tls_security_level: 1 to accept it, as TorchServe does"
    ) in out.stderr, out.stderr
    config.write_text(settings + "tls_security_level: 1\n")
    out = subprocess.run(start, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    server = Server(tmp_path / "run", json.loads((tmp_path / "run" / "status.json").read_text()))
    try:
        client = ssl.create_default_context(cafile=str(cert))
        client.set_ciphers("DEFAULT:@SECLEVEL=1")  # a client that accepts such keys too
        assert _https(server, "inference", "GET", "/ping", client).status == 200
    finally:
        subprocess.run([MSERVE, "--stop", "--run-dir", str(tmp_path / "run")], timeout=120)
