"""The management operations, whatever the transport: register, scale, unregister, set-default,
describe and list, with their parameters read and checked once, by the names the REST API gives
them. The REST router (server/rest/management.py) and the gRPC management service
(server/rpc/management.py) both call these, so both answer with the same semantics, errors and
messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from server.config import BATCH_WAITS
from server.download import parse_sha256, relative_path_refusal
from server.errors import (
    ArchiveNotAllowed,
    BadRequest,
    ModelApiDisabled,
    ModelNotFound,
    ModelVersionNotFound,
)
from server.models.describe import describe as described
from server.models.registry import RegisterRequest, Registry
from server.models.reload import reload_version
from server.models.version_order import sorted_versions

# The most workers one model may be asked for through the API (min_worker, max_worker,
# initial_workers); more is refused with 400 rather than started.
MAX_WORKERS = 1024
# TorchServe's paging (server/rest/management.py models_page)
MAX_PAGE = 100
# TorchServe's runtimes (its Manifest.RuntimeType); all Python ones run on the model's Python 3.
PYTHON_RUNTIMES = ("python", "python2", "python3")


@dataclass(frozen=True)
class Outcome:
    """What a management call did: ``done`` when finished (200), else still under way (202)."""

    message: str
    done: bool = True


def int_param(
    params: Mapping[str, str], name: str, minimum: int | None = 0, maximum: int | None = None
) -> int | None:
    raw = params.get(name)
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


def workers_param(params: Mapping[str, str], name: str) -> int | None:
    """A worker count: each one is a process, so a typo of a few zeros must not start them."""
    return int_param(params, name, 0, MAX_WORKERS)


def bool_param(params: Mapping[str, str], name: str, default: bool) -> bool:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise BadRequest(f"parameter '{name}' should be true or false, found {raw!r}")


def _names(value: str | None) -> tuple[str, ...] | None:
    """A comma-separated list parameter; None when not given."""
    if value is None:
        return None
    return tuple(n.strip() for n in value.split(",") if n.strip())


def _seconds(value: int | None) -> float | None:
    return float(value) if value is not None else None


def runtime_param(params: Mapping[str, str]) -> str | None:
    runtime = params.get("runtime") or None
    if runtime is None or runtime in PYTHON_RUNTIMES:
        return runtime
    if runtime == "LSP":
        raise BadRequest("runtime LSP (TorchServe's C++ backend) is not supported by mserve")
    raise BadRequest(
        f"Invalid RuntimeType value: {runtime} (expected one of {', '.join(PYTHON_RUNTIMES)})"
    )


def batch_wait_param(params: Mapping[str, str]) -> str | None:
    wait = params.get("batch_wait") or None
    if wait is None or wait in BATCH_WAITS:
        return wait
    raise BadRequest(
        f"parameter 'batch_wait' should be one of {', '.join(BATCH_WAITS)}, found {wait!r}"
    )


# TorchServe's words for a method its model API control refuses (the TorchServe layout's):
# its REST answer, and its gRPC management service's
TS_METHOD_NOT_ALLOWED = "Requested method is not allowed, please refer to API document."
TS_GRPC_MODEL_API_DISABLED = "Model API disabled"


def check_model_api(
    enabled: bool, action: str, torchserve: bool = False, grpc: bool = False
) -> None:
    """TorchServe's model API control: registering and unregistering are refused unless the
    operator enabled them (``enable_model_api``). ``action``: "registering models" or
    "unregistering models"; ``torchserve``: in TorchServe's words (its layout), which differ
    between REST and ``grpc``."""
    if not enabled:
        ts_message = TS_GRPC_MODEL_API_DISABLED if grpc else TS_METHOD_NOT_ALLOWED
        message = ts_message if torchserve else (
            f"{action} through the API is disabled (model API control): start mserve with"
            " --enable-model-api or set enable_model_api to true; models given at start"
            " (--models, load_models, the snapshot) load either way"
        )  # fmt: skip
        allowed = ("GET",) if action == "registering models" else ("GET", "PUT")
        raise ModelApiDisabled(message, allowed)


def models_page(
    registry: Registry, params: Mapping[str, str], public: bool = False
) -> dict[str, Any]:
    """``GET /models`` on either port, paged as TorchServe pages it: ``limit`` is 100 when
    missing, over 100 or negative, and 0 gives an empty page; a negative ``next_page_token``
    starts at the beginning. ``public`` (the inference port): a ``modelUrl`` that is a server
    path (a startup model named by its absolute path) shows no server folder. Each entry has
    TorchServe's two keys, and mserve's ``loadState`` outside TorchServe's layout."""
    limit = int_param(params, "limit", None)
    if limit is None or not 0 <= limit <= MAX_PAGE:
        limit = MAX_PAGE
    start = max(0, int_param(params, "next_page_token", None) or 0)
    names = sorted(registry.models)
    page = names[start : start + limit]
    entries: list[dict[str, str]] = []
    for n in page:
        mv = registry.get(n)  # the default version
        entry = {"modelName": n, "modelUrl": registry.redact(mv.url) if public else mv.url}
        if not registry.config.torchserve:
            entry["loadState"] = mv.load_state()
        entries.append(entry)
    out: dict[str, Any] = {"models": entries}
    if start + limit < len(names):
        out["nextPageToken"] = str(start + limit)
    return out


