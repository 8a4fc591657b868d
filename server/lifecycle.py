"""The mserve process's lifecycle: start in order, serve until a signal, stop in order.

Start: the lock on the run dir, logging (server/logs.py), the REST listeners
(server/rest/frontend.py), the startup and snapshot models (server/snapshot.py,
server/ts_snapshot.py), the gRPC listeners (server/rpc/frontend.py), then ready. Signal
handlers only set an event; the main coroutine acts on it (a second signal forces exit).
Shutdown order: stop accepting, let in-flight requests finish against a deadline, stop workers,
remove the status and pid files.

The status file (what ``mserve --status`` shows; server/status.py) is rewritten on every
registry change, and within a second of a model's state changing on its own (workers arriving,
a model failing).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import signal
import time
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from archiver import __version__
from server import locks, snapshot, tenants, tracing, ts_snapshot
from server.accesslog import AccessLogFile
from server.auth import Keys, open_warning, read_key_file
from server.config import ServerConfig
from server.console import ConsoleHandler
from server.devices import GpuAllocator, server_gpus
from server.download import is_remote, recorded_url
from server.errors import ConfigError, MserveError, answer_as_torchserve
from server.http import HttpServer
from server.logs import setup_logging, torchserve_banner
from server.loop_watch import LoopWatch
from server.metrics.handler import load_metrics_config
from server.metrics.server_metrics import Metrics
from server.models import watch
from server.models.registry import RegisterRequest, Registry
from server.rest import frontend as rest_frontend
from server.rollouts.router import Router
from server.rollouts.shadow_control import Shadows
from server.rundir import (
    LOCK_FILE,
    PID_FILE,
    SNAPSHOT_FILE,
    STATUS_FILE,
    StartupModel,
    write_json_atomic,
)
from server.status import models_status, sandbox_status
from server.tls import certificate_not_after
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
# the longest ``Model server started.`` waits for the ``--start`` command to exit (it exits
# as soon as it has read the status file: milliseconds)
LAUNCHER_EXIT_WAIT_S = 10.0


# Young objects the garbage collector lets pile up before a pass, up from CPython's 700. Each
# request allocates a few dozen containers, nearly all freed at once by reference counting; a
# pass every 700 allocations walked the objects of every request in flight each time (a
# visible share of the frontend's CPU under load; docs/explanations/costs.md). Cyclic garbage now
# waits a little longer: a few hundred requests' worth of objects.
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


class Server:
    def __init__(
        self, config: ServerConfig, early: EarlyStart | None = None, ready_fd: int | None = None,
        console: ConsoleHandler | None = None, launcher_pid: int | None = None,
    ) -> None:  # fmt: skip
        """``early``: the templates started before the server imported itself (if not, they
        start in :meth:`run`); ``ready_fd``: a pipe to write a byte to once ready;
        ``console``: the TorchServe layout's console (``Model server started.`` goes there,
        once ``launcher_pid``, the ``--start`` command waiting on ``ready_fd``, has exited)."""
        self.config = config
        self.ready_fd = ready_fd
        self.launcher_pid = launcher_pid
        self.console = console
        self.early = early or EarlyStart([], PreloadMemory(config.env_path), [])
        self.gpus = GpuAllocator(server_gpus(config.number_of_gpu, os.environ))
        worker_env = WorkerEnvironment.split(
            os.environ, config.worker_env_deny, config.worker_env_deny_regex
        )
        self.launcher = Launcher(
            config.fork_workers, config.worker_preload, worker_env, self.early.memory
        )
        # TorchServe's metric log files: written in log and legacy modes, made (empty) in
        # prometheus mode too where its log files are (its log4j makes them at start)
        metric_logs = config.metrics_mode != "prometheus" or config.log_layout == "torchserve"
        self.metrics = Metrics(
            config.metrics_mode,
            load_metrics_config(Path(config.metrics_config)) if config.metrics_config else None,
            config.metrics_log_path if metric_logs else None,
            gpus=self.gpus.devices,
            auto_detect=config.model_metrics_auto_detect,
            system_metrics=not config.disable_system_metrics,
            uuid_label=not config.torchserve,  # TorchServe 0.8's labels in its layout
        )
        self.registry = Registry(config, self.gpus, __version__, self.launcher, self.metrics)
        self.metrics.watch(self.registry.all, self.registry.residency)
        # which version answers a request (server/rollouts/): before the snapshot's listener,
        # so a version that goes is out of the splits before the snapshot is saved
        self.router = Router(self.registry, self.metrics)
        # a share of a model's traffic shadowed onto another version (server/rollouts/shadow.py)
        self.shadows = Shadows(self.router, self.registry, self.metrics)
        if config.certificate_file:
            not_after = certificate_not_after(config.certificate_file)
            if not_after is not None:
                self.metrics.watch_certificate(config.certificate_file, not_after)
        self.keys = None if config.disable_token_authorization else _keys(config)
        if config.tenants_file:  # before any model version: their queues are then fair ones
            if self.keys is None:
                raise ConfigError(
                    "tenants_file needs token authorization (its tenants are told apart by"
                    " their keys): remove disable_token_authorization or tenants_file"
                )
            tenants.setup(Path(config.tenants_file).expanduser(), lambda: self.registry.models)
        self.listeners: list[HttpServer] = []
        self.grpc_listeners: list[GrpcListener] = []
        self.addresses: dict[str, str] = {}
        self.urls: dict[str, str] = {}  # each API's base URL, http:// or https://
        self.warnings: list[str] = []  # said at start and by mserve --status
        if self.registry.sandbox.warning:
            self.warnings.append(self.registry.sandbox.warning)
            log.warning("%s", self.registry.sandbox.warning)
        self.load_failures: dict[str, str] = {}  # startup or snapshot models that failed
        self._written_models: dict[str, str] | None = None
        self._written_sandbox: dict[str, Any] | None = None
        self._status_writing = asyncio.Lock()  # one write of the status file at a time
        self.state = "starting"
        self.stop_event = asyncio.Event()
        self.access_log: AccessLogFile | None = None
        self.started = time.time()

    @property
    def status_path(self) -> Path:
        return self.config.run_path / STATUS_FILE

    def models_status(self) -> dict[str, str]:
        return models_status(self.registry, self.load_failures)

    def write_status(self) -> None:
        write_json_atomic(self.status_path, self._status(), durable=False)

    def _status(self) -> dict[str, Any]:
        """The status file's content (written without an fsync: it describes this process,
        which a crash makes stale anyway); what it says of the models is remembered, so that
        :meth:`refresh_status` rewrites it when that changes."""
        for name in self.registry.models:  # registered since, through the API: that counts now
            self.load_failures.pop(name, None)
        models = self.models_status()
        self._written_models = models
        self._written_sandbox = sandbox_status(self.registry)
        return {
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
            "sandbox": sandbox_status(self.registry),
            "gpus": self.gpus.count,
            "models": models,
            "log_dir": str(self.config.log_path),
            "env_dir": str(self.config.env_path),
            "tracing": self.tracing_status(),
            "memory": {
                "worker_memory_budget_mb": self.config.worker_memory_budget_mb,
                "max_loaded_models": self.config.max_loaded_models,
                "warm_tier_budget_mb": self.config.warm_tier_budget_mb,
                "eviction": self.config.eviction,
            },
        }

    @staticmethod
    def tracing_status() -> dict[str, Any] | None:
        """Where traces go (the start banner says it); None: tracing is off."""
        if tracing.current is None:
            return None
        settings = tracing.current.settings
        return {
            "endpoint": settings.endpoint,
            "protocol": settings.protocol,
            "sampling_ratio": settings.sampling_ratio,
        }

    async def refresh_status(self) -> None:
        """Rewrite the status file when a model's state changed on its own (loads, unloads,
        crashes: every second under a load of many models). Written in a thread: a file
        written and renamed waits for the filesystem, 0.1-0.4 s when it is busy with
        weights being read or dropped, which on the event loop every request would wait
        for."""
        while True:
            await asyncio.sleep(STATUS_REFRESH_S)
            if (
                self.models_status() != self._written_models
                or sandbox_status(self.registry) != self._written_sandbox
            ):
                async with self._status_writing:
                    try:
                        await asyncio.to_thread(
                            write_json_atomic, self.status_path, self._status(), durable=False
                        )
                    except OSError as exc:
                        self._written_models = None  # tried again at the next pass
                        log.error("could not save the status file: %s", exc)

    async def listen(self) -> None:
        """The REST listeners (server/rest/frontend.py), with the key file written first."""
        config = self.config
        if config.access_log:
            torchserve = config.log_layout == "torchserve"
            name = "access_log.log" if torchserve else "access.log"
            self.access_log = AccessLogFile(
                config.log_path / name, torchserve=torchserve,
                json_lines=config.log_format == "json",
            )  # fmt: skip
        if self.keys is not None:
            self.keys.write()
            log.info("token authorization is on: keys in %s", self.keys.path)
        if tenants.current is not None:
            tenants.current.start()  # reloaded when the file changes
        for opened in await rest_frontend.open_listeners(
            config, self.registry, self.metrics, self.keys, self.access_log, self.router
        ):
            self.listeners.append(opened.listener)
            self.addresses[opened.api] = opened.address
            self.urls[opened.api] = opened.url

    async def _listen_grpc(self) -> None:
        """The gRPC frontend (server/rpc/frontend.py)."""
        # grpc is slow to import: only a server that serves gRPC pays for it, and in a
        # thread, as this runs while the startup models' workers load: the loop stays free to
        # answer their handshakes (grpc's import releases the GIL often enough for that)
        frontend = await asyncio.to_thread(importlib.import_module, "server.rpc.frontend")
        for opened in await frontend.open_listeners(
            self.config, self.registry, self.metrics, self.keys, self.router
        ):
            self.grpc_listeners.append(opened.listener)
            self.addresses[f"grpc_{opened.api}"] = opened.address
            self.urls[f"grpc_{opened.api}"] = opened.url

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
            router = self.router
            ts_snapshot.save(config, registry, "startup", router.to_json())
            registry.on_change(
                "snapshot",
                lambda: ts_snapshot.save(config, registry, "snapshot", router.to_json()),
            )
            return
        path = config.run_path / SNAPSHOT_FILE
        router = self.router
        registry.on_change("snapshot", lambda: snapshot.save(registry, path, router.to_json()))
        registry.changed()

    async def restore_snapshot(self) -> None:
        """mserve's own snapshot (none in TorchServe's layout: its config snapshot is the
        properties file, restored by :meth:`restore_ts_snapshot`)."""
        if self.config.snapshot and not self.config.torchserve:
            path = self.config.run_path / SNAPSHOT_FILE
            await snapshot.restore(self.registry, path, self.load_failures)
            self.router.restore(snapshot.load_traffic(path))

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
            if self.keys is not None:  # a forced exit leaves no live keys behind
                self.keys.remove()
            os._exit(1)
        log.info("received %s: shutting down", signal.Signals(signum).name)
        self.stop_event.set()

    async def run(self, models: list[StartupModel]) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.registry.on_change("status file", self.write_status)
        if tracing.current is not None:
            tracing.current.start()  # the span exporter process (server/tracing/process.py)
            warning = await asyncio.to_thread(tracing.collector_warning)
            if warning:  # said at start, not only in the log once the first batch fails
                self.warnings.append(warning)
                log.warning("%s", warning)
        try:
            # the templates of the models about to load import what those need meanwhile
            self.launcher.prestart(self.early.models, self.early.templates, self.early.guessed)
            if not await self._until_stopped(self._start(models)):
                log.info("stopping before the startup models finished loading")
                return
            self._keep_snapshots()
            self.state = "ready"
            self.registry.started = True
            self.write_status()
            log.info("mserve %s ready", __version__)
            self.said_ready()
            if self.console is not None:  # what TorchServe's launchers and tests wait for
                await self._launcher_exited()
                self.console.say("Model server started.")
            tune_gc()
            chores = [
                asyncio.create_task(self.refresh_status()),
                asyncio.create_task(self.metrics.run()),
                asyncio.create_task(self.registry.residency.run()),
            ]
            if self.access_log is not None:
                chores.append(asyncio.create_task(self.access_log.flush_every(ACCESS_LOG_FLUSH_S)))
            if self.config.loop_stall_warn_s:  # a diagnostic (docs/observability.md)
                chores.append(asyncio.create_task(LoopWatch(self.config.loop_stall_warn_s).run()))
            if self.config.watch:  # development: handler code reloads as its files change
                chores.append(asyncio.create_task(watch.run(self.registry, self.stop_event)))
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

    async def _launcher_exited(self) -> None:
        """Until the ``--start`` command that waits on ``ready_fd`` has exited (bounded).
        TorchServe's launcher is gone before its server says ``Model server started.``, and
        its test harness (``ts_scripts/tsutils.py``) reads the console up to that line, then
        takes the command's ``poll()`` as the verdict: the line must not come before the exit.
        This process is the command's child: its parent changes the moment the command exits,
        in the same step that makes the exit visible to ``poll()``."""
        if self.launcher_pid is None:
            return
        deadline = time.monotonic() + LAUNCHER_EXIT_WAIT_S
        while os.getppid() == self.launcher_pid and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

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
        """The models a TorchServe config snapshot records (``model_snapshot``); names our own
        snapshot already restored are skipped (it is newer: it holds what changed since)."""
        restored = {mv.name for mv in self.registry.all()} | set(self.load_failures)
        entries = [e for e in self.config.model_snapshot or () if e.name not in restored]
        await ts_snapshot.restore(self.registry, entries, self.load_failures)
        if entries:
            self.router.restore(ts_snapshot.load_traffic(self.config))

    async def _start(self, models: list[StartupModel]) -> None:
        """Listeners and startup models, in the order that brings the first answer soonest:
        the HTTP listeners, then the startup models, and the gRPC listeners once their workers
        are under way (or they are loaded), so that gRPC's import and set-up overlap the
        workers' start (or their template's imports) in other processes. Ready (the caller)
        only when all are done; a listener that cannot open stops the models' loading and fails
        the start."""
        await self.listen()
        if self.config.torchserve:  # TorchServe's start-up banner, which runbooks grep
            initial = [f"{m.name}={m.url}" if m.name else m.url for m in models]
            banner = torchserve_banner(self.config, __version__, self.urls, self.gpus.count,
                                       initial)  # fmt: skip
            log.info("%s", banner)
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
        if tenants.current is not None:  # quotas may name models from now on
            tenants.current.models_registered()

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
        async with self._status_writing:  # never overwritten by a refresh still under way
            self.write_status()
        if self.config.torchserve and self.config.snapshot and self.registry.started:
            ts_snapshot.save(self.config, self.registry, "shutdown", self.router.to_json())
        drain_s = self.config.shutdown_drain_s
        for listener in self.listeners:  # new requests get 503 and "Connection: close"
            listener.stop_accepting()
        # new gRPC calls are refused at once (UNAVAILABLE); calls under way drain with the rest
        grpc_stops = [asyncio.ensure_future(g.stop(drain_s)) for g in self.grpc_listeners]
        await self._drain(drain_s)
        self.router.close()
        await self.registry.close()
        await asyncio.gather(*(mv.stop(drain_s) for mv in self.registry.all()))
        await self.registry.residency.warm.stop_parked()
        await self.launcher.close()
        for listener in self.listeners:
            listener.close()
        for listener in self.listeners:
            await listener.wait_closed(1.0)
        await asyncio.gather(*grpc_stops)
        if self.keys is not None:
            self.keys.remove()
        if tenants.current is not None:
            await tenants.current.close()
        if tracing.current is not None:  # what is still queued goes out (bounded)
            await tracing.current.close()
        log.info("mserve stopped")


def _keys(config: ServerConfig) -> Keys:
    minutes = {
        "inference": config.inference_token_expiration_min or config.token_expiration_min,
        "management": config.management_token_expiration_min or config.token_expiration_min,
    }
    fixed = None
    if config.token_key_file:  # one key for every replica (a mounted Secret)
        fixed = read_key_file(Path(config.token_key_file).expanduser())
    return Keys(config.key_path, {k: m * 60 for k, m in minutes.items()}, fixed=fixed)


def _remove_stale_keys(config: ServerConfig) -> None:
    """The key file of a server that was killed (SIGKILL, a power cut) before it could remove
    it: its keys died with it, and a start without token authorization would leave them there
    (``token_key_file``'s own file, were it named as the key file, stays)."""
    path = config.key_path
    fixed = config.token_key_file
    if fixed and Path(fixed).expanduser().resolve() == path.resolve():
        return
    path.unlink(missing_ok=True)


def hold_lock(run_dir: Path) -> int:
    """An exclusive lock for the server's life: a second server on one run dir is refused."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = locks.try_hold(run_dir / LOCK_FILE)
    if fd is None:
        raise AlreadyRunning(f"mserve is already running with run dir {run_dir}")
    return fd


def run_server(
    config: ServerConfig,
    models: list[StartupModel],
    foreground: bool,
    warnings: list[str] | None = None,
    early: EarlyStart | None = None,
    ready_fd: int | None = None,
    launcher_pid: int | None = None,
) -> int:
    """``warnings``: what reading the config found worth saying (TorchServe keys with no effect),
    logged once logging is set up; ``early``: the templates the caller started first thing
    (server/workers/prespawn.py), else they start now; ``ready_fd``: a pipe to write a byte to
    once ready (``mserve --start`` waits on it), closed then; ``launcher_pid``: that command."""
    lock = hold_lock(config.run_path)
    _remove_stale_keys(config)
    if early is None:
        early = start_early(config, models)
    console, no_log_files = setup_logging(config, foreground)
    if no_log_files:  # said once (TorchServe's layout): no access log either
        config = replace(config, access_log=False)
    tracing.setup(config)  # before hide_own_environ: the OTEL_* variables are read here
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
    server = Server(config, early, ready_fd, console, launcher_pid)
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
