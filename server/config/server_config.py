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
    """Every setting of the server. A setting's comment is its meaning in the generated
    settings reference (docs_site/settings_page.py): the comment block above it, and its own at
    the end of its line; each setting has one."""

    # The inference API's address: host:port, http://host:port or https://host:port (TLS,
    # from certificate_file); port 0 picks a free port.
    inference_address: str = "127.0.0.1:8080"
    management_address: str = "127.0.0.1:8081"  # the management API's, in the same forms
    metrics_address: str = "127.0.0.1:8082"  # Prometheus text at /metrics, in the same forms
    # the folder of the archives: startup models' paths and registration urls are relative to it
    model_store: str | None = None
    # where POST /workflows finds a .war by name (TorchServe's workflow_store); unset: the
    # model store, as in TorchServe
    workflow_store: str | None = None
    # the server's own files: pid, status, key_file.json, logs, snapshot.json, unpack cache
    run_dir: str = "~/.mserve"
    # mserve.log and access.log (relative to the folder the server starts from); unset:
    # <run_dir>/logs, or logs/ in the TorchServe layout
    log_dir: str | None = None
    # GPUs the workers are spread over; unset: detected (nvidia-smi, else torch); 0: CPU only
    number_of_gpu: int | None = None
    # a model's workers (its minWorkers and maxWorkers) when neither its registration, its
    # archive nor its models entry names them
    default_workers_per_model: int = 1
    # requests per batch for a model that names no batchSize (registration, archive, models entry)
    batch_size: int = 1
    # the longest a batch waits for more requests (see batch_wait)
    max_batch_delay_ms: int = 100
    # how long a worker may take over one batch: past it, the batch's callers get 504 and the
    # worker is killed and restarted
    response_timeout_s: float = 120.0
    # On SIGTERM: how long queued and running requests may take to finish (the rest get 503),
    # and again how long workers get to exit; a pod's terminationGracePeriodSeconds covers both.
    shutdown_drain_s: float = 10.0
    # how long a worker may take to start and load its handler before it is killed and retried
    startup_timeout_s: float = 120.0
    # Per model version: requests waiting, in the queue or already sent to a worker that has not
    # started them (callers that left do not count); full: 429 with Retry-After.
    job_queue_size: int = 100
    # a dead worker's requests go back to the head of the queue, once each (off: they get 500;
    # a request that kills its worker would kill a second one too)
    retry_on_worker_death: bool = False
    # how long a worker slot keeps restarting a worker that does not load before it gives up
    # (per model maxRetryTimeoutInSec): about six tries with the backoff, so a handler that
    # cannot load is reported failed in seconds; the TorchServe layout takes TorchServe's 300
    max_retry_timeout_s: float = 10.0
    # Many models on one server (server/models/residency.py): a model asked for nothing this
    # long scales down to its minWorkers (unset: never; per model idleUnloadTimeout).
    idle_unload_s: float | None = None
    # the workers' memory (PSS) a new worker (on demand, by scaling or registration) may not
    # push past; idle models are unloaded to make room, the cheapest first (see eviction)
    worker_memory_budget_mb: int | None = None
    # model versions with workers that a new worker may not push past; the same eviction
    max_loaded_models: int | None = None
    # how long a new worker waits for room under those limits before its requests (or the
    # scale request) get 503
    load_wait_s: float = 30.0
    # the warm tier (server/models/warm.py, docs/warm-tier.md): page cache an evicted model's
    # mapped weights may keep, so its next worker maps them instead of reading and unpickling
    # them; workers then load torch checkpoints with mmap (unset or 0: off)
    warm_tier_budget_mb: int | None = None
    # with the warm tier on: evicted models' idle workers kept alive (parked: what each holds
    # beside its weights counted in the tier's budget), so that a wake skips the worker's
    # start and the handler's load (mserve_worker/park.py; 0: none)
    warm_tier_parked_workers: int = 16
    # which idle model makes room: "cost", the one whose request rate x reload time is least
    # (server/models/eviction.py); "lru", the least recently used
    eviction: str = "cost"
    # a batch waits for more requests only while its worker is busy ("busy"), or up to
    # max_batch_delay_ms whatever the worker does ("fill", TorchServe's way)
    batch_wait: str = "busy"
    # Generative and stateful models: the default of each model's setting of the same meaning
    # (server/config/model_settings.py). Continuous batching (continuousBatching): the handler
    # is called step after step, each step taking the requests still generating plus new ones.
    continuous_batching: bool = False
    # a request's deadline from its arrival, queue time included (0: none); past it, it is
    # dropped or leaves the next step and its client gets 504 (clientTimeoutInMills)
    client_timeout_ms: int = 0
    # requests of one sequence id go to one worker, one at a time, in order (sequenceBatching)
    sequence_batching: bool = False
    # sequences open at once, at least batchSize x maxWorkers; a new one beyond waits, in order
    # (maxNumSequence)
    max_num_sequence: int = 0
    # a sequence with no request for this long expires; a later request naming it gets 503
    # (0: never; sequenceMaxIdleMSec)
    sequence_max_idle_ms: int = 0
    # a sequence open this long expires, busy or not: its waiting requests get 504 (0: never;
    # sequenceTimeoutMSec)
    sequence_timeout_ms: int = 0
    # requests of one sequence that may wait behind the one being run; another gets 429
    # (maxSequenceJobQueueSize)
    max_sequence_job_queue_size: int = 1
    # the request and answer header that carries a sequence's id
    sequence_id_header: str = "ts_request_sequence_id"
    # the header the server adds to a sequence's first request
    sequence_start_header: str = "ts_request_sequence_start"
    # the header (on a request, or on the handler's answer) that closes a sequence once answered
    sequence_end_header: str = "ts_request_sequence_end"
    max_request_size_bytes: int = 6_553_500  # a larger request body gets 413
    # a larger answer gets 413 naming this setting (checked in the worker, which keeps serving)
    max_response_size_bytes: int = 6_553_500
    keepalive_timeout_s: float = 75.0  # an idle HTTP connection is closed after this
    # a request that stops arriving for this long, or whose request line and headers are not
    # complete this long after they began, is dropped
    read_timeout_s: float = 60.0
    # open connections per port; more are closed as soon as they open (logged once a minute)
    max_connections: int = 4096
    # absolute folders the management API may register from, besides the model store
    allowed_paths: tuple[str, ...] = field(default_factory=tuple)
    # one line per request in access.log (the request line, status, bytes, seconds, request and
    # trace ids), written every second; rotate it with logrotate's copytruncate
    access_log: bool = True
    # the registered models, their versions, workers and settings saved to
    # <run_dir>/snapshot.json on every change and restored at the next start (TorchServe's
    # config snapshots in its layout); false (--ncs): neither read nor written
    snapshot: bool = True
    # build each model's own environment from its requirements file; false: every model runs on
    # the server's interpreter
    install_py_dep_per_model: bool = True
    env_dir: str | None = None  # the model environments' cache; unset: <run_dir>/envs
    # base packages (and what they depend on) a model's requirements may not change
    protected_packages: tuple[str, ...] = ("torch",)
    # fork workers from a warm template process; false: every worker is a fresh interpreter
    fork_workers: bool = True
    # Confine every worker to its own model (server/workers/sandbox.py), and each model
    # environment's build (server/workers/build_sandbox.py): on where the kernel offers
    # Landlock, with one warning at start where it does not; false turns it off.
    sandbox: bool = True
    # Run each model's workers as their own uid from this range when the server runs as root
    # (server/workers/sandbox_users.py); "off": they keep the server's user. The default lies
    # above the uids of people and of podman's first subordinate range.
    sandbox_uid_range: str = "200000-299999"
    # Folders (or files) every model's workers may read, besides the model caches the server's
    # environment names and its user's own (server/workers/sandbox_caches.py): absolute paths,
    # never the server's own files. A model config grants one model more (sandbox.readPaths).
    sandbox_read_paths: tuple[str, ...] = ()
    # modules every worker template imports, besides those its models' workers were seen to
    # import
    worker_preload: tuple[str, ...] = ()
    # Registration by URL (TorchServe's allowed_urls: regular expressions a URL must match in
    # full); empty: the model store and allowed_paths only.
    allowed_urls: tuple[str, ...] = field(default_factory=tuple)
    # where TorchServe's metrics go: "prometheus" (the metrics port), "log" (the metric log
    # files) or "legacy", as TorchServe defines them
    metrics_mode: str = "prometheus"
    # a TorchServe metrics.yaml; its model_metrics are honoured
    metrics_config: str | None = None
    # Handler metrics metrics_config does not declare: kept (true) or dropped (false,
    # TorchServe's default, and the TorchServe layout's).
    model_metrics_auto_detect: bool = True
    # true: no CPU, memory, disk or GPU metrics of the host are measured (else each minute)
    disable_system_metrics: bool = False
    # "torchserve": TorchServe's log files (ts_log.log, access_log.log, model_log.log) in place
    # of ours (mserve.log, access.log), in TorchServe's line formats.
    log_layout: str = "mserve"
    # "json": one JSON object per line in mserve.log and access.log, for log shippers (the
    # TorchServe layout's files keep TorchServe's line formats); "text": our lines.
    log_format: str = "text"
    # a diagnostic: warn, with the event loop thread's stack, when the loop has not run for
    # this long (server/loop_watch.py; unset: off)
    loop_stall_warn_s: float | None = None
    # OpenTelemetry traces (server/tracing/): the OTLP endpoint they are exported to (unset:
    # the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing is off).
    otel_endpoint: str | None = None
    # the OTLP protocol: "http/protobuf" or "grpc" (unset: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL,
    # else http/protobuf)
    otel_protocol: str | None = None
    # share of new traces sampled; a client's sampled flag is followed (unset:
    # OTEL_TRACES_SAMPLER_ARG, else 1)
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
    # ts_metrics.log and model_metrics.log (relative to the folder the server starts from;
    # TorchServe's METRICS_LOCATION); unset: the log folder, or logs/ in the TorchServe layout
    metrics_log_dir: str | None = None
    # the properties file's own keys and values, as read (written back into the snapshots)
    ts_properties: tuple[tuple[str, str], ...] = ()
    # the properties file read (TorchServe's console names it at start), set by the CLI
    ts_config_file: str | None = None
    # Token authorization (server/auth.py) is on unless disabled (also --disable-token-auth):
    # true serves every API without keys.
    disable_token_authorization: bool = False
    # minutes a management or inference key lives from its making or rotation
    token_expiration_min: float = 60.0
    # minutes an inference key lives; unset: token_expiration_min
    inference_token_expiration_min: float | None = None
    # minutes a management key lives; unset: token_expiration_min
    management_token_expiration_min: float | None = None
    # Fixed keys instead of random ones (a mounted Secret, so every replica behind a Service
    # takes the same key): a JSON file in key_file.json's layout (server/auth.py). Fixed keys do
    # not expire and are not rotated through the API; change the file and restart instead.
    token_key_file: str | None = None
    # Tenants (server/tenants/, docs/tenants.md): a YAML file giving each client its own
    # inference keys (sha256-hashed), a weight in each model's fair queue and quotas; reloaded
    # when it changes. Unset: one inference key, one plain queue per model, as before.
    tenants_file: str | None = None
    # paths of the inference and management ports that need no key (probes)
    token_exempt_paths: tuple[str, ...] = (
        "/ping", "/v2/health/live", "/v2/health/ready", "/api-description"
    )  # fmt: skip
    metrics_need_token: bool = False  # the metrics port asks for the management key too
    # TorchServe's model API control: registering and unregistering through the API is off
    # unless enabled; startup models load either way.
    enable_model_api: bool = False
    # Development: reload a model's handler code when its files change (server/models/watch.py,
    # docs/hot-reload.md); also --watch
    watch: bool = False
    # TorchServe's service_envelope for every model (docs/apis.md, Envelopes): "" (none),
    # "kserve" or "json" (each of a request's instances is one row of the handler's batch,
    # the answer {"predictions": [...]}), "kservev2" (decoded OIP tensors, as a model config's
    # kserveEnvelope: true), "body" (a row is the body itself). A model config's
    # kserveEnvelope: false opts that model out.
    service_envelope: str = ""
    # TLS for the listeners whose address is https:// (server/tls.py): the PEM certificate
    # (chain).
    certificate_file: str | None = None
    private_key_file: str | None = None  # the certificate's unencrypted PEM private key
    # OpenSSL's security level for the HTTPS listeners (its default, 2 on current systems,
    # refuses RSA keys under 2048 bits; 1 accepts them, as TorchServe's Java TLS does)
    tls_security_level: int | None = None
    # The gRPC frontend (server/rpc/): TorchServe's inference and management services; off with
    # grpc: false. Over TLS when enable_grpc_ssl (TorchServe's name) or an https:// address,
    # from certificate_file and private_key_file.
    grpc: bool = True
    # the gRPC inference service's host:port; port 0 picks a free port
    grpc_inference_address: str = "127.0.0.1:7070"
    grpc_management_address: str = "127.0.0.1:7071"  # the gRPC management service's
    # gRPC over TLS from certificate_file and private_key_file (an https:// gRPC address does
    # the same)
    enable_grpc_ssl: bool = False
    # Startup models (TorchServe's load_models; --models replaces them): NAME=PATH, PATH, "all".
    load_models: tuple[str, ...] = field(default_factory=tuple)
    # Settings per model and version (TorchServe's ``models``: {name: {version: {minWorkers,
    # batchSize, ...}}}): they win over the server's defaults, and lose to the archive's.
    models: tuple[ModelEntry, ...] = field(default_factory=tuple)
    # Models to register at start with the settings recorded (TorchServe's snapshot); when set,
    # even to none, load_models is not used, as in TorchServe.
    model_snapshot: tuple[ModelEntry, ...] | None = None
    # Registration by URL: the largest archive downloaded; larger: 413.
    download_max_bytes: int = 8 * 1024**3
    # connecting to the upstream, and the longest wait between two reads; past it: 504
    download_timeout_s: float = 30.0
    download_total_timeout_s: float = 3600.0  # one whole download; past it: 504
    # Environment variables workers do not get (shell-style globs on the name, case ignored;
    # server/workers/env_vars.py), unless the model's config names them in allowedEnvVars;
    # MSERVE_* never.
    worker_env_deny: tuple[str, ...] = DEFAULT_DENY
    # a regular expression: variables whose whole name matches it are held back too (case
    # counts; TorchServe's blacklist_env_vars)
    worker_env_deny_regex: str | None = None
    # Pickled weights scanned at registration for imports off the allow-list (server/weights/,
    # docs/weights-safety.md): off; warn (register, log, describe); require (refuse). A model's
    # models entry or model config (weightsScan) can only make it stricter.
    weights_scan: str = "warn"
    # Inference logging (server/inference_log/): what every model logs, unless its config
    # (inferenceLog) or registration (inference_log) says otherwise: off, request, response or
    # all. Its sample, batch, url, file and redact settings are defaults a model overrides the
    # same way (inferenceLogSample, ...).
    inference_log: str = "off"
    inference_log_sample: int = 1  # log every Nth request
    # records a sink takes per send (one file write; events pipelined together)
    inference_log_batch: int = 32
    inference_log_url: str | None = None  # a receiver of KServe's logger's CloudEvents
    inference_log_file: bool = True  # JSON lines under <run_dir>/inference_log/
    # key names (at any depth) or JSON pointers (/card/number) whose values are logged as
    # "[redacted]"
    inference_log_redact: tuple[str, ...] = ()
    # How every sink (a model version's log file, its receiver) delivers: the records that
    # may wait per sink; more are dropped and counted.
    inference_log_queue_size: int = 10_000
    # a batch that is not full goes out this long after its first record
    inference_log_flush_s: float = 1.0
    # more tries a batch that delivers nothing gets (after 0.2 s, 0.4 s, ... up to 5 s); then
    # its records count as failed
    inference_log_retries: int = 3
    # a try's requests on one connection (connecting included) must be answered within it;
    # what is not is sent again
    inference_log_timeout_s: float = 5.0
    # a log file is rotated before a batch would take it past this size
    inference_log_file_max_bytes: int = 64 * 1024**2
    inference_log_file_max_age_s: float = 86_400.0  # a log file is rotated once this old
    inference_log_file_count: int = 5  # rotated log files kept
    # the events' source attribute (KServe's); unset: http://localhost:<inference port>/
    inference_log_source: str | None = None
    inference_log_namespace: str = ""  # the events' namespace attribute (KServe's)
    # Archive signatures (server/signatures.py, docs/signing.md), checked before an archive is
    # unpacked: "off"; "warn" (a failure is logged and described, the model loads); "require"
    # (a failure refuses the registration). A registration's archive_signatures may only make
    # it stricter.
    archive_signatures: str = "off"
    # who may sign: PEM public key or certificate (CA) files (relative to the folder the
    # server starts from), or "sigstore:IDENTITY ISSUER [TRUSTED_ROOT]"; a bad entry stops the
    # start, naming the file and the reason
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
