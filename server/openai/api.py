"""The OpenAI-compatible calls, answered on the inference port (docs/generative.md).

Each choice of a request is one job on the model's queue, so choices, requests and clients share
the model's batching (continuous batching included) like any prediction. A request is one task:
it waits for each job's first answer (a refusal then is an HTTP error in OpenAI's shape), then
answers whole or as server-sent events, one event per piece the handler streams. The task is the
request's ``future``: a client that goes away cancels it, and its jobs with it.

A request's id is the client's ``X-Request-ID`` when usable (server/tracing/), else ours, as on
``/predictions``: its jobs carry it (``<id>.<i>`` for the i-th of several, which a handler keying
its state by request id needs apart), its answer's ``X-Request-Id`` header and the access log
name it, and the answer's ``id`` is ``chatcmpl-<id>`` / ``cmpl-<id>``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson

from mserve_worker.protocol import RequestItem, ResponseItem
from server import tracing
from server.errors import InternalError, ModelNotFound, MserveError, ServiceUnavailable
from server.http import JSON, ChunkedAnswer, Connection, Request
from server.metrics.server_metrics import Metrics
from server.models.batching import Job
from server.models.registry import Registry
from server.models.version import ModelVersion
from server.openai.pieces import Choice, Piece, read_embedding, read_piece, usage
from server.openai.request import (
    Completion,
    Embedding,
    Generative,
    OpenAIError,
    completion,
    embedding,
    generative,
    read_body,
)
from server.rollouts.router import Router
from server.streaming import ChunkStream
from server.tracing import RequestTrace, client_request_id, trace_id_of

log = logging.getLogger(__name__)

SSE_HEADERS = [["Content-Type", "text/event-stream"], ["Cache-Control", "no-cache"]]
DONE = b"data: [DONE]\n\n"


class OpenAIAPI:
    def __init__(
        self, registry: Registry, metrics: Metrics, new_id: Callable[[], str],
        max_response_bytes: int, router: Router | None = None,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.router = router or Router(registry, metrics)  # which version answers
        self.metrics = metrics
        self.new_id = new_id
        self.max_response_bytes = max_response_bytes

    def route(self, conn: Connection, req: Request, op: str, name: str | None) -> None:
        if op == "models":
            rows = [self._card(m) for m in self.registry.all() if self._is_default(m)]
            conn.answer_json(req, 200, {"object": "list", "data": [r for r in rows if r]})
            return
        if op == "model":
            try:
                model = self._model(name or "")[0]
            except OpenAIError as error:
                if error.status != 400:
                    raise
                # not in the list, so not found here, as OpenAI answers for a model it lacks
                raise OpenAIError(404, error.message, "model", "model_not_found") from None
            conn.answer_json(req, 200, self._card(model))
            return
        rid = client_request_id(req.known.get("x-request-id")) or self.new_id()
        asked = ""
        try:
            body = read_body(op, req.body)
            asked = body["model"]
            model, declared = self._model(asked, req)
            req.tag = (rid, trace_id_of(req.known.get("traceparent")), model.name, model.version,
                       "")  # fmt: skip
            if op == "embedding":
                if not declared.embeddings:
                    raise self._not_for(model, "embeddings", "embeddings: true")
                parsed: Completion | Embedding = embedding(body)
            else:
                if not declared.chat:
                    raise self._not_for(model, "completions", "chat: true")
                parsed = completion(op, body, declared)
        except MserveError as error:  # refused before it is queued: its span all the same
            self._refused(req, rid, asked, op, error)
            raise
        span = _Span(req, rid, model, op)
        req.tag = (rid, span.trace_id, model.name, model.version, "")
        if isinstance(parsed, Embedding):
            work: Awaitable[None] = self._embed(conn, req, model, parsed, span)
        else:
            work = self._complete(conn, req, model, declared, parsed, span)
        model.stats.arrived(False)
        task = asyncio.ensure_future(work)
        conn.api.tasks.add(task)  # type: ignore[arg-type]  # held until done
        req.future = task  # a client that leaves cancels it (server/http/connection.py)
        task.add_done_callback(functools.partial(self._done, conn, req, model, span))

    def _refused(self, req: Request, rid: str, asked: str, op: str, error: MserveError) -> None:
        """A call refused before it is queued (unknown model, bad parameter): its error
        answer's ``X-Request-Id`` and, while tracing, its server span, ended with the error."""
        trace_id = tracing.refused(
            f"{req.method} /{'/'.join(req.parts)}", req.known, rid, asked, "", req.started,
            {"http.request.method": req.method, "gen_ai.request.model": asked,
             "gen_ai.operation.name": _OPERATIONS.get(op, op)}, error,
        )  # fmt: skip
        model, version = req.tag[2:4] if req.tag is not None else ("", "")
        req.tag = (rid, trace_id, model, version, "")

    # --- models ---------------------------------------------------------------------------

    def _model(self, name: str, req: Request | None = None) -> tuple[ModelVersion, Generative]:
        """``req``: a call to answer (its version picked by the model's traffic policy, its
        sticky key in a header or the body), or None to describe the model."""
        try:
            if req is None:
                model = self.registry.get(name)
            else:
                item = RequestItem(request_id="", content_type=JSON, headers=req.headers,
                                   body=req.body)  # fmt: skip
                model = self.router.pick(name, None, item)
        except ModelNotFound:
            raise OpenAIError(
                404, f"The model `{name}` does not exist", "model", "model_not_found"
            ) from None
        declared = generative(model.name, model.model_yaml_config)
        if declared is None:
            raise OpenAIError(
                400,
                f"model {name!r} is not generative: its model config has no `generative:`"
                " section, so it is not served under /openai/ (docs/generative.md)",
                "model",
                "model_not_generative",
            )
        return model, declared

    def _is_default(self, model: ModelVersion) -> bool:
        return self.registry.defaults.get(model.name) == model.version

    def _card(self, model: ModelVersion) -> dict[str, Any] | None:
        try:
            declared = generative(model.name, model.model_yaml_config)
        except OpenAIError:
            declared = None
        if declared is None:
            return None
        return {
            "id": model.name,
            "object": "model",
            "created": int(getattr(model, "registered_at", 0) or time.time()),
            "owned_by": "mserve",
            "context_length": declared.context_length,
        }

    @staticmethod
    def _not_for(model: ModelVersion, what: str, key: str) -> OpenAIError:
        return OpenAIError(
            400,
            f"model {model.name!r} does not serve {what}: its `generative:` section lacks `{key}`",
            "model",
            None,
        )

    # --- the task ------------------------------------------------------------------------

    def _done(
        self, conn: Connection, req: Request, model: ModelVersion, span: _Span,
        task: asyncio.Future[None],
    ) -> None:  # fmt: skip
        conn.api.tasks.discard(task)  # type: ignore[arg-type]
        if task.cancelled():  # the client left (nothing is written), or the server stops
            if req.out is None:
                conn.answer_error(req, ServiceUnavailable("the server is shutting down"))
            self.metrics.answered(model, 499, None)
            span.finish(499, "the client went away")
            return
        error = task.exception()
        if error is None:
            span.finish(span.status, span.error)
            return
        if not isinstance(error, MserveError):
            log.error("unexpected error answering %s", model.label, exc_info=error)
            error = InternalError("internal server error; see the server log")
        self.metrics.answered(model, error.status, None)
        span.finish(error.status, error.message)
        if req.out is None:  # nothing sent yet
            conn.answer_error(req, error)

    def _enqueue(
        self, model: ModelVersion, req: Request, i: int, count: int, content_type: str,
        body: bytes, span: _Span,
    ) -> Job:  # fmt: skip
        """Job ``i`` of ``count`` for request ``req`` (named by its id, see the module's doc).
        Traced, every job's handler sees the request's span as its parent, and the first job's
        times make the span's children (queue, batch, worker, handler)."""
        rid = req.tag[0] if req.tag is not None else ""
        item = RequestItem(
            request_id=rid if count == 1 else f"{rid}.{i}", content_type=content_type,
            headers=[], body=body,
        )  # fmt: skip
        trace = span.trace
        if trace is None:
            job = model.enqueue(item, None, req.tenant)
        else:
            trace.pass_on(item.headers)
            job = model.enqueue(item, trace if i == 0 else None, req.tenant)
            if i == 0:
                span.job = job
        if i == 0:  # once per call: its first choice stands for it (counted, watched, shadowed)
            self.router.after_enqueue(model, item, job)
        return job

    @staticmethod
    def _answer_json(conn: Connection, req: Request, payload: dict[str, Any]) -> None:
        """A whole answer (200), naming the request's id as every answer of a prediction does."""
        headers = [["Content-Type", JSON]]
        if req.tag is not None:
            headers.append(["X-Request-Id", req.tag[0]])
        conn.answer(req, 200, headers, _json(payload))

    async def _first(self, model: ModelVersion, job: Job) -> AsyncIterator[bytes]:
        """The job's answer as its raw pieces, once the first has come; a refusal raises.

        A stream is taken here, at once: the pump reads no more of the worker until a frontend
        takes a new stream, and the ``n`` choices of one request may run on that one worker, so
        waiting for choice 1's first piece before taking choice 0's stream would wait for ever.
        """
        result = await job.future
        if type(result) is ChunkStream:
            chunks = result.chunks()
            try:  # its first chunk is there already: this takes the stream without waiting
                head = await chunks.__anext__()
            except StopAsyncIteration:
                return _raw(())
            return _raw((head,), chunks)
        if result.status >= 300:
            raise _handler_refusal(model, result)
        return _raw((bytes(result.body),))

    async def _complete(
        self, conn: Connection, req: Request, model: ModelVersion, declared: Generative,
        request: Completion, span: _Span,
    ) -> None:  # fmt: skip
        started = time.perf_counter()
        jobs: list[Job] = []
        choices: list[Choice] = []
        try:
            for i in range(request.n):
                body = request.handler_body(declared, i)
                jobs.append(self._enqueue(model, req, i, request.n, *body, span))
            choices = [Choice(i, request.stop, request.max_tokens) for i in range(request.n)]
            meta = _Meta(request, model.name, "chatcmpl-" if request.kind == "chat" else "cmpl-")
            meta.request_id = req.tag[0] if req.tag is not None else ""
            meta.id += meta.request_id
            if request.stream:
                # every choice must have begun (or been refused) before the 200 goes out; each
                # stream is taken as its first piece comes (see _first), so the choices read so
                # far hold at most BACKLOG_BYTES each until the last one begins
                firsts = [await self._first(model, job) for job in jobs]
                await self._stream(conn, req, model, meta, choices, firsts, started, span)
                return

            async def collect(choice: Choice, job: Job) -> None:
                await _collect(choice, await self._first(model, job))

            await _together([collect(c, j) for c, j in zip(choices, jobs, strict=True)])
            self._answer_json(conn, req, meta.whole(choices))
            self.metrics.answered(model, 200, time.perf_counter() - started)
        finally:
            for job in jobs:
                cancel_job(model, job)
            if choices:  # what was generated, a stream cut short included
                counted = usage(choices)
                self.metrics.tokens(model, counted["prompt_tokens"], counted["completion_tokens"])
                span.usage(counted["prompt_tokens"], counted["completion_tokens"])

    async def _stream(
        self, conn: Connection, req: Request, model: ModelVersion, meta: _Meta,
        choices: list[Choice], firsts: list[AsyncIterator[bytes]], started: float, span: _Span,
    ) -> None:  # fmt: skip
        source = _Source(asyncio.current_task())
        status = {"ok": False}

        def done(code: int, ok: bool) -> None:
            status["ok"] = ok

        def too_large() -> MserveError:
            return OpenAIError(500, "the stream is too large to hold for an HTTP/1.0 client")

        sent = [False]
        answer = ChunkedAnswer(
            conn, req, 200, [*SSE_HEADERS, ["X-Request-Id", meta.request_id]], source,
            self.max_response_bytes, too_large, done,
        )  # fmt: skip

        async def send(payload: dict[str, Any]) -> None:
            await source.writable.wait()
            if not sent[0]:  # the answer's first token
                sent[0] = True
                self.metrics.first_chunk(model, time.perf_counter() - req.started)
            span.chunk()
            answer.chunk(b"data: " + _json(payload) + b"\n\n")

        try:
            await _together([
                _stream_choice(c, f, meta, send) for c, f in zip(choices, firsts, strict=True)
            ])  # fmt: skip
        except Exception as exc:  # the stream began: the error is its last event
            error = exc
            if not isinstance(error, MserveError):
                log.error("unexpected error streaming %s", model.label, exc_info=error)
                error = InternalError("internal server error; see the server log")
            log.warning("stream of %s broke: %s", model.label, error.message)
            body = {"message": error.message, "type": "server_error", "param": None,
                    "code": getattr(error, "code", None)}  # fmt: skip
            answer.chunk(b"data: " + _json({"error": body}) + b"\n\n")
            answer.end(b"")
            self.metrics.answered(model, error.status, None)
            span.status, span.error = error.status, error.message
            return
        if meta.request.include_usage:
            await send({**meta.chunk([]), "usage": usage(choices)})
        answer.end(DONE)
        self.metrics.answered(model, 200, time.perf_counter() - started)

    async def _embed(
        self, conn: Connection, req: Request, model: ModelVersion, request: Embedding,
        span: _Span,
    ) -> None:  # fmt: skip
        started = time.perf_counter()
        jobs = []
        try:
            for i, text in enumerate(request.inputs):
                body = json.dumps({"kind": "embedding", "input": text}).encode()
                jobs.append(self._enqueue(model, req, i, len(request.inputs), JSON, body, span))
            data, prompt = [], 0
            for i, job in enumerate(jobs):
                first = await self._first(model, job)
                raw = b"".join([c async for c in first])
                vector, tokens = read_embedding(raw, model.name)
                prompt += tokens
                value: Any = vector
                if request.base64:
                    value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
                data.append({"object": "embedding", "index": i, "embedding": value})
            self._answer_json(conn, req, {
                "object": "list", "data": data, "model": model.name,
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            })  # fmt: skip
            self.metrics.tokens(model, prompt, 0)
            span.usage(prompt, None)
            self.metrics.answered(model, 200, time.perf_counter() - started)
        finally:
            for job in jobs:
                cancel_job(model, job)


