"""What tracing the server does, from its settings and the standard ``OTEL_*`` variables
(docs/observability.md): :func:`trace_settings`, checked when the config is loaded and
read again by :func:`server.tracing.setup`; :func:`export_options`, how the exporter process
sends, read there. Every ``OTEL_EXPORTER_OTLP_*`` variable is read through
:func:`otlp_variable`, the ``TRACES_`` one first."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from server.errors import ConfigError

PROTOCOLS = ("http/protobuf", "grpc")


class TraceConfig(Protocol):
    """The server settings tracing reads (server/config/'s ServerConfig has them); None:
    unset, the standard variables then decide."""

    @property
    def otel_endpoint(self) -> str | None: ...

    @property
    def otel_protocol(self) -> str | None: ...

    @property
    def otel_sampling_ratio(self) -> float | None: ...


@dataclass(frozen=True)
class TraceSettings:
    """What the frontend needs to trace: where spans go, how, and how many new traces."""

    endpoint: str
    protocol: str
    sampling_ratio: float


def otlp_variable(environ: Mapping[str, str], name: str, default: str = "") -> str:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``, else
    ``default``: the signal's own variable wins, as the OpenTelemetry specification says, and an
    empty one counts as unset."""
    return (
        environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
        or environ.get(f"OTEL_EXPORTER_OTLP_{name}")
        or default
    ).strip()


@dataclass(frozen=True)
class ExportOptions:
    """How the exporter process sends (what the SDK's exporters read from the environment)."""

    headers: dict[str, str]  # names in lower case
    timeout_s: float  # per export, retries included
    compression: str  # "none", "gzip" or "deflate"
    certificate: str | None  # the CA bundle (PEM) the collector's certificate is checked with
    insecure: bool | None  # gRPC without TLS; None: as the endpoint's scheme says
    client_certificate: str | None  # PEM: ours, for a collector that asks for one
    client_key: str | None  # PEM: its private key (None: in client_certificate's file)


def export_options(environ: Mapping[str, str]) -> ExportOptions:
    """The standard variables' options, read by the exporter process (its environment is the
    server's): headers in W3C baggage format, percent-decoded (the SDK's
    ``parse_env_headers(..., liberal=True)``: an unencoded value with spaces is taken as it
    is), timeout (seconds, as the SDK reads it), compression, certificate, insecure, client
    certificate and key."""
    headers: dict[str, str] = {}
    raw = otlp_variable(environ, "HEADERS")
    if raw:
        from opentelemetry.util.re import parse_env_headers

        headers = {k.lower(): v for k, v in parse_env_headers(raw, liberal=True).items()}
    try:
        timeout_s = float(otlp_variable(environ, "TIMEOUT", "10"))
    except ValueError:
        timeout_s = 10.0
    compression = otlp_variable(environ, "COMPRESSION", "none").lower()
    if compression not in ("none", "gzip", "deflate"):
        compression = "none"
    insecure = otlp_variable(environ, "INSECURE").lower()
    return ExportOptions(
        headers, timeout_s, compression, otlp_variable(environ, "CERTIFICATE") or None,
        insecure == "true" if insecure else None,
        otlp_variable(environ, "CLIENT_CERTIFICATE") or None,
        otlp_variable(environ, "CLIENT_KEY") or None,
    )  # fmt: skip


def trace_settings(config: TraceConfig, environ: Mapping[str, str]) -> TraceSettings | None:
    """What tracing the server does: None (off) without an endpoint, or with
    ``OTEL_SDK_DISABLED=true`` / ``OTEL_TRACES_EXPORTER=none``. Our settings win over the
    standard variables; bad values are refused with the setting's name."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    protocol = (config.otel_protocol or otlp_variable(environ, "PROTOCOL", "http/protobuf")).strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"'otel_protocol' should be one of {', '.join(PROTOCOLS)}, found {protocol!r}"
        )
    endpoint = config.otel_endpoint
    if not endpoint:
        traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if traces:
            endpoint = traces
        elif base:  # the base URL: OTLP/HTTP appends the signal's path
            endpoint = base.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else base
    if not endpoint:
        return None
    if not re.match(r"^https?://[^/\s]+", endpoint):
        raise ConfigError(
            f"'otel_endpoint' should be an http:// or https:// URL, found {endpoint!r}"
        )
    ratio = config.otel_sampling_ratio
    if ratio is None:
        raw = environ.get("OTEL_TRACES_SAMPLER_ARG")
        try:
            ratio = float(raw) if raw else 1.0
        except ValueError:
            raise ConfigError(
                f"OTEL_TRACES_SAMPLER_ARG should be a number from 0 to 1, found {raw!r}"
            ) from None
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"'otel_sampling_ratio' should be from 0 to 1, found {ratio!r}")
    return TraceSettings(endpoint, protocol, ratio)
