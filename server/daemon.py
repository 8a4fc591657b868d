"""The daemon's side of ``mserve --start``: forked first thing, then handed the start.

A daemon start forks the server-to-be before anything else (:class:`Prefork`): the child imports
the server's modules while this process imports the CLI and reads the config, on two cores at
once, instead of one after the other (docs/explanations/measuring.md, cold start). The child is
handed the parsed start over a pipe and becomes the daemon; when the command turns out to be
something else, or fails (a bad flag, a server already running), the pipe closes unused and the
child exits without a word.

Imports the standard library only, so that the fork comes first thing.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from pathlib import Path

    from server.config import ServerConfig
    from server.rundir import StartupModel

# The flags after which a --start is not a daemon start (or no start at all).
_NOT_A_DAEMON = {"--foreground", "--stop", "--status", "-h", "--help", "-v", "--version"}


def is_daemon_start(args: list[str]) -> bool:
    """A quick look at the command line: a wrong guess costs only a fork that exits."""
    return "--start" in args and not _NOT_A_DAEMON.intersection(args)


class Prefork:
    """The daemon-to-be, forked before the CLI parsed anything. ``ready_r``: the pipe the
    daemon writes a byte to once it is ready (closed if it exits first)."""

    def __init__(self, pid: int, go_w: int, ready_r: int) -> None:
        self.pid = pid
        self.ready_r = ready_r
        self._go_w: int | None = go_w

    @classmethod
    def start(cls, keep_console: bool = False) -> Prefork:
        """Fork; in the child, wait for :meth:`hand_over` (never returns there).
        ``keep_console``: the child may become a daemon that writes to this process's stdout
        and stderr (the TorchServe layout); it keeps copies of them until it knows."""
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            os.close(ready_r)
            console = (os.dup(1), os.dup(2)) if keep_console else None
            _wait_for_start(go_r, ready_w, console)
        os.close(go_r)
        os.close(ready_w)
        return cls(pid, go_w, ready_r)

    def hand_over(self, config: ServerConfig, startup: list[StartupModel], warnings: list[str],
                  out_path: Path | None) -> None:  # fmt: skip
        """Tell the child to become the daemon serving this start."""
        import pickle

        assert self._go_w is not None
        data = pickle.dumps((config, startup, warnings, out_path))
        view = memoryview(data)
        while view:
            view = view[os.write(self._go_w, view) :]
        os.close(self._go_w)
        self._go_w = None

    def cancel(self) -> None:
        """Not a daemon start after all: the child exits; reap it."""
        if self._go_w is not None:
            os.close(self._go_w)
            self._go_w = None
            os.close(self.ready_r)
            os.waitpid(self.pid, 0)


def _wait_for_start(go_r: int, ready_w: int, console: tuple[int, int] | None) -> NoReturn:
    """The pre-forked child: import the server while the parent parses, then serve or exit.
    ``console``: copies of the parent's stdout and stderr, for a daemon that keeps them."""
    code = 0
    try:
        # the parent's output pipes must not wait for this process (a caller reads them to
        # their end); mserve.out takes over once the parent says where it is
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        import pickle
        import threading

        # what the hand-over needs (to unpickle, to start the templates) in this thread, the
        # rest of the server in another, so that no import here waits on one there
        import server.config
        import server.rundir
        import server.workers.prespawn  # noqa: F401

        importing = threading.Thread(target=_import_server, name="import", daemon=True)
        importing.start()
        chunks = []
        while chunk := os.read(go_r, 1 << 16):
            chunks.append(chunk)
        os.close(go_r)
        if not chunks:
            os._exit(0)  # not a daemon start, or the CLI failed: nothing to do
        config, startup, warnings, out_path = pickle.loads(b"".join(chunks))
        if console is not None and out_path is None:  # its output stays on the console
            os.dup2(console[0], 1)
            os.dup2(console[1], 2)
        for fd in console or ():
            os.close(fd)
        become_daemon(config, startup, warnings, out_path, ready_w, importing)
    except BaseException:  # Ctrl-C before the hand-over included: exit quietly
        code = 1
    os._exit(code)


def _import_server() -> None:
    import server.lifecycle  # noqa: F401


def become_daemon(
    config: ServerConfig,
    startup: list[StartupModel],
    warnings: list[str],
    out_path: Path | None,
    ready_fd: int,
    importing: object = None,
) -> NoReturn:
    """This process (forked by ``mserve --start``) becomes the server: its own session, its
    output to ``out_path`` (None: it keeps its stdout and stderr, the caller's console), never
    back into the CLI; it exits with the server's exit code. ``importing``: a thread importing
    the server's modules meanwhile (joined before they are needed)."""
    code = 1
    launcher = os.getppid()  # the ``--start`` command, waiting for this process to be ready
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if out_path is not None:
            out = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        code = serve(config, startup, warnings, False, ready_fd, importing, launcher)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        from server.errors import MserveError

        if isinstance(exc, MserveError):  # a start that cannot go on says why, as the CLI does
            print(f"mserve: {exc.message}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(
    config: ServerConfig,
    startup: list[StartupModel],
    warnings: list[str],
    foreground: bool,
    ready_fd: int | None = None,
    importing: object = None,
    launcher_pid: int | None = None,
) -> int:
    """Run the server in this process until it stops; its exit code. ``ready_fd``: a pipe the
    server writes a byte to once it is ready; ``launcher_pid``: the ``--start`` command that
    waits on it (in the TorchServe layout the console's ``Model server started.`` comes once
    it has exited)."""
    # the worker templates first: their imports (torch: seconds) overlap the server's own
    from server.workers.prespawn import start_early

    early = start_early(config, startup)
    if importing is not None:
        importing.join()  # type: ignore[attr-defined]
    from server.lifecycle import run_server  # heavy: only the server process needs it

    return run_server(
        config, startup, foreground=foreground, warnings=warnings, early=early,
        ready_fd=ready_fd, launcher_pid=launcher_pid,
    )  # fmt: skip