def _json(payload: Any) -> bytes:
    """An answer or event as JSON, written by orjson: a streamed chunk costs ~0.3 us against
    json's ~4, paid per token. Compact and UTF-8 as is; NaN and infinities (an embedding model's
    vector may hold them) are written as null, which every client's parser reads, where json
    would write ``NaN``, which is not JSON. What orjson refuses (an integer past 64 bits, such as
    a handler's token count; a lone surrogate in a client's text) goes through json, escaped."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:
        return json.dumps(payload).encode()


def cancel_job(model: ModelVersion, job: Job) -> None:
    """Stop a job whose answer is no longer wanted: dropped while queued, left out of the next
    step while it generates (continuous batching: its slot goes to the next request), counted
    in mserve_requests_cancelled_total. Does nothing to a finished one (Job.cancel)."""
    model.withdraw(job)


async def _together(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run the choices' coroutines at once; the first to fail cancels the others and its error
    is raised (asyncio.TaskGroup would, from Python 3.11)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


def _handler_refusal(model: ModelVersion, result: ResponseItem) -> OpenAIError:
    """The handler answered with an error status before streaming (a prompt over its context,
    ``PredictionException(message, 400)``): its message, in OpenAI's shape."""
    raw = bytes(result.body)
    try:
        message = json.loads(raw).get("message") or raw.decode()
    except (ValueError, AttributeError, UnicodeDecodeError):
        message = raw.decode("utf-8", "replace")
    status = result.status if 400 <= result.status < 600 else 500
    return OpenAIError(status, f"model {model.name!r}: {message}")


