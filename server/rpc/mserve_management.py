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
from server import tenants
from server.errors import BadRequest, MserveError
from server.models.registry import Registry
from server.rollouts import control
from server.rollouts.router import Router
from server.rpc.protos import mserve_management_pb2 as pb
from server.rpc.protos import mserve_management_pb2_grpc
from server.rpc.server import AddService, abort
from server.tenants import edit


class MserveManagementService(mserve_management_pb2_grpc.MserveManagementServiceServicer):
    def __init__(self, registry: Registry, router: Router | None = None) -> None:
        self.registry = registry
        self.router = router or Router(registry)  # traffic policies (server/rollouts/)

    def add_to(self) -> AddService:
        return lambda server: (
            mserve_management_pb2_grpc.add_MserveManagementServiceServicer_to_server(self, server)
        )

    async def ReloadModel(
        self, request: pb.ReloadModelRequest, context: aio.ServicerContext
    ) -> pb.ReloadModelResponse:
        """``PUT /models/{name}[/{version}]/reload``: its JSON answer, or its error's code."""
        try:
            name, version = _required(request.model_name), request.model_version or None
            answer = await ops.reload_model(self.registry, name, version)
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
            raise  # abort raises; never reached
        return pb.ReloadModelResponse(msg=json.dumps(answer))

    async def Traffic(
        self, request: pb.TrafficRequest, context: aio.ServicerContext
    ) -> pb.RolloutResponse:
        """``/models/{name}/traffic`` (docs/rollouts.md): ``get``, ``set`` with REST's JSON
        body, ``clear``."""
        try:
            name = _required(request.model_name)
            action = request.action or "get"
            if action == "get":
                answer = control.traffic(self.router, name)
            elif action == "set":
                answer = control.set_traffic(self.router, name, _body(request.body))
            elif action == "clear":
                answer = control.clear_traffic(self.router, name)
            else:
                raise BadRequest(f"action {action!r}: expected get, set or clear")
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
            raise  # abort raises; never reached
        return pb.RolloutResponse(msg=json.dumps(answer))

    async def Canary(
        self, request: pb.CanaryRequest, context: aio.ServicerContext
    ) -> pb.RolloutResponse:
        """``/models/{name}/canary`` (docs/rollouts.md): ``get``, ``start`` with the plan as
        REST's JSON body, ``pause``, ``resume``, ``promote``, ``abort``, ``forget``."""
        try:
            name = _required(request.model_name)
            action = request.action or "get"
            router = self.router
            if action == "get":
                answer = control.canary_state(router, name)
            elif action == "start":
                answer = control.start_canary(router, name, _body(request.body))
            elif action == "forget":
                answer = control.forget_canary(router, name)
            elif action in control.CANARY_ACTIONS:
                answer = control.canary_action(router, name, action)
            else:
                raise BadRequest(
                    f"action {action!r}: expected get, start, pause, resume, promote, abort or"
                    " forget"
                )
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
            raise  # abort raises; never reached
        return pb.RolloutResponse(msg=json.dumps(answer))

    async def Shadow(
        self, request: pb.ShadowRequest, context: aio.ServicerContext
    ) -> pb.RolloutResponse:
        """``/models/{name}/shadow`` (docs/shadow.md): ``get``, ``set`` with REST's JSON body,
        ``clear``."""
        try:
            name = _required(request.model_name)
            action = request.action or "get"
            shadows = self.router.shadows
            if shadows is None:  # a service made without the server's (tests)
                raise BadRequest("shadows are not served here")
            if action == "get":
                answer = shadows.inspect(name)
            elif action == "set":
                answer = shadows.put(name, _body(request.body))
            elif action == "clear":
                answer = shadows.delete(name)
            else:
                raise BadRequest(f"action {action!r}: expected get, set or clear")
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
            raise  # abort raises; never reached
        return pb.RolloutResponse(msg=json.dumps(answer))

    async def Tenants(
        self, request: pb.TenantsRequest, context: aio.ServicerContext
    ) -> pb.RolloutResponse:
        """``/tenants`` (docs/tenants.md): ``list``, ``get``, ``add`` and ``set`` with REST's
        JSON body, ``remove``, ``add_key``, ``revoke_key``."""
        try:
            answer = self._tenants(request)
        except MserveError as exc:
            await abort(context, exc, self.registry.redact)
            raise  # abort raises; never reached
        return pb.RolloutResponse(msg=json.dumps(answer))

    def _tenants(self, request: pb.TenantsRequest) -> object:
        current = edit.required(tenants.current)
        action, name = request.action or "list", request.tenant_name
        if action == "list":
            return edit.listing(current)
        if action == "add":
            return edit.add_tenant(current, _body(request.body))
        if action not in ("get", "set", "remove", "add_key", "revoke_key"):
            raise BadRequest(
                f"action {action!r}: expected list, get, add, set, remove, add_key or revoke_key"
            )
        if not name:
            raise BadRequest("parameter 'tenant_name' is required")
        if action == "get":
            return edit.detail(current, name, ((mv.name, mv.queue) for mv in self.registry.all()))
        if action == "set":
            return edit.change_tenant(current, name, _body(request.body))
        if action == "remove":
            return edit.remove_tenant(current, name)
        if action == "add_key":
            return edit.add_key(current, name)
        return edit.revoke_key(current, name, request.key_id)


def _required(name: str) -> str:
    if not name:
        raise BadRequest("parameter 'model_name' is required")
    return name


def _body(text: str) -> object:
    try:
        return json.loads(text or "{}")
    except ValueError as exc:
        raise BadRequest(f"body: not JSON ({exc})") from None
