"""The Open Inference Protocol's gRPC service (``inference.GRPCInferenceService``, KServe v2 and
Triton's), on the gRPC inference port next to TorchServe's service.

Health and metadata answer what their REST paths answer (server/rest/inference.py). An inference
goes to the worker as its REST form with binary data (server/rpc/oip_messages.py), marked
``api: "v2"``, through the same queue as TorchServe's gRPC predictions (server/rpc/inference.py),
so signatures, checks, error messages and handler styles are those of ``/v2/models/{m}/infer``.
A request the worker refuses (400 with OIP's ``{"error"}`` body) ends the call with the code of
that status (INVALID_ARGUMENT) and the same message.

The service answers under two names: KServe's and Triton's ``inference.GRPCInferenceService``,
and TorchServe's ``org.pytorch.serve.grpc.openinference.GRPCInferenceService`` (its
``open_inference_grpc.proto``: the same messages and field numbers in another package), so a
client generated from TorchServe's file calls it too.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from mserve_worker.oip.tensors import HEADER_LENGTH
from mserve_worker.protocol import RequestItem
from server.errors import BadRequest, InternalError, MserveError, ResponseTooLarge
from server.inference import model_metadata, request_id, server_metadata
from server.models.registry import Registry
from server.rpc import status
from server.rpc.inference import (
    HandlerStatus,
    InferenceService,
    request_metadata,
    request_trace,
    tenant_of,
)
from server.rpc.oip_messages import request_body, response
from server.rpc.protos import oip_pb2 as pb
from server.rpc.protos import oip_pb2_grpc
from server.rpc.server import AddService, abort
from server.tenants import Tenant
from server.tracing import client_request_id

SERVICE = "inference.GRPCInferenceService"
TORCHSERVE_SERVICE = "org.pytorch.serve.grpc.openinference.GRPCInferenceService"
# probes: exempt from token authorization while their REST paths are (token_exempt_paths)
PROBES = {
    "/v2/health/live": tuple(f"/{s}/ServerLive" for s in (SERVICE, TORCHSERVE_SERVICE)),
    "/v2/health/ready": tuple(f"/{s}/ServerReady" for s in (SERVICE, TORCHSERVE_SERVICE)),
}


def error_text(exc: HandlerStatus) -> str:
    """The message of a worker's failed v2 answer: OIP's ``{"error": "..."}``, else its text."""
    text = str(exc)
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    error = doc.get("error") if isinstance(doc, dict) else None
    return error if isinstance(error, str) else text


class OipService(oip_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, registry: Registry, queue: InferenceService) -> None:
        self.registry = registry
        self.queue = queue  # TorchServe's service: queues requests and counts them

    def add_to(self) -> AddService:
        def add(server: aio.Server) -> None:
            oip_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(self, server)
            server.add_generic_rpc_handlers((self._handlers(TORCHSERVE_SERVICE),))

        return add

    def _handlers(self, service: str) -> grpc.GenericRpcHandler:
        """This servicer's methods under another service name, with the same messages."""
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
            request = getattr(pb, method.input_type.name)
            reply = getattr(pb, method.output_type.name)
            make = (
                grpc.stream_stream_rpc_method_handler
                if method.client_streaming
                else grpc.unary_unary_rpc_method_handler
            )
            handlers[method.name] = make(
                getattr(self, method.name),
                request_deserializer=request.FromString,
                response_serializer=reply.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(service, handlers)

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.registry.healthy())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            model = self.registry.get(_name(request.name), request.version or None)
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
        return pb.ModelReadyResponse(ready=model.ready())

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_metadata())

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        try:
            metadata = model_metadata(self.registry, _name(request.name), request.version or None)
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
        return pb.ModelMetadataResponse(**metadata)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: aio.ServicerContext
    ) -> pb.ModelInferResponse:
        # the client's x-request-id (or ours) names the request, and goes back in the trailing
        # metadata, errors included, as REST's X-Request-Id header and TorchServe's calls do
        meta = request_metadata(context)
        rid = client_request_id(meta.get("x-request-id")) or request_id()
        context.set_trailing_metadata((("x-request-id", rid),))
        try:
            return await self._infer(request, rid, meta, tenant_of(context))
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
        except HandlerStatus as exc:
            await context.abort(status.code_of_http(exc.status), status.message(error_text(exc)))
        raise AssertionError("abort raises")  # pragma: no cover

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Triton's stream: each request in turn, one answer each; a request that fails is
        answered with its ``error_message`` and the stream goes on."""
        meta = request_metadata(context)  # the call's trace context: each request's parent
        async for request in requests:
            try:
                answer = await self._infer(request, request_id(), meta, tenant_of(context))
            except MserveError as exc:
                text = self.registry.redact(exc.message)
            except HandlerStatus as exc:
                text = error_text(exc)
            else:
                yield pb.ModelStreamInferResponse(infer_response=answer)
                continue
            yield pb.ModelStreamInferResponse(error_message=status.message(text))

    async def _infer(
        self, request: pb.ModelInferRequest, rid: str, meta: dict[str, str],
        tenant: Tenant | None = None,
    ) -> pb.ModelInferResponse:  # fmt: skip
        """Queue the request in its REST form and read the worker's answer back; raises the
        error that answers it instead."""
        version = request.model_version or None
        model = self.queue.router.pick(_name(request.model_name, "model_name"), version, None, meta)
        counts = model.stats.arrived(version is not None)
        started = time.perf_counter()
        body, header = request_body(request)
        headers = [] if header is None else [[HEADER_LENGTH, str(header)]]
        item = RequestItem(
            request_id=rid,
            content_type="application/json" if header is None else "application/octet-stream",
            headers=headers,
            body=body,
            api="v2",
        )
        trace = request_trace(f"gRPC {SERVICE}", meta, model, item, started)
        pieces, size, first = [], 0, None
        run = self.queue.run(model, item, counts, started, trace, tenant)
        async with contextlib.aclosing(run) as answer:
            async for piece in answer:
                first = first or piece
                pieces.append(piece.body)
                size += len(piece.body)
                if size > self.queue.max_response_bytes:
                    raise ResponseTooLarge(
                        f"the streamed response of {model.label} is more than"
                        f" max_response_size_bytes={self.queue.max_response_bytes}"
                    )
        if first is None:
            raise InternalError(f"model {model.label} sent no answer")
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        try:
            return response(body, _header(first.headers))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InternalError(
                f"the answer of model {model.label} is not an Open Inference Protocol response"
                f" ({exc}); a TorchServe-style handler gets and answers tensors with"
                " kserveEnvelope: true in its model config (docs/handlers.md)"
            ) from None


def _name(name: str, field: str = "name") -> str:
    if not name:
        raise BadRequest(f"parameter '{field}' is required")
    return name


def _header(headers: list[Any]) -> str | None:
    wanted = HEADER_LENGTH.lower()
    return next((str(v) for k, v in headers if k.lower() == wanted), None)
