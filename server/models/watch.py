"""``mserve --watch`` (development): reload a model's handler code when its files change, as
``PUT /models/{name}/{version}/reload`` does (server/models/reload.py, docs/hot-reload.md).

What is watched, per registered version: for a model served in place from a folder (a
no-archive registration), every ``.py`` file in that folder and the folders below it (not
hidden ones, ``__pycache__`` or a ``site-packages``); for an archive, its handler's module in
the folder the archive was unpacked to (the archive itself is not: a new archive is a new
registration). Changes are gathered by watchfiles (inotify, not polling) and debounced:
a burst of writes within ``DEBOUNCE_MS`` (an editor's save, a ``git checkout``) is one reload
per version. Each reload and its outcome are logged; a failed one leaves the old code serving,
as the API's does. The set of folders follows the registry: registering or unregistering a
model restarts the watch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from server.errors import MserveError
from server.models.reload import reload_version

if TYPE_CHECKING:
    from server.models.registry import Registry
    from server.models.version import ModelVersion

log = logging.getLogger(__name__)

DEBOUNCE_MS = 300  # writes closer together than this are one change
STEP_MS = 50  # how often watchfiles looks for the end of a burst
_SKIPPED_PARTS = ("__pycache__", "site-packages", "dist-packages")


@dataclass(frozen=True)
class Watched:
    """One version's files: ``files`` None means every .py below ``folder``."""

    model: ModelVersion
    folder: Path
    files: frozenset[Path] | None

    def owns(self, path: Path) -> bool:
        if self.files is not None:
            return path in self.files
        try:
            parts = path.relative_to(self.folder).parts
        except ValueError:
            return False
        return path.suffix == ".py" and not any(
            p.startswith(".") or p in _SKIPPED_PARTS for p in parts[:-1]
        )


def watched(registry: Registry) -> list[Watched]:
    """What to watch for every registered version (none for a built-in handler's archive)."""
    unpacked = (registry.config.run_path / "unpacked").resolve()
    out = []
    for model in registry.all():
        folder = model.model_dir.resolve()
        if not folder.is_relative_to(unpacked):  # served in place from its folder
            out.append(Watched(model, folder, None))
            continue
        handler = _handler_file(folder, model.handler)
        if handler is not None:
            out.append(Watched(model, folder, frozenset({handler})))
    return out


def _handler_file(folder: Path, handler: str) -> Path | None:
    """The file of the handler's module in the model folder (None: a built-in handler)."""
    module = handler.partition(":")[0].replace("\\", "/").rsplit("/", 1)[-1]
    module = module.removesuffix(".py").replace(".", "/")
    for candidate in (folder / f"{module}.py", folder / module / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


async def run(registry: Registry, stop: asyncio.Event) -> None:
    """Watch until ``stop`` is set (the server's stop). Owned by the server's lifecycle."""
    from watchfiles import awatch  # a development tool: imported only with --watch

    changed = asyncio.Event()
    registry.on_change("watched model folders", changed.set)
    while not stop.is_set():
        changed.clear()
        targets = watched(registry)
        folders = sorted({t.folder for t in targets})
        halt = asyncio.Event()
        relay = asyncio.create_task(_first_of(stop, changed, halt))
        try:
            if not folders:
                await halt.wait()
                continue
            log.info("watching %d model folder(s) for code changes: %s", len(folders),
                     ", ".join(map(str, folders)))  # fmt: skip
            async for changes in awatch(
                *folders, stop_event=halt, debounce=DEBOUNCE_MS, step=STEP_MS, recursive=True,
                watch_filter=lambda _change, path: path.endswith(".py"),
            ):  # fmt: skip
                await reload_changed(targets, (Path(p) for _, p in changes))
        finally:
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)


async def _first_of(stop: asyncio.Event, changed: asyncio.Event, halt: asyncio.Event) -> None:
    """Set ``halt`` when the server stops or the registered models change."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(changed.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        halt.set()
    finally:
        for wait in waits:
            wait.cancel()


async def reload_changed(targets: list[Watched], paths: Iterable[Path]) -> None:
    """Reload each version that owns one of the changed ``paths``, one after another."""
    paths = [p.resolve() if p.exists() else p for p in paths]
    for target in targets:
        mine = sorted(str(p) for p in paths if target.owns(p))
        if not mine:
            continue
        log.info("model %s: %s changed; reloading its handler", target.model.label,
                 ", ".join(mine))  # fmt: skip
        try:
            await reload_version(target.model, "watch")
        except MserveError:  # logged by reload_version, with why; the old code serves on
            continue
