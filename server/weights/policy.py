"""``weights_scan`` at registration: off, warn or require, checked before any worker starts.

The server config sets it for every model (``weights_scan``, ``MSERVE_WEIGHTS_SCAN``); a model's
``models`` entry and its archive's model config (``weightsScan``) can only make it stricter: a
hostile archive cannot switch its own scan off. Under ``require`` a flagged file refuses the
registration (the answer names the file and the globals) and the registration leaves nothing
on disk; under ``warn`` the model registers, the log says why, and describe lists the files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from server.config.model_settings import WEIGHTS_SCAN_MODES as MODES
from server.errors import InvalidModel, UnsafeWeights
from server.weights.scan import CACHE_SUFFIX, WeightsScan, cached_scan, keep

log = logging.getLogger(__name__)

SETTING = "weightsScan"  # the model config's and the models entry's name
_WHERE = {"models": "models entry", "archive": "model config", "api": "registration"}


class Counter(Protocol):
    """The ``mserve_weights_flagged_files`` counter (server/metrics/server_metrics.py)."""

    def labels(self, *values: str) -> Any: ...


def strictest(
    server: str, entry: Any, archive: Any, label: str, api: Any = None
) -> tuple[str, str]:
    """The effective mode and where it came from (server, models, archive or api: the
    registration's ``weights_scan`` parameter)."""
    mode, source = server, "server"
    for value, where in ((entry, "models"), (archive, "archive"), (api, "api")):
        if value is None:
            continue
        if value is False:  # YAML reads a bare off as false
            value = "off"
        if not isinstance(value, str) or value.strip().lower() not in MODES:
            name = "weights_scan" if where == "api" else SETTING
            raise InvalidModel(
                f"model {label}: {name} should be one of {', '.join(MODES)}, found {value!r}"
            )
        value = value.strip().lower()
        if MODES.index(value) > MODES.index(mode):
            mode, source = value, where
        elif MODES.index(value) < MODES.index(mode):
            log.info("model %s: %s %s in its %s is weaker than %s; %s applies", label, SETTING,
                     value, _WHERE[where], mode, mode)  # fmt: skip
    return mode, source


def settings_with_mode(settings: Any, mode: str, source: str) -> Any:
    """``settings`` (ModelSettings) with the effective mode and its source."""
    return replace(settings, weights_scan=mode, sources={**settings.sources, "weights_scan":
                                                         source})  # fmt: skip


async def check(
    model_dir: Path, digest: str | None, cache: Path, mode: str, label: str,
    counter: Counter | None,
) -> WeightsScan | None:  # fmt: skip
    """Scan the model's weights under ``mode`` (None when off). Raises :class:`UnsafeWeights`
    under require when a file is flagged; the caller removes what the registration unpacked."""
    if mode == "off":
        return None
    marker = cache / f"{digest}{CACHE_SUFFIX}" if digest else None
    scan = await asyncio.to_thread(cached_scan, model_dir, marker)
    name, _, version = label.partition(":")
    for f in scan.flagged:
        if counter is not None:
            counter.labels(name, version, f.verdict, "refused" if mode == "require" else
                           "warned").inc()  # fmt: skip
    if not scan.cached:
        log.info("model %s: scanned %d weights file(s), %.1f MB, in %.2f s", label,
                 len(scan.files), scan.scanned_bytes / 1e6, scan.seconds)  # fmt: skip
    if scan.flagged and mode == "require":
        reasons = "; ".join(f.reason() for f in scan.flagged)
        raise UnsafeWeights(
            f"model {label}: weights that would run code when loaded: {reasons}. weights_scan"
            " is require: save a state dict (model.state_dict()) or safetensors instead"
            " (docs/weights-safety.md)"
        )
    for f in scan.flagged:
        log.warning("model %s: %s: loading it may run code (weights_scan warn)", label,
                    f.reason())  # fmt: skip
    if marker is not None:
        keep(scan, marker)
    return scan


def discard_unpacked(model_dir: Path, cache: Path) -> None:
    """Remove an unpacked archive a refused registration left (its folder under ``cache``,
    named for its sha256, and the markers beside it): unusable at once, then deleted."""
    if model_dir.parent != cache:  # an archive folder registered in place: the user's own
        return
    for marker in cache.glob(f"{model_dir.name}.*"):
        marker.unlink(missing_ok=True)
    trash = cache / f".refused-{model_dir.name}-{secrets.token_hex(4)}"
    try:
        os.rename(model_dir, trash)
    except OSError as exc:
        log.warning("could not remove %s: %s", model_dir, exc)
        return
    shutil.rmtree(trash, ignore_errors=True)


async def admit(
    model_dir: Path, digest: str | None, cache: Path, settings: Any, server_mode: str,
    entry: Any, model_config: dict[str, Any], label: str, counter: Counter | None,
    api: str | None = None,
) -> tuple[Any, WeightsScan | None]:  # fmt: skip
    """The registration's step: the effective mode (``entry``: the models entry, or None;
    ``api``: the registration's ``weights_scan``), then :func:`check`. Returns the settings
    with the mode, and the scan (None when off)."""
    entry_value = entry.get(SETTING) if entry is not None else None
    mode, source = strictest(server_mode, entry_value, model_config.get(SETTING), label, api)
    scan = await check(model_dir, digest, cache, mode, label, counter)
    return settings_with_mode(settings, mode, source), scan
