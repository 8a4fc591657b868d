"""``mserve`` and ``torchserve``: start (as a daemon or in the foreground), stop, and show status.

``--start`` returns once the APIs answer and the startup models are loaded or have clearly
failed; the daemon keeps a pid file, a status file (with the ports actually bound, so port 0
works) and a log folder under the run dir.

``torchserve`` (the opt-in command that takes TorchServe's place; docs/migration.md) is the same
command in TorchServe's layout: files where TorchServe writes them (key file, logs, config
snapshots, relative to the folder it is started from; ``LOG_LOCATION`` and
``METRICS_LOCATION``), the newest config snapshot restored unless ``--ncs``, the server's console
on the caller's stdout with ``Model server started.`` once ready, and TorchServe's messages.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from server import locks
from server.config import ServerConfig, load_config
from server.daemon import Prefork, become_daemon, serve
from server.errors import ConfigError, MserveError
from server.logs import make_log_folder
from server.rundir import (
    ENV_META_FILE,
    PID_FILE,
    StartupModel,
    parse_models,
    read_status,
    running_pid,
)
from server.ts_config import TsConfig, load_ts_config

START_WAIT_S = 600.0
STOP_WAIT_S = 60.0
# TorchServe's launcher's words, which scripts wait for or grep
TS_ALREADY_RUNNING = (
    "TorchServe is already running, please use torchserve --stop to stop TorchServe."
)
TS_NOT_RUNNING = "TorchServe is not currently running."
TS_STOPPED = "TorchServe has stopped."
TS_STOP_TOO_LONG = "Stopping TorchServe took too long."
# held by the ``--stop`` under way: a second one waits for the server instead of signalling it
STOP_LOCK_FILE = "stop.lock"


@dataclass(frozen=True)
class Invocation:
    """How the command was called: ``prefork``, the daemon-to-be forked first thing
    (server/daemon.py); ``torchserve``, as the ``torchserve`` command."""

    prefork: Prefork | None = None
    torchserve: bool = False


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"mserve: {message}", err=True)
    sys.exit(code)


def _print_status(status: dict[str, Any], env_sizes: bool = True) -> None:
    """``env_sizes``: count and size the environment cache (a walk over every file of every
    environment: tens of ms for one with torch), which ``--status`` shows and ``--start`` does
    not wait for."""
    click.echo(f"mserve {status.get('version')} pid {status['pid']}: {status['state']}")
    urls = status.get("urls") or {}
    for api in ("inference", "management", "metrics"):
        click.echo(f"  {api:<10} {urls.get(api) or f'http://{status.get(api)}'}")
    grpc = [f"{api} {urls[f'grpc_{api}']}" for api in ("inference", "management")
            if urls.get(f"grpc_{api}")]  # fmt: skip
    if grpc:
        click.echo(f"  grpc       {', '.join(grpc)}")
    if status.get("key_file"):
        click.echo(f"  keys       {status['key_file']} (send 'Authorization: Bearer <key>')")
    for name, state in sorted(status.get("models", {}).items()):
        click.echo(f"  model {name}: {state}")
    sandbox = status.get("sandbox") or {}
    if sandbox.get("setting"):
        click.echo(f"  sandbox    {sandbox['setting']}")
    for worker, confinement in sorted((sandbox.get("workers") or {}).items()):
        click.echo(f"  worker {worker}: {confinement}")
    trace = status.get("tracing")
    if trace:
        click.echo(
            f"  tracing    OTLP {trace['protocol']} to {trace['endpoint']},"
            f" sampling {trace['sampling_ratio']:g} of new traces"
        )
    memory = status.get("memory") or {}
    limits = [
        text.format(memory[key])
        for key, text in (
            ("worker_memory_budget_mb", "workers' memory {} MB"),
            ("max_loaded_models", "{} models loaded"),
            ("warm_tier_budget_mb", "warm tier {} MB"),
        )
        if memory.get(key)
    ]
    if limits:
        click.echo(
            f"  memory     at most {', '.join(limits)}"
            f" (idle models evicted by {memory.get('eviction')})"
        )
    click.echo(f"  logs       {status.get('log_dir')}")
    if status.get("env_dir") and env_sizes:
        click.echo(f"  envs       {status['env_dir']} ({_env_summary(Path(status['env_dir']))})")
    elif status.get("env_dir"):
        click.echo(f"  envs       {status['env_dir']}")
    for warning in status.get("warnings") or ():
        click.echo(f"mserve: WARNING: {warning}", err=True)


def _env_summary(root: Path) -> str:
    """Count and size of the per-model environment cache (prune: DELETE /environments)."""
    if not root.is_dir():
        return "empty"
    envs = [p for p in root.iterdir() if (p / ENV_META_FILE).is_file()]
    total = 0
    for env in envs:
        for folder, _dirs, files in os.walk(env):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
    return f"{len(envs)} environments, {total / 2**20:.1f} MiB"


class DaemonStarted(Exception):
    """``--start`` is done: the daemon is ready and its addresses are printed. :func:`main`
    ends this process at once on it (see there)."""


def _start_daemon(
    config: ServerConfig, startup: list[StartupModel], warnings: list[str],
    prefork: Prefork | None,
) -> NoReturn:  # fmt: skip
    """Hand the start to the process forked first thing (``prefork``, server/daemon.py: it has
    imported the server meanwhile), else fork the server off this process now; wait for it to
    say it is ready, then raise :class:`DaemonStarted` (or fail: ``SystemExit``). A fork, not a
    fresh interpreter: the daemon starts with what was imported and read already. In the
    TorchServe layout the daemon keeps this command's stdout and stderr (its console), as
    TorchServe's server does; otherwise its output goes to ``mserve.out`` in the log folder."""
    out_path = None if config.torchserve else config.log_path / "mserve.out"
    if out_path is not None:  # TorchServe's layout has no such file (server/logs.py)
        make_log_folder(config.log_path)
    if prefork is not None:
        try:
            prefork.hand_over(config, startup, warnings, out_path)
        except OSError:  # it is gone (killed?): fork one now, as without it
            prefork.cancel()
            prefork = None
    if prefork is not None:
        pid, ready_r = prefork.pid, prefork.ready_r
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        # the daemon writes a byte here once ready (and the pipe closes if it exits): this
        # process wakes at once instead of polling the status file, the source of truth
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            become_daemon(config, startup, warnings, out_path, ready_w)
        os.close(ready_w)
    try:
        _wait_ready(config, pid, ready_r, out_path)
    finally:
        os.close(ready_r)
    raise DaemonStarted


