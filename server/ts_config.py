"""TorchServe's ``config.properties`` (and its config snapshots) read onto our server config.

A TorchServe deployment keeps its file: ``mserve --start --ts-config config.properties`` (or
``TS_CONFIG_FILE``) reads it with Java's ``Properties.load`` rules, maps each key TorchServe
documents onto our config (server/config.py, where the file sits in the precedence order), and
says once which keys have no effect here. A TorchServe config snapshot
(``logs/config/<timestamp>-snapshot.cfg``) is such a file too, with ``model_snapshot``: reading
it brings the models it records back as they were. A folder given as the file means the newest
snapshot in it, as TorchServe picks its last snapshot.

What each key becomes is one table here (``_MAPPED``, ``_NO_EFFECT``, ``_REFUSED``) and the
migration page (docs/migration.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import parse_model_entries
from server.errors import ConfigError

_WHITESPACE = " \t\f"
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_LINE_END = re.compile(r"(\r\n|\r|\n)")
_SURROGATE = re.compile("[\ud800-\udfff]")
_ENV_REF = re.compile(r"\$\$([^$]+[^$])\$\$")  # TorchServe's $$VAR$$ in a value
SNAPSHOT_NAME = re.compile(r"^(\d{17})-(startup|snapshot|shutdown)\.cfg$")


@dataclass(frozen=True)
class Property:
    key: str
    value: str
    line: int  # where its logical line starts, 1-based


def _unescape(text: str, path: Path, line: int) -> str:
    """Java's escapes: ``\\uXXXX``, ``\\t \\n \\r \\f``, and ``\\c`` for any other ``c``.
    A Java string is UTF-16: a ``\\uD83D\\uDE00`` pair is one character (a lone half stays)."""
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char != "\\" or i + 1 == len(text):
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "u":
            digits = text[i + 2 : i + 6]
            if len(digits) != 4 or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise ConfigError(
                    f"{path} line {line}: malformed \\uxxxx escape {text[i : i + 6]!r}"
                    " (\\u needs four hex digits)"
                )
            out.append(chr(int(digits, 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(nxt, nxt))
        i += 2
    result = "".join(out)
    if _SURROGATE.search(result):  # pairs join up, as in Java's UTF-16 string
        result = result.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return result


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """The lines of ``Properties.load`` (its LineReader, JDK 9 and later): CRLF, LF and CR end a
    line; one whose first non-blank character is ``#`` or ``!`` is a comment; blank lines are
    skipped; a line ending in an odd number of backslashes goes on onto the next, that one's
    leading whitespace dropped, and a blank line ends it. While the logical line is still empty
    (a lone ``\\`` continued), the next line counts as a new one: blank or comment, it is
    skipped. At the end of the file the last backslash is dropped, and a line of nothing else
    still counts (the key "" with value "") unless a CRLF follows it, as in Java."""
    chunks = _LINE_END.split(text)  # line, its end, line, its end, ..., the text after the last
    last = len(chunks) - 1
    out: list[tuple[int, str]] = []
    parts: list[str] = []  # the logical line so far
    start = 0
    for k in range(0, last + 1, 2):
        number = k // 2 + 1
        stripped = chunks[k].lstrip(_WHITESPACE)
        if not parts:
            if not stripped or stripped[0] in "#!":
                continue
            start = number
        elif not stripped:  # a blank line after a continued one ends it
            out.append((start, "".join(parts)))
            parts = []
            continue
        trailing = len(stripped) - len(stripped.rstrip("\\"))
        if not trailing % 2:
            parts.append(stripped)
            out.append((start, "".join(parts)))
            parts = []
            continue
        if len(stripped) > 1:
            parts.append(stripped[:-1])
        # The file ends here, or right after this line's CR or LF: Java takes the line as it
        # stands, even empty. After a last CRLF it reads on to the end first, and an empty
        # line is then none (the blank-line rules above).
        if k == last or (k + 2 == last and not chunks[last] and chunks[k + 1] != "\r\n"):
            out.append((start, "".join(parts)))
            parts = []
    return out


def parse_properties(text: str, path: Path) -> dict[str, Property]:
    """Keys and values as ``java.util.Properties.load`` reads them (the last of a repeated key
    wins); the only malformed input Java knows, a bad ``\\u`` escape, names the line."""
    props: dict[str, Property] = {}
    for line, logical in _logical_lines(text):
        i, n = 0, len(logical)
        while i < n:  # the key ends at an unescaped separator or whitespace
            char = logical[i]
            if char == "\\":
                i += 2
                continue
            if char in "=:" or char in _WHITESPACE:
                break
            i += 1
        key_raw, rest = logical[:i], logical[i:]
        rest = rest.lstrip(_WHITESPACE)
        if rest[:1] in ("=", ":"):
            rest = rest[1:].lstrip(_WHITESPACE)
        key = _unescape(key_raw, path, line)
        props[key] = Property(key, _unescape(rest, path, line), line)
    return props


def read_properties(path: Path) -> dict[str, Property]:
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ConfigError(f"TorchServe config {path} is a folder") from None
    except OSError as exc:
        raise ConfigError(f"cannot read TorchServe config {path}: {exc.strerror}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # Java reads properties files as ISO-8859-1
        text = data.decode("latin-1")
    return parse_properties(text, path)


def newest_snapshot(folder: Path) -> Path:
    """The newest ``<yyyyMMddHHmmssSSS>-<kind>.cfg`` in TorchServe's snapshot folder."""
    try:
        found = find_newest_snapshot(folder)
    except OSError as exc:
        raise ConfigError(f"cannot read TorchServe snapshot folder {folder}: {exc}") from exc
    if found is None:
        raise ConfigError(
            f"{folder} holds no TorchServe config snapshot (<timestamp>-snapshot.cfg,"
            " -startup.cfg or -shutdown.cfg)"
        )
    return found


