"""Continuous batching, worker side: the worker runs the steps itself.

:func:`run` calls the handler step after step, back to back while any request generates: a step
never waits for the server. Between two steps it takes what the server sent meanwhile: new
requests (BATCH frames; the server sends no more than ``batchSize`` minus those generating) and
CANCELs of requests whose clients left or whose deadline passed. Each step's answers go back in
one STEP frame that names each request by the BATCH frame that brought it and its place there
(docs/protocol.md, Continuous batching).

After each call the handler's ``context.stopping_criteria`` (TorchServe's: one callable per
request, given that request's result) says, per request: ``False`` it goes on (its result is one
chunk of its stream), ``True`` this was its last chunk, ``None`` its result is its whole answer.
A request that goes on gets TorchServe's ``ts_stream_next: true`` response header, which the
server reads, and comes back in the next step as TorchServe's request "cached in the backend".

A request that went on and is missing from the next step was cancelled by the server: its
client went away or its deadline passed. Its state is then cleaned up as a TorchServe handler
does when it finishes: its stopping criterion's ``clean_up()`` when it has one (TorchServe's vLLM
handler), else its ``context.cache`` entry (keyed by request id) is removed.

Runs inside the model's own environment: standard library only, Python 3.8.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Tuple

from . import streaming
from .protocol import (
    Frame,
    Kind,
    ProtocolError,
    RequestItem,
    parse_batch,
    result_frame,
    step_frame,
)

if TYPE_CHECKING:
    from .runtime import Channel
    from .service import HandlerService

NEXT_HEADER = "ts_stream_next"


class Steps:
    """The requests a continuous-batching handler is generating, between its calls."""

    def __init__(self) -> None:
        self.running: dict[str, Any] = {}  # request id -> its stopping criterion
        # the last call's ts_stream_next values by row, for rows whose answer the handler set
        # nothing on: the service adds the header to the answer itself (see ``mark``), which
        # spares a request processor per request per step
        self.marks: dict[int, str] = {}

    def begin(self, items: Sequence[Any], cancelled: Collection[str], context: Any) -> None:
        """A step starts with ``items``: clean up what went on last step and is not here."""
        if not self.running:
            return
        here = {item.request_id for item in items if item.request_id not in cancelled}
        for request_id in [r for r in self.running if r not in here]:
            _clean_up(context, request_id, self.running.pop(request_id))

    def judge(self, context: Any, outputs: Sequence[Any]) -> None:
        """Ask the handler's stopping criteria about each result of the call just made; mark
        the requests that go on. Raises what a criterion raises (the call then fails)."""
        criteria = getattr(context, "stopping_criteria", None)
        ids = context.request_ids
        marks = self.marks
        marks.clear()
        for idx in range(len(outputs)):
            request_id = ids.get(idx)
            criterion = _criterion(criteria, idx)
            stop = None if criterion is None else criterion(outputs[idx])
            if stop is False:
                marks[idx] = "true"
                self.running[request_id] = criterion
            else:
                self.running.pop(request_id, None)
                if stop is True:
                    marks[idx] = "false"

    def mark(self, context: Any, everywhere: bool) -> None:
        """Set the last call's ts_stream_next headers through the context, as a handler sets a
        header, when the answers are built from request processors: ``everywhere`` (v1/v2
        answers), or the handler made them (it read or set something per request). Otherwise
        the marks stay for the service to add to the answers it builds."""
        marks = self.marks
        if not marks or not (everywhere or context._touched(0) is not None):
            return
        for idx, value in marks.items():
            context.set_response_header(idx, NEXT_HEADER, value)
        marks.clear()


# A request of the loop: the BATCH frame that brought it, its place there, and the item the
# handler gets (cached, after its first step).
_Member = Tuple[int, int, RequestItem]


class Loop:
    """The requests of a worker's continuous-batching loop: those generating and those that
    joined since the last step."""

    def __init__(self, service: HandlerService, send: Any) -> None:
        self.service = service
        self.send = send  # the channel's send, for chunks sent in the middle of a step
        self.running: list[_Member] = []
        self.joining: list[_Member] = []
        self.steps = 0
        self.members: list[list[int]] = []  # [batch_id, index] of each request of the step

    @property
    def busy(self) -> bool:
        return bool(self.running or self.joining)

    def take(self, frame: Frame) -> None:
        """A frame from the server: new requests join the next step."""
        if frame.kind != Kind.BATCH:
            raise ProtocolError(f"unexpected {frame.kind.name} frame after INIT")
        batch_id, items = parse_batch(frame)
        self.joining.extend((batch_id, i, item) for i, item in enumerate(items))

    def drop(self, cancelled: dict[int, set[str]]) -> None:
        """Leave out the requests the server cancelled (its client went away, its deadline
        passed): the next step's start cleans up the state of those that were generating."""
        if not cancelled:
            return

        def kept(member: _Member) -> bool:
            ids = cancelled.get(member[0])
            return ids is None or member[2].request_id not in ids

        self.running = [m for m in self.running if kept(m)]
        self.joining = [m for m in self.joining if kept(m)]

    def step(self) -> Frame:
        """Run one handler call over every request; its STEP frame."""
        from .service import BatchFailed  # the service imports this module

        members, self.joining = self.running + self.joining, []
        self.running = []
        self.steps += 1
        self.members = [[m[0], m[1]] for m in members]
        service = self.service
        try:
            responses, handler_ms, metrics = service.serve(self.steps, [m[2] for m in members])
            reply = result_frame(
                self.steps, responses, handler_ms=handler_ms, metrics=metrics,
                phases=service.phases, inference_log=service.take_inference_log(),
            )  # fmt: skip
        except BatchFailed as exc:
            _forget(service.context, "its step failed")
            reply = Frame(Kind.BATCH_FAILED, {"error": exc.error, "traceback": exc.traceback})
        except ProtocolError as exc:  # e.g. a status outside 100-599 set by the handler
            print(f"cannot send the handler's results: {exc}", file=sys.stderr)
            _forget(service.context, "its step failed")
            reply = Frame(
                Kind.BATCH_FAILED, {"error": f"invalid handler result: {exc}", "traceback": ""}
            )
        else:
            self.running = [
                (b, i, _again(item))
                for (b, i, item), response in zip(members, responses)
                if _goes_on(response.headers)
            ]
        return step_frame(self.steps, self.members, reply)

    def send_chunk(self, frame: Frame) -> None:
        """A chunk the handler sent in the middle of the step (TorchServe's
        ``send_intermediate_predict_response``, or an item of an iterator it returned): its
        CHUNK frame names the step's requests, as the step's answer will."""
        frame.meta["members"] = self.members
        self.send(frame)


