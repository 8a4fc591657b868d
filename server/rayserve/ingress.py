"""The ingress deployment: mserve's inference paths behind Ray's HTTP proxy.

``/ping``, ``/predictions/{m}[/{v}]``, ``/explanations/{m}[/{v}]``, KServe v1's
``/v1/models/{m}[:predict|:explain]`` and the Open Inference Protocol's ``/v2/...`` answer with
the bodies, statuses and error shapes a single-node mserve gives, so a client cannot tell which
engine serves it. Tensors are read by the replica's worker runtime, as under mserve; the
ingress only routes and never parses a body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions
from ray.serve.context import _get_serve_request_context
from starlette.requests import Request
from starlette.responses import Response

from mserve_worker.oip.signature import SignatureError, parse_signature
from mserve_worker.protocol import TOO_LARGE_HEADER, RequestItem, ResponseItem
from server.errors import (
    HandlerError,
    InternalError,
    MethodNotAllowed,
    ModelNotFound,
    ModelVersionNotFound,
    MserveError,
    PathNotFound,
    ResponseTooLarge,
    TooManyRequests,
    WorkerDied,
    WorkerTimeout,
)
from server.http import error_body
from server.inference import request_id, server_metadata
from server.rayserve.replica import BATCH_FAILED
from server.rest.inference import SERVER_HEADERS
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
    match,
)

log = logging.getLogger(__name__)

JSON = "application/json"
# how long a readiness probe waits for a replica of each model
READY_WAIT_S = 5.0
# Ray's ways of saying the replica running a request went away (kill -9, node lost)
_REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)


class Ingress:
    """``routes``: model name -> version -> handle of its deployment (Serve replaces the bound
    deployments with handles); ``models``: name -> ``{"default": version, "versions": {version:
    entry}}}`` with each version's plan entry (``ModelPlan.entry``)."""

    def __init__(self, routes: dict[str, dict[str, Any]], models: dict[str, Any]) -> None:
        self.routes = routes
        self.models = models

    def mapping(self) -> dict[str, Any]:
        """The model table as deployed (``mserve ray status`` and ``scale`` read it)."""
        return self.models

    async def __call__(self, request: Request) -> Response:
        parts = [p for p in request.url.path.split("/") if p]
        try:
            return await self._route(request, parts)
        except MserveError as exc:
            body = error_body(parts, exc, exc.message)
            headers = exc.headers()
            return Response(json.dumps(body), exc.status, headers, media_type=JSON)

    async def _route(self, request: Request, parts: list[str]) -> Response:
        route = match(parts, request.method)
        if route is None or route.kind == OPENAI:  # the OpenAI API is mserve's own server's
            raise _not_found(request.method, request)
        _allow(request, *route.methods)
        kind = route.kind
        if kind == INFER:
            headers = [[k, v] for k, v in request.headers.items()]
            if route.url_path is not None:  # replaces a client's own
                headers = [h for h in headers if h[0] != "url_path"]
                headers.append(["url_path", route.url_path])
            if route.explain:
                headers.append(["explain", "True"])
            assert route.model is not None
            return await self._infer(
                request, route.model, route.version, route.op, route.api, headers
            )
        if kind == PING:
            healthy = await self._all_ready()
            return _json(200 if healthy else 500, {"status": "Healthy" if healthy else "Unhealthy"})
        if kind == MODELS:  # TorchServe's list on the inference port (no server paths)
            return _json(200, {"models": [
                {"modelName": name, "modelUrl": _archive_name(model), "loadState": "loaded"}
                for name, model in sorted(self.models.items())
            ]})  # fmt: skip
        if kind == V1_MODELS:
            return _json(200, {"models": sorted(self.models)})
        if kind == V1_READY:
            assert route.model is not None
            ready = await self._ready(route.model, None)
            return _json(200 if ready else 503, {"name": route.model, "ready": ready})
        if kind == V2_SERVER:
            return _json(200, server_metadata())
        if kind == V2_LIVE:
            return _json(200, {"live": True})
        if kind == V2_READY:
            ready = await self._all_ready()
            return _json(200 if ready else 503, {"ready": ready})
        assert route.model is not None
        if kind == V2_MODEL:
            return _json(200, self._metadata(route.model, route.version))
        resolved = self._version(route.model, route.version)  # V2_MODEL_READY
        ready = await self._ready(route.model, resolved)
        return _json(200 if ready else 503,
                     {"name": route.model, "version": resolved, "ready": ready})  # fmt: skip

    # --- models -----------------------------------------------------------------------------

    def _version(self, name: str, version: str | None) -> str:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"Model not found: {name}")
        key = version or model["default"]
        if key not in model["versions"]:
            raise ModelVersionNotFound(f"Model version {key} does not exist for model {name}")
        return key

    def _metadata(self, name: str, version: str | None) -> dict[str, Any]:
        """The model's OIP metadata: its versions and the signature its model config declares."""
        resolved = self._version(name, version)
        config = self.models[name]["versions"][resolved]["replica"]["model_yaml_config"]
        try:
            signature = parse_signature(config).metadata()
        except SignatureError as exc:
            raise InternalError(f"model {name}:{resolved}: {exc}") from None
        versions = list(self.models[name]["versions"])
        return {"name": name, "versions": versions, "platform": "mserve", **signature}

    async def _ready(self, name: str, version: str | None) -> bool:
        """Whether a replica of the model answers within READY_WAIT_S."""
        resolved = self._version(name, version)
        try:
            response = self.routes[name][resolved].ready.remote()
            return bool(await asyncio.wait_for(response, READY_WAIT_S))
        except Exception:  # any failure of the probe means "not ready"
            return False

    async def _all_ready(self) -> bool:
        checks = [self._ready(name, v) for name, m in self.models.items() for v in m["versions"]]
        return all(await asyncio.gather(*checks))

    async def _infer(
        self, request: Request, name: str, version: str | None, op: str, api: str,
        headers: list[list[str]],
    ) -> Response:  # fmt: skip
        resolved = self._version(name, version)
        label = f"{name}:{resolved}"
        entry = self.models[name]["versions"][resolved]
        timeout_s = entry["replica"]["response_timeout_s"]
        item = RequestItem(
            # Serve's proxy answers with its own X-Request-Id: the handler sees that one too
            request_id=_get_serve_request_context().request_id or request_id(),
            content_type=request.headers.get("content-type", ""),
            headers=headers,
            body=await request.body(),
            params=dict(request.query_params),
            op=op,
            api=api,
        )
        response = self.routes[name][resolved].infer.remote(item)
        try:
            result = await asyncio.wait_for(response, timeout_s)
        except TimeoutError:
            response.cancel()
            raise WorkerTimeout(
                f"model {label} did not answer within responseTimeout {timeout_s:g} s"
            ) from None
        except serve_exceptions.BackPressureError:  # max_queued_requests, from jobQueueSize
            raise TooManyRequests(
                f"model {label} queue is full (job_queue_size={entry['settings']['jobQueueSize']})"
            ) from None
        except _REPLICA_GONE as exc:
            raise WorkerDied(
                f"the replica of {label} running this request died ({type(exc).__name__});"
                " Serve starts another: retry the request"
            ) from None
        if isinstance(result, tuple) and result[0] == BATCH_FAILED:
            raise HandlerError(result[1])
        return _answer(label, result, entry["replica"]["max_response_bytes"])


