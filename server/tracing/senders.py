"""Sending encoded OTLP requests (server/tracing/otlp.py) from the span exporter process: OTLP/HTTP
(protobuf) over one kept-alive connection, OTLP/gRPC through TraceService's ``Export`` method,
each with the standard variables' options and the SDK exporters' retries."""

from __future__ import annotations

import gzip
import http.client
import random
import ssl
import time
import urllib.parse
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


class HttpSender:
    """OTLP/HTTP (protobuf) over one kept-alive connection, reopened when the collector
    closes it."""

    def __init__(self, endpoint: str, options: ExportOptions) -> None:
        url = urllib.parse.urlsplit(endpoint)
        self._https = url.scheme == "https"
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._https else 80)
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._timeout_s = options.timeout_s
        self._compression = options.compression
        self._headers = {"Content-Type": "application/x-protobuf", **options.headers}
        if self._compression != "none":
            self._headers.setdefault("content-encoding", self._compression)
        self._certificate = options.certificate
        self._conn: http.client.HTTPConnection | None = None

    def _post(self, data: bytes, timeout_s: float) -> tuple[int, str]:
        conn = self._conn
        if conn is None:
            if self._https:
                context = ssl.create_default_context(cafile=self._certificate)
                conn = http.client.HTTPSConnection(self._host, self._port, context=context)
            else:
                conn = http.client.HTTPConnection(self._host, self._port)
            self._conn = conn
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        conn.request("POST", self._path, data, self._headers)
        reply = conn.getresponse()
        reply.read()
        if reply.will_close:
            self.close()
        return reply.status, reply.reason

    def send(self, data: bytes) -> str | None:
        """Post one request; None once the collector took it, else why not."""
        if self._compression == "gzip":
            data = gzip.compress(data)
        elif self._compression == "deflate":
            import zlib

            data = zlib.compress(data)
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            reused = self._conn is not None and self._conn.sock is not None
            try:
                status, reason = self._post(data, max(deadline - time.monotonic(), 0.001))
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if reused:  # the collector closed the kept-alive connection: once more, now
                    continue
                failure = f"Failed to export spans batch: {exc or type(exc).__name__}"
            else:
                if 200 <= status < 400:
                    return None
                failure = f"Failed to export spans batch code: {status}, reason: {reason}"
                if status not in _HTTP_RETRY:
                    return failure
            if not _backoff(attempt, deadline):
                return failure
            attempt += 1

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


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
        if insecure:
            self._channel = grpc.insecure_channel(target, compression=compression)
        else:
            roots = None
            if options.certificate:
                with open(options.certificate, "rb") as file:
                    roots = file.read()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
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
