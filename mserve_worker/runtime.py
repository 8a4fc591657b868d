"""Child side of a worker, the socket loop: say hello, have the handler loaded once
(:mod:`.service`), then turn BATCH frames into RESULT frames until EOF.

Runs inside the model's own environment, so it imports the standard library and its sibling
modules only. A handler exception fails its batch (traceback to stderr, which the server re-logs)
and never the worker. Started as ``python -m mserve_worker.runtime --fd N``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from . import continuous, inflight, park, proctitle, streaming
from .channel import Channel
from .protocol import (
    PROTOCOL_VERSION,
    Frame,
    Kind,
    ProtocolError,
    parked_frame,
    parse_batch,
    parse_park,
    parse_reload,
    reloaded_frame,
    result_frame,
)
from .sdk import weights
from .service import BatchFailed, HandlerService, LoadFailed

# After the server closes the channel, how long a worker still busy in its handler may run on
# (the server's own stop waits 5 s before SIGTERM); none if the server process is gone.
_GRACE_AFTER_CLOSE_S = 5.0
_PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is being torn down (linux/sched.h)
# The exit status of a worker that got a frame it cannot trust (1: its handler failed to load).
EXIT_PROTOCOL_ERROR = 3


def _gpu_unusable() -> str | None:
    """Why this worker, given a GPU, cannot use it, as torch tells (when torch is imported): a
    handler that finds no CUDA quietly runs on the CPU (TorchServe's handlers fall back), and
    its operator should hear of it. Asked once the handler loaded; on a CUDA build of torch
    this starts CUDA's driver as TorchServe's BaseHandler does, which a model that leaves the
    GPU alone avoids with ``deviceType: cpu`` (no GPU given, nothing asked)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return None
    version = getattr(torch, "__version__", "?")
    build = getattr(torch, "version", None)
    if getattr(build, "cuda", None) is None and getattr(build, "hip", None) is None:
        return (
            f"torch {version} is a CPU-only build: the model's environment needs a CUDA build"
            " of torch"
        )
    try:
        if cuda.is_available():
            return None
    except Exception as exc:  # a broken install: say so rather than fail the worker
        return f"torch.cuda.is_available() raised {exc!r}"
    return (
        f"torch {version} finds no usable GPU (torch.cuda.is_available() is False; the"
        " worker's log has CUDA's own reason)"
    )


def _load(
    init: dict, channel: Channel, sandbox: dict | None = None, phases: dict | None = None
) -> HandlerService | None:
    """The service, READY sent (with how the worker was confined, ``sandbox``, and when each
    step of its start ended, ``phases``); None when the handler failed to load (LOAD_FAILED
    sent)."""
    try:
        service = HandlerService.load(init)
    except LoadFailed as exc:
        channel.send(Frame(Kind.LOAD_FAILED, {"error": exc.error, "traceback": exc.traceback}))
        return None
    # What the handler built while loading (its model, its modules) lives as long as the worker:
    # out of the collector's reach, a full collection need not walk it again (it walked every
    # object of a torch model and its imports: ~80 ms each, one every ~10,000 tokens when
    # generating, measured in process on examples/tiny_lm)
    gc.freeze()
    ready = {"load_s": service.load_s, "style": service.style, "imports": service.imports}
    if _concurrent(init, service):
        ready["concurrent"] = True
    if service.code is not None:
        ready["code"] = service.code
    if weights.enabled():  # the checkpoints it mapped: the server keeps them warm
        ready["mapped"] = weights.mapped_files()
        if _parks(init, service):
            ready["parks"] = True
    if phases is not None:  # what its start took, step by step: the server logs it
        ready["phases"] = {**phases, **weights.timings(), "ready": time.time()}
    if sandbox is not None:
        ready["sandbox"] = sandbox
    if init.get("gpu_id") is not None:
        unusable = _gpu_unusable()
        if unusable:
            ready["gpu_unusable"] = unusable
    channel.send(Frame(Kind.READY, ready))
    return service


def _open_server_stat(server_pid: int | None) -> int | None:
    """The server's ``/proc`` stat, opened before the sandbox closes other processes' folders
    to the worker: Landlock checks a file when it is opened, not when it is read."""
    if server_pid is None:
        return None
    try:
        return os.open(f"/proc/{server_pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _server_gone(server_pid: int | None, stat_fd: int | None = None) -> bool:
    """Whether the server process has ended or is ending: a zombie counts (nobody reaped it
    yet), and so does a process the kernel is tearing down (PF_EXITING), which is what a kill -9
    looks like at the moment its sockets close: the EOF can come before the zombie."""
    if server_pid is None:
        return False
    try:
        if stat_fd is not None:
            text = os.pread(stat_fd, 4096, 0).decode("ascii", "replace")
        else:
            with open(f"/proc/{server_pid}/stat") as f:
                text = f.read()
        fields = text.rpartition(")")[2].split()
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    except (FileNotFoundError, ProcessLookupError):  # reaped (a held stat file says ESRCH)
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _exit_with_server(fd: int, server_pid: int | None, stat_fd: int | None) -> None:
    """Die with the server, even in the middle of a batch.

    An idle worker reads the channel's EOF and exits; a busy one reads its socket only after
    the handler returns, which may be never. This thread sleeps until the server's end of the
    socket is closed (no polling), then gives the worker the server's own stop grace to finish
    on its own, less if the server process is gone (kill -9, or a forced exit that did not wait
    for its workers), and then kills the worker's process group: the worker and anything its
    handler started."""
    poller = select.poll()
    poller.register(fd, 0)  # no events asked: only hang-up and errors wake it
    while not poller.poll():
        pass
    deadline = time.monotonic() + _GRACE_AFTER_CLOSE_S
    while time.monotonic() < deadline and not _server_gone(server_pid, stat_fd):
        time.sleep(0.1)
    try:
        print("mserve-worker: the server closed the channel and is gone; exiting", file=sys.stderr)
        sys.stderr.flush()
    except Exception:  # stderr is a pipe to the server, which may be gone with it
        pass
    _kill_own_group()
    os._exit(1)


def _kill_own_group() -> None:
    """SIGKILL this worker's process group: the worker and anything its handler started (a
    forked child, a multiprocessing pool), which would otherwise live on, reparented to init."""
    if os.getpgid(0) == os.getpid():  # the server made this process its group's leader
        os.killpg(0, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mserve-worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited Unix socket")
    args = parser.parse_args(argv)
    started = time.time()  # forked from a template: just after the fork
    # Handlers log with the logging module (the seeds' hooks and kernels do); stderr is re-logged
    # by the server under the model's name, so the worker's own format stays short.
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    channel = Channel(socket.socket(fileno=args.fd))
    channel.send(
        Frame(
            Kind.HELLO,
            {
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "python": platform.python_version(),
                "runtime": "mserve-worker",
            },
        )
    )
    try:
        return _serve(channel, args.fd, started)
    except ProtocolError as exc:
        # The stream cannot be trusted past a bad frame: say why and exit; the server sees the
        # channel close and the exit status (docs/protocol.md, Errors).
        print(f"mserve-worker: the server broke the protocol ({exc}); exiting", file=sys.stderr)
        return EXIT_PROTOCOL_ERROR


def _serve(channel: Channel, fd: int, started: float | None = None) -> int:
    """INIT, then batches until the server closes the channel; ProtocolError on a bad frame."""
    init = channel.receive()
    if init is None:
        return 0
    phases = {"started": started, "init": time.time()} if started is not None else None
    if init.kind != Kind.INIT:
        raise ProtocolError(f"expected an INIT frame first, got {init.kind.name}")
    _check_init(init.meta)
    _show_model(init.meta)  # before any thread starts: threads take the command name with them
    server_pid = init.meta.get("server_pid")
    if type(server_pid) is not int:
        server_pid = None
    stat_fd = _open_server_stat(server_pid)  # before the sandbox
    sandbox = None
    if isinstance(init.meta.get("sandbox"), dict):  # before any thread: Landlock binds a thread
        from . import confine

        try:
            sandbox = confine.apply(init.meta["sandbox"])
        except OSError as exc:  # never run a model meant to be confined unconfined
            error = f"cannot confine the worker: {exc}"
            channel.send(Frame(Kind.LOAD_FAILED, {"error": error, "traceback": ""}))
            return 1
    threading.Thread(
        target=_exit_with_server,
        args=(fd, server_pid, stat_fd),
        name="server-watch",
        daemon=True,
    ).start()
    if "rank" in init.meta:
        _rank_threads()
    service = _load(init.meta, channel, sandbox, phases)
    if service is None:
        return 1
    if init.meta.get("continuous_batching") is True:  # the worker runs the steps
        try:
            continuous.run(channel, service)
        finally:
            service.shutdown()
        return 0
    # A parallel worker's other ranks (INIT's rank above 0) run each batch with rank 0, in
    # step, and answer nothing: rank 0 alone does (TorchServe's workers send from LOCAL_RANK 0)
    answers = not (type(init.meta.get("rank")) is int and init.meta["rank"] > 0)
    if _concurrent(init.meta, service):  # TorchServe's async worker: batches overlap
        try:
            inflight.run(channel, service, _answer)
        finally:
            service.shutdown()
        return 0
    send = channel.send if answers else _dropped
    streaming.install(streaming.Stream(send, channel.gone), service.context)
    serve = service.serve
    try:
        while True:
            frame = channel.receive()
            if frame is None:
                break  # the server closed the channel: we must not outlive it
            if frame.kind == Kind.RELOAD:  # hot reload: runs in turn with the batches
                send(reloaded_frame(service.reloader.step(*parse_reload(frame))))
                continue
            if frame.kind == Kind.PARK:  # evicted and kept (park.py); woken by a BATCH
                mapped = sum(size for _path, size in weights.mapped_files())
                send(parked_frame(park.park(parse_park(frame), mapped)))
                continue
            if frame.kind != Kind.BATCH:
                raise ProtocolError(f"unexpected {frame.kind.name} frame after INIT")
            batch_id, items = parse_batch(frame)
            send(_answer(serve, service, batch_id, items, channel.cancelled(batch_id)))
    finally:
        service.shutdown()
    # A server that stops waits for us, then kills what is left of our group; a killed one
    # cannot, and the server-watch thread may lose the race to this exit: take the group now.
    if _server_gone(server_pid, stat_fd):
        _kill_own_group()
    return 0


def _answer(
    serve: Any, service: HandlerService, batch_id: int, items: list[Any], cancelled: Any
) -> Frame:
    """The batch's RESULT frame, or its BATCH_FAILED when it failed as a whole."""
    try:
        responses, handler_ms, metrics = serve(batch_id, items, cancelled)
        return result_frame(
            batch_id, responses, handler_ms=handler_ms, metrics=metrics,
            phases=service.phases,
            inference_log=service.take_inference_log(),
        )  # fmt: skip
    except BatchFailed as exc:
        meta = {"error": exc.error, "traceback": exc.traceback, "batch_id": batch_id}
        return Frame(Kind.BATCH_FAILED, meta)
    except ProtocolError as exc:  # e.g. a status outside 100-599 set by the handler
        print(f"cannot send the handler's results: {exc}", file=sys.stderr)
        error = f"invalid handler result: {exc}"
        return Frame(Kind.BATCH_FAILED, {"batch_id": batch_id, "error": error, "traceback": ""})


def _concurrent(init: dict, service: HandlerService) -> bool:
    """Whether this worker runs the batches it is sent at once: an ``async def handle`` with
    ``asyncCommunication: true`` in the model config, as TorchServe's async worker does (not
    for continuous batching, whose steps are in order, nor a parallel model's ranks, which run
    each batch in step)."""
    config = init.get("model_yaml_config")
    return (
        isinstance(config, dict)
        and config.get("asyncCommunication") is True
        and service.handler.is_async
        and init.get("continuous_batching") is not True
        and "rank" not in init
    )


def _parks(init: dict, service: HandlerService) -> bool:
    """Whether this worker can be parked when its model is evicted (park.py): its weights are
    mapped files, and it runs the plain loop (one batch at a time, no ranks, no continuous
    batching), on the CPU (a GPU's memory would stay held)."""
    return (
        bool(weights.mapped_files())
        and not _concurrent(init, service)
        and init.get("continuous_batching") is not True
        and "rank" not in init
        and init.get("gpu_id") is None
    )


def _rank_threads() -> None:
    """A rank's ``OMP_NUM_THREADS`` (torchrun's, from the model config) made to count where
    torch was imported before it was set: by the warm template this rank was forked from."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def _dropped(frame: Frame) -> None:
    """What a rank that does not answer does with its answers."""


def _show_model(meta: dict) -> None:
    """``ps`` and ``top`` show the model, version and worker id, not the template's command
    line: ``mserve-worker mlp:1.0 W-9001`` (command name ``mlp:1.0``)."""
    version = meta.get("model_version")
    model = f"{meta['model_name']}:{version}" if version else meta["model_name"]
    worker = meta.get("worker_id")
    title = f"mserve-worker {model}" + (f" W-{worker}" if worker else "")
    if type(meta.get("rank")) is int:  # one of a parallel worker's ranks
        title += f" rank {meta['rank']}"
    proctitle.set_title(title, model)


# What the runtime itself reads from INIT's meta; the rest is optional (docs/protocol.md).
_INIT_FIELDS = {"model_name": (str, "a string"), "model_dir": (str, "a string"),
                "handler": (str, "a string"), "manifest": (dict, "an object"),
                "batch_size": (int, "an integer")}  # fmt: skip


def _check_init(meta: dict) -> None:
    for name, (kind, what) in _INIT_FIELDS.items():
        if name not in meta:
            raise ProtocolError(f"INIT lacks the required field {name!r}")
        if type(meta[name]) is not kind:
            raise ProtocolError(f"INIT {name} must be {what}, got {meta[name]!r:.60}")
    if meta["batch_size"] < 1:
        raise ProtocolError(f"INIT batch_size must be at least 1, got {meta['batch_size']}")


if __name__ == "__main__":
    sys.exit(main())
