"""Sending encoded OTLP requests (server/tracing/otlp.py) from the span exporter process: OTLP/HTTP
(protobuf) through httpx, OTLP/gRPC through TraceService's ``Export`` method, each with the
standard variables' options (server/tracing/settings.py) and the SDK exporters' retries.

Both check the collector's certificate with ``CERTIFICATE`` (else the system's CAs) and present
``CLIENT_CERTIFICATE`` / ``CLIENT_KEY`` when set. TLS files that cannot be loaded fail every
export with their names (the frontend logs it once and counts the spans), not the process."""

from __future__ import annotations

import gzip
import random
import ssl
import time
import urllib.parse
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.tracing.settings import ExportOptions

MAX_TRIES = 6  # as the SDK's exporters: backoff 1, 2, 4, ... s (+-20%) within the timeout
_HTTP_RETRY = frozenset({429, 502, 503, 504})


def _backoff(attempt: int, deadline: float) -> bool:
    """Sleep before try ``attempt + 1``; False when that would pass the deadline."""
    wait = 2**attempt * random.uniform(0.8, 1.2)
    if attempt + 1 >= MAX_TRIES or time.monotonic() + wait > deadline:
        return False
    time.sleep(wait)
    return True


def _unreadable(options: ExportOptions, exc: Exception) -> str:
    files = (options.certificate, options.client_certificate, options.client_key)
    names = ", ".join(f for f in files if f)
    return f"Failed to export spans batch: the TLS files could not be loaded ({names}): {exc}"


class HttpSender:
    """OTLP/HTTP (protobuf) through one httpx client, its connections kept alive; the proxy the
    environment names (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``: httpx's
    ``trust_env``)."""

    def __init__(self, endpoint: str, options: ExportOptions) -> None:
        import httpx

        self._url = endpoint
        self._timeout_s = options.timeout_s
        self._compression = options.compression
        self._headers = {"Content-Type": "application/x-protobuf", **options.headers}
        if self._compression != "none":
            self._headers.setdefault("content-encoding", self._compression)
        self._broken: str | None = None  # why every export fails: its TLS files
        verify: ssl.SSLContext | bool = True
        if urllib.parse.urlsplit(endpoint).scheme == "https":
            try:
                verify = ssl.create_default_context(cafile=options.certificate)
                if options.client_certificate:
                    verify.load_cert_chain(options.client_certificate, options.client_key)
            except OSError as exc:  # ssl.SSLError included: not PEM, a key that does not match
                self._broken = _unreadable(options, exc)
        self._client = httpx.Client(verify=verify, trust_env=True)
        self._stale = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
        self._failed = httpx.TransportError

    def send(self, data: bytes) -> str | None:
        """Post one request; None once the collector took it, else why not."""
        if self._broken is not None:
            return self._broken
        if self._compression == "gzip":
            data = gzip.compress(data)
        elif self._compression == "deflate":
            data = zlib.compress(data)
        deadline = time.monotonic() + self._timeout_s
        attempt, fresh = 0, False
        while True:
            try:
                reply = self._client.post(
                    self._url, content=data, headers=self._headers,
                    timeout=max(deadline - time.monotonic(), 0.001),
                )  # fmt: skip
            except self._stale as exc:
                if not fresh:  # the collector may have closed a kept-alive connection: now
                    fresh = True
                    continue
                failure = f"Failed to export spans batch: {exc or type(exc).__name__}"
            except self._failed as exc:
                failure = f"Failed to export spans batch: {exc or type(exc).__name__}"
            else:
                if 200 <= reply.status_code < 400:
                    return None
                failure = (
                    f"Failed to export spans batch code: {reply.status_code}, "
                    f"reason: {reply.reason_phrase}"
                )
                if reply.status_code not in _HTTP_RETRY:
                    return failure
            if not _backoff(attempt, deadline):
                return failure
            attempt += 1

    def close(self) -> None:
        self._client.close()


class GrpcSender:
    """OTLP/gRPC: TraceService's ``Export``, its path taken from the generated descriptor,
    sending the encoded request as it is (the generated stub would parse and re-serialize it)."""

    def __init__(self, endpoint: str, options: ExportOptions) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        url = urllib.parse.urlsplit(endpoint)
        target = url.netloc or endpoint
        if ":" not in target.rsplit("]", 1)[-1]:
            target += ":4317"
        insecure = url.scheme == "http" if options.insecure is None else options.insecure
        compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            options.compression, grpc.Compression.NoCompression
        )
        self._broken: str | None = None  # why every export fails: its TLS files
        if insecure:
            self._channel = grpc.insecure_channel(target, compression=compression)
        else:
            try:
                roots, chain = _read(options.certificate), _read(options.client_certificate)
                # no key file: the key is in the certificate's (as ssl's load_cert_chain reads)
                key = _read(options.client_key) if options.client_key else chain
            except OSError as exc:
                self._broken = _unreadable(options, exc)
                roots = chain = key = None
            credentials = grpc.ssl_channel_credentials(roots, key, chain)
            self._channel = grpc.secure_channel(target, credentials, compression=compression)
        service = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"]
        self._export = self._channel.unary_unary(
            f"/{service.full_name}/{service.methods_by_name['Export'].name}",
            request_serializer=None,  # bytes, already encoded
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
        self._metadata = tuple(options.headers.items())
        self._timeout_s = options.timeout_s
        self._grpc = grpc

    def send(self, data: bytes) -> str | None:
        """Call Export once; None once the collector took it, else why not."""
        if self._broken is not None:
            return self._broken
        code = self._grpc.StatusCode
        retry = {code.CANCELLED, code.DEADLINE_EXCEEDED, code.RESOURCE_EXHAUSTED, code.ABORTED,
                 code.OUT_OF_RANGE, code.UNAVAILABLE, code.DATA_LOSS}  # fmt: skip
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            try:
                self._export(data, metadata=self._metadata,
                             timeout=max(deadline - time.monotonic(), 0.001))  # fmt: skip
                return None
            except self._grpc.RpcError as exc:
                status = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                name = getattr(status, "name", status)
                failure = f"Failed to export spans batch, error code: {name}, details: {details}"
                if status not in retry or not _backoff(attempt, deadline):
                    return failure
            attempt += 1

    def close(self) -> None:
        self._channel.close()


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read()