def find_newest_snapshot(folder: Path) -> Path | None:
    """As TorchServe picks its last snapshot: the newest by the time stamp in the name, of
    any kind; None when there is none (``OSError`` when the folder cannot be read)."""
    names = [p for p in folder.iterdir() if SNAPSHOT_NAME.match(p.name) and p.is_file()]
    return max(names, key=lambda p: p.name[:17]) if names else None


# --- what each key becomes ----------------------------------------------------------------


def _address(value: str, where: str, key: str) -> str:
    """``http://host[:port]`` (TorchServe's form), ``https://host[:port]`` (TLS, with
    certificate_file and private_key_file) or ``host:port``. Unix sockets are refused."""
    lower = value.lower()
    if lower.startswith("unix:"):
        raise ConfigError(f"{where}: {key}={value}: unix socket addresses are not supported")
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if lower.startswith(scheme):
            rest = value[len(scheme) :].rstrip("/")
            if ":" not in rest.rsplit("]", 1)[-1]:
                rest += port  # TorchServe's default port for a bare host
            return rest if scheme == "http://" else scheme + rest
    return value


def _grpc_address(host: str, port: str, where: str, key: str) -> str:
    """TorchServe's gRPC host (an IP or name, no port) and port as our ``host:port``."""
    host = host.strip()
    if host.lower().startswith(("http://", "https://", "unix:")):
        raise ConfigError(f"{where}: {key}={host}: TorchServe's gRPC address is a host, no scheme")
    if ":" in host and not host.startswith("["):  # an IPv6 address
        host = f"[{host}]"
    return f"{host}:{port.strip()}"


def _boolean(value: str, where: str, key: str) -> bool:
    """``true``/``false`` in any case; anything else is an error here, where Java would read it
    as false without a word."""
    text = value.strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"{where}: {key} should be true or false, found {value!r}")
    return text == "true"


