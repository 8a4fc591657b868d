"""The server config: one typed object from defaults, a TorchServe properties file, a YAML file,
``MSERVE_*`` variables and flags.

Precedence, lowest to highest: built-in defaults < TorchServe's ``config.properties``
(``--ts-config`` or ``TS_CONFIG_FILE``; its ``TS_<KEY>`` variables when the file sets
``enable_envvars_config=true``; server/ts_config.py) < YAML file (``--config``) < environment
(``MSERVE_<KEY>``, e.g. ``MSERVE_JOB_QUEUE_SIZE=50``) < command-line flags. A later layer replaces
a key's whole value. Unknown keys are errors naming the key and where it came from (the
properties file warns instead, as TorchServe ignores them). Every listener binds to 127.0.0.1
unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from server.errors import ConfigError
from server.models.settings import BATCH_WAITS, ENTRY_SETTINGS, INFERENCE_LOG_MODES, Setting
from server.rundir import KEY_FILE
from server.tracing.settings import trace_settings
from server.workers.env_vars import DEFAULT_DENY

ENV_PREFIX = "MSERVE_"

# A model version's settings in the ``models`` key and in a TorchServe snapshot are those of
# ENTRY_SETTINGS (server/models/settings.py), under TorchServe's names: integers, where a value
# <= 0 means "not set", as TorchServe reads them; and mserve's batchWait (one of BATCH_WAITS,
# when a batch waits for more requests; the first is the default).


@dataclass(frozen=True)
class ModelEntry:
    """One model version of the ``models`` key (TorchServe's per-model settings in
    config.properties) or of ``model_snapshot`` (the models TorchServe's snapshot records)."""

    name: str
    version: str
    settings: tuple[tuple[str, int | str], ...] = ()  # (archive model-config key, value) pairs
    default_version: bool = False
    mar_name: str | None = None
    url: str | None = None  # mserve's modelUrl in a snapshot it wrote (server/ts_snapshot.py)

    def get(self, key: str) -> int | str | None:
        return next((v for k, v in self.settings if k == key), None)


def _entry_value(setting: Setting, raw: Any, key: str, where: str) -> int | str | None:
    """One setting of a ``models`` or snapshot entry; None: unset (0 or less, which TorchServe
    reads as "not given", except a snapshot's worker counts)."""
    if setting.unit == "choice":
        if raw not in setting.choices:
            raise ConfigError(
                f"{where} {setting.key} should be one of {', '.join(setting.choices)},"
                f" found {raw!r}"
            )
        return str(raw)
    try:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        number = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} {setting.key} should be an integer, found {raw!r}") from None
    kept_zero = key == "model_snapshot" and setting.zero_kept
    return number if number > 0 or (number == 0 and kept_zero) else None


