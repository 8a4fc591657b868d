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
from collections.abc import Sequence
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
from .service import BatchFailed, HandlerService
from .steps import NEXT_HEADER, forget

if TYPE_CHECKING:
    from .channel import Channel

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
            forget(service.context, "its step failed")
            reply = Frame(Kind.BATCH_FAILED, {"error": exc.error, "traceback": exc.traceback})
        except ProtocolError as exc:  # e.g. a status outside 100-599 set by the handler
            print(f"cannot send the handler's results: {exc}", file=sys.stderr)
            forget(service.context, "its step failed")
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