def _wait_ready(config: ServerConfig, pid: int, ready_r: int, out_path: Path | None) -> None:
    """Until the daemon ``pid`` says it is ready (then print its status) or exits (then fail
    with the tail of its output, which ``out_path`` None means is on the console already)."""
    import select

    deadline = time.monotonic() + START_WAIT_S
    wake: list[int] = [ready_r]
    while time.monotonic() < deadline:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(wait_status)
            if out_path is None:
                _fail(f"server exited with code {code} during start (its output is above)")
            assert out_path is not None
            tail = out_path.read_text(errors="replace").splitlines()[-15:]
            _fail(f"server exited with code {code} during start:\n" + "\n".join(tail))
        status = read_status(config.run_path)
        if status and status.get("pid") == pid and status.get("state") == "ready":
            if not config.torchserve:  # TorchServe's console said "Model server started."
                _print_status(status, env_sizes=False)
            failed = [n for n, s in status.get("models", {}).items() if "failed: " in s]
            if failed:
                click.echo(f"mserve: {len(failed)} startup model(s) failed; see above", err=True)
            return
        # woken by the daemon's byte, or its end (EOF: then poll for its exit status)
        if wake and select.select(wake, [], [], 0.5)[0] and not os.read(ready_r, 1):
            wake = []
        elif not wake:
            time.sleep(0.01)
    where = "its output above" if out_path is None else out_path
    _fail(f"server did not become ready within {START_WAIT_S:g} s; see {where}")


