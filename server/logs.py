"""The server's logs: mserve's files (``mserve.log``) or TorchServe's (``ts_log.log``,
``model_log.log``, in log4j2's default line format), and a console where there is one (stderr in
the foreground; in TorchServe's layout, the caller's stdout: server/console.py). Configured once,
by the server process at start; modules only ``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import json
import logging
import time
from logging.handlers import RotatingFileHandler
from pathlib import Path

from server.config import ServerConfig
from server.console import ConsoleHandler


def setup_logging(config: ServerConfig, foreground: bool) -> ConsoleHandler | None:
    """The log files, and a console: stderr in the foreground; in the TorchServe layout, stdout
    (TorchServe's console), daemon or not. The console handler, if any, is returned."""
    config.log_path.mkdir(parents=True, exist_ok=True)
    config.metrics_log_path.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    # httpx logs every request with its full URL (query secrets included); ours say what matters
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if config.log_layout == "torchserve":
        fmt = TorchServeFormatter()
        main = _rotating(config.log_path / "ts_log.log")
        models = _rotating(config.log_path / "model_log.log")
        models.setFormatter(fmt)
        logging.getLogger("mserve.model").addHandler(models)  # and on to ts_log.log, as there
    else:
        main = _rotating(config.log_path / "mserve.log")
        if config.log_format == "json":
            fmt = JsonFormatter()
    main.setFormatter(fmt)
    root.addHandler(main)
    if config.torchserve:
        console: logging.Handler = ConsoleHandler(1)
    elif foreground:
        console = logging.StreamHandler()
    else:
        return None
    console.setFormatter(fmt)
    root.addHandler(console)
    return console if isinstance(console, ConsoleHandler) else None


_LOG4J_LEVELS = {"WARNING": "WARN", "CRITICAL": "FATAL"}


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


class TorchServeFormatter(logging.Formatter):
    """TorchServe's log4j2 line, ``2024-05-01T12:00:00,123 [INFO ] thread logger - message``,
    for tools that parse its files. A worker's output line is written as TorchServe writes it:
    thread ``W-9000-<model>_<version>-stdout``, logger ``MODEL_LOG``, the line as printed."""

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
            label = record.name[len("mserve.model.") :].replace(":", "_")
            record.ts_thread = f"W-{worker_id}-{label}-{getattr(record, 'stream', 'stdout')}"
            record.ts_logger = "MODEL_LOG"
            record.msg, record.args = "%s", (line,)
            try:
                return super().format(record)
            finally:
                record.msg, record.args = "[worker %s] %s", (worker_id, line)
        record.ts_thread = "main" if record.threadName == "MainThread" else record.threadName
        record.ts_logger = record.name
        return super().format(record)
