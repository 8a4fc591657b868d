"""The server's logs: mserve's files (``mserve.log``) or TorchServe's (``ts_log.log``,
``model_log.log``, in log4j2's default line format), and a console where there is one (stderr in
the foreground; in TorchServe's layout, the caller's stdout: server/console.py). Configured once,
by the server process at start; modules only ``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from logging.handlers import RotatingFileHandler
from pathlib import Path

from server.config import ServerConfig
from server.console import ConsoleHandler
from server.errors import ConfigError


def setup_logging(
    config: ServerConfig, foreground: bool
) -> tuple[ConsoleHandler | None, str | None]:
    """The log files, and a console: stderr in the foreground; in the TorchServe layout, stdout
    (TorchServe's console), daemon or not. Returns the console handler, if any, and why the
    log files are not written, if they are not: in the TorchServe layout a log folder that
    cannot be made or written in is a warning and the console carries the log alone, as
    TorchServe starts when log4j cannot open its files (elsewhere the error is raised)."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    # httpx logs every request with its full URL (query secrets included); ours say what matters
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if config.log_layout != "torchserve":  # TorchServe's own words are for its layout only
        said_as_torchserve = logging.getLogger(TS_LOGGER_ROOT)
        said_as_torchserve.propagate = False
        said_as_torchserve.setLevel(logging.CRITICAL + 1)
        said_as_torchserve.addHandler(logging.NullHandler())
    if config.log_layout == "torchserve":
        fmt = TorchServeFormatter()
    elif config.log_format == "json":
        fmt = JsonFormatter()
    problem = None
    try:
        _add_files(config, fmt, config.log_layout == "torchserve")
    except OSError as exc:
        if not config.torchserve:
            raise unusable_log_folder(config.log_path, exc) from None
        problem = (
            f"log folder {config.log_path} cannot be used ({exc.strerror or exc}): logging to"
            " the console only, with no ts_log.log, model_log.log or access_log.log, and no"
            " config snapshots"
        )
    if config.torchserve:
        console: logging.Handler = ConsoleHandler(1)
    elif foreground:
        console = logging.StreamHandler()
    else:
        return None, problem
    console.setFormatter(fmt)
    if config.log_layout == "torchserve":
        console.addFilter(_not_ours_only)
    root.addHandler(console)
    if problem is not None:
        logging.getLogger(__name__).warning("%s", problem)
    return (console if isinstance(console, ConsoleHandler) else None), problem


def make_log_folder(path: Path) -> None:
    """The log folder, made if need be (mserve's layout: ``mserve.out`` goes there before the
    server starts); ConfigError naming it and why when it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise unusable_log_folder(path, exc) from None


def unusable_log_folder(path: Path, exc: OSError) -> ConfigError:
    """The start error for a log folder that cannot be made or written in (mserve's layout;
    TorchServe's logs to the console instead): which folder, why, and the setting."""
    why = exc.strerror or str(exc)
    for part in (path, *path.parents):  # a file where a folder should be: name it
        if part.exists() and not part.is_dir():
            why = f"{part} is a file, not a folder"
            break
    return ConfigError(
        f"log folder {path} cannot be used ({why}): set log_dir (--log-dir, MSERVE_LOG_DIR) to"
        " a folder the server can make and write in"
    )


def _add_files(config: ServerConfig, fmt: logging.Formatter, torchserve: bool) -> None:
    """The log files in the log folder, made if need be; OSError when they cannot be opened.
    ``torchserve``: TorchServe's layout, whose files leave out our lines marked OURS_ONLY."""
    config.log_path.mkdir(parents=True, exist_ok=True)
    if config.log_layout == "torchserve":
        main = _rotating(config.log_path / "ts_log.log")
        models = _rotating(config.log_path / "model_log.log")
        models.setFormatter(fmt)
        models.addFilter(_not_ours_only)
        logging.getLogger("mserve.model").addHandler(models)  # and on to ts_log.log, as there
    else:
        main = _rotating(config.log_path / "mserve.log")
    main.setFormatter(fmt)
    if torchserve:
        main.addFilter(_not_ours_only)
    logging.getLogger().addHandler(main)


_LOG4J_LEVELS = {"WARNING": "WARN", "CRITICAL": "FATAL"}

# Our loggers under TorchServe's names (the class that logs the same event there), for the
# TorchServe layout's lines, which runbooks and log shippers grep; the longest prefix wins, and
# a logger with no counterpart keeps its own name.
_TS_LOGGERS = {
    "mserve": "org.pytorch.serve.ModelServer",
    "server.models.registry": "org.pytorch.serve.wlm.ModelManager",
    "server.models": "org.pytorch.serve.wlm.WorkerThread",
    "server.workers": "org.pytorch.serve.wlm.WorkerLifeCycle",
    "server.store": "org.pytorch.serve.wlm.ModelManager",
    "server.download": "org.pytorch.serve.wlm.ModelManager",
    "server.model_envs": "org.pytorch.serve.wlm.ModelManager",
    "server.rest": "org.pytorch.serve.http.HttpRequestHandler",
    "server.http": "org.pytorch.serve.http.HttpRequestHandler",
    "server.rpc": "org.pytorch.serve.grpcimpl.GRPCServiceFactory",
    "server.metrics": "org.pytorch.serve.metrics.MetricCollector",
    "server.snapshot": "org.pytorch.serve.snapshot.SnapshotManager",
    "server.ts_snapshot": "org.pytorch.serve.snapshot.SnapshotManager",
    "server.auth": "org.pytorch.serve.util.TokenAuthorization",
    "server.devices": "org.pytorch.serve.util.ConfigManager",
}
# TorchServe's own words for an event, logged by our code under TorchServe's logger names
# (``logging.getLogger(TS_LOGGER_ROOT + ".wlm.WorkerThread")``): said in the TorchServe layout
# only (:func:`setup_logging`), next to our own line for the same event.
TS_LOGGER_ROOT = "org.pytorch.serve"
# extra= of our own line for an event that TorchServe's layout tells otherwise (a failed load:
# the handler's traceback, then TorchServe's WorkerThread lines): not written in that layout,
# where tools read the console line by line for TorchServe's sequence
OURS_ONLY = {"mserve_layout_only": True}


def _not_ours_only(record: logging.LogRecord) -> bool:
    return not record.__dict__.get("mserve_layout_only", False)


def ts_logger_name(name: str) -> str:
    """The TorchServe logger a line of ours is written under in its layout."""
    probe = name
    while probe:
        if probe in _TS_LOGGERS:
            return _TS_LOGGERS[probe]
        probe = probe.rpartition(".")[0]
    return name


def torchserve_banner(
    config: ServerConfig, version: str, urls: Mapping[str, str], gpus: int,
    initial_models: list[str],
) -> str:  # fmt: skip
    """What TorchServe logs at start (its ConfigManager's configuration dump), in its order and
    words, with this server's values; what has no meaning here (the JVM's heap, Netty's
    threads, the C++ backend) says so. ``urls``: the APIs' bound addresses."""
    props = dict(config.ts_properties)
    allowed = ", ".join(config.allowed_urls) or "none: the model store and allowed_paths"
    rows = [
        ("Torchserve version", f"{version} (mserve)"),
        ("TS Home", str(Path(__file__).resolve().parent.parent)),
        ("Current directory", str(config.start_path)),
        ("Temp directory", tempfile.gettempdir()),
        ("Metrics config path", config.metrics_config or "N/A (the default metrics)"),
        ("Number of GPUs", str(gpus)),
        ("Number of CPUs", str(len(os.sched_getaffinity(0)))),
        ("Max heap size", "N/A (no JVM)"),
        ("Python executable", sys.executable),
        ("Config file", config.ts_config_file or "N/A"),
        ("Inference address", urls.get("inference", "N/A")),
        ("Management address", urls.get("management", "N/A")),
        ("Metrics address", urls.get("metrics", "N/A")),
        ("Model Store", str(config.store_path) if config.store_path else "N/A"),
        ("Initial Models", ",".join(initial_models) or "N/A"),
        ("Log dir", str(config.log_path.resolve())),
        ("Metrics dir", str(config.metrics_log_path.resolve())),
        ("Netty threads", "N/A (no Netty)"),
        ("Netty client threads", "N/A (no Netty)"),
        ("Default workers per model", str(config.default_workers_per_model)),
        ("Blacklist Regex", config.worker_env_deny_regex or "N/A"),
        ("Maximum Response Size", str(config.max_response_size_bytes)),
        ("Maximum Request Size", str(config.max_request_size_bytes)),
        ("Limit Maximum Image Pixels", props.get("limit_max_image_pixels", "true")),
        ("Prefer direct buffer", "N/A (no JVM)"),
        ("Allowed Urls", f"[{allowed}]"),
        ("Custom python dependency for model allowed", _bool(config.install_py_dep_per_model)),
        ("Enable metrics API", "true"),
        ("Metrics mode", config.metrics_mode),
        ("Disable system metrics", _bool(config.disable_system_metrics)),
        ("Workflow Store", str(config.workflow_store_path or "N/A")),
        ("CPP log config", "N/A (no C++ backend)"),
        ("Model config", props.get("models", "N/A")),
        ("System metrics command", "default"),
        ("Model API enabled", _bool(config.enable_model_api)),
    ]
    return "".join(f"\n{name}: {value}" for name, value in rows)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _rotating(path: Path) -> RotatingFileHandler:
    return RotatingFileHandler(path, maxBytes=50 << 20, backupCount=5)


# Facts a record may carry (``log.info(..., extra={"model": ...})``), copied into its JSON object
_JSON_FIELDS = ("request_id", "trace_id", "model", "version", "worker", "status", "latency_ms")


class JsonFormatter(logging.Formatter):
    """``log_format: json``: one JSON object per line (time, level, logger, message, and the
    request id, trace id, model, version, worker where the record has them; a worker's output
    line names its model and worker), for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
        }
        worker_line = record.name.startswith("mserve.model.") and isinstance(record.args, tuple)
        if worker_line and len(record.args) == 2:  # type: ignore[arg-type]
            entry["worker"] = str(record.args[0])  # type: ignore[index]
            entry["message"] = str(record.args[1])  # type: ignore[index]
            model, _, version = record.name[len("mserve.model.") :].partition(":")
            entry["model"], entry["version"] = model, version
            entry["stream"] = getattr(record, "stream", "stdout")
        else:
            entry["message"] = record.getMessage()
        for key in _JSON_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        local = time.localtime(record.created)
        zone = time.strftime("%z", local)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", local)
        return f"{stamp}.{int(record.msecs):03d}{zone[:3]}:{zone[3:]}"


def worker_facts(model: str, version: str, worker_id: str) -> dict[str, str]:
    """What a line about one worker carries (``log.info(..., extra=worker_facts(...))``): the
    JSON lines show the three facts, TorchServe's layout names the worker's thread from them."""
    return {"model": model, "version": version, "worker": worker_id}


def _worker_thread(worker_id: object, model: object, version: object) -> str:
    """TorchServe's name for a worker's thread (its WorkerThread's getWorkerName)."""
    return f"W-{worker_id}-{model}_{version}"


class TorchServeFormatter(logging.Formatter):
    """TorchServe's log4j2 line, ``2024-05-01T12:00:00,123 [INFO ] thread logger - message``,
    for tools that parse its files. A line about a worker (:func:`worker_facts`) names the
    worker's thread, ``W-9000-<model>_<version>``, as TorchServe's WorkerThread lines do; other
    lines ``main``. A worker's output line is written as TorchServe writes it: thread
    ``W-9000-<model>_<version>-stdout`` (or ``-stderr``), logger ``MODEL_LOG``, the line as
    printed."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s [%(ts_level)-5s] %(ts_thread)s %(ts_logger)s - %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created))
        return f"{stamp},{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        record.ts_level = _LOG4J_LEVELS.get(record.levelname, record.levelname)
        worker_line = record.name.startswith("mserve.model.") and isinstance(record.args, tuple)
        if worker_line and len(record.args) == 2:  # type: ignore[arg-type]
            worker_id, line = record.args  # type: ignore[misc]
            model, _, version = record.name[len("mserve.model.") :].partition(":")
            thread = _worker_thread(worker_id, model, version)
            record.ts_thread = f"{thread}-{getattr(record, 'stream', 'stdout')}"
            record.ts_logger = "MODEL_LOG"
            record.msg, record.args = "%s", (line,)
            try:
                return super().format(record)
            finally:
                record.msg, record.args = "[worker %s] %s", (worker_id, line)
        worker = record.__dict__.get("worker")
        if worker is not None:
            record.ts_thread = _worker_thread(
                worker, record.__dict__.get("model"), record.__dict__.get("version")
            )
        else:
            record.ts_thread = "main" if record.threadName == "MainThread" else record.threadName
        record.ts_logger = ts_logger_name(record.name)
        return super().format(record)
