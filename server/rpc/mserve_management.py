"""mserve's own gRPC management service (``mserve.management.MserveManagementService``,
server/rpc/protos/mserve_management.proto), beside TorchServe's on the management address:
the calls TorchServe's ``management.proto`` has no method for, on the same operations as REST
(server/operations.py), with the same errors and words. TorchServe's proto stays exactly its
own, so clients compiled from it keep working.
"""

from __future__ import annotations

import json

from grpc import aio

from server import operations as ops
from server.errors import BadRequest, MserveError
from server.models.registry import Registry
from server.rpc.protos import mserve_management_pb2 as pb
from server.rpc.protos import mserve_management_pb2_grpc
from server.rpc.server import AddService, abort


class MserveManagementService(mserve_management_pb2_grpc.MserveManagementServiceServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def add_to(self) -> AddService:
        return lambda server: (
            mserve_management_pb2_grpc.add_MserveManagementServiceServicer_to_server(self, server)
        )

    async def ReloadModel(
        self, request: pb.ReloadModelRequest, context: aio.ServicerContext
    ) -> pb.ReloadModelResponse:
        """``PUT /models/{name}[/{version}]/reload``: its JSON answer, or its error's code."""
        try:
            if not request.model_name:
                raise BadRequest("parameter 'model_name' is required")
            version = request.model_version or None
            answer = await ops.reload_model(self.registry, request.model_name, version)
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
            raise  # abort raises; never reached
        return pb.ReloadModelResponse(msg=json.dumps(answer))
