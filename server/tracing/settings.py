"""What tracing the server does, from its settings and the standard ``OTEL_*`` variables
(docs/server.md, Observability): :func:`trace_settings`, checked when the config is loaded and
read again by :func:`server.tracing.setup`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from server.errors import ConfigError

PROTOCOLS = ("http/protobuf", "grpc")


class TraceConfig(Protocol):
    """The server settings tracing reads (server/config.py's ServerConfig has them); None:
    unset, the standard variables then decide."""

    @property
    def otel_endpoint(self) -> str | None: ...

    @property
    def otel_protocol(self) -> str | None: ...

    @property
    def otel_sampling_ratio(self) -> float | None: ...


@dataclass(frozen=True)
class TraceSettings:
    endpoint: str
    protocol: str
    sampling_ratio: float
    headers: dict[str, str]


def trace_settings(config: TraceConfig, environ: Mapping[str, str]) -> TraceSettings | None:
    """What tracing the server does: None (off) without an endpoint, or with
    ``OTEL_SDK_DISABLED=true`` / ``OTEL_TRACES_EXPORTER=none``. Our settings win over the
    standard variables; bad values are refused with the setting's name."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    protocol = (
        config.otel_protocol
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
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
    headers = {}
    for pair in (environ.get("OTEL_EXPORTER_OTLP_HEADERS") or "").split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            headers[key.strip()] = value.strip()
    return TraceSettings(endpoint, protocol, ratio, headers)
