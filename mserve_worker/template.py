"""A warm template process: imports the heavy modules once, then forks ready-to-load workers.

Starting a worker from a cold interpreter re-imports torch (seconds); forking this process costs
milliseconds and shares the imported pages. The template never touches CUDA (importing torch
does not initialise it) and is started with ``CUDA_VISIBLE_DEVICES`` empty, so even a preload
that does cannot take a device. Each child sets its own environment, ``CUDA_VISIBLE_DEVICES``
included, before it imports or loads anything (CUDA reads it when it initialises, not when
torch is imported). Runs inside the model's environment: stdlib only.

Control channel (JSON lines over an inherited Unix socket):
  server -> template  {"op": "spawn", "id": n, "cwd": dir, "env": {...}, "user": {...} or null}
                      + 3 fds (SCM_RIGHTS):
                      the worker's channel socket, its stdout pipe, its stderr pipe
  template -> server  {"ready": true, "preloaded": [...], "modules": [...], "pid": n}
                      once, after imports: the names it imported, and all the installed
                      packages it holds since
                      {"spawned": n, "pid": pid}                          per spawn
                      {"exited": pid, "returncode": code}                 per child that ends
                      (negative returncode: killed by that signal, as subprocess reports it)
The template exits when the server closes the channel; its workers exit on their own channels.
"""

from __future__ import annotations

import argparse
import array
import gc
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import sys

_FDS = 3
_REAP_INTERVAL_S = 0.02


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _preload(names: list) -> list:
    loaded = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                continue
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # a broken optional module must not stop the template
            print(f"template: could not preload {name}: {exc}", file=sys.stderr)
    return loaded


def _warm_runtime() -> None:
    """Import what every forked worker imports first (the runtime, the handler SDK, and what a
    handler's load imports of it: ``BaseHandler`` and the styles' adapters, standard library
    only), so each child starts without it (docs/workers.md, has what it saves; a wake from
    the warm tier, docs/warm-tier.md, pays for each import it still makes)."""
    from . import confine, runtime, sdk  # noqa: F401
    from .sdk import base_handler, kernel, v2_serving  # noqa: F401


def _warm_spawn() -> None:
    """What every forked worker asks before its handler loads, asked once here, once the
    server knows the template is ready (it is waiting for its first spawn request meanwhile, or
    that request waits a few ms, as the worker would have): whether the environment holds a
    ``torchserve`` that our ``ts`` hides, and ``ctypes`` (for the process title)."""
    import ctypes  # noqa: F401

    from .compat import shadowed_torchserve

    shadowed_torchserve()


def _fork() -> int:
    """Fork with every object so far moved out of the collector's reach (``gc.freeze``, the
    recipe in the gc module's docs): a collection in the child would otherwise touch each
    inherited object, copying its pages: after importing torch, a full collection takes a
    noticeable time and leaves most of them private to the child (docs/explanations/costs.md)."""
    if hasattr(gc, "freeze"):
        gc.freeze()
    return os.fork()


def _receive(sock: socket.socket, buffer: bytearray) -> tuple:
    """One read: (bytes received, fds received); b'' means the server went away."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % fds.itemsize
            fds.frombytes(payload[:usable])
    buffer.extend(data)
    return data, list(fds)


def _child(control: socket.socket, request: dict, fds: list) -> None:
    """In the forked child: become the worker. Never returns."""
    code = 1
    try:
        control.close()
        channel, out, err = fds
        os.setsid()  # its own process group, so the server can kill the whole tree
        if request.get("user"):  # the model's own uid, before anything of the model runs
            from .confine import become

            become(request["user"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.environ.update(request.get("env", {}))
        os.chdir(request["cwd"])
        from .runtime import main

        code = main(["--fd", str(channel)])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _send(control, {"exited": pid, "returncode": code})


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mserve-template")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.fd)
    loaded = _preload([n for n in args.preload.split(",") if n])
    _warm_runtime()
    from .imports import loaded_packages

    # everything installed the preload brought in (torch brings numpy): what workers inherit
    modules = loaded_packages([os.path.dirname(os.path.abspath(__file__))])
    _send(control, {"ready": True, "preloaded": loaded, "modules": modules, "pid": os.getpid()})
    _warm_spawn()
    buffer = bytearray()
    pending_fds: list = []
    while True:
        readable, _, _ = select.select([control], [], [], _REAP_INTERVAL_S)
        _reap(control)
        if not readable:
            continue
        data, fds = _receive(control, buffer)
        pending_fds.extend(fds)
        if not data:
            return 0
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            request = json.loads(line)
            mine, pending_fds = pending_fds[:_FDS], pending_fds[_FDS:]
            pid = _fork()
            if pid == 0:
                _child(control, request, mine)
            for fd in mine:
                os.close(fd)
            _send(control, {"spawned": request["id"], "pid": pid})


if __name__ == "__main__":
    sys.exit(main())