def describe(registry: Registry, name: str, version: str | None) -> Any:
    """Describe one version (None: the default one) or, for ``all``, every version; a model
    whose archive is still downloading is described by its download's progress."""
    downloading = registry.downloader.in_progress(name)
    if downloading and name not in registry.models:  # listed while its archive arrives
        return downloading
    models = registry.versions(name) if version == "all" else [registry.get(name, version)]
    out = [registry.redact.describe(described(m)) for m in models]
    swap = registry.swaps.shown(name)  # the running swap, or the last one (swap_model)
    if swap is not None:
        for entry in out:
            entry["swap"] = swap
    return out


async def register_model(registry: Registry, params: Mapping[str, str]) -> Outcome:
    url = params.get("url")
    # TorchServe's two answers, word for word: no ``url`` is a bad request, ``url=`` (given,
    # empty) fails where the archive is looked for. gRPC's "" is "not given" (proto3).
    if url is None:
        raise BadRequest("Parameter url is required.")
    if url == "":
        raise ModelNotFound("empty url")
    refusal = relative_path_refusal(url)
    if refusal is not None:  # TorchServe's words; its 404 in its layout, a refusal (403) in ours
        raise (ModelNotFound if registry.config.torchserve else ArchiveNotAllowed)(refusal)
    delay = int_param(params, "max_batch_delay")
    timeout = int_param(params, "response_timeout", 1)
    startup_timeout = int_param(params, "startup_timeout", 1)
    req = RegisterRequest(
        url=url,
        model_name=params.get("model_name") or None,
        handler=params.get("handler") or None,
        batch_size=int_param(params, "batch_size", 1),
        max_batch_delay_ms=delay,
        batch_wait=batch_wait_param(params),
        response_timeout_s=float(timeout) if timeout is not None else None,
        initial_workers=workers_param(params, "initial_workers"),
        startup_timeout_s=float(startup_timeout) if startup_timeout is not None else None,
        runtime=runtime_param(params),
        synchronous=bool_param(params, "synchronous", True),
        sha256=parse_sha256(params.get("sha256")),
        idle_unload_s=_seconds(int_param(params, "idle_unload_timeout")),
        inference_log=params.get("inference_log") or None,
        inference_log_sample=int_param(params, "inference_log_sample", 1),
        inference_log_batch=int_param(params, "inference_log_batch", 1),
        inference_log_url=params.get("inference_log_url") or None,
        inference_log_file=(
            bool_param(params, "inference_log_file", True)
            if params.get("inference_log_file")
            else None
        ),
        inference_log_redact=_names(params.get("inference_log_redact")),
        archive_signatures=params.get("archive_signatures") or None,
        weights_scan=params.get("weights_scan") or None,
        # TorchServe's layout: no initial_workers and none in the archive starts none
        workers_default=0 if registry.config.torchserve else None,
    )
    model = await registry.register(req)
    workers = model.settings.min_workers
    if workers == 0:  # TorchServe's words
        return Outcome(
            f'Model "{model.name}" Version: {model.version} registered with 0 initial workers.'
            " Use scale workers API to add workers for the model."
        )
    if req.synchronous:
        return Outcome(
            f'Model "{model.name}" Version: {model.version} registered with'
            f" {workers} initial workers"
        )
    return Outcome(
        f'Model "{model.name}" Version: {model.version} registered; starting {workers} workers',
        done=False,
    )


async def scale_model(
    registry: Registry, name: str, version: str | None, params: Mapping[str, str]
) -> Outcome:
    model = registry.get(name, version)
    min_worker = workers_param(params, "min_worker")
    max_worker = workers_param(params, "max_worker")
    if min_worker is None:
        min_worker = model.settings.min_workers
    if max_worker is not None and max_worker < min_worker:
        raise BadRequest(f"max_worker ({max_worker}) is less than min_worker ({min_worker})")
    synchronous = bool_param(params, "synchronous", False)
    _not_swapping(registry, model.name, model.version, "scaled")
    await model.scale(min_worker, max_worker, synchronous)
    registry.changed()
    if synchronous:
        return Outcome(f"Workers scaled to {min_worker} for model: {model.name}")
    return Outcome("Processing worker updates...", done=False)