def _stop(config: ServerConfig, quiet: bool = False) -> None:
    """SIGTERM the server and wait until it has exited, so that a stop is a stop: its keys
    removed, its snapshot written, its port free. A stop while another is under way (or while
    the server is stopping on its own signal) waits for that one instead of signalling again:
    a second signal forces the server out without its cleanup. ``mserve --stop`` SIGKILLs a
    server still there after :data:`STOP_WAIT_S`; ``torchserve --stop`` says so and exits 1,
    as TorchServe's launcher says it (``quiet``: ``--foreground``, after which TorchServe's
    launcher prints nothing when the server stopped)."""
    pid = running_pid(config.run_path)
    if pid is None:
        if config.torchserve:
            click.echo(TS_NOT_RUNNING)
            return
        _fail(f"mserve is not running (no live pid in {config.run_path / PID_FILE})")
    assert pid is not None
    try:
        stopper = locks.try_hold(config.run_path / STOP_LOCK_FILE)
        first = stopper is not None
    except OSError:  # a run dir this user may not write: no other stop can be seen
        stopper, first = None, True
    try:
        stopping = (read_status(config.run_path) or {}).get("state") == "stopping"
        if first and not stopping:
            os.kill(pid, signal.SIGTERM)
        gone = _wait_gone(pid, STOP_WAIT_S)
    finally:
        if stopper is not None:
            os.close(stopper)
    if config.torchserve:
        if not gone:
            _fail_plain(TS_STOP_TOO_LONG)
        if not quiet:
            click.echo(TS_STOPPED)
        return
    if not gone:
        click.echo(f"mserve: pid {pid} ignored SIGTERM for {STOP_WAIT_S:g} s; killing it", err=True)
        os.kill(pid, signal.SIGKILL)
    click.echo(f"mserve stopped (pid {pid})")


def _fail_plain(message: str, code: int = 1) -> NoReturn:
    """TorchServe's launcher's words on stdout, as it prints them, and exit ``code``."""
    click.echo(message)
    sys.exit(code)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Until ``pid`` has exited (a zombie that nobody reaped counts: it runs no more)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _ts_config(flag: Path | None, environ: Mapping[str, str]) -> TsConfig | None:
    """TorchServe's properties file: ``--ts-config``, else ``TS_CONFIG_FILE`` (a flag beats a
    variable here, as everywhere in mserve's config)."""
    path = flag or (Path(environ["TS_CONFIG_FILE"]) if environ.get("TS_CONFIG_FILE") else None)
    if path is None:
        return None
    if not path.exists():
        source = "--ts-config" if flag else "TS_CONFIG_FILE"
        raise ConfigError(f"{source} file not found: {path}")
    return load_ts_config(path, environ)


def _check_model_store(config: ServerConfig) -> None:
    """A store that is not there is an error at start, as TorchServe answers it."""
    store = config.store_path
    if store is not None and not store.is_dir():
        what = "is not a folder" if store.exists() else "does not exist"
        raise ConfigError(f"model store {config.model_store} {what} ({store})")


def _not_used(option: str, value: str | None, why: str) -> None:
    if value:
        click.echo(f"mserve: warning: {option} {value} is not used: {why}", err=True)