def parse_model_entries(value: Any, key: str, source: str) -> tuple[ModelEntry, ...]:
    """``{"name": {"version": {"minWorkers": 1, ...}}}`` as a mapping or its JSON text; for
    ``model_snapshot``, TorchServe's snapshot object whose ``models`` holds that mapping.
    Unknown parameters are ignored (TorchServe ignores them; newer versions add some)."""
    where = f"{source}: '{key}'"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {exc}") from None
    if key == "model_snapshot" and isinstance(value, dict):
        value = value.get("models", {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where} should map model names to versions, found {value!r}")
    out = []
    for name, versions in value.items():
        if not isinstance(versions, dict):
            raise ConfigError(f"{where}: model {name!r} should map versions to settings")
        for version, params in versions.items():
            if not isinstance(params, dict):
                raise ConfigError(f"{where}: {name} {version} should be an object of settings")
            settings = []
            for setting in ENTRY_SETTINGS:
                raw = params.get(setting.key)
                if raw is not None:
                    value = _entry_value(setting, raw, key, f"{where}: {name} {version}")
                    if value is not None:
                        settings.append((setting.key, value))
            default = params.get("defaultVersion", False)
            if not isinstance(default, bool):
                raise ConfigError(
                    f"{where}: {name} {version} defaultVersion should be true or false,"
                    f" found {default!r}"
                )
            mar = params.get("marName")
            if mar is not None and (not isinstance(mar, str) or not mar):
                raise ConfigError(f"{where}: {name} {version} marName should be a file name")
            if key == "model_snapshot" and mar is None:
                raise ConfigError(f"{where}: {name} {version} has no marName (the archive)")
            url = params.get("modelUrl")
            if url is not None and (not isinstance(url, str) or not url):
                raise ConfigError(f"{where}: {name} {version} modelUrl should be a string")
            out.append(ModelEntry(str(name), str(version), tuple(settings), default, mar, url))
    return tuple(out)


@dataclass(frozen=True)
class ServerConfig:
    inference_address: str = "127.0.0.1:8080"
    management_address: str = "127.0.0.1:8081"
    metrics_address: str = "127.0.0.1:8082"
    model_store: str | None = None
    run_dir: str = "~/.mserve"
    log_dir: str | None = None
    number_of_gpu: int | None = None
    default_workers_per_model: int = 1
    batch_size: int = 1
    max_batch_delay_ms: int = 100
    response_timeout_s: float = 120.0
    # On SIGTERM: how long queued and running requests may take to finish (the rest get 503),
    # and again how long workers get to exit; a pod's terminationGracePeriodSeconds covers both.
    shutdown_drain_s: float = 10.0
    startup_timeout_s: float = 120.0
    job_queue_size: int = 100
    retry_on_worker_death: bool = False
    # Many models on one server (server/models/residency.py): a model idle this long scales
    # down to its minWorkers (None: never, per model idleUnloadTimeout); the workers' memory
    # (PSS) and the number of models with workers that starting a worker on demand may not
    # pass, evicting the least recently used idle models first; how long such a start waits
    # for room.
    idle_unload_s: float | None = None
    worker_memory_budget_mb: int | None = None
    max_loaded_models: int | None = None
    load_wait_s: float = 30.0
    # a batch waits for more requests only while its worker is busy ("busy"), or up to
    # max_batch_delay_ms whatever the worker does ("fill", TorchServe's way)
    batch_wait: str = "busy"
    # the defaults of the per-model generative and stateful settings (server/models/settings.py)
    continuous_batching: bool = False
    client_timeout_ms: int = 0
    sequence_batching: bool = False
    max_num_sequence: int = 0
    sequence_max_idle_ms: int = 0
    sequence_timeout_ms: int = 0
    max_sequence_job_queue_size: int = 1
    # TorchServe's names of the sequence headers (ts_header_key_sequence_*)
    sequence_id_header: str = "ts_request_sequence_id"
    sequence_start_header: str = "ts_request_sequence_start"
    sequence_end_header: str = "ts_request_sequence_end"
    max_request_size_bytes: int = 6_553_500
    max_response_size_bytes: int = 6_553_500
    keepalive_timeout_s: float = 75.0
    read_timeout_s: float = 60.0
    max_connections: int = 4096
    allowed_paths: tuple[str, ...] = field(default_factory=tuple)
    access_log: bool = True
    snapshot: bool = True
    install_py_dep_per_model: bool = True
    env_dir: str | None = None
    protected_packages: tuple[str, ...] = ("torch",)
    fork_workers: bool = True
    # Confine every worker to its own model (server/workers/sandbox.py): on where the kernel
    # offers Landlock, with one warning at start where it does not; false turns it off.
    sandbox: bool = True
    # Run each model's workers as their own uid from this range when the server runs as root
    # (server/workers/sandbox_users.py); "off": they keep the server's user.
    sandbox_uid_range: str = "200000-299999"
    worker_preload: tuple[str, ...] = ()  # besides what the models' workers were seen to import
    # Registration by URL (TorchServe's allowed_urls: regular expressions a URL must match in
    # full); empty: the model store and allowed_paths only.
    allowed_urls: tuple[str, ...] = field(default_factory=tuple)
    # TorchServe's metrics settings: "prometheus", "log" or "legacy"; its metrics.yaml file.
    metrics_mode: str = "prometheus"
    metrics_config: str | None = None
    # "torchserve": TorchServe's log files (ts_log.log, access_log.log, model_log.log) in place
    # of ours (mserve.log, access.log), in TorchServe's line formats.
    log_layout: str = "mserve"
    # "json": one JSON object per line in mserve.log and access.log, for log shippers (the
    # TorchServe layout's files keep TorchServe's line formats); "text": our lines.
    log_format: str = "text"
    # OpenTelemetry traces (server/tracing/): exported over OTLP to otel_endpoint (unset:
    # the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing is off), with
    # otel_protocol "http/protobuf" or "grpc", sampling otel_sampling_ratio of new traces.
    otel_endpoint: str | None = None
    otel_protocol: str | None = None
    otel_sampling_ratio: float | None = None
    # "torchserve" (what the ``torchserve`` command runs; server/torchserve.py): every file where
    # TorchServe writes it, relative to start_dir (the folder the server was started from):
    # key_file.json there, the logs in log_dir (TorchServe's LOG_LOCATION, default logs/), the
    # metric logs in metrics_log_dir (METRICS_LOCATION, default the log folder), config
    # snapshots in <log folder>/config/ instead of <run_dir>/snapshot.json; TorchServe's
    # defaults and answers (0 workers for a registration that names none, 500 for a handler
    # that fails to load and for a timed-out batch, its 405 message); the server's console on
    # the caller's terminal.
    layout: str = "mserve"
    start_dir: str | None = None
    metrics_log_dir: str | None = None
    # the properties file's own keys and values, as read (written back into the snapshots)
    ts_properties: tuple[tuple[str, str], ...] = ()
    # Token authorization (server/auth.py): on unless disabled. Keys expire after
    # token_expiration_min, or the per-kind value when set; the paths that need no key (on the
    # inference and management ports); whether the metrics port wants the management key.
    disable_token_authorization: bool = False
    token_expiration_min: float = 60.0
    inference_token_expiration_min: float | None = None
    management_token_expiration_min: float | None = None
    # Fixed keys instead of random ones (a mounted Secret, so every replica behind a Service
    # takes the same key): a JSON file in key_file.json's layout (server/auth.py). Fixed keys do
    # not expire and are not rotated through the API; change the file and restart instead.
    token_key_file: str | None = None
    token_exempt_paths: tuple[str, ...] = (
        "/ping", "/v2/health/live", "/v2/health/ready", "/api-description"
    )  # fmt: skip
    metrics_need_token: bool = False
    # TorchServe's model API control: registering and unregistering through the API is off
    # unless enabled; startup models load either way.
    enable_model_api: bool = False
    # TorchServe's service_envelope for every model (docs/server.md, Envelopes): "" (none),
    # "kserve" or "json" (each of a request's instances is one row of the handler's batch,
    # the answer {"predictions": [...]}), "kservev2" (decoded OIP tensors, as a model config's
    # kserveEnvelope: true), "body" (a row is the body itself). A model config's
    # kserveEnvelope: false opts that model out.
    service_envelope: str = ""
    # TLS for listeners whose address is https:// (server/tls.py): PEM files.
    certificate_file: str | None = None
    private_key_file: str | None = None
    # OpenSSL's security level for the HTTPS listeners (its default, 2 on current systems,
    # refuses RSA keys under 2048 bits; 1 accepts them, as TorchServe's Java TLS does)
    tls_security_level: int | None = None
    # The gRPC frontend (server/rpc/): TorchServe's inference and management services; off with
    # grpc: false. Over TLS when enable_grpc_ssl (TorchServe's name) or an https:// address,
    # from certificate_file and private_key_file.
    grpc: bool = True
    grpc_inference_address: str = "127.0.0.1:7070"
    grpc_management_address: str = "127.0.0.1:7071"
    enable_grpc_ssl: bool = False
    # Startup models (TorchServe's load_models; --models replaces them): NAME=PATH, PATH, "all".
    load_models: tuple[str, ...] = field(default_factory=tuple)
    # Per-version settings (TorchServe's ``models``): between the archive's and the server's.
    models: tuple[ModelEntry, ...] = field(default_factory=tuple)
    # Models to register at start with the settings recorded (TorchServe's snapshot); when set,
    # even to none, load_models is not used, as in TorchServe.
    model_snapshot: tuple[ModelEntry, ...] | None = None
    # Registration by URL: the largest archive downloaded, the wait for the upstream (connect,
    # and between two reads) and for a whole download.
    download_max_bytes: int = 8 * 1024**3
    download_timeout_s: float = 30.0
    download_total_timeout_s: float = 3600.0
    # Environment variables workers do not get (shell-style globs on the name, case ignored;
    # server/workers/env_vars.py), unless the model's config names them in allowedEnvVars;
    # MSERVE_* never. worker_env_deny_regex: TorchServe's blacklist_env_vars, a regular
    # expression the whole name must match, on top.
    worker_env_deny: tuple[str, ...] = DEFAULT_DENY
    worker_env_deny_regex: str | None = None
    # Inference logging (server/inference_log/, docs/server.md): every model's defaults, which
    # its config (inferenceLog, ...) and registration (inference_log, ...) override: off,
    # request, response or all; every Nth request; records per send; a CloudEvents receiver;
    # JSON-lines files under <run_dir>/inference_log/; keys or JSON pointers redacted. Then how
    # every sink delivers: records waiting per sink (more are dropped), the wait before a batch
    # that is not full goes out, retries, the receiver's timeout, the files' rotation, and
    # KServe's event attributes (source, namespace).
    inference_log: str = "off"
    inference_log_sample: int = 1
    inference_log_batch: int = 32
    inference_log_url: str | None = None
    inference_log_file: bool = True
    inference_log_redact: tuple[str, ...] = ()
    inference_log_queue_size: int = 10_000
    inference_log_flush_s: float = 1.0
    inference_log_retries: int = 3
    inference_log_timeout_s: float = 5.0
    inference_log_file_max_bytes: int = 64 * 1024**2
    inference_log_file_max_age_s: float = 86_400.0
    inference_log_file_count: int = 5
    inference_log_source: str | None = None
    inference_log_namespace: str = ""

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir).expanduser().resolve()

    @property
    def torchserve(self) -> bool:
        return self.layout == "torchserve"

    @property
    def start_path(self) -> Path:
        return Path(self.start_dir or ".").resolve()

    @property
    def log_path(self) -> Path:
        if self.log_dir:
            return (self.start_path / Path(self.log_dir).expanduser()).resolve()
        return self.start_path / "logs" if self.torchserve else self.run_path / "logs"

    @property
    def metrics_log_path(self) -> Path:
        """Where ts_metrics.log and model_metrics.log go (metrics_mode log)."""
        if self.metrics_log_dir:
            return (self.start_path / Path(self.metrics_log_dir).expanduser()).resolve()
        return self.log_path

    @property
    def key_path(self) -> Path:
        """key_file.json: TorchServe writes it in the folder it was started from."""
        return (self.start_path if self.torchserve else self.run_path) / KEY_FILE

    @property
    def ts_snapshot_path(self) -> Path:
        """TorchServe's config snapshot folder (its LOG_LOCATION/config)."""
        return self.log_path / "config"

    @property
    def env_path(self) -> Path:
        return Path(self.env_dir).expanduser().resolve() if self.env_dir else self.run_path / "envs"

    @property
    def store_path(self) -> Path | None:
        return Path(self.model_store).expanduser().resolve() if self.model_store else None

    def model_entry(self, name: str, version: str) -> ModelEntry | None:
        """The ``models`` entry for this name and version, if any."""
        return next((e for e in self.models if e.name == name and e.version == version), None)


