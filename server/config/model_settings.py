"""A model version's effective settings, where each came from, and the one table of their
TorchServe names.

Every place that spells a setting's camelCase name (describe, the registration precedence, the
``models`` entries of config.properties and TorchServe's ``model_snapshot``, the snapshot we
write, its restore, the Ray plan) goes through :data:`SETTINGS`: a name added or renamed here
is added or renamed everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from server.errors import InvalidModel

log = logging.getLogger(__name__)

BATCH_WAITS = ("busy", "fill")
# TorchServe's request headers of a sequence: its id, its start and its end (the server's
# ts_header_key_sequence_id, _start and _end rename them)
SEQUENCE_HEADERS = (
    "ts_request_sequence_id",
    "ts_request_sequence_start",
    "ts_request_sequence_end",
)
INFERENCE_LOG_MODES = ("off", "request", "response", "all")  # KServe's logger modes, and off
WEIGHTS_SCAN_MODES = ("off", "warn", "require")  # weakest first (server/weights/policy.py)
SIGNATURE_POLICIES = ("off", "warn", "require")  # weakest first (server/signatures.py)


@dataclass(frozen=True)
class Setting:
    """One model setting. ``unit``: ``count``, ``ms``, ``s`` (seconds: a whole number is shown
    as an int, as TorchServe writes it), ``flag``, ``choice`` (one of ``choices``), ``text`` or
    ``list`` (of strings; a registration parameter gives it comma-separated)."""

    key: str  # TorchServe's name: describe, the model config, config.properties, snapshots
    attr: str  # the ModelSettings attribute
    default: str  # the ServerConfig attribute that gives it when nothing else does
    unit: str
    request: str | None = None  # the RegisterRequest field of the registration API
    entry: bool = False  # in config.properties ``models``, ``model_snapshot`` and our snapshot
    zero_kept: bool = False  # a snapshot's 0 is a value (a worker count), not "unset"
    ray: bool = False  # in the Ray plan's settings
    choices: tuple[str, ...] = ()


SETTINGS = (
    Setting("minWorkers", "min_workers", "default_workers_per_model", "count",
            request="initial_workers", entry=True, zero_kept=True, ray=True),
    Setting("maxWorkers", "max_workers", "default_workers_per_model", "count",
            request="max_workers", entry=True, zero_kept=True, ray=True),
    Setting("batchSize", "batch_size", "batch_size", "count",
            request="batch_size", entry=True, ray=True),
    Setting("maxBatchDelay", "max_batch_delay_ms", "max_batch_delay_ms", "ms",
            request="max_batch_delay_ms", entry=True, ray=True),
    Setting("responseTimeout", "response_timeout_s", "response_timeout_s", "s",
            request="response_timeout_s", entry=True, ray=True),
    Setting("startupTimeout", "startup_timeout_s", "startup_timeout_s", "s",
            request="startup_timeout_s", entry=True),
    Setting("jobQueueSize", "job_queue_size", "job_queue_size", "count", ray=True),
    Setting("retryOnWorkerDeath", "retry_on_worker_death", "retry_on_worker_death", "flag"),
    Setting("maxRetryTimeoutInSec", "max_retry_timeout_s", "max_retry_timeout_s", "s"),
    Setting("batchWait", "batch_wait", "batch_wait", "choice",
            request="batch_wait", entry=True, choices=BATCH_WAITS),
    Setting("idleUnloadTimeout", "idle_unload_s", "idle_unload_s", "s", request="idle_unload_s"),
    # generative and stateful serving (server/models/continuous.py, server/models/sequences.py)
    Setting("continuousBatching", "continuous_batching", "continuous_batching", "flag"),
    Setting("clientTimeoutInMills", "client_timeout_ms", "client_timeout_ms", "ms"),
    Setting("sequenceBatching", "sequence_batching", "sequence_batching", "flag"),
    Setting("maxNumSequence", "max_num_sequence", "max_num_sequence", "count"),
    Setting("sequenceMaxIdleMSec", "sequence_max_idle_ms", "sequence_max_idle_ms", "ms"),
    Setting("sequenceTimeoutMSec", "sequence_timeout_ms", "sequence_timeout_ms", "ms"),
    Setting("maxSequenceJobQueueSize", "max_sequence_job_queue_size",
            "max_sequence_job_queue_size", "count"),
    # inference logging (server/inference_log/): checked by its parse_policy at registration
    Setting("inferenceLog", "inference_log", "inference_log", "choice",
            request="inference_log", choices=INFERENCE_LOG_MODES),
    Setting("inferenceLogSample", "inference_log_sample", "inference_log_sample", "count",
            request="inference_log_sample"),
    Setting("inferenceLogBatch", "inference_log_batch", "inference_log_batch", "count",
            request="inference_log_batch"),
    Setting("inferenceLogUrl", "inference_log_url", "inference_log_url", "text",
            request="inference_log_url"),
    Setting("inferenceLogFile", "inference_log_file", "inference_log_file", "flag",
            request="inference_log_file"),
    Setting("inferenceLogRedact", "inference_log_redact", "inference_log_redact", "list",
            request="inference_log_redact"),
    # pickled weights scanned at registration (server/weights/): a models entry or the model
    # config can only make it stricter
    Setting("weightsScan", "weights_scan", "weights_scan", "choice", entry=True,
            choices=WEIGHTS_SCAN_MODES),
    # archive signatures checked before unpacking (server/signatures.py): the registration's
    # parameter, a models entry and a snapshot's record can only make it stricter
    Setting("archiveSignatures", "archive_signatures", "archive_signatures", "choice",
            request="archive_signatures", entry=True, choices=SIGNATURE_POLICIES),
)  # fmt: skip
ENTRY_SETTINGS = tuple(s for s in SETTINGS if s.entry)
# TorchServe's parallelType values (ModelConfig.ParallelType): pp, tp and pptp start each worker
# as torchrun's ranks; custom gives one process the worker's GPUs
PARALLEL_TYPES = ("pp", "tp", "pptp", "custom")
# torchrun keys TorchServe reads but that change nothing here: the ranks rendezvous on this
# machine, and the server (not torchrun) restarts a group whose rank died
TORCHRUN_NO_EFFECT = ("rdzv-backend", "rdzv-endpoint", "rdzv-conf", "monitor-interval",
                      "node-rank")  # fmt: skip
INFERENCE_LOG_SETTINGS = tuple(s for s in SETTINGS if s.attr.startswith("inference_log"))


@dataclass(frozen=True)
class Parallel:
    """A model's parallelism, from its model config as TorchServe reads it: ``parallelType``,
    ``parallelLevel`` and the ``torchrun`` section (whose ``nproc-per-node`` is the level).
    TorchServe's none (type ``""``, level 0) unless both a type and a level above 0 are given."""

    type: str = ""
    level: int = 0  # GPUs per worker; processes per worker for pp, tp and pptp
    omp_threads: int = 1  # torchrun.OMP_NUMBER_THREADS: each rank's OMP_NUM_THREADS

    @property
    def torchrun(self) -> bool:
        """Each worker is ``level`` ranks with torchrun's environment (pp, tp, pptp)."""
        return self.type in ("pp", "tp", "pptp")

    @property
    def ranks(self) -> int:
        return self.level if self.torchrun else 1

    @property
    def broadcast(self) -> bool:
        """Every rank gets each batch (tp, pptp), as TorchServe's frontend sends it to each;
        with pp only rank 0 does, and drives the other stages itself."""
        return self.type in ("tp", "pptp")

    @property
    def gpus(self) -> int:
        """GPUs one worker takes (round robin by groups)."""
        return self.level if self.type else 1


