"""The snapshot: registered models, versions, defaults and worker counts, saved atomically on
every change and restored at the next start, so a restart (even after kill -9) loses nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from server.config.model_settings import INFERENCE_LOG_SETTINGS
from server.errors import MserveError
from server.models.registry import RegisterRequest, Registry
from server.rundir import write_json_atomic

log = logging.getLogger(__name__)

FORMAT = 1


def save(registry: Registry, path: Path, traffic: dict[str, Any] | None = None) -> None:
    """Write what is registered, plus the snapshot entries that failed to restore at start
    (kept until the operator registers that name and version again or deletes it: a model whose
    archive was briefly unreadable must not vanish from the next start)."""
    registered = {(mv.name, mv.version) for mv in registry.all()}
    registry.unrestored = [
        e for e in registry.unrestored if (e.get("name"), e.get("version")) not in registered
    ]
    models: list[dict[str, Any]] = []
    for mv in registry.all():
        if mv.workflow is not None:  # a workflow's node: workflows are not saved (TorchServe)
            continue
        s = mv.settings
        models.append(
            {
                "url": mv.url,
                "name": mv.name,
                "version": mv.version,
                "default": registry.defaults.get(mv.name) == mv.version,
                "handler": mv.handler if mv.handler_overridden else None,
                "min_workers": s.min_workers,
                "max_workers": s.max_workers,
                "batch_size": s.batch_size if s.sources.get("batch_size") == "api" else None,
                "max_batch_delay_ms": s.max_batch_delay_ms
                if s.sources.get("max_batch_delay_ms") == "api"
                else None,
                "batch_wait": s.batch_wait if s.sources.get("batch_wait") == "api" else None,
                "response_timeout_s": s.response_timeout_s
                if s.sources.get("response_timeout_s") == "api"
                else None,
                "startup_timeout_s": s.startup_timeout_s
                if s.sources.get("startup_timeout_s") == "api"
                else None,
                "idle_unload_s": s.idle_unload_s
                if s.sources.get("idle_unload_s") == "api"
                else None,
                # a stricter archive_signatures the registration asked for (server/signatures.py)
                "archive_signatures": s.archive_signatures
                if s.sources.get("archive_signatures") == "api"
                else None,
                "trusted": mv.trusted,
                "sha256": mv.archive_sha256,
                # inference logging set through the registration (inference_log, ...)
                **{
                    row.request: getattr(s, row.attr)
                    for row in INFERENCE_LOG_SETTINGS
                    if row.request and s.sources.get(row.attr) == "api"
                },
            }
        )
    models.extend(registry.unrestored)
    saved = {"format": FORMAT, "saved": time.time(), "models": models}
    swaps = registry.swaps.to_json()  # in-place swaps: a running one resumes at the next start
    if swaps:
        saved["swaps"] = swaps
    if traffic:  # traffic policies and canaries by model name (server/rollouts/router.py)
        saved["traffic"] = traffic
    write_json_atomic(path, saved)


def load_traffic(path: Path) -> dict[str, Any]:
    """The snapshot's traffic policies (server/rollouts/), put back once its models are."""
    try:
        traffic = json.loads(path.read_text()).get("traffic")
    except (OSError, ValueError, AttributeError):
        return {}  # load() said why
    return traffic if isinstance(traffic, dict) else {}


def load(path: Path) -> tuple[list[tuple[RegisterRequest, dict[str, Any]]], dict[str, str]]:
    """Registration requests (each with its snapshot entry, kept should it fail to restore) and
    default versions from the snapshot; nothing if there is none."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return [], {}
    except (OSError, ValueError) as exc:
        log.error("snapshot %s is unreadable (%s); starting without it", path, exc)
        return [], {}
    requests, defaults = [], {}
    for m in data.get("models", []):
        requests.append((
            RegisterRequest(
                url=m["url"],
                model_name=m["name"],
                handler=m.get("handler"),
                batch_size=m.get("batch_size"),
                max_batch_delay_ms=m.get("max_batch_delay_ms"),
                batch_wait=m.get("batch_wait"),
                response_timeout_s=m.get("response_timeout_s"),
                startup_timeout_s=m.get("startup_timeout_s"),
                initial_workers=m.get("min_workers"),
                max_workers=m.get("max_workers"),
                idle_unload_s=m.get("idle_unload_s"),
                archive_signatures=m.get("archive_signatures"),
                trusted=bool(m.get("trusted")),
                at_startup=True,
                sha256=m.get("sha256"),
                **{
                    row.request: tuple(m[row.request]) if row.unit == "list" else m[row.request]
                    for row in INFERENCE_LOG_SETTINGS
                    if row.request and m.get(row.request) is not None
                },
            ),
            m,
        ))  # fmt: skip
        if m.get("default"):
            defaults[m["name"]] = m["version"]
    return requests, defaults


async def restore(registry: Registry, path: Path, load_failures: dict[str, str]) -> None:
    """Register what the snapshot at ``path`` holds; a version that fails is logged, listed in
    ``load_failures`` and kept for the next snapshot (``registry.unrestored``)."""
    requests, defaults = load(path)
    if not requests:
        return
    log.info("restoring %d model version(s) from the snapshot", len(requests))

    async def one(request: RegisterRequest, entry: dict[str, Any]) -> None:
        try:
            await registry.register(request)
        except MserveError as exc:
            log.error(
                "snapshot model %s failed to restore: %s (kept in the snapshot for the next"
                " start; DELETE /models/%s removes it)",
                request.url, exc.message, request.model_name,
            )  # fmt: skip
            load_failures[request.model_name or request.url] = f"failed: {exc.message}"
            registry.unrestored.append(entry)

    await asyncio.gather(*(one(r, e) for r, e in requests))
    for name, version in defaults.items():
        if version in registry.models.get(name, {}):
            registry.defaults[name] = version
    _resume_swaps(registry, path)


def _resume_swaps(registry: Registry, path: Path) -> None:
    """The snapshot's swaps: an ended one is shown by describe again; one the stop interrupted
    resumes from the worker counts the snapshot kept (saved after each of its steps), its
    rollback aiming at A's workers from before it began."""
    try:
        entries = json.loads(path.read_text()).get("swaps") or []
    except (OSError, ValueError):
        return
    for entry in entries:
        name = entry.get("model")
        versions = registry.models.get(name, {})
        source, target = versions.get(entry.get("from")), versions.get(entry.get("to"))
        if entry.get("state") != "running":
            registry.swaps.restored[name] = entry
            continue
        if source is None or target is None:
            log.error(
                "the swap of %s from %s to %s was interrupted by the stop and cannot resume:"
                " a version failed to restore", name, entry.get("from"), entry.get("to"),
            )  # fmt: skip
            registry.swaps.restored[name] = {
                **entry, "state": "failed", "reason": "a version failed to restore"
            }  # fmt: skip
            continue
        log.info(
            "resuming the swap of %s from %s to %s interrupted by the stop (%d and %d"
            " worker(s) now)", name, source.version, target.version, len(source.slots),
            len(target.slots),
        )  # fmt: skip
        swap = registry.start_swap(
            source, target, int(entry.get("workers") or 1), bool(entry.get("unregister")),
            bool(entry.get("overlap")),
        )  # fmt: skip
        # the task runs from the next turn of the loop: the rollback's aim is set before
        swap.source_before = int(entry.get("fromWorkers") or swap.source_before)
        swap.target_before = int(entry.get("toWorkers") or 0)