def run(channel: Channel, service: HandlerService) -> None:
    """Serve a continuous-batching handler until the server closes the channel: block while
    nothing generates, else take what arrived and run the next step at once."""
    loop = Loop(service, channel.send)
    streaming.install(streaming.Stream(loop.send_chunk), service.context)
    while True:
        if not loop.busy:
            frame = channel.receive()
            if frame is None:
                return
            loop.take(frame)
        channel.poll()
        for frame in channel.take_pending():
            loop.take(frame)
        loop.drop(channel.take_cancelled())
        if loop.busy:
            channel.send(loop.step())


def _again(item: RequestItem) -> RequestItem:
    """A request in its later steps: its id and headers, no body (``cached``: the handler has
    its state), as TorchServe sends a request cached in the backend."""
    if item.cached:
        return item
    return RequestItem(
        item.request_id, "", item.headers, b"", item.params, item.op, item.api, cached=True
    )


def _goes_on(headers: Sequence[Sequence[str]]) -> bool:
    for name, value in headers:
        if name == NEXT_HEADER:
            return value == "true"
    return False


def _forget(context: Any, why: str) -> None:
    """Clean up every request the handler was generating (their step failed)."""
    steps = getattr(context, "_mserve_steps", None)
    if steps is not None:
        for request_id in list(steps.running):
            _clean_up(context, request_id, steps.running.pop(request_id), why)


def _criterion(criteria: Any, idx: int) -> Any:
    """Request ``idx``'s criterion: from a list (TorchServe's way), or one for all."""
    if criteria is None:
        return None
    if isinstance(criteria, (list, tuple)):
        return criteria[idx] if idx < len(criteria) else None
    return criteria if callable(criteria) else None


def _clean_up(
    context: Any, request_id: str, criterion: Any,
    why: str = "was dropped by the server (client gone or deadline passed)",
) -> None:  # fmt: skip
    print(f"request {request_id} {why}; cleaning up its state", file=sys.stderr)
    try:
        clean_up = getattr(criterion, "clean_up", None)
        if callable(clean_up):
            clean_up()
            return
        cache = getattr(context, "cache", None)
        if isinstance(cache, dict):
            cache.pop(request_id, None)
    except Exception:  # the handler's own clean-up failing must not fail the next step
        traceback.print_exc()
