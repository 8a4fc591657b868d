"""Streamed responses, worker side: pieces of a request's answer sent while its batch still runs.

A handler streams in one of two ways. TorchServe's way: it calls
``send_intermediate_predict_response(ret, req_id_map, message, code, context)`` as often as it
likes and returns the last piece as its result. mserve's own: it returns, for a request, an
iterator (a generator, say), and each item is one piece. Either way every piece leaves at once in
a CHUNK frame (``docs/protocol.md``), the first one with the response's status, content type and
headers as the context holds them at that moment; the batch's RESULT frame then closes every
stream of the batch. Sending blocks while the server does not read, so a client that reads
slowly slows the handler down instead of making the server buffer without bound.

Runs inside the model's own environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .payload import encode_output
from .protocol import ChunkItem, Frame, chunk_frame

# Outputs that are never streams, checked by type before the (slower) Iterator test.
_PLAIN = (bytes, str, dict, list, int, float, bool, type(None), bytearray, tuple)


class Stream:
    """The streams of the batch being run; one per worker, pointed at each handler call.

    ``started`` holds the batch positions (index in the BATCH frame) that have sent a first
    chunk: their RESULT entry is the last chunk, not a whole answer."""

    def __init__(
        self, send: Callable[[Frame], None], gone: Callable[[int], set[str]] | None = None
    ) -> None:
        self._send = send
        self._gone = gone  # batch id -> ids of its requests whose callers left
        self._lock = threading.Lock()  # a handler may stream from a thread of its own
        self.batch_id = -1  # the batch being run
        self.active = False  # a handler call is running
        self.indexes: Sequence[int] = ()  # the handler's idx -> position in the BATCH frame
        self.context: Any = None
        self.started: set[int] = set()

    def reset(self, batch_id: int) -> None:
        """A new batch: no request of it has streamed yet."""
        self.batch_id = batch_id
        if self.started:
            self.started = set()

    def begin(self, indexes: Sequence[int], context: Any) -> None:
        """A handler call for the requests at ``indexes`` of the batch starts."""
        self.indexes = indexes
        self.context = context
        self.active = True

    def end(self) -> None:
        self.active = False

    def send(self, pieces: Sequence[tuple[int, Any]]) -> None:
        """Send ``(idx, value)`` pieces (``idx`` as the handler knows the request) in one frame;
        raises when there is no running handler call or a value cannot be encoded."""
        if not self.active:
            raise RuntimeError(
                "send_intermediate_predict_response was called outside a handler call (after"
                " the batch was answered, or from a thread that outlived it)"
            )
        gone = self._gone(self.batch_id) if self._gone is not None else ()
        if gone:  # a caller that left gets no more chunks (the server would drop them)
            ids = self.context.request_ids
            pieces = [(idx, value) for idx, value in pieces if ids.get(idx) not in gone]
        items = [self._item(idx, value) for idx, value in pieces]
        if not items:
            return
        with self._lock:
            self._send(chunk_frame(self.batch_id, items))
            for item in items:
                self.started.add(item.index)

    def _item(self, idx: int, value: Any) -> ChunkItem:
        count = len(self.indexes)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < count:
            raise IndexError(
                f"streamed response for request index {idx!r}: the batch has {count}"
                f" request{'' if count == 1 else 's'} (valid: 0 to {count - 1})"
            )
        position = self.indexes[idx]
        request = self.context._request(idx)
        body, content_type = encode_output(value, request.get_response_content_type() or "")
        if position in self.started:
            return ChunkItem(position, body)
        headers = request.response_header_pairs()
        return ChunkItem(position, body, request.get_response_status_code(), content_type, headers)

    def drain(self, iterators: Mapping[int, Iterator[Any]]) -> dict[int, str]:
        """Send the items of the iterators a handler returned, one round of all of them per
        frame, so that every request of a batch advances together. Returns the handler idx of
        each request whose iterator raised (or yielded what cannot be sent), with the error."""
        live = dict(iterators)
        failed: dict[int, str] = {}
        while live:
            gone = self._gone(self.batch_id) if self._gone is not None else ()
            if gone:  # a caller left: stop making its chunks (the generator is closed)
                ids = self.context.request_ids
                for idx in [i for i in live if ids.get(i) in gone]:
                    _close(live.pop(idx))
            pieces = []
            for idx in list(live):
                try:
                    pieces.append((idx, self._item(idx, next(live[idx]))))
                except StopIteration:
                    del live[idx]
                except Exception as exc:  # this request's stream ends; the others go on
                    traceback.print_exc()
                    failed[idx] = f"{type(exc).__name__}: {exc}"
                    _close(live.pop(idx))
            if pieces:
                with self._lock:
                    self._send(chunk_frame(self.batch_id, [item for _, item in pieces]))
                    for _, item in pieces:
                        self.started.add(item.index)
        return failed


def iterators_in(outputs: list[Any]) -> dict[int, Iterator[Any]] | None:
    """The outputs that are streams (iterators, generators), by position; None when there are
    none (the usual case costs one type test per output and allocates nothing)."""
    found = None
    for j, out in enumerate(outputs):
        if type(out) not in _PLAIN and isinstance(out, Iterator):
            if found is None:
                found = {}
            found[j] = out
    return found


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # a generator's own cleanup failing must not fail the others
            traceback.print_exc(file=sys.stderr)


# The worker's one stream, for a call whose context is not the one the runtime handed out (a
# handler that built its own); set by the runtime once the handler is loaded.
_current: Stream | None = None


def install(stream: Stream, context: Any) -> None:
    global _current
    _current = stream
    context._mserve_stream = stream


def send_intermediate_predict_response(
    ret: Sequence[Any] | None,
    req_id_map: Mapping[int, str],
    message: str = "",
    code: int = 200,
    context: Any = None,
) -> None:
    """TorchServe's call: send ``ret[idx]`` to the caller of each request ``idx`` of
    ``req_id_map`` (usually ``context.request_ids``) now, as one chunk of its response.

    As in TorchServe, the status and headers are the ones set on the context for that request
    (``message`` and ``code`` only matter to TorchServe without a context), ``ret`` None sends
    ``error``, and a process whose ``LOCAL_RANK`` is not 0 sends nothing."""
    if str(os.environ.get("LOCAL_RANK", 0)) != "0":
        return
    stream = getattr(context, "_mserve_stream", None) or _current
    if stream is None:
        raise RuntimeError(
            "send_intermediate_predict_response needs an mserve worker: it was called outside one"
        )
    stream.send([(idx, b"error" if ret is None else ret[idx]) for idx in req_id_map])