def _load_models(value: str, where: str, key: str) -> tuple[str, ...]:
    text = value.strip()
    if text.lower() == "standalone":  # TorchServe's documented "no models"
        return ()
    if text.lower() == "all":
        return ("all",)
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _workers(value: str, where: str, key: str) -> str | None:
    """0 means "TorchServe picks" there; here the server's own default (one) applies."""
    return None if value.strip() == "0" else value


def _same(value: str, where: str, key: str) -> str:
    return value


def _entries(value: str, where: str, key: str) -> Any:
    return parse_model_entries(value, key, where)


def _list(value: str, where: str, key: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _name_regex(value: str, where: str, key: str) -> str | None:
    """TorchServe's ``blacklist_env_vars``: a (Java) regular expression a variable's whole name
    must match for workers not to get it; empty, none. Python reads the usual ones alike."""
    if not value.strip():
        return None
    try:
        re.compile(value)
    except re.error as exc:
        raise ConfigError(
            f"{where}: {key}={value} is not a valid regular expression: {exc}"
        ) from None
    return value


# TorchServe key -> (our key, conversion)
_Convert = Callable[[str, str, str], Any]
_MAPPED: dict[str, tuple[str, _Convert]] = {
    "inference_address": ("inference_address", _address),
    "management_address": ("management_address", _address),
    "metrics_address": ("metrics_address", _address),
    "model_store": ("model_store", _same),
    "workflow_store": ("workflow_store", _same),
    "load_models": ("load_models", _load_models),
    "models": ("models", _entries),
    "model_snapshot": ("model_snapshot", _entries),
    "default_workers_per_model": ("default_workers_per_model", _workers),
    "default_response_timeout": ("response_timeout_s", _same),
    "default_startup_timeout": ("startup_timeout_s", _same),
    "job_queue_size": ("job_queue_size", _same),
    "number_of_gpu": ("number_of_gpu", _same),
    "max_request_size": ("max_request_size_bytes", _same),
    "max_response_size": ("max_response_size_bytes", _same),
    "install_py_dep_per_model": ("install_py_dep_per_model", _boolean),
    "allowed_urls": ("allowed_urls", _list),
    "blacklist_env_vars": ("worker_env_deny_regex", _name_regex),
    "disable_token_authorization": ("disable_token_authorization", _boolean),
    "enable_model_api": ("enable_model_api", _boolean),
    "model_api_enabled": ("enable_model_api", _boolean),  # TorchServe 0.11's name
    "token_expiration_min": ("token_expiration_min", _same),
    "certificate_file": ("certificate_file", _same),
    "private_key_file": ("private_key_file", _same),
    "metrics_mode": ("metrics_mode", lambda v, w, k: v.strip().lower()),
    "metrics_config": ("metrics_config", _same),
    "model_metrics_auto_detect": ("model_metrics_auto_detect", _boolean),
    "disable_system_metrics": ("disable_system_metrics", _boolean),
    "enable_grpc_ssl": ("enable_grpc_ssl", _boolean),
    "service_envelope": ("service_envelope", _same),  # checked against our choices
    "ts_header_key_sequence_id": ("sequence_id_header", _same),
    "ts_header_key_sequence_start": ("sequence_start_header", _same),
    "ts_header_key_sequence_end": ("sequence_end_header", _same),
}
# TorchServe gives each gRPC API a host and a port in two keys; ours is one host:port.
# (our key, TorchServe's host key, its default, TorchServe's port key, its default)
_GRPC_ADDRESSES = tuple(
    (f"grpc_{api}_address", f"grpc_{api}_address", "127.0.0.1", f"grpc_{api}_port", port)
    for api, port in (("inference", "7070"), ("management", "7071"))
)
# Keys that steer how the file itself is read, or that TorchServe writes into its snapshots
# for its own bookkeeping: used here or meaningless, never warned about.
_QUIET = frozenset(
    ("enable_envvars_config", "use_env_allowed_urls", "tsConfigFile", "version", "NUM_WORKERS")
)
# Keys of the JVM, Netty, gRPC, plugins and other TorchServe-only parts: accepted, no effect,
# listed in one warning.
_NO_EFFECT = frozenset((
    "vmargs", "number_of_netty_threads", "netty_client_threads", "async_logging",
    "prefer_direct_buffer", "use_native_io", "io_ratio", "plugins_path", "model_server_home",
    "snapshot_store", "initial_worker_port", "initial_distribution_port", "python",
    "grpc_inference_max_connection_age_ms",
    "grpc_management_max_connection_age_ms", "grpc_inference_max_connection_age_grace_ms",
    "grpc_management_max_connection_age_grace_ms",
    "ts_open_inference_protocol", "cors_allowed_origin", "cors_allowed_methods",
    "cors_allowed_headers", "keystore", "keystore_pass", "keystore_type",
    "default_service_handler", "limit_max_image_pixels", "unregister_model_timeout",
    "metric_time_interval", "system_metrics_cmd", "enable_metrics_api", "ipex_enable",
    "cpu_launcher_enable", "cpu_launcher_args", "ipex_gpu_enable", "cpp_log_config", "debug",
))  # fmt: skip
# Keys whose non-default value would change what clients or handlers get, or what workers can
# see: ignoring them would be silently wrong, so only their default value is accepted.
_REFUSED: dict[str, tuple[Callable[[str], bool], str]] = {
    "decode_input_request": (
        lambda v: v.strip().lower() == "true",
        "mserve always decodes JSON and text bodies for handlers (TorchServe's default, true)",
    ),
}
# TorchServe reads these variables (its TS_ field names) when enable_envvars_config=true.
_ENV_NAMES: dict[str, str] = {
    **{f"TS_{key.upper()}": key for key in (
        "debug", "inference_address", "management_address", "metrics_address", "load_models",
        "blacklist_env_vars", "default_workers_per_model", "default_response_timeout",
        "default_startup_timeout", "unregister_model_timeout", "number_of_netty_threads",
        "netty_client_threads", "job_queue_size", "number_of_gpu", "metrics_config",
        "metrics_mode", "model_metrics_auto_detect", "disable_system_metrics", "ipex_enable",
        "cpu_launcher_enable", "cpu_launcher_args", "ipex_gpu_enable", "async_logging",
        "cors_allowed_origin", "cors_allowed_methods", "cors_allowed_headers",
        "decode_input_request", "keystore", "keystore_pass", "keystore_type",
        "certificate_file", "private_key_file", "max_request_size", "max_response_size",
        "limit_max_image_pixels", "default_service_handler", "service_envelope",
        "model_server_home", "model_store", "prefer_direct_buffer", "allowed_urls",
        "install_py_dep_per_model", "enable_metrics_api", "grpc_inference_address",
        "grpc_management_address", "grpc_inference_port", "grpc_management_port",
        "grpc_inference_max_connection_age_ms", "grpc_management_max_connection_age_ms",
        "grpc_inference_max_connection_age_grace_ms",
        "grpc_management_max_connection_age_grace_ms", "enable_grpc_ssl",
        "initial_worker_port", "initial_distribution_port", "workflow_store", "cpp_log_config",
        "disable_token_authorization", "enable_model_api",
    )},
    "TS_OPEN_INFERENCE_PROTOCOL": "ts_open_inference_protocol",
    "TS_TOKEN_EXPIRATION_TIME_MIN": "token_expiration_min",
    "TS_HEADER_KEY_SEQUENCE_ID": "ts_header_key_sequence_id",
    "TS_HEADER_KEY_SEQUENCE_START": "ts_header_key_sequence_start",
    "TS_HEADER_KEY_SEQUENCE_END": "ts_header_key_sequence_end",
}  # fmt: skip


@dataclass(frozen=True)
class TsConfig:
    """A properties file read onto our config: one layer per key (each naming its line, so a
    bad value's error says where it is), and the keys that have no effect here."""

    path: Path
    layers: tuple[tuple[str, dict[str, Any]], ...]
    no_effect: tuple[str, ...]
    unknown: tuple[str, ...]
    # every key as read (variables resolved): what a config snapshot writes back
    properties: tuple[tuple[str, str], ...] = ()

    def warnings(self) -> list[str]:
        out = []
        if self.no_effect:
            out.append(
                f"{self.path}: these TorchServe keys have no effect on mserve (JVM, Netty, gRPC,"
                f" plugins and other TorchServe-only parts; see docs/migration.md):"
                f" {', '.join(self.no_effect)}"
            )
        if self.unknown:
            out.append(
                f"{self.path}: unknown keys, ignored as TorchServe ignores them:"
                f" {', '.join(self.unknown)}"
            )
        return out


def _resolve_env_refs(prop: Property, path: Path, environ: Mapping[str, str]) -> str:
    """TorchServe replaces ``$$NAME$$`` in a value with the variable NAME, which must exist."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ConfigError(
                f"{path} line {prop.line}: {prop.key} refers to the environment variable"
                f" {name} ($${name}$$), which is not set"
            )
        return environ[name]

    return _ENV_REF.sub(one, prop.value)


def load_ts_config(path: Path, environ: Mapping[str, str]) -> TsConfig:
    """Read ``path`` (a folder: its newest snapshot) and map it; values are checked when the
    layers are merged (server/config.py), each error naming the file, line and key."""
    if path.is_dir():
        path = newest_snapshot(path)
    props = read_properties(path)
    values: dict[str, tuple[str, str]] = {}  # TorchServe key -> (value, where)
    for key, prop in props.items():
        values[key] = (_resolve_env_refs(prop, path, environ), f"{path} line {prop.line}")
    enabled = values.get("enable_envvars_config", ("false", ""))
    if _boolean(enabled[0], enabled[1], "enable_envvars_config"):
        env_urls = values.get("use_env_allowed_urls", ("false", ""))[0].strip().lower()
        for env_name, key in _ENV_NAMES.items():
            if env_name in environ and (key != "allowed_urls" or env_urls == "true"):
                values[key] = (environ[env_name], f"environment variable {env_name}")
    layers: list[tuple[str, dict[str, Any]]] = []
    no_effect, unknown = [], []
    grpc_keys = {k for row in _GRPC_ADDRESSES for k in (row[1], row[3])}
    for ours, host_key, host_default, port_key, port_default in _GRPC_ADDRESSES:
        if host_key in values or port_key in values:
            host, where = values.get(host_key, (host_default, ""))
            port, port_where = values.get(port_key, (port_default, ""))
            layers.append((
                f"{where or port_where} ({host_key}, {port_key})",
                {ours: _grpc_address(host, port, where or port_where, host_key)},
            ))  # fmt: skip
    for key, (value, where) in values.items():
        if key in grpc_keys:
            continue
        if key in _MAPPED:
            ours, convert = _MAPPED[key]
            converted = convert(value, where, key)
            if converted is not None:
                layers.append((f"{where} ({key})", {ours: converted}))
        elif key in _REFUSED:
            accepted, reason = _REFUSED[key]
            if not accepted(value):
                raise ConfigError(f"{where}: {key}={value} is not supported: {reason}")
        elif key in _NO_EFFECT:
            no_effect.append(key)
        elif key not in _QUIET:
            unknown.append(key)
    if "install_py_dep_per_model" not in values:  # TorchServe's default differs from ours
        layers.insert(0, (f"{path} (TorchServe's default)", {"install_py_dep_per_model": False}))
    properties = tuple((key, value) for key, (value, _where) in values.items())
    return TsConfig(
        path, tuple(layers), tuple(sorted(no_effect)), tuple(sorted(unknown)), properties
    )
