"""The management API (8081), with TorchServe's paths and parameters. The inference port (8080)
is server/inference_api.py, the metrics port (8082) server/metrics.py; all three run on
server/http.py.

Errors keep TorchServe's JSON shape ``{"code", "type", "message"}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from server.api_description import MAX_PAGE, MAX_WORKERS
from server.download import parse_sha256
from server.errors import BadRequest, ModelNotFound, ModelVersionNotFound
from server.http import Answer, Connection, Request, json_answer
from server.registry import RegisterRequest, Registry

log = logging.getLogger(__name__)


def _int_param(
    query: Mapping[str, str], name: str, minimum: int | None = 0, maximum: int | None = None
) -> int | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"parameter '{name}' should be an integer, found {raw!r}") from None
    if minimum is not None and value < minimum:
        raise BadRequest(f"parameter '{name}' should be >= {minimum}, found {value}")
    if maximum is not None and value > maximum:
        raise BadRequest(f"parameter '{name}' should be <= {maximum}, found {value}")
    return value


def _workers_param(query: Mapping[str, str], name: str) -> int | None:
    """A worker count: each one is a process, so a typo of a few zeros must not start them."""
    return _int_param(query, name, 0, MAX_WORKERS)


def _bool_param(query: Mapping[str, str], name: str, default: bool) -> bool:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise BadRequest(f"parameter '{name}' should be true or false, found {raw!r}")


def models_page(registry: Registry, query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /models`` on either port, paged as TorchServe pages it: ``limit`` is 100 when
    missing, over 100 or negative, and 0 gives an empty page; a negative ``next_page_token``
    starts at the beginning."""
    limit = _int_param(query, "limit", None)
    if limit is None or not 0 <= limit <= MAX_PAGE:
        limit = MAX_PAGE
    start = max(0, _int_param(query, "next_page_token", None) or 0)
    names = sorted(registry.models)
    page = names[start : start + limit]
    out: dict[str, Any] = {
        "models": [{"modelName": n, "modelUrl": registry.get(n).url} for n in page]
    }
    if start + limit < len(names):
        out["nextPageToken"] = str(start + limit)
    return out


# --- management ----------------------------------------------------------------------------