def parallel_settings(config: Mapping[str, Any], label: str) -> Parallel:
    """``parallelType``, ``parallelLevel`` and ``torchrun`` of a model config. What TorchServe
    ignores with a warning is ignored with one; what cannot be started is ``InvalidModel``:
    a ``parallelLevel`` that disagrees with ``torchrun.nproc-per-node`` (TorchServe then starts
    one number of ranks and waits for the other) and ``nnodes`` above 1."""
    kind = config.get("parallelType")
    if kind is not None and (not isinstance(kind, str) or kind.lower() not in PARALLEL_TYPES):
        log.warning("model %s: invalid parallelType %r, should be pp, tp, pptp or custom;"
                    " ignored", label, kind)  # fmt: skip
        kind = None
    level = config.get("parallelLevel")
    if level is not None and (type(level) is not int or level < 0):
        log.warning("model %s: invalid parallelLevel %r, should be an integer >= 0; ignored",
                    label, level)  # fmt: skip
        level = None
    omp_threads = 1
    torchrun = config.get("torchrun")
    if torchrun is not None and not isinstance(torchrun, Mapping):
        log.warning("model %s: invalid torchrun %r, should be a mapping of torchrun's"
                    " parameters; ignored", label, torchrun)  # fmt: skip
    elif torchrun is not None:
        nproc = _positive(torchrun, "nproc-per-node", label)
        omp_threads = _positive(torchrun, "OMP_NUMBER_THREADS", label)
        nnodes = _positive(torchrun, "nnodes", label)
        if nnodes > 1:
            raise InvalidModel(
                f"model {label}: torchrun.nnodes is {nnodes}: mserve starts a worker's ranks"
                " on its own machine only (nnodes 1)"
            )
        for key in torchrun:
            if key not in (*TORCHRUN_NO_EFFECT, "nproc-per-node", "OMP_NUMBER_THREADS",
                           "nnodes"):  # fmt: skip
                log.warning("model %s: unsupported torchrun parameter %s; ignored", label, key)
        if level is not None and level != nproc:
            raise InvalidModel(
                f"model {label}: parallelLevel {level} and torchrun.nproc-per-node {nproc}"
                " disagree; set one of them (each is the number of ranks of a worker)"
            )
        level = nproc
    if not kind or not level:
        return Parallel()
    return Parallel(kind.lower(), level, omp_threads)


