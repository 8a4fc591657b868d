"""The span exporter process's connection to a collector (server/tracing/senders.py): a real
exporter process (``python -m server.tracing.export``) fed one record, sending to a real
collector in this test over TLS that requires a client certificate (OTLP/HTTP and OTLP/gRPC),
or through the HTTP proxy its environment names. The certificates are made here: a CA, the
collector's certificate and the client's."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import marshal
import os
import ssl
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from server.tracing.export import FRAME
from tests.conftest import REPO

TRACE = "c" * 32


def _pem(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.crt; collector.crt/.key for 127.0.0.1; client.crt/.key, for client authentication;
    all signed by the CA; stranger.crt/.key, signed by a CA the collector does not trust."""
    folder = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name: str, issuer: tuple[x509.Name, Any] | None, **extensions: Any) -> tuple[
        x509.Name, ec.EllipticCurvePrivateKey
    ]:  # fmt: skip
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"mserve test {name}")])
        issuer_name, issuer_key = issuer or (subject, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None),
                           critical=True)
        )  # fmt: skip
        for extension in extensions.values():
            builder = builder.add_extension(extension, critical=False)
        _pem(folder / name, builder.sign(issuer_key, hashes.SHA256()), key)
        return subject, key

    ca = issue("ca", None)
    issue("collector", ca,
          san=x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
          usage=x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]))  # fmt: skip
    client = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
    issue("client", ca, usage=client)
    issue("stranger", issue("other-ca", None), usage=client)
    return folder


class Collector:
    """An OTLP/HTTP collector (TLS requiring a client certificate of ``pki``'s CA when ``pki``
    is given): the spans it was sent, by name, and each post's request line target."""

    def __init__(self, pki: Path | None = None) -> None:
        self.names: list[str] = []
        self.targets: list[str] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                collector.add(request)
                collector.targets.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if pki is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki / "ca.crt")
            context.load_cert_chain(pki / "collector.crt", pki / "collector.key")
            context.verify_mode = ssl.CERT_REQUIRED
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.port = self.server.server_address[1]
        self.url = f"{scheme}://127.0.0.1:{self.port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.names += [span.name for span in scope.spans if span.trace_id.hex() == TRACE]

    def stop(self) -> None:
        self.server.shutdown()


class GrpcCollector(Collector):
    """An OTLP/gRPC collector (TraceService) over TLS requiring a client certificate."""

    def __init__(self, pki: Path) -> None:
        self.names, self.targets = [], []
        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:
                collector.add(request)
                return ExportTraceServiceResponse()

        credentials = grpc.ssl_server_credentials(
            [((pki / "collector.key").read_bytes(), (pki / "collector.crt").read_bytes())],
            root_certificates=(pki / "ca.crt").read_bytes(), require_client_auth=True,
        )  # fmt: skip
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.grpc)
        self.port = self.grpc.add_secure_port("127.0.0.1:0", credentials)
        self.grpc.start()
        self.url = f"https://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.grpc.stop(0)


def export_one(endpoint: str, protocol: str, environ: dict[str, str]) -> list[str]:
    """Run the exporter process on one work span's record (``environ`` added to a copy of this
    process's environment without its OTEL_* and proxy variables); what it reported failed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OTEL_") and not k.lower().endswith("_proxy")}  # fmt: skip
    env |= {"PYTHONPATH": str(REPO), "OTEL_EXPORTER_OTLP_TIMEOUT": "2", **environ}
    data = marshal.dumps([("s", "mserve.model.load", TRACE, 1, 0, 1, 2, {}, None)], 4)
    out = subprocess.run(
        [sys.executable, "-m", "server.tracing.export",
         json.dumps({"endpoint": endpoint, "protocol": protocol})],
        input=FRAME.pack(len(data)) + data, env=env, capture_output=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()
    reports, stdout = [], out.stdout
    while stdout:
        (size,) = FRAME.unpack_from(stdout)
        kind, _, message = marshal.loads(stdout[FRAME.size : FRAME.size + size])
        stdout = stdout[FRAME.size + size :]
        if kind == "failed":
            reports.append(message)
    return reports


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_reach_a_collector_that_requires_a_client_certificate(pki, protocol) -> None:
    """``OTEL_EXPORTER_OTLP_[TRACES_]CLIENT_CERTIFICATE`` and ``..._CLIENT_KEY`` (the TRACES one
    first), the collector checked with ``..._CERTIFICATE``; without a client certificate, or
    with one of a CA the collector does not trust, the export fails and says so."""
    collector = GrpcCollector(pki) if protocol == "grpc" else Collector(pki)
    trusted = {"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(pki / "ca.crt")}
    client = {**trusted, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(pki / "stranger.crt"),
              "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(pki / "stranger.key"),
              "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(pki / "client.crt"),
              "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(pki / "client.key")}  # fmt: skip
    stranger = {**trusted, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(pki / "stranger.crt"),
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(pki / "stranger.key")}  # fmt: skip
    try:
        assert export_one(collector.url, protocol, client) == []
        assert collector.names == ["mserve.model.load"]
        for refused in (trusted, stranger):
            failures = export_one(collector.url, protocol, refused)
            assert len(failures) == 1 and failures[0].startswith("Failed to export spans batch")
        assert collector.names == ["mserve.model.load"]
    finally:
        collector.stop()


def test_a_missing_certificate_file_fails_each_export_with_its_name(pki) -> None:
    missing = pki / "missing.crt"
    environ = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki / "ca.crt"),
               "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(missing)}  # fmt: skip
    for protocol in ("http/protobuf", "grpc"):
        (failure,) = export_one("https://127.0.0.1:9/v1/traces", protocol, environ)
        assert failure.startswith("Failed to export spans batch: the TLS files could not be loaded")
        assert str(missing) in failure


def test_otlp_http_goes_through_the_proxy_its_environment_names() -> None:
    """``HTTP_PROXY`` (as httpx's ``trust_env`` reads it, ``NO_PROXY`` too): the collector's
    name is resolved by the proxy, never here; the proxy (this test's collector) is sent the
    request in absolute form."""
    proxy = Collector()
    via = {"HTTP_PROXY": f"http://127.0.0.1:{proxy.port}"}
    endpoint = "http://collector.invalid:4318/v1/traces"
    try:
        assert export_one(endpoint, "http/protobuf", via) == []
        assert proxy.names == ["mserve.model.load"] and proxy.targets == [endpoint]
        failed = export_one(endpoint, "http/protobuf", {**via, "NO_PROXY": "collector.invalid"})
        assert len(failed) == 1 and proxy.targets == [endpoint]
    finally:
        proxy.stop()