class ManagementAPI:
    """The router of the management port; calls that wait on workers are answered from tasks."""

    api_name = "management"

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def route(self, conn: Connection, req: Request) -> None:
        parts, registry = req.parts, self.registry
        if parts == ["models"]:
            if req.allow("GET", "POST") == "GET":
                conn.answer_json(req, 200, models_page(registry, req.query))
            else:
                conn.answer_later(req, _register(registry, req.query))
            return
        if parts == ["environments"]:
            if req.allow("GET", "DELETE") == "GET":
                conn.answer_later(req, self._environments())
            else:
                conn.answer_later(req, self._prune_environments())
            return
        if len(parts) == 4 and parts[0] == "models" and parts[3] == "set-default":
            req.allow("PUT")
            name, version = parts[1], parts[2]
            registry.set_default(name, version)
            message = f'Default version successfully updated for model "{name}" to "{version}"'
            conn.answer_json(req, 200, {"status": message})
            return
        if len(parts) not in (2, 3) or parts[0] != "models":
            raise req.not_found()
        name, version = parts[1], (parts[2] if len(parts) == 3 else None)
        method = req.allow("GET", "PUT", "DELETE")
        if method == "GET":
            downloading = registry.downloader.in_progress(name)
            if downloading and name not in registry.models:  # listed while its archive arrives
                conn.answer_json(req, 200, downloading)
                return
            models = registry.versions(name) if version == "all" else [registry.get(name, version)]
            conn.answer_json(req, 200, [m.describe() for m in models])
        elif method == "PUT":
            conn.answer_later(req, self._scale(name, version, req.query))
        else:
            conn.answer_later(req, self._unregister(name, version))

    async def _scale(self, name: str, version: str | None, query: Mapping[str, str]) -> Answer:
        model = self.registry.get(name, version)
        min_worker = _workers_param(query, "min_worker")
        max_worker = _workers_param(query, "max_worker")
        if min_worker is None:
            min_worker = model.settings.min_workers
        if max_worker is not None and max_worker < min_worker:
            raise BadRequest(f"max_worker ({max_worker}) is less than min_worker ({min_worker})")
        synchronous = _bool_param(query, "synchronous", False)
        await model.scale(min_worker, max_worker, synchronous)
        self.registry.changed()
        if synchronous:
            return json_answer(
                200, {"status": f"Workers scaled to {min_worker} for model: {model.name}"}
            )
        return json_answer(202, {"status": "Processing worker updates..."})

    async def _unregister(self, name: str, version: str | None) -> Answer:
        try:
            model = await self.registry.unregister(name, version)
        except (ModelNotFound, ModelVersionNotFound):
            if not self.registry.forget_unrestored(name, version):
                raise
            return json_answer(
                200,
                {"status": f'Model "{name}" removed from the snapshot (it had failed to restore)'},
            )
        return json_answer(
            200, {"status": f'Model "{model.name}" version {model.version} unregistered'}
        )

    async def _environments(self) -> Answer:
        """The per-model environment cache: where, how big, which entries registered models
        use."""
        registry = self.registry
        entries = await asyncio.to_thread(registry.envs.entries)
        in_use = registry.envs_in_use()
        return json_answer(200, {
            "root": str(registry.envs.root),
            "totalBytes": sum(int(e["size_bytes"]) for e in entries),  # type: ignore[call-overload]
            "environments": [{**e, "inUse": e["key"] in in_use} for e in entries],
        })  # fmt: skip

    async def _prune_environments(self) -> Answer:
        """Remove every cached environment that no registered model uses."""
        registry = self.registry
        removed = await asyncio.to_thread(registry.envs.prune, registry.envs_in_use())
        return json_answer(200, {"removed": removed})


# TorchServe's runtimes (its Manifest.RuntimeType); all Python ones run on the model's Python 3.
PYTHON_RUNTIMES = ("python", "python2", "python3")


def _runtime_param(query: Mapping[str, str]) -> str | None:
    runtime = query.get("runtime") or None
    if runtime is None or runtime in PYTHON_RUNTIMES:
        return runtime
    if runtime == "LSP":
        raise BadRequest("runtime LSP (TorchServe's C++ backend) is not supported by mserve")
    raise BadRequest(
        f"Invalid RuntimeType value: {runtime} (expected one of {', '.join(PYTHON_RUNTIMES)})"
    )


async def _register(registry: Registry, query: Mapping[str, str]) -> Answer:
    url = query.get("url")
    if not url:
        raise BadRequest(
            "parameter 'url' is required: the archive's name in the model store, or its URL"
        )
    delay = _int_param(query, "max_batch_delay")
    timeout = _int_param(query, "response_timeout", 1)
    startup_timeout = _int_param(query, "startup_timeout", 1)
    req = RegisterRequest(
        url=url,
        model_name=query.get("model_name") or None,
        handler=query.get("handler") or None,
        batch_size=_int_param(query, "batch_size", 1),
        max_batch_delay_ms=delay,
        response_timeout_s=float(timeout) if timeout is not None else None,
        initial_workers=_workers_param(query, "initial_workers"),
        startup_timeout_s=float(startup_timeout) if startup_timeout is not None else None,
        runtime=_runtime_param(query),
        synchronous=_bool_param(query, "synchronous", True),
        sha256=parse_sha256(query.get("sha256")),
    )
    model = await registry.register(req)
    workers = model.settings.min_workers
    if req.synchronous:
        message = (
            f'Model "{model.name}" Version: {model.version} registered with'
            f" {workers} initial workers"
        )
        return json_answer(200, {"status": message})
    return json_answer(202, {
        "status": f'Model "{model.name}" Version: {model.version} registered; starting {workers}'
                  " workers"
    })  # fmt: skip
