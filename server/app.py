"""The management (8081) and metrics (8082) APIs on aiohttp, with TorchServe's paths, and the
frontend's Prometheus metrics. The inference port (8080) is server/inference_api.py.

Errors keep TorchServe's JSON shape ``{"code", "type", "message"}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from server.errors import (
    BadRequest,
    InternalError,
    ModelNotFound,
    MserveError,
    RequestTooLarge,
)
from server.registry import RegisterRequest, Registry

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REGISTRY_KEY = web.AppKey("registry", Registry)
REQUEST_LIMIT_KEY = web.AppKey("max_request_bytes", int)


def _error_response(
    status: int, type_: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        {"code": status, "type": type_, "message": message}, status=status, headers=headers
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except MserveError as exc:
        return _error_response(exc.status, exc.type, exc.message, exc.headers())
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[REQUEST_LIMIT_KEY]
        error = RequestTooLarge(f"request body is larger than max_request_size_bytes={limit}")
        return _error_response(error.status, error.type, error.message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(exc.status, type(exc).__name__.removeprefix("HTTP"), exc.reason)
    except Exception:  # the API edge: log it, answer 500, keep serving
        log.exception("unexpected error on %s %s", request.method, request.path)
        error = InternalError("internal server error; see the server log")
        return _error_response(error.status, error.type, error.message)


class Metrics:
    """Prometheus metrics of the frontend; gauges are read from the registry at scrape time."""

    def __init__(self, registry: Registry) -> None:
        self.prom = CollectorRegistry()
        self.requests = Counter(
            "mserve_requests", "Inference requests answered", ["model", "version", "code"],
            registry=self.prom,
        )  # fmt: skip
        self.latency = Histogram(
            "mserve_request_latency_seconds", "Inference latency, frontend to frontend",
            ["model"], registry=self.prom,
        )  # fmt: skip
        self._registry = registry
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[str, Any] = {}
        self.prom.register(self)  # type: ignore[arg-type]

    def answered(self, model: str, version: str, code: int, seconds: float | None) -> None:
        """Count one answer; label children are cached (``labels()`` costs more than ``inc()``)."""
        key = (model, version, code)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.requests.labels(model, version, str(code))
        counter.inc()
        if seconds is not None:
            timer = self._timers.get(model)
            if timer is None:
                timer = self._timers[model] = self.latency.labels(model)
            timer.observe(seconds)

    def collect(self) -> Any:
        queue = GaugeMetricFamily("mserve_queue_depth", "Jobs waiting", labels=["model", "version"])
        workers = GaugeMetricFamily(
            "mserve_workers_ready", "Ready workers", labels=["model", "version"]
        )
        for mv in self._registry.all():
            queue.add_metric([mv.name, mv.version], len(mv.queue))
            workers.add_metric([mv.name, mv.version], mv.ready_workers())
        yield queue
        yield workers


def _int_param(query: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"parameter '{name}' should be an integer, found {raw!r}") from None
    if value < minimum:
        raise BadRequest(f"parameter '{name}' should be >= {minimum}, found {value}")
    return value


def _bool_param(query: Mapping[str, str], name: str, default: bool) -> bool:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise BadRequest(f"parameter '{name}' should be true or false, found {raw!r}")


# --- management ----------------------------------------------------------------------------


def models_page(registry: Registry, query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /models`` on either port: TorchServe's paging (``limit``, ``next_page_token``)."""
    limit = _int_param(query, "limit", 1) or 100
    start = _int_param(query, "next_page_token") or 0
    names = sorted(registry.models)
    page = names[start : start + limit]
    out: dict[str, Any] = {
        "models": [{"modelName": n, "modelUrl": registry.get(n).url} for n in page]
    }
    if start + limit < len(names):
        out["nextPageToken"] = str(start + limit)
    return out


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(models_page(request.app[REGISTRY_KEY], request.query))