def _answer(label: str, result: ResponseItem, max_bytes: int) -> Response:
    size = len(result.body)
    if result.status == 413 and result.headers and result.headers[0][0] == TOO_LARGE_HEADER:
        size = int(result.headers[0][1])
    if size > max_bytes:
        raise ResponseTooLarge(
            f"the response of {label} is {size} bytes, more than max_response_size_bytes="
            f"{max_bytes}"
        )
    response = Response(result.body, result.status)
    for k, v in result.headers:
        if k.lower() not in SERVER_HEADERS:
            response.headers.append(k, v)
    response.headers["content-type"] = result.content_type or "application/octet-stream"
    return response


def _archive_name(model: dict[str, Any]) -> str:
    return str(model["versions"][model["default"]]["archive"]).rstrip("/").rsplit("/", 1)[-1]


def _json(status: int, body: Any) -> Response:
    return Response(json.dumps(body), status, media_type=JSON)


def _allow(request: Request, *methods: str) -> None:
    if request.method not in methods and not (request.method == "HEAD" and "GET" in methods):
        raise MethodNotAllowed(
            f"method {request.method} is not allowed here; use {', '.join(methods)}", methods
        )


def _not_found(method: str, request: Request) -> PathNotFound:
    return PathNotFound(f"no such path: {method} {request.url.path}")
