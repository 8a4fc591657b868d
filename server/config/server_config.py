"""The server's settings, one typed, frozen object (:class:`ServerConfig`), with their defaults
and the paths derived from them. Reading and checking them from their layers is
:mod:`server.config.loading`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from server.config.entries import ModelEntry
from server.rundir import KEY_FILE

# The default of ``worker_env_deny`` (server/workers/env_vars.py applies it): names that hold
# credentials by common convention, and TorchServe's own settings. Not ``*TOKEN*``:
# TOKENIZERS_PARALLELISM is a model's business.
DEFAULT_DENY = (
    "TS_*", "TOKEN", "*_TOKEN", "*_TOKEN_*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*_PASS",
    "*API_KEY*", "*APIKEY*", "*PRIVATE_KEY*", "*CREDENTIAL*", "SSH_AUTH_SOCK",
)  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    inference_address: str = "127.0.0.1:8080"
    management_address: str = "127.0.0.1:8081"
    metrics_address: str = "127.0.0.1:8082"
    model_store: str | None = None
    # where POST /workflows finds a .war by name (TorchServe's workflow_store); unset: the
    # model store, as in TorchServe
    workflow_store: str | None = None
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
    # how long a worker slot keeps restarting a worker that does not load before it gives up
    # (per model maxRetryTimeoutInSec): about six tries with the backoff, so a handler that
    # cannot load is reported failed in seconds; the TorchServe layout takes TorchServe's 300
    max_retry_timeout_s: float = 10.0
    # Many models on one server (server/models/residency.py): a model idle this long scales
    # down to its minWorkers (None: never, per model idleUnloadTimeout); the workers' memory
    # (PSS) and the number of models with workers that starting a worker on demand may not
    # pass, evicting the least recently used idle models first; how long such a start waits
    # for room.
    idle_unload_s: float | None = None
    worker_memory_budget_mb: int | None = None
    max_loaded_models: int | None = None
    load_wait_s: float = 30.0
    # the warm tier (server/models/warm.py, docs/warm-tier.md): page cache the server keeps
    # evicted models' mapped weights in (None or 0: off); which idle model an eviction picks:
    # "cost" (request rate x reload time, server/models/eviction.py) or "lru"
    warm_tier_budget_mb: int | None = None
    eviction: str = "cost"
    # a batch waits for more requests only while its worker is busy ("busy"), or up to
    # max_batch_delay_ms whatever the worker does ("fill", TorchServe's way)
    batch_wait: str = "busy"
    # the defaults of the per-model generative and stateful settings (model_settings.py)
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
    # (server/workers/sandbox_users.py); "off": they keep the server's user. The default lies
    # above the uids of people and of podman's first subordinate range.
    sandbox_uid_range: str = "200000-299999"
    # Folders (or files) every model's workers may read, besides the model caches the server's
    # environment names and its user's own (server/workers/sandbox_caches.py): absolute paths,
    # never the server's own files. A model config grants one model more (sandbox.readPaths).
    sandbox_read_paths: tuple[str, ...] = ()
    worker_preload: tuple[str, ...] = ()  # besides what the models' workers were seen to import
    # Registration by URL (TorchServe's allowed_urls: regular expressions a URL must match in
    # full); empty: the model store and allowed_paths only.
    allowed_urls: tuple[str, ...] = field(default_factory=tuple)
    # TorchServe's metrics settings: "prometheus", "log" or "legacy"; its metrics.yaml file.
    metrics_mode: str = "prometheus"
    metrics_config: str | None = None
    # Handler metrics metrics_config does not declare: kept (true) or dropped (false,
    # TorchServe's default, and the TorchServe layout's); the host's CPU, memory, disk and GPU
    # metrics measured each minute unless disabled.
    model_metrics_auto_detect: bool = True
    disable_system_metrics: bool = False
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
    # metric logs in metrics_log_dir (METRICS_LOCATION, default logs/), config
    # snapshots in <log folder>/config/ instead of <run_dir>/snapshot.json; TorchServe's
    # defaults and answers (0 workers for a registration that names none, 500 for a handler
    # that fails to load and for a timed-out batch, its 405 message); the server's console on
    # the caller's terminal.
    layout: str = "mserve"
    start_dir: str | None = None
    metrics_log_dir: str | None = None
    # the properties file's own keys and values, as read (written back into the snapshots)
    ts_properties: tuple[tuple[str, str], ...] = ()
    # the properties file read (TorchServe's console names it at start), set by the CLI
    ts_config_file: str | None = None
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
    # Tenants (server/tenants/, docs/tenants.md): a YAML file giving each client its own
    # inference keys (sha256-hashed), a weight in each model's fair queue and quotas; reloaded
    # when it changes. Unset: one inference key, one plain queue per model, as before.
    tenants_file: str | None = None
    token_exempt_paths: tuple[str, ...] = (
        "/ping", "/v2/health/live", "/v2/health/ready", "/api-description"
    )  # fmt: skip
    metrics_need_token: bool = False
    # TorchServe's model API control: registering and unregistering through the API is off
    # unless enabled; startup models load either way.
    enable_model_api: bool = False
    # Development: reload a model's handler code when its files change (server/models/watch.py,
    # docs/hot-reload.md); also --watch
    watch: bool = False
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
    # Pickled weights scanned at registration for imports off the allow-list (server/weights/,
    # docs/weights-safety.md): off; warn (register, log, describe); require (refuse). A model's
    # models entry or model config (weightsScan) can only make it stricter.
    weights_scan: str = "warn"
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
    # Archive signatures (server/signatures.py, docs/signing.md), checked before an archive is
    # unpacked: "off"; "warn" (a failure is logged and described, the model loads); "require"
    # (a failure refuses the registration). A registration's archive_signatures may only make
    # it stricter. trusted_signers: PEM public key or certificate files (relative to the
    # folder the server starts from), or "sigstore:IDENTITY ISSUER [TRUSTED_ROOT]".
    archive_signatures: str = "off"
    trusted_signers: tuple[str, ...] = ()

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
        """Where ts_metrics.log and model_metrics.log go: metrics_log_dir, else the log folder;
        in the TorchServe layout logs/, whatever LOG_LOCATION says (TorchServe's log4j2.xml
        reads only METRICS_LOCATION for them)."""
        if self.metrics_log_dir:
            return (self.start_path / Path(self.metrics_log_dir).expanduser()).resolve()
        return self.start_path / "logs" if self.torchserve else self.log_path

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

    @property
    def workflow_store_path(self) -> Path | None:
        if self.workflow_store:
            return Path(self.workflow_store).expanduser().resolve()
        return self.store_path

    def model_entry(self, name: str, version: str) -> ModelEntry | None:
        """The ``models`` entry for this name and version, if any."""
        return next((e for e in self.models if e.name == name and e.version == version), None)