def _startup_models(config: ServerConfig, flag_models: list[str]) -> list[StartupModel]:
    """``--models`` replaces the config's ``load_models`` (TorchServe's rule); with a snapshot
    (``model_snapshot``) the snapshot's models load instead of ``load_models``."""
    if flag_models:
        values = flag_models
    elif config.model_snapshot is not None:
        values = []
    else:
        values = list(config.load_models)
    startup = parse_models(values)
    if len(startup) == 1 and startup[0].name is None and startup[0].url.lower() == "all":
        if config.store_path is None:
            _fail("--models all needs --model-store", 2)
        from server.store import store_archives

        assert config.store_path is not None
        startup = [StartupModel(None, str(p)) for p in store_archives(config.store_path)]
    return startup


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Ray Serve: mserve ray deploy|status|scale|delete (mserve ray -h, docs/ray.md)."
    " A live view of the running server: mserve top (mserve top -h).",
)
@click.option("--start", is_flag=True, help="Start the server (a daemon unless --foreground).")
@click.option("--stop", is_flag=True, help="Stop the running server.")
@click.option("--status", "show_status", is_flag=True, help="Show the running server's state.")
@click.option("--foreground", is_flag=True, help="With --start: stay attached (containers).")
@click.option(
    "--models", multiple=True, help="NAME=PATH or PATH, several allowed; 'all' loads the store."
)
@click.option("--model-store", help="Folder of archives (registration by name).")
@click.option(
    "--config", "config_file", type=click.Path(path_type=Path), help="Server config YAML."
)
@click.option("--run-dir", help="Pid, status, logs and unpack cache (default ~/.mserve).")
@click.option("--log-dir", help="Log folder (default <run-dir>/logs).")
@click.option(
    "--ncs",
    "--no-config-snapshot",
    "--no-config-snapshots",
    "no_snapshot",
    is_flag=True,
    help="Neither restore nor save the snapshot of registered models.",
)
@click.option(
    "--ts-config",
    "ts_config_file",
    type=click.Path(path_type=Path),
    help="TorchServe's config.properties, or one of its config snapshots (a folder: its newest"
    " snapshot). Default: $TS_CONFIG_FILE.",
)
@click.option(
    "--disable-token-auth", "--dt", "disable_token_auth", is_flag=True,
    help="Serve without token authorization (disable_token_authorization=true; keys are"
    " required by default, as in TorchServe).",
)  # fmt: skip
@click.option(
    "--enable-model-api", "--model-api-enabled", "enable_model_api", is_flag=True,
    help="Allow registering and unregistering models through the management API"
    " (enable_model_api=true; off by default, as in TorchServe).",
)  # fmt: skip
@click.option(
    "--watch", is_flag=True,
    help="Development: reload a model's handler code when its files change (watch: true;"
    " docs/hot-reload.md).",
)  # fmt: skip
@click.option("--log-config", help="TorchServe's log4j2 file: accepted, not used.")
@click.option("--cpp-log-config", help="TorchServe's C++ backend log config: not used.")
@click.option(
    "--workflow-store", help="Folder of workflow archives (.war) POST /workflows registers by"
    " name (default: the model store)."
)  # fmt: skip
@click.option("--plugins-path", "--ppath", help="TorchServe's Java plugins: not used.")
@click.option("-v", "--version", "show_version", is_flag=True, help="Print the version.")
@click.option("--quiet", is_flag=True, hidden=True)
@click.argument("more_models", nargs=-1)
def serve_main(
    start: bool,
    stop: bool,
    show_status: bool,
    foreground: bool,
    models: tuple[str, ...],
    model_store: str | None,
    config_file: Path | None,
    run_dir: str | None,
    log_dir: str | None,
    no_snapshot: bool,
    ts_config_file: Path | None,
    disable_token_auth: bool,
    enable_model_api: bool,
    watch: bool,
    log_config: str | None,
    cpp_log_config: str | None,
    workflow_store: str | None,
    plugins_path: str | None,
    show_version: bool,
    quiet: bool,
    more_models: tuple[str, ...],
) -> None:
    """Serve model archives (.mar) with TorchServe's REST APIs."""
    invocation: Invocation = click.get_current_context().obj or Invocation()
    if show_version:
        from archiver import __version__

        where = " (in TorchServe's place)" if invocation.torchserve else ""
        click.echo(f"mserve {__version__}{where}")
        return
    try:
        flags: dict[str, Any] = {
            "model_store": model_store,
            "run_dir": run_dir,
            "log_dir": log_dir,
            "snapshot": False if no_snapshot else None,
            "disable_token_authorization": True if disable_token_auth else None,
            "enable_model_api": True if enable_model_api else None,
            "watch": True if watch else None,
            "workflow_store": workflow_store,
        }
        if invocation.torchserve:
            flags.update(torchserve_flags(os.environ, log_dir))
            if ts_config_file is None and not os.environ.get("TS_CONFIG_FILE") and start:
                ts_config_file = None if no_snapshot else last_snapshot(flags)
        ts = _ts_config(ts_config_file, os.environ)
        if ts is not None and invocation.torchserve:
            flags["ts_properties"] = ts.properties
            flags["ts_config_file"] = str(ts.path)
        config = load_config(config_file, flags, ts_layers=list(ts.layers) if ts else None)
        if sum((start, stop, show_status)) != 1:
            _fail("say one of --start, --stop or --status (see mserve -h)", 2)
        if stop:
            _stop(config, quiet=foreground)
            return
        if show_status:
            status = read_status(config.run_path) if running_pid(config.run_path) else None
            if status is None:
                _fail("mserve is not running", 3)
            assert status is not None
            _print_status(status)
            return
        if more_models and not models:
            _fail(f"unexpected arguments {' '.join(more_models)} (models go after --models)", 2)
        if log_config and not Path(log_config).is_file():
            _fail(f"--log-config file not found: {log_config}")
        _check_model_store(config)
        if workflow_store and not Path(workflow_store).is_dir():  # TorchServe's words
            _fail(f"--workflow-store directory not found: {workflow_store}")
        if config.token_key_file and not config.disable_token_authorization:
            from server.auth import read_key_file

            read_key_file(Path(config.token_key_file).expanduser())  # a bad file fails here
        startup = _startup_models(config, [*models, *more_models])
        warnings = ts.warnings() if ts else []
        if not quiet:
            _not_used("--log-config", log_config, "mserve logs with Python's logging (--log-dir)")
            _not_used("--cpp-log-config", cpp_log_config, "mserve has no C++ backend")
            _not_used("--plugins-path", plugins_path, "mserve loads no Java plugins")
            for warning in warnings if not foreground else ():  # foreground: logged below
                click.echo(f"mserve: warning: {warning}", err=True)
        _refuse_if_running(config)
        prefork = invocation.prefork
        if not foreground:
            _start_daemon(config, startup, warnings, prefork)  # raises DaemonStarted once ready
        if prefork is not None:
            prefork.cancel()
        sys.exit(serve(config, startup, warnings, foreground=not quiet))
    except MserveError as exc:
        _fail(exc.message)


