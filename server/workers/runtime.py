"""Child side of a worker: say hello, load the handler once, then serve batches until EOF.

Runs inside the model's own environment, so it imports the standard library and its sibling
modules only. A handler exception fails its batch (traceback to stderr, which the server re-logs)
and never the worker. Started as ``python -m server.workers.runtime --fd N``.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import sys
import time
import traceback
from typing import Any

from .context import Context
from .loader import HandlerLoadError, LoadedHandler, load_handler
from .payload import PayloadError, decode_request, encode_output
from .protocol import (
    PROTOCOL_VERSION,
    Decoder,
    Frame,
    Kind,
    ProtocolError,
    ResponseItem,
    encode_for_send,
    parse_batch,
    result_frame,
)

_RECV_BYTES = 1 << 18


class Channel:
    """Blocking frame I/O over the inherited socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = Decoder()
        self.pending: list[Frame] = []
        # one reused buffer: a fresh 256 KiB bytes per recv costs page faults on every call
        self._buffer = bytearray(_RECV_BYTES)
        self._view = memoryview(self._buffer)

    def send(self, frame: Frame) -> None:
        for buffer in encode_for_send(frame):
            self.sock.sendall(buffer)

    def receive(self) -> Frame | None:
        """The next frame, or None when the server closed the channel."""
        while not self.pending:
            n = self.sock.recv_into(self._buffer)
            if not n:
                return None
            self.pending.extend(self.decoder.feed(self._view[:n]))
        return self.pending.pop(0)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _serve_batch(frame: Frame, handler: LoadedHandler, context: Context) -> Frame:
    batch_id, items = parse_batch(frame)
    responses: list[ResponseItem | None] = [None] * len(items)
    decoded: dict[int, Any] = {}
    groups: dict[str, list[int]] = {}  # one handler call per operation, in arrival order
    for i, item in enumerate(items):
        try:
            decoded[i] = decode_request(item.content_type, item.headers, item.body, item.params)
        except PayloadError as exc:
            responses[i] = ResponseItem(400, str(exc).encode(), "text/plain; charset=utf-8")
            continue
        groups.setdefault(item.op, []).append(i)
    for op, indexes in groups.items():
        failure = _serve_group(op, indexes, items, decoded, handler, context, responses)
        if failure is None:
            continue
        if len(groups) == 1:
            return Frame(Kind.BATCH_FAILED, dict(failure, batch_id=batch_id))
        # A batch mixing operations: only the requests of the failed one share its fate.
        for i in indexes:
            responses[i] = ResponseItem(500, failure["error"].encode(), "text/plain; charset=utf-8")
    try:
        return result_frame(batch_id, [r for r in responses if r is not None])
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
) -> dict[str, str] | None:
    """Call the handler for the requests at ``indexes`` (all asking for ``op``) and fill in
    their responses; returns the failure (``error``, ``traceback``) when the call failed."""
    context.start_batch([items[i] for i in indexes], op)
    data = [decoded[i] for i in indexes]
    try:
        outputs = handler.handle(data, context)
    except Exception as exc:  # the per-batch boundary: the worker keeps serving
        traceback.print_exc()
        return {"error": _error_text(exc), "traceback": traceback.format_exc()}
    if not isinstance(outputs, list) or len(outputs) != len(data):
        if isinstance(outputs, list):
            found = f"{len(outputs)} results"
        else:
            found = "None" if outputs is None else type(outputs).__name__
        message = (
            "handler must return a list with one result per request:"
            f" got {found} for a batch of {len(data)}"
        )
        print(message, file=sys.stderr)
        return {"error": message, "traceback": ""}
    for j, i in enumerate(indexes):
        status, _phrase = context.get_response_status(j)
        try:
            body, content_type = encode_output(
                outputs[j], context.get_response_content_type(j) or ""
            )
        except PayloadError as exc:
            print(f"request {items[i].request_id}: {exc}", file=sys.stderr)
            responses[i] = ResponseItem(500, str(exc).encode(), "text/plain; charset=utf-8")
            continue
        headers = [[k, v] for k, v in context.get_response_headers(j).items()]
        responses[i] = ResponseItem(status, body, content_type, headers)
    return None


def _load(init: dict, channel: Channel) -> tuple | None:
    started = time.monotonic()
    model_dir = init["model_dir"]
    sys.path.insert(0, model_dir)  # under -I nothing else puts the model on the path
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
    except HandlerLoadError as exc:
        channel.send(Frame(Kind.LOAD_FAILED, {"error": str(exc), "traceback": ""}))
        return None
    except BaseException as exc:  # the user's module raised while importing or initialising
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        channel.send(Frame(Kind.LOAD_FAILED, {"error": _error_text(exc), "traceback": text}))
        return None
    channel.send(
        Frame(Kind.READY, {"load_s": round(time.monotonic() - started, 4), "style": handler.style})
    )
    return handler, context


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
    init = channel.receive()
    if init is None or init.kind != Kind.INIT:
        return 0
    loaded: Any = _load(init.meta, channel)
    if loaded is None:
        return 1
    handler, context = loaded
    try:
        while True:
            frame = channel.receive()
            if frame is None:
                return 0  # the server closed the channel: we must not outlive it
            if frame.kind == Kind.BATCH:
                channel.send(_serve_batch(frame, handler, context))
    finally:
        handler.shutdown()


if __name__ == "__main__":
    sys.exit(main())