async def unregister_model(registry: Registry, name: str, version: str | None) -> Outcome:
    _not_swapping(registry, name, version or registry.defaults.get(name, ""), "unregistered")
    try:
        model = await registry.unregister(name, version)
    except (ModelNotFound, ModelVersionNotFound):
        if not registry.forget_unrestored(name, version):
            raise
        return Outcome(f'Model "{name}" removed from the snapshot (it had failed to restore)')
    if registry.config.torchserve:  # TorchServe's words
        return Outcome(f'Model "{model.name}" unregistered')
    return Outcome(f'Model "{model.name}" version {model.version} unregistered')


def set_default(registry: Registry, name: str, version: str) -> Outcome:
    registry.set_default(name, version)
    return Outcome(f'Default version successfully updated for model "{name}" to "{version}"')


async def reload_model(registry: Registry, name: str, version: str | None) -> dict[str, Any]:
    """Hot-reload the handler's code of one version (None: the default) on its workers
    (server/models/reload.py): the answer's ``status`` sentence, the workers that switched, the
    code they run and how long it took; an error when it failed (the old code serves on)."""
    outcome = await reload_version(registry.get(name, version))
    return {
        "status": outcome.message,
        "workers": outcome.workers,
        "code": outcome.code,
        "seconds": outcome.seconds,
    }


def _not_swapping(registry: Registry, name: str, version: str, what: str) -> None:
    """A version a swap moves workers from or to is scaled and unregistered by it alone."""
    swap = registry.swaps.running(name)
    if swap is not None and version in (swap.source.version, swap.target.version):
        raise BadRequest(
            f"model {name} version {version} cannot be {what} while a swap from"
            f" {swap.source.version} to {swap.target.version} runs ({swap.step}); wait for it"
            f" to end (GET /models/{name} shows its progress)"
        )


async def swap_model(
    registry: Registry, name: str, version: str, params: Mapping[str, str]
) -> Outcome:
    """``PUT /models/{name}/{version}/swap?to=B``: replace ``version`` by B in place, one worker
    at a time within the memory budget (server/models/swap.py). ``workers``: B's workers at the
    end (A's now, at least 1); ``unregister``: unregister A at the end; ``overlap``: B's worker
    starts before A's drains (the budget passed by one worker meanwhile); ``synchronous``: answer
    when it has ended (a rollback is an error naming why), else at once (202)."""
    versions = sorted_versions(mv.version for mv in registry.versions(name))
    if version not in versions:
        raise BadRequest(
            f"version {version!r} (the path's) is not registered for model {name} (registered:"
            f" {', '.join(versions)})"
        )
    to = params.get("to")
    if not to:
        raise BadRequest(f"parameter 'to' is required: the version of {name} to swap {version}"
                         " for")  # fmt: skip
    if to not in versions:
        raise BadRequest(
            f"parameter 'to': version {to!r} is not registered for model {name} (registered:"
            f" {', '.join(versions)}); register it first (with initial_workers=0)"
        )
    if to == version:
        raise BadRequest(
            f"parameter 'to': {to!r} is the version being swapped out; name another version"
        )
    source, target = registry.get(name, version), registry.get(name, to)
    running = registry.swaps.running(name)
    if running is not None:
        raise BadRequest(
            f"model {name}: a swap from {running.source.version} to {running.target.version} is"
            f" already running ({running.step}); wait for it to end"
        )
    for mv in (source, target):
        if mv.removing:
            raise BadRequest(f"model {mv.label} is being unregistered: it cannot be swapped")
    workers = workers_param(params, "workers")
    if workers == 0:
        raise BadRequest("parameter 'workers' should be >= 1, found 0")
    workers = workers or max(1, len(source.slots))
    unregister = bool_param(params, "unregister", False)
    overlap = bool_param(params, "overlap", False)
    synchronous = bool_param(params, "synchronous", False)
    swap = registry.start_swap(source, target, workers, unregister, overlap)
    if not synchronous:
        return Outcome(
            f"Swapping model {name} from {version} to {to} ({workers} worker(s)); GET"
            f" /models/{name} shows its progress",
            done=False,
        )
    assert swap.task is not None
    await asyncio.shield(swap.task)  # a client that leaves does not stop the swap
    if swap.error is not None:
        raise type(swap.error)(
            f"swap of model {name} from {version} to {to} {swap.state}: {swap.reason}"
        )
    return Outcome(
        f"Model {name} swapped from {version} to {to}: {len(target.slots)} worker(s) of {to}"
        f" serve, and {to} is the default version"
    )