def _refuse_if_running(config: ServerConfig) -> None:
    """A second server on one run dir is refused; one that is stopping (on a signal from
    elsewhere: a container runtime, a stop that gave up waiting) is waited for, so that a stop
    and a start in a row work."""
    pid = running_pid(config.run_path)
    if pid is not None and (read_status(config.run_path) or {}).get("state") == "stopping":
        _wait_gone(pid, STOP_WAIT_S)
        pid = running_pid(config.run_path)
    if pid is None:
        return
    if config.torchserve:
        click.echo(TS_ALREADY_RUNNING, err=True)
        sys.exit(1)
    _fail(f"mserve is already running (pid {pid}, run dir {config.run_path})")


def torchserve_flags(environ: Mapping[str, str], log_dir: str | None) -> dict[str, Any]:
    """What the ``torchserve`` command sets: TorchServe's layout, rooted in the folder it is
    started from; its log folder from ``LOG_LOCATION`` (``--log-dir`` wins) and its metric
    logs' from ``METRICS_LOCATION``, as TorchServe's launcher reads them."""
    return {
        "layout": "torchserve",
        "start_dir": str(Path.cwd()),
        "log_dir": log_dir or environ.get("LOG_LOCATION") or None,
        "metrics_log_dir": environ.get("METRICS_LOCATION") or None,
    }


def last_snapshot(flags: Mapping[str, Any]) -> Path | None:
    """TorchServe's newest config snapshot under ``<log folder>/config``, which a start
    restores unless ``--ncs`` or a config file is named; None when there is none."""
    from server.ts_config import find_newest_snapshot

    try:
        return find_newest_snapshot(Path(flags.get("log_dir") or "logs").expanduser() / "config")
    except OSError:  # no snapshot folder: the first start
        return None


def main(
    argv: list[str] | None = None, prefork: Prefork | None = None, torchserve: bool = False
) -> None:
    """The ``mserve`` command: ``mserve ray ...`` deploys on Ray Serve
    (server/rayserve/cli.py); everything else is the server's, as TorchServe's flags.
    ``prefork``: the daemon-to-be, forked before this module was imported (server/daemon.py);
    unless ``--start`` hands it the start, it exits when this process does. ``torchserve``:
    run as the ``torchserve`` command (TorchServe's layout)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "ray" and not torchserve:
        if prefork is not None:
            prefork.cancel()
        from server.rayserve.cli import main as ray_main

        ray_main(args[1:])
        return
    if args and args[0] == "replay" and not torchserve:
        if prefork is not None:
            prefork.cancel()
        from server.replay.cli import main as replay_main

        replay_main(args[1:])
        return
    if args and args[0] == "top" and not torchserve:
        if prefork is not None:
            prefork.cancel()
        from server.top import main as top_main

        top_main(args[1:])
        return
    try:
        serve_main.main(
            args=args,
            prog_name="torchserve" if torchserve else "mserve",
            obj=Invocation(prefork, torchserve),
        )
    except DaemonStarted:
        # ``mserve --start`` is done and the daemon runs on its own: nothing in this process
        # needs cleaning up, and Python's teardown of what it imported would only add time
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
