"""One grpc.aio server per gRPC address, on the server's own event loop (uvloop), serving the
services it is given, with token authorization as an interceptor and TLS when asked.

A listener is built from a list of services (each a function that adds its servicer to a
``grpc.aio.Server``), so another service (the Open Inference Protocol's
``inference.GRPCInferenceService``) joins the inference port by being added to that list.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from server.auth import Keys, Unauthorized, bearer, check_tenant
from server.errors import MserveError
from server.rpc import status

log = logging.getLogger(__name__)

AddService = Callable[[aio.Server], None]
# TorchServe's GRPCInterceptor refuses a missing or wrong key with PERMISSION_DENIED and this
TORCHSERVE_REFUSAL = (
    "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
)


class TokenGuard(aio.ServerInterceptor):
    """Token authorization for one gRPC port, as for REST (server/auth.py): the ``authorization:
    Bearer <key>`` metadata must carry the live key of ``kind``; ``exempt`` methods (probes,
    full names such as ``/org.pytorch.serve.grpc.inference.InferenceAPIsService/Ping``) need
    none. A refusal is UNAUTHENTICATED with REST's 401 message, server paths redacted as in
    every answer (``redact``: server/redaction.py); in TorchServe's layout (``torchserve``) it
    is TorchServe's PERMISSION_DENIED "Token Authorization failed. ...", REST's message after
    it (its GRPCInterceptor's words, which its clients and tests match)."""

    def __init__(
        self, keys: Keys, kind: str, api: str, exempt: frozenset[str],
        redact: Callable[[str], str], torchserve: bool = False,
    ) -> None:  # fmt: skip
        self.keys = keys
        self.kind = kind
        self.realm = f"mserve {api} API"
        self.exempt = exempt
        self.redact = redact
        self.torchserve = torchserve

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in self.exempt:
            return handler
        sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        try:
            check_tenant(
                self.keys, self.kind, bearer(sent if isinstance(sent, str) else None), self.realm
            )
        except Unauthorized as exc:
            if self.torchserve:
                text = f"{TORCHSERVE_REFUSAL} ({self.redact(exc.message)})"
                return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, text)
            return _refusal(handler, status.code_of(exc), self.redact(exc.message))
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, text: str) -> Any:
    """A handler of the same shape as ``handler`` that ends the call with ``code``."""

    async def refuse(_request: Any, context: aio.ServicerContext) -> None:
        await context.abort(code, text)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def abort(
    context: aio.ServicerContext, error: MserveError, redact: Callable[[str], str]
) -> None:
    """End the call with the error's code and its REST message, server paths out as in REST
    answers (server/redaction.py) (raises). A 429's ``Retry-After`` (a queue full, a tenant's
    quota) goes in the trailing metadata as ``retry-after``, beside what the call set there."""
    retry = error.headers().get("Retry-After")
    if retry is None:
        await context.abort(status.code_of(error), status.message(redact(error.message)))
    trailing = (*(context.trailing_metadata() or ()), ("retry-after", retry))
    await context.abort(status.code_of(error), status.message(redact(error.message)), trailing)


def credentials(certificate_file: str, private_key_file: str) -> grpc.ServerCredentials:
    """TLS from the PEM files the HTTPS listeners use; server/tls.py has checked them (a bad
    file stops the start there, naming it)."""
    cert = Path(certificate_file).expanduser().read_bytes()
    key = Path(private_key_file).expanduser().read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


class GrpcListener:
    """A grpc.aio server for one API: built from its services, bound, started, stopped."""

    def __init__(
        self,
        api: str,
        services: Sequence[AddService],
        guard: TokenGuard | None,
        max_receive_bytes: int,
        max_send_bytes: int,
    ) -> None:
        self.api = api
        options = [
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", max_send_bytes),
            # without this, a second server (or another program) could bind the same port
            # and take half the connections without a word
            ("grpc.so_reuseport", 0),
        ]
        self.server = aio.server(interceptors=[guard] if guard else None, options=options)
        for add in services:
            add(self.server)

    def bind(self, host: str, port: int, tls: grpc.ServerCredentials | None) -> int:
        """Listen on ``host:port`` (0: any free port); the port bound."""
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                bound = self.server.add_insecure_port(target)
            else:
                bound = self.server.add_secure_port(target, tls)
        except RuntimeError as exc:  # grpcio raises where older versions returned 0
            raise _cannot_listen(self.api, target) from exc
        if not bound:
            raise _cannot_listen(self.api, target)
        return bound

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once; calls under way get ``grace_s`` to finish, then are
        cancelled."""
        await self.server.stop(grace_s)


def _cannot_listen(api: str, target: str) -> MserveError:
    """grpcio says only that binding failed (its core logs why, e.g. the address in use)."""
    return MserveError(
        f"cannot listen on {target} for the gRPC {api} API: the address is in use or not"
        f" available here (set grpc_{api}_address"
        " to another port, or 0 for any free port, or grpc: false to serve no gRPC)"
    )
