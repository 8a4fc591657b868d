"""TorchServe's gRPC inference service (``InferenceAPIsService``) on our model queues.

A ``PredictionsRequest`` becomes one request on the model's queue, as a REST prediction does:
each entry of its ``input`` map is one field of the handler's request (``data[i]["data"]``), its
value the entry's bytes, and nothing else (no ``body``), as TorchServe passes them. The entries
travel to the worker as a ``multipart/form-data`` body of plain fields, which the worker decodes
into exactly those fields, as bytes (mserve_worker/payload.py), so the worker and its protocol
are unchanged. That Content-Type is the worker's to read, not a request header: the handler
sees the headers TorchServe gives a gRPC request, the sequence id alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Mapping

from google.rpc import status_pb2
from grpc import aio

from mserve_worker.protocol import RequestItem, ResponseItem
from server import tenants, tracing
from server.auth import bearer
from server.errors import BadRequest, MserveError, ResponseTooLarge
from server.inference import check_size, request_id
from server.metrics.server_metrics import Metrics
from server.models.batching import Job
from server.models.registry import Registry
from server.models.version import ModelVersion
from server.rollouts.router import Router
from server.rpc import status
from server.rpc.protos import inference_pb2 as pb
from server.rpc.protos import inference_pb2_grpc
from server.rpc.server import AddService, abort
from server.streaming import ChunkStream
from server.tenants import Tenant
from server.tracing import CLIENT_GONE, RequestTrace, client_request_id


def request_metadata(context: aio.ServicerContext) -> dict[str, str]:
    """The call's metadata that this server reads (request id, trace context), by name."""
    wanted = ("x-request-id", "traceparent", "tracestate")
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if key in wanted and isinstance(value, str):
            found.setdefault(key, value)
    return found


def tenant_of(context: aio.ServicerContext) -> Tenant | None:
    """The call's tenant while the server has tenants (its key passed TokenGuard already)."""
    current = tenants.current
    if current is None:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return current.of_key(bearer(value)) or current.default
    return current.default


def request_trace(
    name: str, meta: dict[str, str], model: ModelVersion, item: RequestItem, started: float
) -> RequestTrace | None:
    """A call's server span while tracing is on (its context passed on to the handler in the
    request's headers), else None; the handler sees the client's context all the same."""
    tracer = tracing.current
    if tracer is None:
        if "traceparent" in meta:
            item.headers += [[k, meta[k]] for k in ("tracestate", "traceparent") if k in meta]
        return None
    trace = tracer.begin(
        name, meta, item.request_id, model.name, model.version, started, {"rpc.system": "grpc"}
    )
    trace.pass_on(item.headers)
    return trace


SERVICE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
PING = f"/{SERVICE}/Ping"  # a probe: needs no key


class HandlerStatus(Exception):
    """A worker's answer with an error status (>= 400): it ends the call with the code
    TorchServe gives that status and the answer's text."""

    def __init__(self, result: ResponseItem) -> None:
        super().__init__(bytes(result.body).decode("utf-8", "replace"))
        self.status = result.status


def form(inputs: Mapping[str, bytes]) -> tuple[str, bytes]:
    """The ``input`` map as a multipart/form-data body (content type, body): plain fields (no
    filename), which the worker passes on as bytes; no entries is a form with no field, an
    empty request as in TorchServe."""
    boundary = os.urandom(16).hex().encode()
    while any(boundary in value for value in inputs.values()):
        boundary = os.urandom(16).hex().encode()
    parts: list[bytes] = []
    for name, value in inputs.items():
        if any(c in name for c in '"\r\n'):
            raise BadRequest(f"input name {name!r} has a quote or a line break; these are refused")
        parts += [
            b"--", boundary, b'\r\nContent-Disposition: form-data; name="', name.encode(),
            b'"\r\n\r\n', value, b"\r\n",
        ]  # fmt: skip
    parts += [b"--", boundary, b"--\r\n"]
    return f"multipart/form-data; boundary={boundary.decode()}", b"".join(parts)


