"""A model version's inference-logging settings, parsed once at registration.

The per-model values come from the one settings table (server/config/model_settings.py: model config
``inferenceLog*`` keys, registration parameters ``inference_log*``, then the server's
``inference_log*`` defaults); how sinks behave (queue, retries, rotation) is the server's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from server.config.model_settings import INFERENCE_LOG_MODES as MODES
from server.errors import InvalidModel


@dataclass(frozen=True)
class LogPolicy:
    """What one model version logs and where. ``sample``: every Nth request (mlrun's
    ``log_stream_sample``); ``batch``: records a sink takes per send (``log_stream_batch``)."""

    mode: str
    sample: int
    batch: int
    url: str | None  # a CloudEvents receiver; None: no HTTP sink
    file: bool  # JSON lines under the run dir
    redact: tuple[str, ...]  # key names, or JSON pointers ("/inputs/0/ssn")

    @property
    def requests(self) -> bool:
        return self.mode in ("request", "all")

    @property
    def responses(self) -> bool:
        return self.mode in ("response", "all")


def parse_policy(label: str, settings: Any) -> LogPolicy | None:
    """``settings``' inference-log values checked; None when logging is off (or has no sink).
    Raises InvalidModel naming the setting and the value found."""
    sources = getattr(settings, "sources", {})

    def bad(attr: str, key: str, value: Any, wanted: str) -> InvalidModel:
        where = sources.get(attr, "server")
        return InvalidModel(
            f"model {label}: {key} should be {wanted}, found {value!r} (from the {where})"
        )

    mode = settings.inference_log
    if mode in (None, "", False):
        mode = "off"
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise bad("inference_log", "inferenceLog", mode, f"one of {', '.join(MODES)}")
    mode = mode.lower()
    numbers = {}
    for attr, key in (("inference_log_sample", "inferenceLogSample"),
                      ("inference_log_batch", "inferenceLogBatch")):  # fmt: skip
        value = getattr(settings, attr)
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(attr, key, value, "a whole number of at least 1")
        numbers[attr] = value
    url = settings.inference_log_url or None
    if url is not None:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise bad("inference_log_url", "inferenceLogUrl", url, "an http:// or https:// URL")
    file = settings.inference_log_file
    if isinstance(file, str) and file.lower() in ("true", "false"):
        file = file.lower() == "true"
    if not isinstance(file, bool):
        raise bad("inference_log_file", "inferenceLogFile", file, "true or false")
    redact = settings.inference_log_redact or ()
    if isinstance(redact, str):
        redact = tuple(r.strip() for r in redact.split(",") if r.strip())
    if not isinstance(redact, (list, tuple)) or not all(isinstance(r, str) and r for r in redact):
        raise bad("inference_log_redact", "inferenceLogRedact", redact,
                  "a list of key names or JSON pointers")  # fmt: skip
    if mode == "off" or (url is None and not file):
        return None
    return LogPolicy(mode, numbers["inference_log_sample"], numbers["inference_log_batch"],
                     url, file, tuple(redact))  # fmt: skip


def safe_url(url: str) -> str:
    """``url`` without its user name and password, for the log."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return parts._replace(netloc=host).geturl()
