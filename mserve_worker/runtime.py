"""Child side of a worker: say hello, load the handler once, then serve batches until EOF.

Runs inside the model's own environment, so it imports the standard library and its sibling
modules only. A handler exception fails its batch (traceback to stderr, which the server re-logs)
and never the worker. Started as ``python -m mserve_worker.runtime --fd N``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from . import compat, proctitle, stand_ins, streaming
from .context import Context, Metrics
from .imports import loaded_packages
from .loader import HandlerLoadError, LoadedHandler, load_handler
from .oip import serving as oip_serving
from .oip.signature import SignatureError
from .oip.tensors import OIPError
from .payload import PayloadError, decode_request, encode_output
from .protocol import (
    PROTOCOL_VERSION,
    STREAM_FAILED_HEADER,
    TOO_LARGE_HEADER,
    Decoder,
    Frame,
    Kind,
    ProtocolError,
    ResponseItem,
    encode,
    parse_batch,
    parse_cancel,
    result_frame,
)
from .sdk.errors import PredictionException

_RECV_BYTES = 1 << 18
# After the server closes the channel, how long a worker still busy in its handler may run on
# (the server's own stop waits 5 s before SIGTERM); none if the server process is gone.
_GRACE_AFTER_CLOSE_S = 5.0
# A batch that waited behind others for longer than this gets a look at the socket for CANCELs
# first; one that waited less is run at once. With eight requests in flight, polling before every
# batch was one failing recv() per request for a window of a few hundred microseconds.
_CANCEL_POLL_AFTER_S = 0.001
# How often a streaming handler's sends look for CANCELs of its own batch (clients that left).
_STREAM_POLL_S = 0.01
CLIENT_GONE = 499  # the answer to a cancelled request, which nobody reads
# The exit status of a worker that got a frame it cannot trust (1: its handler failed to load).
EXIT_PROTOCOL_ERROR = 3


class Channel:
    """Blocking frame I/O over the inherited socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = Decoder()
        self.pending: list[Frame] = []
        self.buffered = False  # the last frame received had arrived with an earlier one
        self.read_at = 0.0  # when the socket was last looked at
        self._cancelled: dict[int, set[str]] = {}  # batch id -> request ids whose callers left
        self._eof = False
        # one reused buffer: a fresh 256 KiB bytes per recv costs page faults on every call
        self._buffer = bytearray(_RECV_BYTES)
        self._view = memoryview(self._buffer)

    def send(self, frame: Frame) -> None:
        """Header, meta and payload in one ``sendmsg``: one system call, and the payload is
        written from where it lies, never joined to the header."""
        buffers: list[Any] = encode(frame)
        while buffers:  # a blocking send stops short only when a signal interrupts it
            sent = self.sock.sendmsg(buffers)
            while buffers and sent >= len(buffers[0]):
                sent -= len(buffers.pop(0))
            if sent:
                buffers[0] = memoryview(buffers[0])[sent:]

    def receive(self) -> Frame | None:
        """The next frame other than CANCEL, or None when the server closed the channel."""
        self.buffered = bool(self.pending)
        while not self.pending:
            if self._eof:
                return None
            n = self.sock.recv_into(self._buffer)
            if not n:
                return None
            self.read_at = time.monotonic()
            self._take(self.decoder.feed(self._view[:n]))
        return self.pending.pop(0)

    def poll(self) -> None:
        """Take in what has already arrived, without waiting: a CANCEL for a batch that was
        queued here while the one before it ran."""
        self.read_at = time.monotonic()
        while not self._eof:
            try:
                n = self.sock.recv_into(self._buffer, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if not n:
                self._eof = True  # the next receive() reports it, after the frames we hold
                return
            self._take(self.decoder.feed(self._view[:n]))

    def cancelled(self, batch_id: int) -> set[str]:
        """Request ids of ``batch_id`` the server cancelled; forgets older batches' leftovers."""
        if not self._cancelled:
            return set()
        for stale in [b for b in self._cancelled if b < batch_id]:
            del self._cancelled[stale]
        return self._cancelled.pop(batch_id, set())

    def gone(self, batch_id: int) -> set[str]:
        """Request ids of the running batch ``batch_id`` whose callers left mid-stream; looks at
        the socket (without waiting) at most once per ``_STREAM_POLL_S``."""
        if time.monotonic() - self.read_at >= _STREAM_POLL_S:
            self.poll()
        return self._cancelled.get(batch_id, set()) if self._cancelled else set()

    def _take(self, frames: list[Frame]) -> None:
        for frame in frames:
            if frame.kind == Kind.CANCEL:
                batch_id, ids = parse_cancel(frame)
                self._cancelled.setdefault(batch_id, set()).update(ids)
            else:
                self.pending.append(frame)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _serve_batch(
    frame: Frame,
    handler: LoadedHandler,
    context: Context,
    channel: Channel | None = None,
    max_response_bytes: int | None = None,
) -> Frame:
    batch_id, items = parse_batch(frame)
    if (
        channel is not None
        and channel.buffered
        and time.monotonic() - channel.read_at > _CANCEL_POLL_AFTER_S
    ):
        channel.poll()  # it waited here behind another batch: its callers may have left
    cancelled = channel.cancelled(batch_id) if channel is not None else set()
    stream = getattr(context, "_mserve_stream", None)
    if stream is not None:
        stream.reset(batch_id)
    responses: list[ResponseItem | None] = [None] * len(items)
    decoded: dict[int, Any] = {}
    prepared: dict[int, oip_serving.Prepared] = {}  # v1/v2 requests
    # one handler call per operation and API, in arrival order
    groups: dict[tuple[str, str], list[int]] = {}
    oip = oip_serving.for_context(context, handler.style)  # made when the handler loaded
    for i, item in enumerate(items):
        if item.request_id in cancelled:  # its caller is gone: the answer would reach nobody
            responses[i] = ResponseItem(CLIENT_GONE, b"", "")
            continue
        api = ""
        try:
            if item.api:
                prepared[i] = oip.prepare(item)
                decoded[i], api = prepared[i].row, prepared[i].api
            elif item.op in ("", "explain") and oip.enveloped:
                # the server's service_envelope reads TorchServe's paths too
                prepared[i] = oip.prepare_enveloped(item)
                decoded[i], api = prepared[i].row, prepared[i].api
            else:
                decoded[i] = decode_request(item.content_type, item.headers, item.body, item.params)
            if oip.bare and api != "v2" and item.op in ("", "explain"):
                decoded[i] = oip_serving.bare_row(decoded[i])
        except OIPError as exc:
            responses[i] = ResponseItem(exc.status, exc.message.encode(), "")
            continue
        except PayloadError as exc:
            responses[i] = ResponseItem(400, str(exc).encode(), "text/plain; charset=utf-8")
            continue
        groups.setdefault((item.op, api), []).append(i)
    started = time.perf_counter()
    for (op, api), indexes in groups.items():
        failure = _serve_group(
            op, indexes, items, decoded, handler, context, responses, max_response_bytes,
            api, prepared,
        )  # fmt: skip
        if failure is None:
            continue
        if len(groups) == 1:
            return Frame(Kind.BATCH_FAILED, dict(failure, batch_id=batch_id))
        # A batch mixing operations: only the requests of the failed one share its fate.
        for i in indexes:
            responses[i] = _failed(failure["error"], i, stream)
    for i, item in enumerate(items):  # v1/v2 errors in OIP's shape, {"error": "..."}
        response = responses[i]
        if item.api and response is not None and response.status >= 400 and (
            response.status != CLIENT_GONE and not _streamed(stream, i)
        ):  # fmt: skip
            responses[i] = oip_serving.error_response(response)
    handler_ms = round((time.perf_counter() - started) * 1000, 3) if groups else None
    metrics = context.metrics
    recorded = None
    if isinstance(metrics, Metrics) and len(metrics):  # NaN and infinities are not JSON
        recorded = [m for m in metrics.drain() if math.isfinite(m["value"])]
    try:
        return result_frame(
            batch_id,
            [r for r in responses if r is not None],
            handler_ms=handler_ms,
            metrics=recorded,
        )
    except ProtocolError as exc:  # e.g. a status outside 100-599 set by the handler
        print(f"cannot send the handler's results: {exc}", file=sys.stderr)
        return Frame(
            Kind.BATCH_FAILED,
            {"batch_id": batch_id, "error": f"invalid handler result: {exc}", "traceback": ""},
        )


def _serve_group(
    op: str,
    indexes: list[int],
    items: list[Any],
    decoded: dict[int, Any],
    handler: LoadedHandler,
    context: Context,
    responses: list[ResponseItem | None],
    max_response_bytes: int | None = None,
    api: str = "",
    prepared: dict[int, oip_serving.Prepared] | None = None,
) -> dict[str, str] | None:
    """Call the handler for the requests at ``indexes`` (all asking for ``op`` through ``api``)
    and fill in their responses; returns the failure (``error``, ``traceback``) when the call
    failed."""
    # A request the kserve/json envelope split is several rows of the batch, each with the
    # request's headers; rows[k] is the request of row k.
    rows: list[int] = []
    data: list[Any] = []
    for i in indexes:
        split = prepared.get(i) if prepared else None
        if split is not None and split.rows is not None:
            rows.extend([i] * split.rows)
            data.extend(decoded[i])
        else:
            rows.append(i)
            data.append(decoded[i])
    context.start_batch([items[i] for i in rows], op)
    context.protocol = api
    stream = getattr(context, "_mserve_stream", None)
    if stream is not None:
        stream.begin(rows, context)
    try:
        outputs = handler.handle(data, context)
    except PredictionException as exc:  # the handler chose the batch's answer
        traceback.print_exc()
        for i in indexes:
            responses[i] = _prediction_error(exc, i, stream)
        return None
    except Exception as exc:  # the per-batch boundary: the worker keeps serving
        traceback.print_exc()
        return {"error": _error_text(exc), "traceback": traceback.format_exc()}
    finally:
        if stream is not None:
            stream.end()  # send_intermediate_predict_response is refused from here on
    if not isinstance(outputs, list) or len(outputs) != len(data):
        if isinstance(outputs, list):
            found = f"{len(outputs)} results"
        else:
            found = "None" if outputs is None else type(outputs).__name__
        message = (
            "handler must return a list with one result per request:"
            f" got {found} for a batch of {len(data)}"
        )
        if len(rows) != len(indexes):
            message += " (each instance of an enveloped request is one)"
        print(message, file=sys.stderr)
        return {"error": message, "traceback": ""}
    broken: dict[int, str] | None = None
    if stream is not None:
        iterators = streaming.iterators_in(outputs)
        if iterators:  # mserve's own streaming: each item of a returned iterator is a chunk
            broken = stream.drain(iterators)
            for j in iterators:
                outputs[j] = b""  # every item went out as a chunk; the RESULT closes the stream
    j = 0  # the request's first row
    for i in indexes:
        split = prepared.get(i) if prepared else None
        n = split.rows if split is not None and split.rows is not None else 1
        first, j = j, j + n
        if broken and any(k in broken for k in range(first, j)):
            error = next(broken[k] for k in range(first, j) if k in broken)
            responses[i] = _failed(error, i, stream)
            continue
        request = context._request(first)  # the checked lookup, once per request
        if api and prepared and not _streamed(stream, i):
            if split is None or split.rows is None:
                output = outputs[first]
            else:  # a split request: it fails as its first failed instance does
                failed = next(
                    (k for k in range(first, j)
                     if context._request(k).get_response_status_code() >= 400), None,
                )  # fmt: skip
                if failed is None:
                    output = outputs[first:j]
                else:
                    request, output = context._request(failed), outputs[failed]
            responses[i] = _oip_answer(
                context, prepared[i], output, request, op, items[i].request_id
            )
            if max_response_bytes is not None and len(responses[i].body) > max_response_bytes:
                size = str(len(responses[i].body))
                responses[i] = ResponseItem(413, b"", "", [[TOO_LARGE_HEADER, size]])
            continue
        try:
            body, content_type = encode_output(
                outputs[first], request.get_response_content_type() or ""
            )
        except PayloadError as exc:
            print(f"request {items[i].request_id}: {exc}", file=sys.stderr)
            responses[i] = _failed(str(exc), i, stream)
            continue
        if max_response_bytes is not None and len(body) > max_response_bytes:
            responses[i] = ResponseItem(413, b"", "", [[TOO_LARGE_HEADER, str(len(body))]])
            continue
        headers = [[k, v] for k, v in request.get_response_headers().items()]
        responses[i] = ResponseItem(request.get_response_status_code(), body, content_type, headers)
    return None


def _streamed(stream: streaming.Stream | None, i: int) -> bool:
    return stream is not None and i in stream.started


def _oip_answer(
    context: Context, prepared: oip_serving.Prepared, output: Any, request: Any, op: str,
    request_id: str,
) -> ResponseItem:  # fmt: skip
    """A v1/v2 request's answer; an output that cannot be sent fails that request alone."""
    oip = oip_serving.for_context(context, "")  # made when the batch was read
    headers = [[k, v] for k, v in request.get_response_headers().items()]
    try:
        return oip.answer(prepared, output, request.get_response_status_code(), headers, op)
    except OIPError as exc:
        print(f"request {request_id}: {exc.message}", file=sys.stderr)
        return ResponseItem(exc.status, exc.message.encode(), "")


def _prediction_error(
    exc: PredictionException, i: int, stream: streaming.Stream | None
) -> ResponseItem:
    """Each request of the batch gets the exception's status and message, in TorchServe's body;
    a status HTTP cannot carry becomes a 500 that names it. A request that already streamed a
    chunk cannot change its status any more: its stream ends broken, as any failure's does."""
    code, message = exc.error_code, str(exc.message)
    if isinstance(code, bool) or not isinstance(code, int) or not 100 <= code <= 599:
        message = f"{message} (PredictionException code {code!r} is not an HTTP status)"
        code = 500
    if stream is not None and i in stream.started:
        return _failed(f"PredictionException {code}: {message}", i, stream)
    body = {"code": code, "type": "InternalServerException", "message": message}
    return ResponseItem(code, json.dumps(body).encode(), "application/json")


def _failed(error: str, i: int, stream: streaming.Stream | None) -> ResponseItem:
    """The 500 answer of request ``i``; one that already streamed a chunk says so in a header,
    so that the server ends the response where the client can see it broke."""
    headers = []
    if stream is not None and i in stream.started:
        headers = [[STREAM_FAILED_HEADER, error]]
    return ResponseItem(500, error.encode(), "text/plain; charset=utf-8", headers)


def _load(init: dict, channel: Channel) -> tuple | None:
    started = time.monotonic()
    before = set(sys.modules)  # forked from a template: what it preloaded is not news
    model_dir = init["model_dir"]
    sys.path.insert(0, model_dir)  # under -I nothing else puts the model on the path
    compat.install(after=model_dir)  # `import ts...` finds ours, before any installed torchserve
    stand_ins.install()  # `import mlrun` / `redhareapi` find ours only where they are missing
    log = logging.getLogger("mserve_worker")
    shadowed = compat.shadowed_torchserve()
    if shadowed is not None:
        log.info(
            "torchserve %s is installed in this environment; handlers importing ts.* get "
            "mserve's ts (docs/handlers.md)",
            shadowed,
        )
    for name, where in stand_ins.real_packages():
        log.info(
            "%s is installed (%s); handlers importing %s get that package, not mserve's "
            "stand-in, which is used only where %s is missing (docs/handlers.md)",
            name, where, name, name,
        )  # fmt: skip
    os.chdir(model_dir)
    context = Context(
        model_name=init["model_name"],
        model_dir=model_dir,
        manifest=init["manifest"],
        batch_size=init["batch_size"],
        gpu_id=init.get("gpu_id"),
        server_name=init.get("server_name", "mserve"),
        server_version=init.get("server_version", ""),
        limit_max_image_pixels=init.get("limit_max_image_pixels", True),
        model_yaml_config=init.get("model_yaml_config"),
        model_version=init.get("model_version", ""),
        worker_id=init.get("worker_id", ""),
    )
    try:
        handler = load_handler(init["handler"], model_dir, context, init.get("handler_style"))
        # the model config's signature, and the server's envelope
        oip_serving.for_context(context, handler.style, init.get("service_envelope") or "")
    except (HandlerLoadError, SignatureError) as exc:
        channel.send(Frame(Kind.LOAD_FAILED, {"error": str(exc), "traceback": ""}))
        return None
    except BaseException as exc:  # the user's module raised while importing or initialising
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        channel.send(Frame(Kind.LOAD_FAILED, {"error": _error_text(exc), "traceback": text}))
        return None
    # the installed packages the handler pulled in: what this environment's template preloads
    imports = loaded_packages([model_dir, os.path.dirname(os.path.abspath(__file__))], before)
    channel.send(
        Frame(
            Kind.READY,
            {
                "load_s": round(time.monotonic() - started, 4),
                "style": handler.style,
                "imports": imports,
            },
        )
    )
    return handler, context


def _server_gone(server_pid: int | None) -> bool:
    """Whether the server process has ended (a zombie counts: it has, only nobody reaped it)."""
    if server_pid is None:
        return False
    try:
        with open(f"/proc/{server_pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _exit_with_server(fd: int, server_pid: int | None) -> None:
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
    while time.monotonic() < deadline and not _server_gone(server_pid):
        time.sleep(0.1)
    try:
        print("mserve-worker: the server closed the channel and is gone; exiting", file=sys.stderr)
        sys.stderr.flush()
    except Exception:  # stderr is a pipe to the server, which may be gone with it
        pass
    if os.getpgid(0) == os.getpid():  # the server made this process its group's leader
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mserve-worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited Unix socket")
    args = parser.parse_args(argv)
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
        return _serve(channel, args.fd)
    except ProtocolError as exc:
        # The stream cannot be trusted past a bad frame: say why and exit; the server sees the
        # channel close and the exit status (docs/protocol.md, Errors).
        print(f"mserve-worker: the server broke the protocol ({exc}); exiting", file=sys.stderr)
        return EXIT_PROTOCOL_ERROR


def _serve(channel: Channel, fd: int) -> int:
    """INIT, then batches until the server closes the channel; ProtocolError on a bad frame."""
    init = channel.receive()
    if init is None:
        return 0
    if init.kind != Kind.INIT:
        raise ProtocolError(f"expected an INIT frame first, got {init.kind.name}")
    _check_init(init.meta)
    _show_model(init.meta)  # before any thread starts: threads take the command name with them
    server_pid = init.meta.get("server_pid")
    threading.Thread(
        target=_exit_with_server,
        args=(fd, server_pid if type(server_pid) is int else None),
        name="server-watch",
        daemon=True,
    ).start()
    loaded: Any = _load(init.meta, channel)
    if loaded is None:
        return 1
    handler, context = loaded
    streaming.install(streaming.Stream(channel.send, channel.gone), context)
    max_response = init.meta.get("max_response_bytes")
    if type(max_response) is not int:
        max_response = None
    try:
        while True:
            frame = channel.receive()
            if frame is None:
                return 0  # the server closed the channel: we must not outlive it
            if frame.kind != Kind.BATCH:
                raise ProtocolError(f"unexpected {frame.kind.name} frame after INIT")
            channel.send(_serve_batch(frame, handler, context, channel, max_response))
    finally:
        handler.shutdown()


def _show_model(meta: dict) -> None:
    """``ps`` and ``top`` show the model, version and worker id, not the template's command
    line: ``mserve-worker mlp:1.0 W-9001`` (command name ``mlp:1.0``)."""
    version = meta.get("model_version")
    model = f"{meta['model_name']}:{version}" if version else meta["model_name"]
    worker = meta.get("worker_id")
    title = f"mserve-worker {model}" + (f" W-{worker}" if worker else "")
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