class InferenceService(inference_pb2_grpc.InferenceAPIsServiceServicer):
    def __init__(
        self, registry: Registry, metrics: Metrics, max_response_bytes: int,
        router: Router | None = None,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.router = router or Router(registry, metrics)  # which version answers
        self.metrics = metrics
        self.max_response_bytes = max_response_bytes

    def add_to(self) -> AddService:
        return lambda server: inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(
            self, server
        )

    async def Ping(
        self, request: object, context: aio.ServicerContext
    ) -> pb.TorchServeHealthResponse:
        healthy = self.registry.healthy()
        health = json.dumps({"status": "Healthy" if healthy else "Unhealthy"}, indent=2)
        return pb.TorchServeHealthResponse(health=health)

    async def Predictions(
        self, request: pb.PredictionsRequest, context: aio.ServicerContext
    ) -> pb.PredictionResponse:
        """One answer; a streamed one is gathered whole (up to max_response_size_bytes)."""
        try:
            body = bytearray()
            async with contextlib.aclosing(self._answer(request, context)) as answer:
                async for chunk in answer:
                    body += chunk
                    if len(body) > self.max_response_bytes:
                        raise ResponseTooLarge(
                            f"the streamed response of {request.model_name} is more than"
                            f" max_response_size_bytes={self.max_response_bytes}, too much to"
                            " gather for a unary call (use StreamPredictions)"
                        )
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
        except HandlerStatus as exc:
            await context.abort(status.code_of_http(exc.status), status.message(str(exc)))
        return pb.PredictionResponse(prediction=bytes(body))

    async def StreamPredictions(
        self, request: pb.PredictionsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.PredictionResponse]:
        """The answer as the handler streams it, one message per chunk."""
        try:
            async with contextlib.aclosing(self._answer(request, context)) as answer:
                async for chunk in answer:
                    yield pb.PredictionResponse(prediction=chunk)
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
        except HandlerStatus as exc:
            await context.abort(status.code_of_http(exc.status), status.message(str(exc)))

    async def StreamPredictions2(
        self, requests: AsyncIterator[pb.PredictionsRequest], context: aio.ServicerContext
    ) -> AsyncIterator[pb.PredictionResponse]:
        """Each request in turn, its answer (chunks) tagged with its ``sequenceId``; a request
        that fails is answered with a ``status`` and the call goes on, as in TorchServe."""
        async for request in requests:
            sequence = request.sequenceId
            try:
                if not sequence:
                    raise BadRequest("parameter 'sequenceId' is required for StreamPredictions2")
                answering = self._answer(request, context, echo_id=False)
                async with contextlib.aclosing(answering) as answer:
                    async for chunk in answer:
                        yield pb.PredictionResponse(prediction=chunk, sequenceId=sequence)
            except MserveError as exc:
                code, text = status.code_of(exc), self.registry.redact(exc.message)
            except HandlerStatus as exc:
                code, text = status.code_of_http(exc.status), str(exc)
            else:
                continue
            failed = status_pb2.Status(code=code.value[0], message=status.message(text))
            yield pb.PredictionResponse(sequenceId=sequence, status=failed)

    async def _answer(
        self, request: pb.PredictionsRequest, context: aio.ServicerContext, echo_id: bool = True
    ) -> AsyncIterator[bytes]:
        """Queue the request and yield its answer's bytes (one piece, or each chunk of a
        streamed answer); raises the error that answers it instead. The call's metadata may
        carry ``x-request-id`` and W3C ``traceparent`` / ``tracestate``, as REST headers do;
        the request's id goes back in the call's trailing metadata (``echo_id``: a call of one
        request), errors included, as REST's ``X-Request-Id`` header does."""
        meta = request_metadata(context)
        rid = client_request_id(meta.get("x-request-id")) or request_id()
        if echo_id:
            context.set_trailing_metadata((("x-request-id", rid),))
        started = time.perf_counter()
        version = request.model_version or None
        try:
            if not request.model_name:
                raise BadRequest("parameter 'model_name' is required")
            model = self.router.pick(request.model_name, version, None, meta)
        except MserveError as exc:  # refused before it is queued: its span all the same
            tracing.refused(
                f"gRPC {SERVICE}", meta, rid, request.model_name, version or "", started,
                {"rpc.system": "grpc"}, exc,
            )  # fmt: skip
            raise
        counts = model.stats.arrived(version is not None)
        content_type, body = form(request.input)
        # the sequence id under the server's ts_header_key_sequence_id
        headers = [[model.sequence_headers[0], request.sequenceId]] if request.sequenceId else []
        item = RequestItem(request_id=rid, content_type=content_type, headers=headers, body=body)
        trace = request_trace(f"gRPC {SERVICE}", meta, model, item, started)
        answer_run = self.run(model, item, counts, started, trace, tenant_of(context))
        async with contextlib.aclosing(answer_run) as answer:
            async for piece in answer:
                yield bytes(piece.body)

    async def run(
        self, model: ModelVersion, item: RequestItem, counts: list[float], started: float,
        trace: RequestTrace | None = None, tenant: Tenant | None = None,
    ) -> AsyncIterator[ResponseItem]:  # fmt: skip
        """Queue ``item`` on ``model`` and yield its answer: one item, or one per chunk of a
        streamed answer (with the status and headers the handler set first); raises the error
        that answers it instead (HandlerStatus for a worker's answer >= 400). The request
        counts in the metrics as a REST one does. The Open Inference Protocol's service
        (server/rpc/oip.py) queues its requests here too."""
        try:
            job = model.enqueue(item, trace, tenant)
        except MserveError as exc:
            self.metrics.answered(model, exc.status, None)
            if trace is not None:
                trace.finish(None, exc.status, exc.message)
            raise
        self.router.after_enqueue(model, item, job)
        try:
            result = await self._wait(model, job)
            if type(result) is ChunkStream:
                first_chunk = time.perf_counter()
                self.metrics.first_chunk(model, first_chunk - started)
                async with contextlib.aclosing(result.chunks()) as chunks:
                    async for chunk in chunks:
                        yield ResponseItem(
                            result.status, chunk, result.content_type, result.headers
                        )
                code = result.status
                if trace is not None:
                    trace.finish(job, code, None, (first_chunk, result.chunks_in))
                    trace = None
            else:
                check_size(model, result, self.max_response_bytes)
                if result.status >= 400:
                    raise HandlerStatus(result)
                code = result.status
                yield result
        except MserveError as exc:
            self.metrics.answered(model, exc.status, None)
            if trace is not None:
                trace.finish(job, exc.status, exc.message)
            raise
        except HandlerStatus as exc:
            self.metrics.answered(model, exc.status, None)
            if trace is not None:
                trace.finish(job, exc.status, str(exc)[:200] if exc.status >= 500 else None)
            raise
        except asyncio.CancelledError:  # the call ended first
            if trace is not None:
                trace.finish(job, CLIENT_GONE, "the client went away")
            raise
        self.metrics.answered(model, code, time.perf_counter() - started, counts, job)
        if trace is not None:
            trace.finish(job, code)

    async def _wait(self, model: ModelVersion, job: Job) -> ResponseItem | ChunkStream:
        """The job's answer; a call that ends first (the client left, its deadline passed)
        withdraws the request, which then costs no worker time if no worker started it."""
        try:
            return await job.future  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if job.future.cancelled():
                model.withdraw(job)
            raise