def _positive(section: Mapping[str, Any], key: str, label: str) -> int:
    value = section.get(key, 1)
    if type(value) is not int or value < 1:
        log.warning("model %s: invalid torchrun.%s %r, should be an integer >= 1; 1 used",
                    label, key, value)  # fmt: skip
        return 1
    return value


@dataclass(frozen=True)
class ModelSettings:
    """Effective settings; ``sources`` says where each came from (api, archive, server)."""

    batch_size: int
    max_batch_delay_ms: int
    response_timeout_s: float
    startup_timeout_s: float
    min_workers: int
    max_workers: int
    job_queue_size: int
    device_ids: tuple[int, ...] | None
    device_type: str | None = None  # the model config's deviceType: cpu, gpu, neuron
    retry_on_worker_death: bool = False
    # how long a worker slot that lost its worker keeps restarting it without one loading
    # (TorchServe's maxRetryTimeoutInSec); then it gives up (server/models/version.py)
    max_retry_timeout_s: float = 300.0
    idle_unload_s: float | None = None  # scale down to min_workers after this long unused
    # when a batch waits for more requests: "busy" only while its worker runs another batch,
    # "fill" up to max_batch_delay_ms even when the worker idles (TorchServe's way)
    batch_wait: str = "busy"
    # TorchServe's continuous batching: the handler is called step after step with the requests
    # still generating plus new ones (server/models/continuous.py)
    continuous_batching: bool = False
    # a request's deadline from its arrival, queue time included (0: none): past it, it is
    # dropped, or its stream stopped, and answered 504
    client_timeout_ms: int = 0
    # TorchServe's sequence batching: requests of one sequence id go to one worker, in order
    sequence_batching: bool = False
    max_num_sequence: int = 0  # sequences open at once (0: batchSize x maxWorkers)
    sequence_max_idle_ms: int = 0  # a sequence unused this long expires (0: never)
    sequence_timeout_ms: int = 0  # a sequence this old expires (0: never)
    max_sequence_job_queue_size: int = 1  # requests of one sequence waiting at once
    # inference logging (server/inference_log/policy.py): off, request, response or all; every
    # Nth request; records per send; a CloudEvents URL; JSON-lines files; keys redacted
    inference_log: str = "off"
    inference_log_sample: int = 1
    inference_log_batch: int = 32
    inference_log_url: str | None = None
    inference_log_file: bool = True
    inference_log_redact: tuple[str, ...] = ()
    weights_scan: str = "warn"  # off, warn, require (server/weights/policy.py)
    archive_signatures: str = "off"  # the policy its archive was checked under (signatures.py)
    # parallelType, parallelLevel, torchrun: the archive's model config alone sets them
    parallel: Parallel = Parallel()
    sources: dict[str, str] = field(default_factory=dict)


def with_changes(settings: ModelSettings, source: str | None, **changes: Any) -> ModelSettings:
    """``settings`` with ``changes``; each that differs is recorded as from ``source``."""
    sources = dict(settings.sources)
    for key, value in changes.items():
        if value != getattr(settings, key) and source is not None:
            sources[key] = source
    return replace(settings, **changes, sources=sources)


def whole(seconds: float) -> float | int:
    """A whole number of seconds as an int, as TorchServe writes it (typed clients refuse 120.0
    where they expect an integer)."""
    return int(seconds) if float(seconds).is_integer() else seconds


def shown(settings: ModelSettings, which: Iterable[Setting] = SETTINGS) -> dict[str, Any]:
    """``which`` settings under their TorchServe names, in TorchServe's types (describe)."""
    out = {}
    for setting in which:
        value = getattr(settings, setting.attr)
        out[setting.key] = whole(value) if setting.unit == "s" and value is not None else value
    return out


def snapshot_fields(settings: ModelSettings) -> dict[str, Any]:
    """The settings a snapshot entry records: whole seconds (TorchServe reads integers)."""
    out = {}
    for setting in ENTRY_SETTINGS:
        value = getattr(settings, setting.attr)
        out[setting.key] = round(value) if setting.unit == "s" else value
    return out


def request_fields(get: Any) -> dict[str, Any]:
    """RegisterRequest fields from a ``models`` or snapshot entry (``get``: its value of a
    TorchServe name, None when unset); seconds as floats."""
    out = {}
    for setting in ENTRY_SETTINGS:
        value = get(setting.key)
        if setting.request is None:
            continue
        if setting.unit == "s":
            value = float(value) if value else None
        out[setting.request] = value
    return out