async def register(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    url = request.query.get("url")
    if not url:
        raise BadRequest("parameter 'url' is required: the archive's name in the model store")
    delay = _int_param(request.query, "max_batch_delay")
    timeout = _int_param(request.query, "response_timeout", 1)
    req = RegisterRequest(
        url=url,
        model_name=request.query.get("model_name") or None,
        handler=request.query.get("handler") or None,
        batch_size=_int_param(request.query, "batch_size", 1),
        max_batch_delay_ms=delay,
        response_timeout_s=float(timeout) if timeout is not None else None,
        initial_workers=_int_param(request.query, "initial_workers"),
        synchronous=_bool_param(request.query, "synchronous", True),
    )
    model = await registry.register(req)
    workers = model.settings.min_workers
    if req.synchronous:
        message = (
            f'Model "{model.name}" Version: {model.version} registered with'
            f" {workers} initial workers"
        )
        return web.json_response({"status": message})
    return web.json_response(
        {"status": f'Model "{model.name}" Version: {model.version} registered; starting {workers}'
         " workers"},
        status=202,
    )  # fmt: skip


async def describe(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    name = request.match_info["model"]
    version = request.match_info.get("version")
    models = registry.versions(name) if version == "all" else [registry.get(name, version)]
    return web.json_response([m.describe() for m in models])


async def scale(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    model = registry.get(request.match_info["model"], request.match_info.get("version"))
    min_worker = _int_param(request.query, "min_worker")
    max_worker = _int_param(request.query, "max_worker")
    if min_worker is None:
        min_worker = model.settings.min_workers
    if max_worker is not None and max_worker < min_worker:
        raise BadRequest(f"max_worker ({max_worker}) is less than min_worker ({min_worker})")
    synchronous = _bool_param(request.query, "synchronous", False)
    await model.scale(min_worker, max_worker, synchronous)
    registry.changed()
    if synchronous:
        return web.json_response(
            {"status": f"Workers scaled to {min_worker} for model: {model.name}"}
        )
    return web.json_response({"status": "Processing worker updates..."}, status=202)


async def unregister(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    model = await registry.unregister(
        request.match_info["model"], request.match_info.get("version")
    )
    return web.json_response(
        {"status": f'Model "{model.name}" version {model.version} unregistered'}
    )


async def set_default(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    name, version = request.match_info["model"], request.match_info["version"]
    registry.set_default(name, version)
    return web.json_response(
        {"status": f'Default version successfully updated for model "{name}" to "{version}"'}
    )


async def environments(request: web.Request) -> web.Response:
    """The per-model environment cache: where, how big, which entries registered models use."""
    registry = request.app[REGISTRY_KEY]
    entries = await asyncio.to_thread(registry.envs.entries)
    in_use = registry.envs_in_use()
    return web.json_response(
        {
            "root": str(registry.envs.root),
            "totalBytes": sum(int(e["size_bytes"]) for e in entries),  # type: ignore[call-overload]
            "environments": [{**e, "inUse": e["key"] in in_use} for e in entries],
        }
    )


async def prune_environments(request: web.Request) -> web.Response:
    """Remove every cached environment that no registered model uses."""
    registry = request.app[REGISTRY_KEY]
    removed = await asyncio.to_thread(registry.envs.prune, registry.envs_in_use())
    return web.json_response({"removed": removed})


async def not_found(request: web.Request) -> web.Response:
    raise ModelNotFound(f"no such path: {request.method} {request.path}")


async def metrics_endpoint(request: web.Request) -> web.Response:
    metrics: Metrics = request.app["metrics"]
    return web.Response(
        body=generate_latest(metrics.prom),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


def _app(registry: Registry, metrics: Metrics, max_request_bytes: int) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=max_request_bytes)
    app[REQUEST_LIMIT_KEY] = max_request_bytes
    app[REGISTRY_KEY] = registry
    app["metrics"] = metrics
    return app


def build_apps(registry: Registry, metrics: Metrics) -> tuple[web.Application, web.Application]:
    """The management and metrics apps (the inference port is server/inference_api.py)."""
    management = _app(registry, metrics, 1 << 20)
    management.router.add_post("/models", register)
    management.router.add_get("/models", list_models)
    management.router.add_get("/models/{model}", describe)
    management.router.add_get("/models/{model}/{version}", describe)
    management.router.add_put("/models/{model}", scale)
    management.router.add_put("/models/{model}/{version}", scale)
    management.router.add_delete("/models/{model}", unregister)
    management.router.add_delete("/models/{model}/{version}", unregister)
    management.router.add_put("/models/{model}/{version}/set-default", set_default)
    management.router.add_get("/environments", environments)
    management.router.add_delete("/environments", prune_environments)

    metrics_app = _app(registry, metrics, 1 << 16)
    metrics_app.router.add_get("/metrics", metrics_endpoint)
    return management, metrics_app