async def _raw(
    taken: tuple[bytes, ...], rest: AsyncIterator[bytes] | None = None
) -> AsyncIterator[bytes]:
    """What was read already, then the rest of the stream; closing it early cancels the rest."""
    try:
        for data in taken:
            yield data
        if rest is not None:
            async for data in rest:
                yield data
    finally:
        if rest is not None:
            await rest.aclose()  # type: ignore[attr-defined]


async def _pieces(first: AsyncIterator[bytes]) -> AsyncIterator[Piece]:
    async with contextlib.aclosing(first) as chunks:  # leaving early cancels it
        async for data in chunks:
            yield read_piece(data)


async def _collect(choice: Choice, first: AsyncIterator[bytes]) -> None:
    async with contextlib.aclosing(_pieces(first)) as pieces:
        async for piece in pieces:
            choice.add(piece)
            if choice.finish_reason is not None:
                return
    choice.end()


async def _stream_choice(
    choice: Choice, first: AsyncIterator[bytes], meta: _Meta,
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:  # fmt: skip
    if meta.request.kind == "chat":
        await send(meta.chunk([meta.delta(choice.index, {"role": "assistant", "content": ""})]))
    async with contextlib.aclosing(_pieces(first)) as pieces:
        async for piece in pieces:
            text = choice.add(piece)
            if text:
                await send(meta.chunk([meta.delta(choice.index, {"content": text}, text)]))
            if choice.finish_reason is not None:
                break
    if choice.finish_reason is None:
        text = choice.end()
        if text:
            await send(meta.chunk([meta.delta(choice.index, {"content": text}, text)]))
    await send(meta.chunk([meta.delta(choice.index, {}, "", choice.finish_reason)]))


# OpenTelemetry's GenAI names for the operations (gen_ai.operation.name)
_OPERATIONS = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings"}


class _Span:
    """One OpenAI request's server span while tracing is on (server/tracing/; a no-op
    otherwise): its first choice's job gives the children, a streamed answer its
    ``mserve.stream`` span, the usage OpenTelemetry's ``gen_ai.usage.*`` attributes."""

    def __init__(self, req: Request, request_id: str, model: ModelVersion, op: str) -> None:
        tracer = tracing.current
        self.trace: RequestTrace | None = None
        if tracer is None:
            self.trace_id = trace_id_of(req.known.get("traceparent"))
        else:
            self.trace = tracer.begin(
                f"{req.method} /{'/'.join(req.parts)}", req.known, request_id, model.name,
                model.version, req.started,
                {"http.request.method": req.method, "gen_ai.request.model": model.name,
                 "gen_ai.operation.name": _OPERATIONS.get(op, op)},
            )  # fmt: skip
            self.trace_id = self.trace.trace_id
        self.job: Job | None = None
        self.status, self.error = 200, None  # a stream that broke after its 200 says so
        self.first = 0.0  # perf_counter time of the first event streamed
        self.chunks = 0

    def chunk(self) -> None:
        if self.trace is not None:
            self.chunks += 1
            if self.chunks == 1:
                self.first = time.perf_counter()

    def usage(self, prompt: int, completion: int | None) -> None:
        if self.trace is not None:
            self.trace.attributes["gen_ai.usage.input_tokens"] = prompt
            if completion is not None:
                self.trace.attributes["gen_ai.usage.output_tokens"] = completion

    def finish(self, status: int, error: str | None) -> None:
        if self.trace is not None:
            stream = (self.first, self.chunks) if self.chunks else None
            self.trace.finish(self.job, status, error, stream)


class _Meta:
    """The fields every object of one answer shares, and its shapes (chat or completion)."""

    def __init__(self, request: Completion, model: str, prefix: str) -> None:
        self.request = request
        self.model = model
        self.id = prefix
        self.request_id = ""  # X-Request-Id: the client's, or ours
        self.created = int(time.time())
        self.chat = request.kind == "chat"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}  # fmt: skip

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = choices
        if self.request.include_usage:
            out["usage"] = None
        return out

    def delta(
        self, index: int, delta: dict[str, Any], text: str = "", reason: str | None = None
    ) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": None}

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        out = self._head("chat.completion" if self.chat else "text_completion")
        rows = []
        for c in choices:
            if self.chat:
                body: dict[str, Any] = {"message": {"role": "assistant", "content": c.content}}
            else:
                body = {"text": c.content}
            rows.append({"index": c.index, **body, "finish_reason": c.finish_reason,
                         "logprobs": None})  # fmt: skip
        out["choices"] = rows
        out["usage"] = usage(choices)
        return out


class _Source:
    """The SSE answer's source for the HTTP layer: pausing blocks the task's next write; a
    client that leaves cancels the task."""

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.writable = asyncio.Event()
        self.writable.set()

    def pause(self) -> None:
        self.writable.clear()

    def resume(self) -> None:
        self.writable.set()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