ADDRESS_KEYS = ("inference_address", "management_address", "metrics_address")
GRPC_ADDRESS_KEYS = ("grpc_inference_address", "grpc_management_address")


@functools.cache
def _types() -> dict[str, Any]:
    """The settings' types, evaluated once: the evaluation is slow, and each setting asks."""
    return get_type_hints(ServerConfig)


def split_address(value: str, key: str) -> tuple[bool, str, int]:
    """(TLS, host, port) of ``[http://|https://]host:port`` (port 0 = any free port); a bare
    port means 127.0.0.1, as does an empty host."""
    tls = False
    lower = value.lower()
    if lower.startswith(("http://", "https://")):
        tls = lower.startswith("https://")
        value = value.split("://", 1)[1].rstrip("/")
    host, sep, port = value.rpartition(":")
    if not sep or "]" in port:
        host, port = "127.0.0.1", value
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not host:port") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{key}: port {number} is out of range 0-65535")
    return tls, host.strip("[]") or "127.0.0.1", number


def grpc_tls(config: ServerConfig) -> bool:
    """Whether the gRPC frontend serves TLS: TorchServe's ``enable_grpc_ssl``, or an address
    written ``https://``; both of its ports alike."""
    return config.enable_grpc_ssl or any(
        split_address(getattr(config, key), key)[0] for key in GRPC_ADDRESS_KEYS
    )


def parse_address(value: str, key: str) -> tuple[str, int]:
    """(host, port) of an address (see split_address)."""
    return split_address(value, key)[1:]


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
    "inference_log": INFERENCE_LOG_MODES,
    "service_envelope": ("", "kserve", "kservev2", "json", "body"),
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
_SET_BY_THE_CLI = frozenset(("start_dir", "ts_properties"))


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
    "install_py_dep_per_model": False,
}
