"""The inference API (8080): TorchServe's, the Open Inference Protocol's (KServe v2) and KServe
v1's paths, routed on our HTTP server (server/http/).

v1 and v2 requests go to the worker with their body as it arrived, marked with their API; the
worker reads tensors and answers in the protocol's shape (mserve_worker/oip/serving.py), so this
process, shared by every model, never parses a tensor. Errors on those paths are ``{"error":
"..."}`` (server/http/answer.py).

A prediction runs no coroutine: the parsed request goes on the model's queue with the body as
it arrived, and the answer is written from the queue future's callback.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from mserve_worker.protocol import RequestItem, ResponseItem
from server import tracing
from server.errors import InternalError, MserveError, ResponseTooLarge
from server.http import ChunkedAnswer, Connection, Request, header_problem
from server.inference import check_size, model_metadata, request_id, server_metadata
from server.metrics.server_metrics import Metrics
from server.models.batching import Job
from server.models.registry import Registry
from server.models.version import ModelVersion
from server.openai.api import OpenAIAPI
from server.operations import models_page
from server.rest.description import answer_description
from server.rest.routes import (
    INFER,
    MODELS,
    OPENAI,
    PING,
    V1_MODELS,
    V1_READY,
    V2_LIVE,
    V2_MODEL,
    V2_READY,
    V2_SERVER,
    WFPREDICT,
    match,
)
from server.rest.workflows import WorkflowAPI
from server.rollouts.router import Router
from server.streaming import ChunkStream
from server.tracing import CLIENT_GONE, client_request_id, trace_id_of

log = logging.getLogger(__name__)

# Set by the server alone: a handler's value would break the framing or contradict ours.
SERVER_HEADERS = frozenset(
    ("content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "date",
     "server", "content-type", "x-request-id")
)  # fmt: skip


class InferenceAPI:
    """The router of the inference port."""

    def __init__(
        self, registry: Registry, metrics: Metrics, max_response_bytes: int,
        workflows: WorkflowAPI | None = None, router: Router | None = None,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.router = router or Router(registry, metrics)  # which version answers
        self.metrics = metrics
        self.max_response_bytes = max_response_bytes
        self.openai = OpenAIAPI(registry, metrics, request_id, max_response_bytes, self.router)
        self.workflows = workflows  # /wfpredict (None: no such path)

    def route(self, conn: Connection, req: Request) -> None:
        if answer_description("inference", conn, req):
            return
        route = match(req.parts, req.method)
        if route is None:
            raise req.not_found()
        req.allow(*route.methods)
        kind = route.kind
        if kind == INFER:
            if route.url_path is not None:
                _set_url_path(req, route.url_path)
            if route.explain:  # TorchServe adds this header; handlers written for it look at it
                req.headers.append(["explain", "True"])
            self._infer(conn, req, route.model, route.version, route.op, route.api)
        elif kind == OPENAI:
            self.openai.route(conn, req, route.op, route.model)
        elif kind == WFPREDICT:
            if self.workflows is None:
                raise req.not_found()
            self.workflows.predict(conn, req, route.model)
        elif kind == PING:
            healthy = self.registry.healthy()
            status = {"status": "Healthy" if healthy else "Unhealthy"}
            conn.answer_json(req, 200 if healthy else 500, status)
        elif kind == MODELS:
            conn.answer_json(req, 200, models_page(self.registry, req.query, public=True))
        elif kind == V1_MODELS:
            conn.answer_json(req, 200, {"models": sorted(self.registry.models)})
        elif kind == V1_READY:
            model = self.registry.get(route.model, None)
            ready = model.ready()
            conn.answer_json(req, 200 if ready else 503, {"name": model.name, "ready": ready})
        elif kind == V2_SERVER:
            conn.answer_json(req, 200, server_metadata())
        elif kind == V2_LIVE:
            conn.answer_json(req, 200, {"live": True})
        elif kind == V2_READY:
            ready = self.registry.healthy()
            conn.answer_json(req, 200 if ready else 503, {"ready": ready})
        elif kind == V2_MODEL:
            conn.answer_json(req, 200, model_metadata(self.registry, route.model, route.version))
        else:  # V2_MODEL_READY
            model = self.registry.get(route.model, route.version)
            ready = model.ready()
            body = {"name": model.name, "version": model.version, "ready": ready}
            conn.answer_json(req, 200 if ready else 503, body)

    def _infer(
        self, conn: Connection, req: Request, name: str, version: str | None, op: str,
        api: str = "",
    ) -> None:  # fmt: skip
        known = req.known
        rid = known.get("x-request-id")
        rid = (client_request_id(rid) if rid is not None else None) or request_id()
        item = RequestItem(
            request_id=rid,
            content_type=known.get("content-type") or "",
            headers=req.headers,
            body=req.body,
            params=req.query if req.query_string else {},
            op=op,
            api=api,
        )
        try:
            model = self.router.pick(name, version, item)
        except MserveError as exc:  # no such model or version: refused, named all the same
            self._refused(req, rid, name, version, exc)
            raise
        counts = model.stats.arrived(version is not None)
        trace = None
        tracer = tracing.current
        if tracer is not None:
            trace = tracer.begin(
                f"{req.method} {route_name(req.parts)}", known, rid, model.name, model.version,
                req.started, {"http.request.method": req.method},
            )  # fmt: skip
            trace.pass_on(item.headers)
            trace_id = trace.trace_id
        else:
            trace_id = trace_id_of(known.get("traceparent"))
        req.tag = (rid, trace_id, model.name, model.version, "")
        try:
            job = model.enqueue(item, trace, req.tenant)
        except MserveError as exc:
            self.metrics.answered(model, exc.status, None)
            if trace is not None:
                trace.finish(None, exc.status, exc.message)
            raise
        self.router.after_enqueue(model, item, job)
        req.future = job.future
        job.future.add_done_callback(
            functools.partial(self._answered, conn, req, model, job, counts)
        )

    def _refused(
        self, req: Request, rid: str, name: str, version: str | None, error: MserveError
    ) -> None:
        """A prediction refused before it is queued still has its id (its error answer's
        ``X-Request-Id``, the access log) and, when tracing, its span with the error, as an
        HTTP server's instrumentation makes one for every request."""
        trace_id = tracing.refused(
            f"{req.method} {route_name(req.parts)}", req.known, rid, name, version or "",
            req.started, {"http.request.method": req.method}, error,
        )  # fmt: skip
        req.tag = (rid, trace_id, "", "", "")

    def _answered(
        self, conn: Connection, req: Request, model: ModelVersion, job: Job,
        counts: list[float], future: asyncio.Future[ResponseItem],
    ) -> None:  # fmt: skip
        trace = job.trace
        if job.sent is not None and req.tag is not None:
            req.tag = (*req.tag[:4], str(job.sent[0].id))  # type: ignore[assignment]
        if future.cancelled():  # the client went away
            model.withdraw(job)
            if trace is not None:
                trace.finish(job, CLIENT_GONE, "the client went away")
            return
        request_id = job.item.request_id
        try:
            result = future.result()
            if type(result) is ChunkStream:  # the handler streams: its first chunk is here
                self._stream(conn, req, model, result, request_id, counts, job)
                return
            headers = self._headers(model, result, request_id)
        except MserveError as exc:
            error = exc
        except Exception as exc:  # the supervisor's guard: never strand a caller
            log.error("unexpected error answering %s", model.label, exc_info=exc)
            error = InternalError("internal server error; see the server log")
        else:
            elapsed = time.perf_counter() - req.started
            self.metrics.answered(model, result.status, elapsed, counts, job)
            if trace is not None:
                trace.finish(job, result.status, _handler_error(result))
            conn.answer(req, result.status, headers, result.body)
            return
        self.metrics.answered(model, error.status, None)
        if trace is not None:
            trace.finish(job, error.status, error.message)
        conn.answer_error(req, error)

    def _stream(
        self, conn: Connection, req: Request, model: ModelVersion, stream: ChunkStream,
        request_id: str, counts: list[float], job: Job,
    ) -> None:  # fmt: skip
        """Answer with the chunks as they come (docs/apis.md, Streaming); the request counts
        in the metrics once, when its answer ends."""
        try:
            headers = self._headers(
                model,
                ResponseItem(stream.status, b"", stream.content_type, stream.headers),
                request_id,
            )
        except MserveError:
            stream.cancel()
            raise

        first_chunk = time.perf_counter()
        self.metrics.first_chunk(model, first_chunk - req.started)

        def done(status: int, ok: bool) -> None:
            if ok:
                elapsed = time.perf_counter() - req.started
                self.metrics.answered(model, status, elapsed, counts, job)
            else:
                self.metrics.answered(model, status, None)
            if job.trace is not None:
                job.trace.finish(
                    job, status, None if ok else "the stream broke",
                    (first_chunk, stream.chunks_in),
                )  # fmt: skip

        def too_large() -> MserveError:
            return ResponseTooLarge(
                f"the streamed response of {model.label} is more than"
                f" max_response_size_bytes={self.max_response_bytes}, too much to hold for a"
                " client that cannot take it as it comes (HTTP/1.0, or behind an earlier"
                " answer on the connection)"
            )

        answer = ChunkedAnswer(
            conn, req, stream.status, headers, stream, self.max_response_bytes, too_large, done
        )
        stream.attach(answer)

    def _headers(
        self, model: ModelVersion, result: ResponseItem, request_id: str
    ) -> list[list[str]]:
        """The answer's headers; raises when the answer cannot be sent as the handler made it."""
        check_size(model, result, self.max_response_bytes)
        headers = [[k, v] for k, v in result.headers if k.lower() not in SERVER_HEADERS]
        headers.append(["Content-Type", result.content_type or "application/octet-stream"])
        for name, value in headers:
            problem = header_problem(name, value)
            if problem is not None:  # never on the wire: the caller gets why instead
                raise InternalError(
                    f"the handler of {model.label} set response header {name!r} to a value"
                    f" that is not a valid HTTP header: {problem}"
                )
        headers.append(["X-Request-Id", request_id])  # ours, or the client's (checked)
        return headers


def route_name(parts: list[str]) -> str:
    """A span's name: the path's first segment, which names the API without the model's name
    (span names should not grow with the models: ``POST /predictions``)."""
    return f"/{parts[0]}" if parts else "/"


def _handler_error(result: ResponseItem) -> str | None:
    """A worker's error answer as the span's error text (its body, cut short)."""
    if result.status < 500:
        return None
    return bytes(result.body[:200]).decode("utf-8", "replace") or f"status {result.status}"


def _set_url_path(req: Request, url_path: str) -> None:
    """TorchServe 0.11+: the path after ``/predictions/{m}/{v}/`` reaches the handler as the
    request header ``url_path`` (``v1/chat/completions``; empty without one; server/rest/
    routes.py). A client's own ``url_path`` header is replaced."""
    headers = req.headers
    if "url_path" in req.known:  # rare: the HTTP layer indexed it, so no pass per request
        headers[:] = [h for h in headers if h[0].lower() != "url_path"]
    headers.append(["url_path", url_path])
