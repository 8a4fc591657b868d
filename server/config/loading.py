"""The server config from its layers: defaults, a TorchServe properties file, a YAML file,
``MSERVE_*`` variables and flags, each value parsed to its setting's type and checked, with
errors that name the key and where it came from (the precedence is server/config/__init__.py's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from server.config.addresses import ADDRESS_KEYS, GRPC_ADDRESS_KEYS, grpc_tls, split_address
from server.config.entries import parse_model_entries
from server.config.model_settings import (
    BATCH_WAITS,
    INFERENCE_LOG_MODES,
    SIGNATURE_POLICIES,
    WEIGHTS_SCAN_MODES,
)
from server.config.server_config import ServerConfig
from server.errors import ConfigError
from server.tracing.settings import trace_settings

ENV_PREFIX = "MSERVE_"


@functools.cache
def _types() -> dict[str, Any]:
    """The settings' types, evaluated once: the evaluation is slow, and each setting asks."""
    return get_type_hints(ServerConfig)


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed)."""
    args = get_args(hint)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


_EXPECTED = {
    bool: "true or false",
    int: "a non-negative integer",
    float: "a positive finite number",
    str: "a string",
}
# Integer keys for which 0 makes no sense (every request refused, or none served); the rest
# (worker counts, GPU count, batch delay) may be 0. Float keys (timeouts) must be > 0 and finite.
_AT_LEAST_ONE = frozenset(
    ("batch_size", "job_queue_size", "max_request_size_bytes", "max_response_size_bytes",
     "max_connections", "download_max_bytes", "worker_memory_budget_mb", "max_loaded_models",
     "inference_log_sample", "inference_log_batch", "inference_log_queue_size",
     "inference_log_file_max_bytes")
)  # fmt: skip
# Float keys for which 0 is meaningful: a sampling ratio of 0 traces only what a client's
# sampled traceparent asks for.
_ZERO_ALLOWED = frozenset(("otel_sampling_ratio",))


# Keys that take one of a few words; TorchServe reads metrics_mode without regard to case or
# spaces, and so do we.
_CHOICES = {
    "metrics_mode": ("prometheus", "log", "legacy"),
    "log_layout": ("mserve", "torchserve"),
    "log_format": ("text", "json"),
    "layout": ("mserve", "torchserve"),
    "batch_wait": BATCH_WAITS,
    "eviction": ("cost", "lru"),
    "inference_log": INFERENCE_LOG_MODES,
    "weights_scan": WEIGHTS_SCAN_MODES,
    "service_envelope": ("", "kserve", "kservev2", "json", "body"),
    "archive_signatures": SIGNATURE_POLICIES,
}


def _choice(key: str, value: str, source: str) -> str:
    word = "".join(value.split()).lower()
    if word not in _CHOICES[key]:
        raise ConfigError(
            f"{source}: '{key}' should be one of"
            f" {', '.join(c or repr(c) for c in _CHOICES[key])}, found {value!r}"
        )
    return word


def _coerce(key: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the field's type; strings from env and flags are parsed."""
    if key == "ts_properties":
        return tuple((str(k), str(v)) for k, v in value)
    if key in ("models", "model_snapshot"):
        if value is None:
            return None if key == "model_snapshot" else ()
        if isinstance(value, tuple):  # already parsed (the properties file's layer)
            return value
        return parse_model_entries(value, key, source)
    kind, optional = _base_type(_types()[key])
    if value is False and "off" in _CHOICES.get(key, ()):  # YAML reads a bare off as false
        return "off"
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{source}: '{key}' must not be empty")
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number = int(value)
            if number < (1 if key in _AT_LEAST_ONE else 0):
                raise ValueError
            return number
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if (
                not math.isfinite(number)
                or number < 0
                or (number == 0 and key not in _ZERO_ALLOWED)
            ):
                raise ValueError
            return number
        if get_origin(kind) is tuple:
            if isinstance(value, str):
                value = value.split(",")
            if not isinstance(value, (list, tuple)):
                raise ValueError
            return tuple(str(v).strip() for v in value if str(v).strip())
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError
        if key in _CHOICES:
            return _choice(key, str(value), source)
        return str(value)
    except (TypeError, ValueError, OverflowError):
        expected = _EXPECTED.get(kind, "a list")
        if kind is int and key in _AT_LEAST_ONE:
            expected = "a positive integer"
        raise ConfigError(f"{source}: '{key}' should be {expected}, found {value!r}") from None


# Keys the CLI fills in (where the server was started, what the properties file said): not for
# a config file or a variable to set.
_SET_BY_THE_CLI = frozenset(("start_dir", "ts_properties", "ts_config_file"))


