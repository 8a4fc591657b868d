"""How worker processes come to life: forked from a warm template, or a fresh interpreter.

``Launcher`` keeps one template process per interpreter (per model environment) and asks it
to fork workers; a worker then costs milliseconds instead of an interpreter start plus the
model's imports. A template imports what the workers of its models were seen to import
(``server/workers/preload.py``), nothing else. If the template cannot start, workers fall back
to ``exec``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from mserve_worker.imports import valid_names
from server.config import DEFAULT_DENY
from server.workers.env_vars import WorkerEnvironment
from server.workers.pipe_reader import read_pipe
from server.workers.preload import PreloadMemory
from server.workers.prespawn import (
    EarlyTemplate,
    TemplateKey,
    guess_imports,
    key_for,
    template_command,
    template_env,
    template_keys,
)

log = logging.getLogger(__name__)

TEMPLATE_START_TIMEOUT_S = 300.0  # its imports, on a busy machine; then workers use exec
SPAWN_TIMEOUT_S = 30.0  # a fork's answer; then the worker starts with exec


class Process(Protocol):
    pid: int

    @property
    def returncode(self) -> int | None: ...

    stdout: asyncio.StreamReader | None
    stderr: asyncio.StreamReader | None

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...


def worker_command(python: str, fd: int) -> list[str]:
    # -I: the model folder (cwd) must not shadow our own modules on sys.path
    return [python, "-I", "-u", "-m", "mserve_worker.runtime", "--fd", str(fd)]


async def exec_worker(
    python: str, cwd: str, env: dict[str, str], fd: int, base_env: Mapping[str, str]
) -> Process:
    """``base_env``: what every worker gets of the server's environment
    (server/workers/env_vars.py); ``env``: this worker's own (its GPU, the variables its model
    is allowed). Under a uid per model, the worker switches to its user itself, first thing
    after INIT (mserve_worker/confine.py): uvloop's subprocesses take no ``user``."""
    return await asyncio.create_subprocess_exec(
        *worker_command(python, fd),
        cwd=cwd,
        env={**base_env, **env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        pass_fds=(fd,),
        start_new_session=True,  # its own process group: we kill the whole tree
    )


class ForkedProcess:
    """A worker forked by a template: exit status arrives from the template. ``preloaded``:
    what the template had imported when it forked it."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader,
                 exited: asyncio.Future[int], preloaded: frozenset[str]) -> None:  # fmt: skip
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self._exited = exited
        self.preloaded = preloaded

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)


class _AdoptedProcess:
    """A template started with ``subprocess`` before the loop ran, as the launcher uses one."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        while (code := self._popen.poll()) is None:
            await asyncio.sleep(0.02)
        return code

    def kill(self) -> None:
        self._popen.kill()


class Template:
    def __init__(self, python: str, preload: list[str], base_env: Mapping[str, str]) -> None:
        """``base_env``: the template's environment, which every worker forked from it starts
        with; nothing the deny-list holds back, since the template serves every model."""
        self.python = python
        self.preload = preload
        self.modules: frozenset[str] = frozenset(preload)  # installed packages it holds
        self.base_env = base_env
        self.proc: asyncio.subprocess.Process | _AdoptedProcess | None = None
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._ids = 0
        self._spawned: dict[int, asyncio.Future[int]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._log_task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> None:
        parent, child = socket.socketpair()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *template_command(self.python, child.fileno(), self.preload),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(child.fileno(),),
                start_new_session=True,
                env=template_env(self.base_env),
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        assert self.proc.stderr is not None
        await self._attach(parent, self.proc.stderr, timeout_s)

    async def adopt(self, early: EarlyTemplate, timeout_s: float) -> None:
        """Take over a template started before the event loop ran (server/workers/prespawn.py)."""
        self.proc = _AdoptedProcess(early.proc)
        await self._attach(early.sock, read_pipe(early.stderr_fd), timeout_s)

    async def _attach(
        self, sock: socket.socket, stderr: asyncio.StreamReader, timeout_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        self._sock = sock
        self._ready = loop.create_future()
        self._log_task = asyncio.create_task(self._relog(stderr))
        loop.add_reader(sock.fileno(), self._on_readable)
        hello = await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        with contextlib.suppress(ValueError):
            self.modules = frozenset(valid_names(hello.get("modules", [])))
        log.info(
            "worker template for %s ready (pid %s, preloaded: %s)",
            self.python, hello.get("pid"), ", ".join(hello.get("preloaded", [])) or "nothing",
        )  # fmt: skip

    async def _relog(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            log.warning("[template %s] %s", self.python, line.decode(errors="replace").rstrip())

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self._sock is not None

    def _on_readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self._closed(ConnectionError("worker template exited"))
            return
        self._buffer.extend(data)
        while b"\n" in self._buffer:
            line, _, rest = bytes(self._buffer).partition(b"\n")
            self._buffer[:] = rest
            self._dispatch(json.loads(line))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("ready") and self._ready is not None and not self._ready.done():
            self._ready.set_result(message)
        elif "spawned" in message:
            future = self._spawned.pop(message["spawned"], None)
            if future is not None and not future.done():
                future.set_result(message["pid"])
        elif "exited" in message:
            pid = message["exited"]
            future = self._exits.setdefault(pid, asyncio.get_running_loop().create_future())
            if not future.done():
                future.set_result(message["returncode"])

    def _closed(self, error: Exception) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for future in [*self._spawned.values(), *([self._ready] if self._ready else [])]:
            if not future.done():
                future.set_exception(error)
        for future in self._exits.values():  # children of a dead template: status unknown
            if not future.done():
                future.set_result(-signal.SIGKILL)

    async def spawn(
        self, cwd: str, env: dict[str, str], fd: int, user: dict[str, Any] | None = None
    ) -> ForkedProcess:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._ids += 1
        spawned = loop.create_future()
        self._spawned[self._ids] = spawned
        request = {"op": "spawn", "id": self._ids, "cwd": cwd, "env": env, "user": user}
        message = json.dumps(request).encode()
        try:
            try:
                self._sock.sendmsg(
                    [message + b"\n"],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes([fd, out_w, err_w]))],
                )
            finally:
                os.close(out_w)
                os.close(err_w)
            pid = await asyncio.wait_for(asyncio.shield(spawned), SPAWN_TIMEOUT_S)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            # the caller starts the worker with exec on the same channel: a fork the template
            # reports after all must not serve beside it
            spawned.add_done_callback(_kill_late_fork)
            raise
        exited = self._exits.setdefault(pid, loop.create_future())
        return ForkedProcess(pid, read_pipe(out_r), read_pipe(err_r), exited, self.modules)

    async def stop(self) -> None:
        if self._sock is not None:
            self._closed(ConnectionError("worker template stopped"))
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._log_task is not None:
            await self._log_task


def _kill_late_fork(spawned: asyncio.Future[int]) -> None:
    if not spawned.cancelled() and spawned.exception() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spawned.result(), signal.SIGKILL)  # the child's own process group


def _fd_bytes(fds: list[int]) -> bytes:
    return array.array("i", fds).tobytes()


class Launcher:
    """Starts workers for every model: forked from a template of its interpreter that has
    imported what that model's workers were seen to import, and nothing more.

    Models with the same needs share a template; an echo model's workers never carry the torch
    that another model of the same environment needs. A template starts as soon as it is known
    to be needed: at server start for the models the start will load (from what their workers
    imported the last time), else with the model's first worker, and again when a worker
    reports imports its template lacked (it warms up while that worker serves). A worker asked
    for while its template warms up waits for it: the template is already doing the imports a
    fresh interpreter would have to do, so it is ready first, and scale-ups arriving meanwhile
    cost a fork each instead of parallel imports on a few cores.
    """

    def __init__(
        self,
        use_templates: bool = True,
        preload: tuple[str, ...] = (),
        environment: WorkerEnvironment | None = None,
        memory: PreloadMemory | None = None,
    ) -> None:
        """``preload``: modules every template imports besides what its models need;
        ``environment``: the server's environment as workers may see it (by default the
        process's own without the default deny-list); ``memory``: what models imported the
        last time (by default nothing is remembered across starts)."""
        self.use_templates = use_templates
        self.preload = preload
        if environment is None:
            environment = WorkerEnvironment.split(os.environ, DEFAULT_DENY)
        self.environment = environment
        if environment.withheld:
            log.info(
                "workers do not get %d of the server's environment variables (worker_env_deny):"
                " %s", len(environment.withheld), ", ".join(sorted(environment.withheld)),
            )  # fmt: skip
        self.memory = memory if memory is not None else PreloadMemory(None)
        self._templates: dict[TemplateKey, Template] = {}
        self._warming: dict[TemplateKey, asyncio.Task[Template | None]] = {}
        self._uses: dict[tuple[str, str], TemplateKey] = {}  # (python, model) -> its template
        self._guessed: dict[tuple[str, str], list[str]] = {}  # from the model's source
        # set once a worker is under way: its process exists, or it waits for its template to
        # finish importing. The server opens what a first answer does not need (its gRPC
        # listeners) meanwhile, while the work is done in other processes.
        self.underway = asyncio.Event()

    def _key(self, python: str, model: str) -> TemplateKey:
        return key_for(self.memory, python, model, self.preload)

    def prestart(
        self, models: list[str], early: Sequence[EarlyTemplate] = (),
        guessed: Mapping[tuple[str, str], list[str]] | None = None,
    ) -> None:  # fmt: skip
        """Start the templates that ``models`` (names about to be loaded) will need, with what
        their workers imported the last time or, never seen, what their archives were
        ``guessed`` to import, adopting those already started (``early``): their imports
        overlap the server's own start."""
        adopt = {e.key: e for e in early}
        if self.use_templates:
            self._guessed.update(guessed or {})
            keys = template_keys(self.memory, models, self.preload, guessed)
            for (python, model), key in keys.items():
                if os.path.exists(python):
                    self._uses[(python, model)] = key
                    self._template_task(key, adopt.pop(key, None))
        for unused in adopt.values():  # closing its socket ends it
            unused.sock.close()
            os.close(unused.stderr_fd)

    def _template_task(
        self, key: TemplateKey, early: EarlyTemplate | None = None
    ) -> asyncio.Task[Template | None]:
        task = self._warming.get(key)
        template = self._templates.get(key)
        if task is None or (task.done() and template is not None and not template.alive):
            self._templates.pop(key, None)  # first time, or it died: start it (again)
            task = asyncio.create_task(self._warm(key, early), name="template")
            self._warming[key] = task
        return task

    async def _warm(self, key: TemplateKey, early: EarlyTemplate | None) -> Template | None:
        python, preload = key
        template = Template(python, list(preload), self.environment.base)
        try:
            if early is not None:
                await template.adopt(early, timeout_s=TEMPLATE_START_TIMEOUT_S)
            else:
                await template.start(timeout_s=TEMPLATE_START_TIMEOUT_S)
        except (OSError, ConnectionError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("worker template for %s failed (%s); workers start with exec",
                        python, exc)  # fmt: skip
            await template.stop()
            return None
        self._templates[key] = template
        return template

    def learned(self, python: str, model: str, imported: list[str],
                preloaded: frozenset[str]) -> None:  # fmt: skip
        """A worker of ``model`` is ready and reports the installed packages it imported while
        loading: remember them; when its template lacked some, start one that has them now, so
        the model's next worker is forked with them."""
        assumed = self._guessed.pop((python, model), [])
        self.memory.learn(python, model, imported, sorted(preloaded), assumed)
        if not self.use_templates:
            return
        old = self._uses.get((python, model))
        new = self._key(python, model)
        current = self._templates.get(old) if old is not None else None
        if new == old or (current is not None and set(new[1]) <= current.modules):
            return  # its template has all it needs
        self._uses[(python, model)] = new
        self._template_task(new)  # the old one stays: the workers forked from it report to it

    async def launch(
        self,
        python: str,
        cwd: str,
        env: dict[str, str],
        fd: int,
        model: str = "",
        user: dict[str, Any] | None = None,
    ) -> Process:
        if self.use_templates:
            key = self._uses.get((python, model))
            if key is None:
                key = self._key(python, model)
                if not self.memory.knows(python, model):  # its first start ever: guess
                    guess = await asyncio.to_thread(guess_imports, Path(cwd))
                    self._guessed[(python, model)] = guess
                    key = key_for(self.memory, python, model, self.preload, guess)
                self._uses[(python, model)] = key
            task = self._template_task(key)
            if not task.done():
                self.underway.set()  # the template imports (torch: seconds); the worker waits
            template = await asyncio.shield(task)
            if template is not None and template.alive:
                try:
                    forked = await template.spawn(cwd, env, fd, user)
                    self.underway.set()
                    return forked
                except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
                    log.warning("fork from the worker template failed (%s); using exec", exc)
        started = await exec_worker(python, cwd, env, fd, self.environment.base)
        self.underway.set()
        return started

    async def close(self) -> None:
        # Copies: a template still starting may land in ``_templates`` while another stops.
        warming = list(self._warming.values())
        for task in warming:
            task.cancel()
        await asyncio.gather(*warming, return_exceptions=True)
        for template in list(self._templates.values()):
            await template.stop()
        self._templates.clear()
        self._warming.clear()
