"""The mserve process: listeners, startup models, status file, signals and ordered shutdown.

Signal handlers only set an event; the main coroutine acts on it (a second signal forces exit).
Shutdown order: stop accepting, let in-flight requests finish against a deadline, stop workers,
remove the status and pid files.

The status file (what ``mserve --status`` shows) is rewritten on every registry change, and
within a second of a model's state changing on its own (workers arriving, a model failing).
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import ipaddress
import logging
import os
import signal
import time
from collections.abc import Coroutine
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from archiver import __version__
from server import snapshot, ts_snapshot
from server.accesslog import AccessLogFile
from server.auth import Guard, Keys, read_key_file
from server.config import ModelEntry, ServerConfig, grpc_tls, split_address
from server.console import ConsoleHandler
from server.devices import GpuAllocator, server_gpus
from server.download import is_remote, recorded_url
from server.errors import MserveError, answer_as_torchserve
from server.handler_metrics import MetricsConfig, load_metrics_config
from server.http import HttpServer
from server.metrics import Metrics, MetricsAPI
from server.models.registry import RegisterRequest, Registry
from server.models.settings import request_fields
from server.models.version import ModelVersion
from server.rest.inference import InferenceAPI
from server.rest.management import ManagementAPI
from server.rundir import (
    LOCK_FILE,
    PID_FILE,
    SNAPSHOT_FILE,
    STATUS_FILE,
    StartupModel,
    write_json_atomic,
)
from server.tls import server_context
from server.workers.env_vars import WorkerEnvironment, hide_own_environ
from server.workers.launch import Launcher
from server.workers.preload import PreloadMemory
from server.workers.prespawn import EarlyStart, start_early

if TYPE_CHECKING:
    from server.rpc.server import GrpcListener

log = logging.getLogger("mserve")

# client, request line, status, bytes, seconds; the time stamp comes from the log formatter
ACCESS_LOG_FLUSH_S = 1.0  # the longest an access.log line waits in memory
STATUS_REFRESH_S = 1.0  # the longest the status file lags a model's state


# Young objects the garbage collector lets pile up before a pass, up from CPython's 700. Each
# request allocates a few dozen containers, nearly all freed at once by reference counting; a
# pass every 700 allocations walked the objects of every request in flight each time (~5% of
# the frontend's CPU under load, py-spy). Cyclic garbage now waits a little longer: ~10,000
# objects, a few hundred requests' worth.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Once started: what was imported and built at startup lives until the end, so full
    collections need not walk it again (``gc.freeze``), and young passes are rarer.

    No collection before the freeze: it walked every object of the startup (15-40 ms measured,
    right when the first request arrives) to free the cyclic leftovers, about 200 objects at an
    echo start (most from imports), which stay now: a few dozen KiB, once."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


class AlreadyRunning(MserveError):
    pass


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


class Server:
    def __init__(
        self, config: ServerConfig, early: EarlyStart | None = None, ready_fd: int | None = None,
        console: ConsoleHandler | None = None,
    ) -> None:  # fmt: skip
        """``early``: the templates started before the server imported itself (if not, they
        start in :meth:`run`); ``ready_fd``: a pipe to write a byte to once ready;
        ``console``: the TorchServe layout's console (``Model server started.`` goes there)."""
        self.config = config
        self.ready_fd = ready_fd
        self.console = console
        self.early = early or EarlyStart([], PreloadMemory(config.env_path), [])
        self.gpus = GpuAllocator(server_gpus(config.number_of_gpu, os.environ))
        worker_env = WorkerEnvironment.split(
            os.environ, config.worker_env_deny, config.worker_env_deny_regex
        )
        self.launcher = Launcher(
            config.fork_workers, config.worker_preload, worker_env, self.early.memory
        )
        self.metrics = Metrics(
            config.metrics_mode,
            load_metrics_config(Path(config.metrics_config))
            if config.metrics_config
            else MetricsConfig({}, None),
            config.metrics_log_path,
            gpus=self.gpus.devices,
        )
        self.registry = Registry(config, self.gpus, __version__, self.launcher, self.metrics)
        self.metrics.watch(self.registry.all, self.registry.residency)
        self.keys = None if config.disable_token_authorization else _keys(config)
        self.listeners: list[HttpServer] = []
        self.grpc_listeners: list[GrpcListener] = []
        self.addresses: dict[str, str] = {}
        self.urls: dict[str, str] = {}  # each API's base URL, http:// or https://
        self.warnings: list[str] = []  # said at start and by mserve --status
        self.load_failures: dict[str, str] = {}  # startup or snapshot models that failed
        self._written_models: dict[str, str] | None = None
        self.state = "starting"
        self.stop_event = asyncio.Event()
        self.access_log: AccessLogFile | None = None
        self.started = time.time()

    @property
    def status_path(self) -> Path:
        return self.config.run_path / STATUS_FILE

    def models_status(self) -> dict[str, str]:
        """Each model's state (``_state``: ready, unloaded, loading, failed), per version when its
        versions differ; startup models that failed to register are listed too."""
        out = dict(self.load_failures)
        for name, versions in sorted(self.registry.models.items()):
            states = {version: _state(mv) for version, mv in versions.items()}
            if len(set(states.values())) == 1:
                out[name] = next(iter(states.values()))
            else:
                out[name] = ", ".join(f"{version} {state}" for version, state in states.items())
        return out

    def write_status(self) -> None:
        for name in self.registry.models:  # registered since, through the API: that counts now
            self.load_failures.pop(name, None)
        models = self.models_status()
        write_json_atomic(
            self.status_path,
            {
                "pid": os.getpid(),
                "state": self.state,
                "version": __version__,
                "started": self.started,
                "inference": self.addresses.get("inference"),
                "management": self.addresses.get("management"),
                "metrics": self.addresses.get("metrics"),
                "grpc_inference": self.addresses.get("grpc_inference"),
                "grpc_management": self.addresses.get("grpc_management"),
                "urls": self.urls,
                "token_authorization": self.keys is not None,
                "key_file": str(self.keys.path) if self.keys is not None else None,
                "warnings": self.warnings,
                "gpus": self.gpus.count,
                "models": models,
                "log_dir": str(self.config.log_path),
                "env_dir": str(self.config.env_path),
            },
        )
        self._written_models = models

    async def refresh_status(self) -> None:
        """Rewrite the status file when a model's state changed on its own."""
        while True:
            await asyncio.sleep(STATUS_REFRESH_S)
            if self.models_status() != self._written_models:
                try:
                    self.write_status()
                except OSError as exc:
                    log.error("could not save the status file: %s", exc)

    async def listen(self) -> None:
        config = self.config
        if config.access_log:
            torchserve = config.log_layout == "torchserve"
            name = "access_log.log" if torchserve else "access.log"
            self.access_log = AccessLogFile(config.log_path / name, torchserve=torchserve)
        routers = {
            "inference": InferenceAPI(self.registry, self.metrics, config.max_response_size_bytes),
            "management": ManagementAPI(self.registry, self.keys, config.enable_model_api),
            "metrics": MetricsAPI(self.metrics),
        }
        max_request = {
            "inference": config.max_request_size_bytes,
            "management": 1 << 20,
            "metrics": 1 << 16,
        }
        addresses = {name: split_address(getattr(config, f"{name}_address"), name)
                     for name in routers}  # fmt: skip
        tls = None
        if any(secure for secure, _, _ in addresses.values()):
            assert config.certificate_file and config.private_key_file  # checked by the config
            tls = server_context(
                config.certificate_file, config.private_key_file, config.tls_security_level
            )
        if self.keys is not None:
            self.keys.write()
            log.info("token authorization is on: keys in %s", self.keys.path)
        for name, router in routers.items():
            secure, host, port = addresses[name]
            listener = HttpServer(
                router,
                self.access_log if name != "metrics" else None,
                max_request[name],
                keepalive_s=config.keepalive_timeout_s,
                read_timeout_s=config.read_timeout_s,
                max_connections=config.max_connections,
                on_answer=self.metrics.status if name != "metrics" else None,
                guard=self._guard(name),
                redact=self.registry.redact,
            )
            try:
                bound = await listener.listen(host, port, tls if secure else None)
            except OSError as exc:
                raise MserveError(
                    f"cannot listen on {host}:{port} for the {name} API: {exc.strerror}"
                    f" (set {name}_address to another port, or 0 for any free port)"
                ) from exc
            self.listeners.append(listener)
            address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
            self.addresses[name] = address
            self.urls[name] = f"{'https' if secure else 'http'}://{address}"
            log.info("%s API listening on %s", name, self.urls[name])

    async def _listen_grpc(self) -> None:
        """TorchServe's gRPC inference and management services (server/rpc/), each on its own
        address, and the Open Inference Protocol's next to TorchServe's inference service, on
        this event loop."""
        # grpc takes ~0.1 s to import: only a server that serves gRPC pays for it, and in a
        # thread, as this runs while the startup models' workers load: the loop stays free to
        # answer their handshakes (grpc's import releases the GIL often enough for that)
        await asyncio.to_thread(_import_grpc)
        from server.rpc.inference import PING, InferenceService
        from server.rpc.management import ManagementService
        from server.rpc.oip import PROBES, OipService
        from server.rpc.server import GrpcListener, TokenGuard, credentials

        config = self.config
        tls = None
        if grpc_tls(config):
            assert config.certificate_file and config.private_key_file  # checked by the config
            # checks the files
            server_context(
                config.certificate_file, config.private_key_file, config.tls_security_level
            )
            tls = credentials(config.certificate_file, config.private_key_file)
        torchserve = InferenceService(self.registry, self.metrics, config.max_response_size_bytes)
        services = {
            # TorchServe's service and the Open Inference Protocol's share the inference port
            "inference": [torchserve.add_to(), OipService(self.registry, torchserve).add_to()],
            "management": [ManagementService(self.registry, config.enable_model_api).add_to()],
        }
        max_request = {"inference": config.max_request_size_bytes, "management": 1 << 20}
        # the probes are exempt as their REST paths are (token_exempt_paths): Ping as /ping,
        # ServerLive and ServerReady as /v2/health/live and /v2/health/ready
        probes = {"/ping": (PING,), **PROBES}
        exempt = frozenset(
            m for path, methods in probes.items() if path in config.token_exempt_paths
            for m in methods
        )  # fmt: skip
        for api, added in services.items():
            guard = None if self.keys is None else TokenGuard(self.keys, api, api, exempt)
            listener = GrpcListener(
                api, added, guard, max_request[api], config.max_response_size_bytes
            )
            key = f"grpc_{api}_address"
            _, host, port = split_address(getattr(config, key), key)
            bound = listener.bind(host, port, tls)
            await listener.start()
            self.grpc_listeners.append(listener)
            address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
            self.addresses[f"grpc_{api}"] = address
            self.urls[f"grpc_{api}"] = f"{'grpcs' if tls else 'grpc'}://{address}"
            log.info("gRPC %s API listening on %s", api, self.urls[f"grpc_{api}"])

    def _guard(self, api: str) -> Guard | None:
        """Token authorization for one listener: the inference key on the inference port, the
        management key on the management port and, when asked, on the metrics port."""
        if self.keys is None or (api == "metrics" and not self.config.metrics_need_token):
            return None
        kind = "inference" if api == "inference" else "management"
        exempt = self.config.token_exempt_paths if api != "metrics" else ()
        return Guard(self.keys, kind, api, exempt)

    def _warn_if_open(self) -> None:
        if self.keys is None:
            warning = open_warning(self.urls, self.config.enable_model_api)
            if warning:
                self.warnings.append(warning)
                log.warning("%s", warning)

    def _keep_snapshots(self) -> None:
        """From now on, every change is saved: in ``<run_dir>/snapshot.json``, or as
        TorchServe's config snapshots in the TorchServe layout (a ``-startup.cfg`` now, a
        ``-snapshot.cfg`` per change, a ``-shutdown.cfg`` at stop)."""
        config, registry = self.config, self.registry
        if not config.snapshot:
            return
        if config.torchserve:
            ts_snapshot.save(config, registry, "startup")
            registry.on_change("snapshot", lambda: ts_snapshot.save(config, registry, "snapshot"))
            return
        path = config.run_path / SNAPSHOT_FILE
        registry.on_change("snapshot", lambda: snapshot.save(registry, path))
        registry.changed()

    async def restore_snapshot(self) -> None:
        if not self.config.snapshot or self.config.torchserve:  # the latter: --ts-config's
            return
        requests, defaults = snapshot.load(self.config.run_path / SNAPSHOT_FILE)
        if not requests:
            return
        log.info("restoring %d model version(s) from the snapshot", len(requests))

        async def one(request: RegisterRequest, entry: dict[str, Any]) -> None:
            try:
                await self.registry.register(request)
            except MserveError as exc:
                log.error(
                    "snapshot model %s failed to restore: %s (kept in the snapshot for the next"
                    " start; DELETE /models/%s removes it)",
                    request.url, exc.message, request.model_name,
                )  # fmt: skip
                self.load_failures[request.model_name or request.url] = f"failed: {exc.message}"
                self.registry.unrestored.append(entry)

        await asyncio.gather(*(one(r, e) for r, e in requests))
        for name, version in defaults.items():
            if version in self.registry.models.get(name, {}):
                self.registry.defaults[name] = version

    async def load_startup_models(self, models: list[StartupModel]) -> None:
        async def one(m: StartupModel) -> None:
            label = m.name or m.url
            try:
                await self.registry.register(
                    RegisterRequest(url=m.url, model_name=m.name, trusted=True, at_startup=True)
                )
            except MserveError as exc:
                log.error("startup model %s failed: %s", label, exc.message)
                self.load_failures[label] = f"failed: {exc.message}"

        await asyncio.gather(*(one(m) for m in models))

    async def _drain(self, deadline_s: float) -> None:
        """Let queued and running requests finish, up to the deadline; the rest get 503."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        while loop.time() < deadline:
            pending = sum(mv.pending() for mv in self.registry.all())
            if pending == 0:
                return
            await asyncio.sleep(0.02)
        log.warning(
            "shutdown drain deadline (%.0f s) passed with requests still pending", deadline_s
        )

    def _on_signal(self, signum: int) -> None:
        if self.stop_event.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("received %s: shutting down", signal.Signals(signum).name)
        self.stop_event.set()

    async def run(self, models: list[StartupModel]) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.registry.on_change("status file", self.write_status)
        try:
            # the templates of the models about to load import what those need meanwhile
            self.launcher.prestart(self.early.models, self.early.templates)
            if not await self._until_stopped(self._start(models)):
                log.info("stopping before the startup models finished loading")
                return
            self._keep_snapshots()
            if self.console is not None:  # what TorchServe's launchers and tests wait for
                self.console.say("Model server started.")
            self.state = "ready"
            self.registry.started = True
            self.write_status()
            log.info("mserve %s ready", __version__)
            self.said_ready()
            tune_gc()
            chores = [
                asyncio.create_task(self.refresh_status()),
                asyncio.create_task(self.metrics.run()),
                asyncio.create_task(self.registry.residency.run()),
            ]
            if self.access_log is not None:
                chores.append(asyncio.create_task(self.access_log.flush_every(ACCESS_LOG_FLUSH_S)))
            try:
                await self.stop_event.wait()
            finally:
                for chore in chores:
                    chore.cancel()
                await asyncio.gather(*chores, return_exceptions=True)
        finally:
            await self.shutdown()
            if self.access_log is not None:
                self.access_log.close()
            self.metrics.close()

    def said_ready(self) -> None:
        """Wake whoever waits on ``ready_fd`` (``mserve --start``: it then reads the status
        file): a byte once ready, or only the pipe's end when the server stops before."""
        if self.ready_fd is None:
            return
        fd, self.ready_fd = self.ready_fd, None
        try:
            if self.state == "ready":
                os.write(fd, b"r")
        except OSError:
            pass  # the waiting process is gone: nobody to wake
        finally:
            os.close(fd)

    async def restore_ts_snapshot(self) -> None:
        """The models a TorchServe config snapshot records (``model_snapshot``), each from its
        archive in the store with the settings it was running with; names our own snapshot
        already restored are skipped (it is newer: it holds what changed since)."""
        restored = {mv.name for mv in self.registry.all()} | set(self.load_failures)
        entries = [e for e in self.config.model_snapshot or () if e.name not in restored]
        if not entries:
            return
        log.info("registering %d model version(s) from the TorchServe snapshot", len(entries))

        async def one(entry: ModelEntry) -> None:
            request = RegisterRequest(
                url=entry.url or entry.mar_name or "",
                model_name=entry.name,
                **request_fields(entry.get),  # minWorkers, ... (server/models/settings.py)
                trusted=True,
                at_startup=True,
            )
            try:
                model = await self.registry.register(request)
            except MserveError as exc:
                log.error("TorchServe snapshot model %s %s failed: %s",
                          entry.name, entry.version, exc.message)  # fmt: skip
                self.load_failures[entry.name] = f"failed: {exc.message}"
                return
            if entry.default_version:
                self.registry.defaults[entry.name] = model.version

        await asyncio.gather(*(one(e) for e in entries))

    async def _start(self, models: list[StartupModel]) -> None:
        """Listeners and startup models, in the order that brings the first answer soonest:
        the HTTP listeners, then the startup models, and the gRPC listeners once their workers
        are under way (or they are loaded), so that gRPC's import and set-up overlap the
        workers' start (or their template's imports) in other processes. Ready (the caller)
        only when all are done; a listener that cannot open stops the models' loading and fails
        the start."""
        await self.listen()
        self.write_status()
        loading = asyncio.ensure_future(self._load_models(models))
        try:
            if self.config.grpc:
                started = asyncio.ensure_future(self.launcher.underway.wait())
                await asyncio.wait({loading, started}, return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
                await self._listen_grpc()
            self._warn_if_open()
            await loading
        finally:
            if not loading.done():
                loading.cancel()
                await asyncio.gather(loading, return_exceptions=True)

    async def _load_models(self, models: list[StartupModel]) -> None:
        await self.restore_snapshot()
        await self.restore_ts_snapshot()
        restored = {mv.name for mv in self.registry.all()} | {mv.url for mv in self.registry.all()}
        await self.load_startup_models([
            m for m in models
            if m.name not in restored and m.url not in restored
            and not (is_remote(m.url) and recorded_url(m.url) in restored)  # as the snapshot has it
        ])  # fmt: skip

    async def _until_stopped(self, work: Coroutine[Any, Any, None]) -> bool:
        """Run ``work`` unless a stop signal comes first (then cancel it): a SIGTERM during a
        startup that builds environments or loads big models must not wait for it. True when
        ``work`` finished."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stop_event.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            task.result()
            return True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False

    async def shutdown(self) -> None:
        self.state = "stopping"
        self.write_status()
        if self.config.torchserve and self.config.snapshot and self.registry.started:
            ts_snapshot.save(self.config, self.registry, "shutdown")
        drain_s = self.config.shutdown_drain_s
        for listener in self.listeners:  # new requests get 503 and "Connection: close"
            listener.stop_accepting()
        # new gRPC calls are refused at once (UNAVAILABLE); calls under way drain with the rest
        grpc_stops = [asyncio.ensure_future(g.stop(drain_s)) for g in self.grpc_listeners]
        await self._drain(drain_s)
        await self.registry.close()
        await asyncio.gather(*(mv.stop(drain_s) for mv in self.registry.all()))
        await self.launcher.close()
        for listener in self.listeners:
            listener.close()
        for listener in self.listeners:
            await listener.wait_closed(1.0)
        await asyncio.gather(*grpc_stops)
        if self.keys is not None:
            self.keys.remove()
        log.info("mserve stopped")


def _import_grpc() -> None:
    """grpc and the generated service modules (server/rpc/): the bulk of opening the gRPC
    listeners."""
    import server.rpc.inference
    import server.rpc.management
    import server.rpc.oip
    import server.rpc.server  # noqa: F401


def _keys(config: ServerConfig) -> Keys:
    minutes = {
        "inference": config.inference_token_expiration_min or config.token_expiration_min,
        "management": config.management_token_expiration_min or config.token_expiration_min,
    }
    fixed = None
    if config.token_key_file:  # one key for every replica (a mounted Secret)
        fixed = read_key_file(Path(config.token_key_file).expanduser())
    return Keys(config.key_path, {k: m * 60 for k, m in minutes.items()}, fixed=fixed)


def open_warning(urls: dict[str, str], model_api: bool) -> str | None:
    """What to say when token authorization is off and an API listens beyond loopback: anyone
    who reaches it can call it without a key, and register models (their code runs here)."""
    exposed = [f"{api} ({url})" for api, url in urls.items()
               if not _loopback(split_address(url.split("://", 1)[-1], api)[1])]  # fmt: skip
    if not exposed:
        return None
    runs_code = " and register models, which runs their code here" if model_api else ""
    return (
        f"token authorization is OFF and the {', '.join(exposed)} API listens beyond this"
        f" machine: anyone who reaches it can call it without a key{runs_code}; remove"
        " --disable-token-auth / disable_token_authorization to require keys"
    )


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _state(mv: ModelVersion) -> str:
    """``ready`` (its workers serve), ``unloaded`` (no worker; ``loads on demand`` when a
    request starts one), ``loading`` or ``failed: why``."""
    if mv.failed is not None:
        return f"failed: {mv.failed}"
    if mv.stage:
        return f"loading ({mv.stage})"
    state = mv.load_state()
    if state == "unloaded" and mv.healthy():
        return "unloaded (loads on demand)" if mv.loads_on_demand() else "unloaded"
    if state == "loaded" and mv.healthy():
        return "ready"
    return "loading"


def hold_lock(run_dir: Path) -> int:
    """An exclusive lock for the server's life: a second server on one run dir is refused."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(f"mserve is already running with run dir {run_dir}") from None
    return fd


def run_server(
    config: ServerConfig,
    models: list[StartupModel],
    foreground: bool,
    warnings: list[str] | None = None,
    early: EarlyStart | None = None,
    ready_fd: int | None = None,
) -> int:
    """``warnings``: what reading the config found worth saying (TorchServe keys with no effect),
    logged once logging is set up; ``early``: the templates the caller started first thing
    (server/workers/prespawn.py), else they start now; ``ready_fd``: a pipe to write a byte to
    once ready (``mserve --start`` waits on it), closed then."""
    lock = hold_lock(config.run_path)
    if early is None:
        early = start_early(config, models)
    console = setup_logging(config, foreground)
    if config.torchserve:
        answer_as_torchserve()
    for warning in warnings or ():
        log.warning("%s", warning)
    pid_path = config.run_path / PID_FILE
    pid_path.write_text(str(os.getpid()))
    if config.grpc:
        # gRPC's fork handlers (on by default in its core) run in every child the server forks
        # while a gRPC call is under way, and crash a few percent of them before they exec (uvloop
        # starts workers with fork(); tested: 4 of 60 spawns inside a call). The server's
        # children never use gRPC: turn them off, before grpc is first imported (_listen_grpc).
        os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    # workers run as this user: keep them from reading the secrets the deny-list withholds
    # out of /proc/<server pid>/environ
    hide_own_environ()
    server = Server(config, early, ready_fd, console)
    try:
        # uvloop: libuv's loop reuses its read buffers and runs the HTTP path several times
        # faster than asyncio's default loop on this workload (see scripts/bench_server.py)
        uvloop.run(server.run(models))
    finally:
        for path in (pid_path, server.status_path):
            path.unlink(missing_ok=True)
        server.said_ready()
        os.close(lock)
        if console is not None:
            console.close()
    return 0