def _merge(layers: list[tuple[str, Mapping[str, Any]]]) -> ServerConfig:
    known = {f.name for f in fields(ServerConfig)}
    values: dict[str, Any] = {}
    for source, layer in layers:
        for key, value in layer.items():
            if key not in known or (key in _SET_BY_THE_CLI and source != "command line"):
                name = f"{ENV_PREFIX}{key.upper()}" if source.startswith("environment") else key
                raise ConfigError(
                    f"{source}: unknown key '{name}'; known keys:"
                    f" {', '.join(sorted(known - _SET_BY_THE_CLI))}"
                )
            values[key] = _coerce(key, value, source)
    config = dataclasses.replace(ServerConfig(), **values)
    tls = [k for k in ADDRESS_KEYS if split_address(getattr(config, k), k)[0]]
    if tls and not (config.certificate_file and config.private_key_file):
        raise ConfigError(
            f"{tls[0]} is {getattr(config, tls[0])}: serving https needs certificate_file and"
            " private_key_file (PEM files)"
        )
    for key in GRPC_ADDRESS_KEYS:
        split_address(getattr(config, key), key)  # a bad one stops the start, naming the key
    _check_distinct_ports(config)
    if (
        config.grpc
        and grpc_tls(config)
        and not (config.certificate_file and config.private_key_file)
    ):
        raise ConfigError(
            "enable_grpc_ssl is true (or a grpc_*_address is https://): serving gRPC over TLS"
            " needs certificate_file and private_key_file (PEM files)"
        )
    _check_allowed_urls(config.allowed_urls)
    if config.worker_env_deny_regex is not None:
        try:
            re.compile(config.worker_env_deny_regex)
        except re.error as exc:
            raise ConfigError(
                f"worker_env_deny_regex: {config.worker_env_deny_regex!r} is not a valid regular"
                f" expression: {exc}"
            ) from None
    return config


def _check_distinct_ports(config: ServerConfig) -> None:
    """Each API needs a port of its own. Checked on the final values, so a TorchServe file that
    puts two APIs on one port (KServe's TorchServe layout does) works once a later layer (an
    ``MSERVE_*`` variable, a flag) moves one of them."""
    wildcard = ("0.0.0.0", "::")
    seen: list[tuple[str, int, str]] = []
    for key in (*ADDRESS_KEYS, *(GRPC_ADDRESS_KEYS if config.grpc else ())):
        _tls, host, port = split_address(getattr(config, key), key)
        if port == 0:
            continue
        for other_host, other_port, other in seen:
            clash = host == other_host or host in wildcard or other_host in wildcard
            if port == other_port and clash:
                raise ConfigError(
                    f"{other} and {key} are both port {port} ({other_host}, {host}); mserve"
                    " needs a port for each API (TorchServe serves two APIs on one port when"
                    " their addresses are equal)"
                )
        seen.append((host, port, key))


def _check_allowed_urls(patterns: tuple[str, ...]) -> None:
    """A pattern that does not compile is a start error, not a 500 at the first registration."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(
                f"allowed_urls: {pattern!r} is not a valid regular expression: {exc}"
            ) from None


def load_yaml(path: Path) -> dict[str, Any]:
    return read_yaml_mapping(
        path,
        cannot_read=f"cannot read config file {path}",
        invalid=f"config file {path} is not valid YAML",
        not_mapping=f"config file {path}: expected a mapping of keys",
    )


def read_yaml_mapping(
    path: Path, *, cannot_read: str, invalid: str, not_mapping: str
) -> dict[str, Any]:
    """A YAML file that must hold a mapping (an empty file reads as ``{}``); each failure a
    ConfigError in the caller's words, as each file names itself its own way."""
    import yaml  # here: slow to import, paid only when there is a YAML file to read

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{cannot_read}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{invalid}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(not_mapping)
    return data


def from_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``MSERVE_<KEY>`` variables, lower-cased to keys (unknown ones are reported by _merge)."""
    skip = {"MSERVE_CONFIG"}  # names the file itself
    return {
        k[len(ENV_PREFIX) :].lower(): v
        for k, v in environ.items()
        if k.startswith(ENV_PREFIX) and k not in skip
    }


def load_config(
    config_file: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    ts_layers: list[tuple[str, Mapping[str, Any]]] | None = None,
) -> ServerConfig:
    """``ts_layers``: the TorchServe properties file's values, each with where it came from
    (server/ts_config.py), below the YAML file."""
    env = os.environ if environ is None else environ
    if config_file is None and env.get("MSERVE_CONFIG"):
        config_file = Path(env["MSERVE_CONFIG"])
    layers: list[tuple[str, Mapping[str, Any]]] = list(ts_layers or ())
    if config_file is not None:
        layers.append((f"config file {config_file}", load_yaml(config_file)))
    layers.append(("environment (MSERVE_*)", from_environ(env)))
    layers.append(("command line", {k: v for k, v in (flags or {}).items() if v is not None}))
    config = _merge(layers)
    if config.torchserve:  # TorchServe's own defaults, below everything the user said
        config = _merge([("TorchServe's defaults", TORCHSERVE_DEFAULTS), *layers])
    trace_settings(config, env)  # bad tracing settings fail here, before the server starts
    return config


# Where TorchServe's defaults differ from ours, the TorchServe layout takes TorchServe's
# (docs/migration.md lists them with the key that restores ours).
TORCHSERVE_DEFAULTS: Mapping[str, Any] = {
    "log_layout": "torchserve",
    "metrics_mode": "log",
    "model_metrics_auto_detect": False,
    "install_py_dep_per_model": False,
    "max_retry_timeout_s": 300.0,
}
