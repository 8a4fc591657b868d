"""TorchServe's gRPC management service (``ManagementAPIsService``) on the same operations as the
REST management API (server/operations.py): same parameters, checks, errors and messages.

proto3 cannot tell a number left 0 or a string left empty from one not given, so those count as
not given, and the REST default applies; a negative number is refused as REST refuses it. Each
answer is TorchServe's ``ManagementResponse``: the status sentence, or the JSON that REST answers
(describe, list).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from grpc import aio

from server import operations as ops
from server.errors import BadRequest, MserveError
from server.models.registry import Registry
from server.rpc.protos import management_pb2 as pb
from server.rpc.protos import management_pb2_grpc
from server.rpc.server import AddService, abort

Request = TypeVar("Request")


def _params(**values: object) -> dict[str, str]:
    """A request's fields as REST parameters; 0 and "" are not given."""
    out = {}
    for name, value in values.items():
        if isinstance(value, bool):
            out[name] = "true" if value else "false"
        elif value not in (0, ""):
            out[name] = str(value)
    return out


def _required(value: str, name: str) -> str:
    if not value:
        raise BadRequest(f"parameter '{name}' is required")
    return value


def _json(value: Any) -> str:
    return json.dumps(value, indent=2)


def _rpc(
    method: Callable[[Any, Request], Awaitable[str]],
) -> Callable[[Any, Request, aio.ServicerContext], Awaitable[pb.ManagementResponse]]:
    """A servicer method from an operation that returns the answer's text; an error ends the
    call with its code and message."""

    async def call(self: Any, request: Request, context: aio.ServicerContext) -> Any:
        try:
            return pb.ManagementResponse(msg=await method(self, request))
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


class ManagementService(management_pb2_grpc.ManagementAPIsServiceServicer):
    def __init__(self, registry: Registry, model_api: bool) -> None:
        self.registry = registry
        self.model_api = model_api

    def add_to(self) -> AddService:
        return lambda server: management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server(
            self, server
        )

    @_rpc
    async def DescribeModel(self, request: pb.DescribeModelRequest) -> str:
        """REST's describe (``customized`` is ignored there too)."""
        name = _required(request.model_name, "model_name")
        return _json(ops.describe(self.registry, name, request.model_version or None))

    @_rpc
    async def ListModels(self, request: pb.ListModelsRequest) -> str:
        params = _params(limit=request.limit, next_page_token=request.next_page_token)
        return _json(ops.models_page(self.registry, params))

    @_rpc
    async def RegisterModel(self, request: pb.RegisterModelRequest) -> str:
        """TorchServe's ``synchronous`` defaults to false here (a proto3 bool), true in REST."""
        ops.check_model_api(
            self.model_api, "registering models", self.registry.config.torchserve, grpc=True
        )
        params = _params(
            url=request.url, model_name=request.model_name, handler=request.handler,
            batch_size=request.batch_size, max_batch_delay=request.max_batch_delay,
            initial_workers=request.initial_workers, response_timeout=request.response_timeout,
            runtime=request.runtime, synchronous=request.synchronous,
        )  # fmt: skip
        return (await ops.register_model(self.registry, params)).message

    @_rpc
    async def ScaleWorker(self, request: pb.ScaleWorkerRequest) -> str:
        name = _required(request.model_name, "model_name")
        params = _params(
            min_worker=request.min_worker, max_worker=request.max_worker,
            synchronous=request.synchronous,
        )  # fmt: skip
        version = request.model_version or None
        return (await ops.scale_model(self.registry, name, version, params)).message

    @_rpc
    async def SetDefault(self, request: pb.SetDefaultRequest) -> str:
        name = _required(request.model_name, "model_name")
        version = _required(request.model_version, "model_version")
        return ops.set_default(self.registry, name, version).message

    @_rpc
    async def UnregisterModel(self, request: pb.UnregisterModelRequest) -> str:
        ops.check_model_api(
            self.model_api, "unregistering models", self.registry.config.torchserve, grpc=True
        )
        name = _required(request.model_name, "model_name")
        version = request.model_version or None
        return (await ops.unregister_model(self.registry, name, version)).message
