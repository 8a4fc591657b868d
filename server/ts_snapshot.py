"""TorchServe's config snapshots, written as TorchServe writes them (the TorchServe layout).

TorchServe keeps its state in ``<LOG_LOCATION>/config/<yyyyMMddHHmmssSSS>-<kind>.cfg``: a
``java.util.Properties`` file holding its whole config plus ``model_snapshot``, a JSON object
with each model version's settings. It writes ``-startup.cfg`` once the startup models are up,
``-snapshot.cfg`` on every management change and ``-shutdown.cfg`` at stop, and the next start
reads the newest (server/ts_config.py reads them; ``--ncs`` skips both). Writing the same files
lets a fleet move between TorchServe and mserve in either direction, and keeps the scripts that
copy or inspect them working.

Per version we write TorchServe's fields (``defaultVersion``, ``marName``, ``minWorkers``,
``maxWorkers``, ``batchSize``, ``maxBatchDelay``, ``responseTimeout``, ``startupTimeout``,
``runtimeType``) and two of ours that TorchServe ignores: ``batchWait``, and ``modelUrl`` where
the archive is not a file of the model store (TorchServe would look for ``marName`` there).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from server.config.model_settings import request_fields, snapshot_fields
from server.download import is_remote
from server.errors import MserveError
from server.models.registry import RegisterRequest, Registry
from server.rundir import write_text_atomic

if TYPE_CHECKING:
    from server.config import ModelEntry, ServerConfig

log = logging.getLogger(__name__)

KINDS = ("startup", "snapshot", "shutdown")
# The newest files kept: TorchServe adds one per management call and never prunes (a server
# scaled by an autoscaler every minute fills a disk); the oldest beyond this go.
KEEP_FILES = 500
_JAVA_SPECIALS = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f", "\\": "\\\\",
                  "=": "\\=", ":": "\\:", "#": "\\#", "!": "\\!"}  # fmt: skip
# what ``Properties.store`` escapes: the separators, comment marks, backslash, and every
# character outside printable ASCII (a space is left to ``_escape``)
_TO_ESCAPE = re.compile(r"[\t\n\r\f\\=:#!]|[^ -~]")


def _unicode_escape(text: str) -> str:
    """``\\uXXXX`` per UTF-16 unit, as Java writes a char (a pair for one beyond the BMP)."""
    units = text.encode("utf-16-be", "surrogatepass")
    return "".join(f"\\u{units[i]:02X}{units[i + 1]:02X}" for i in range(0, len(units), 2))


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    return _JAVA_SPECIALS.get(char) or _unicode_escape(char)


def _escape(text: str, key: bool) -> str:
    """As ``Properties.store(OutputStream)`` escapes: the separators, comment marks and
    backslashes; control and non-ASCII characters as ``\\uXXXX``, so that the file is ASCII and
    reads the same as UTF-8 (mserve) or ISO-8859-1 (TorchServe's ``Properties.load``); spaces
    everywhere in a key, only a leading one in a value."""
    out = _TO_ESCAPE.sub(_escape_one, text)
    if key:
        return out.replace(" ", "\\ ")
    return "\\" + out if out.startswith(" ") else out


def properties_text(items: Iterable[tuple[str, str]], now: float) -> str:
    """A properties file as Java's ``Properties.store(stream, "Saving snapshot")`` writes it:
    ASCII throughout (the date line's zone name too, which a locale may spell otherwise)."""
    stamp = time.strftime("%a %b %d %H:%M:%S %Z %Y", time.localtime(now))
    stamp = re.sub(r"[^ -~]", lambda m: _unicode_escape(m.group()), stamp)
    lines = ["#Saving snapshot", f"#{stamp}"]
    lines += [f"{_escape(k, True)}={_escape(v, False)}" for k, v in items]
    return "\n".join(lines) + "\n"


def model_state(registry: Registry) -> dict[str, dict[str, dict[str, Any]]]:
    """``models`` of TorchServe's snapshot object: name -> version -> settings; the versions
    that failed to restore at start are written back as they were recorded (TorchServe would
    have registered them), until registered again or deleted."""
    store = registry.config.store_path
    models: dict[str, dict[str, dict[str, Any]]] = {}
    registered = {(mv.name, mv.version) for mv in registry.all()}
    for kept in registry.unrestored:
        name, version, state = kept["name"], kept["version"], kept["torchserve"]
        if (name, version) not in registered:
            default = state["defaultVersion"] and name not in registry.defaults
            models.setdefault(name, {})[version] = {**state, "defaultVersion": default}
    for mv in registry.all():
        if mv.workflow is not None:  # a workflow's node: TorchServe saves no workflow
            continue
        mar = mv.url.rstrip("/").rsplit("/", 1)[-1]
        state: dict[str, Any] = {
            "defaultVersion": registry.defaults.get(mv.name) == mv.version,
            "marName": mar,
            **snapshot_fields(mv.settings),  # minWorkers, ..., batchWait (config/model_settings.py)
            "runtimeType": mv.manifest.get("runtime") or "python",
        }
        if store is None or mv.url != mar or not (store / mar).is_file():
            state["modelUrl"] = mv.url
        models.setdefault(mv.name, {})[mv.version] = state
    return models


def snapshot_properties(
    config: ServerConfig, registry: Registry, name: str, traffic: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """The config TorchServe would record: the properties file the server started from (its
    keys as written), the addresses and store in effect, and ``model_snapshot``; ``traffic``:
    the traffic policies (server/rollouts/), in ``model_snapshot`` as ``mserveTraffic``, a key
    TorchServe does not read."""
    props = dict(config.ts_properties)
    for key in ("inference_address", "management_address", "metrics_address"):
        value = getattr(config, key)
        props[key] = value if "://" in value else f"http://{value}"
    if config.store_path is not None:
        props["model_store"] = str(config.store_path)
    models = model_state(registry)
    snapshot = {"name": name, "modelCount": sum(len(v) for v in models.values()),
                "created": int(time.time() * 1000), "models": models}  # fmt: skip
    if traffic:
        snapshot["mserveTraffic"] = traffic
    props["model_snapshot"] = json.dumps(snapshot, indent=2)
    props.pop("load_models", None)  # the snapshot's models replace it at the next start
    return sorted(props.items())


def save(
    config: ServerConfig, registry: Registry, kind: str, traffic: dict[str, Any] | None = None
) -> Path | None:
    """Write one ``<timestamp>-<kind>.cfg`` (a name already taken moves on a millisecond, so
    two changes in one millisecond both count); an error is logged, not raised: the models
    serve on regardless."""
    folder = config.ts_snapshot_path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        millis = int(now * 1000)
        while True:
            stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(millis / 1000))
            name = f"{stamp}{millis % 1000:03d}-{kind}.cfg"
            path = folder / name
            if not path.exists():
                break
            millis += 1
        text = properties_text(snapshot_properties(config, registry, name, traffic), now)
        write_text_atomic(path, text)
        _prune(folder)
    except OSError as exc:
        log.error("could not write the TorchServe config snapshot in %s: %s", folder, exc)
        return None
    return path


def load_traffic(config: ServerConfig) -> dict[str, Any]:
    """The traffic policies the config snapshot the server started from recorded (``{}``
    without any), put back once its models are (server/rollouts/router.py)."""
    raw = dict(config.ts_properties).get("model_snapshot")
    try:
        traffic = json.loads(raw).get("mserveTraffic") if raw else None
    except (ValueError, AttributeError):
        return {}  # the config's parser said why
    return traffic if isinstance(traffic, dict) else {}


def _prune(folder: Path) -> None:
    from server.ts_config import SNAPSHOT_NAME

    names = sorted(p.name for p in folder.iterdir() if SNAPSHOT_NAME.match(p.name))
    for old in names[:-KEEP_FILES]:
        (folder / old).unlink(missing_ok=True)


class SnapshotArchiveMissing(MserveError):
    """The config snapshot a start in TorchServe's layout restores records archives that are not
    there (``missing``: model, version and the path looked for, None without a model store).
    TorchServe validates its snapshot before it registers anything and does not start; neither
    does mserve in its layout. The message keeps TorchServe's log words."""

    def __init__(self, missing: list[tuple[str, str, Path | None]]) -> None:
        self.missing = missing
        found = "; ".join(
            f"Model archive file for model {name}, version {version} not found in model store: "
            + (str(path) if path is not None else "no model store is configured")
            for name, version, path in missing
        )
        super().__init__(
            f"{found}. The config snapshot restored at this start records it: put the archive"
            " back, or start with --ncs (no snapshot) or --ts-config naming another file"
        )


def _recorded(entry: ModelEntry) -> dict[str, Any]:
    """A snapshot entry's state as :func:`model_state` writes a version's."""
    state: dict[str, Any] = {"defaultVersion": entry.default_version, "marName": entry.mar_name}
    state.update(entry.settings)  # TorchServe's keys: minWorkers, batchSize, ...
    state.setdefault("runtimeType", "python")
    if entry.url is not None:
        state["modelUrl"] = entry.url
    return state


def _archive_path(entry: ModelEntry, store: Path | None) -> Path | None:
    """Where the archive of ``entry`` should be: ``marName`` in the model store (TorchServe's
    rule), or mserve's ``modelUrl`` when it wrote one for an archive outside the store."""
    if entry.url is None:
        return store / entry.mar_name if store is not None and entry.mar_name else None
    named = Path(unquote(urlsplit(entry.url).path) if "://" in entry.url else entry.url)
    named = named.expanduser()
    if named.is_absolute():
        return named
    return store / named if store is not None else None


def check_archives(entries: Iterable[ModelEntry], store: Path | None) -> None:
    """Raise :class:`SnapshotArchiveMissing` unless every archive the snapshot records is there
    (a file or an archive folder; a download by URL is fetched, or read from the cache, as at
    registration)."""
    missing = []
    for entry in entries:
        if entry.url is not None and is_remote(entry.url):
            continue
        path = _archive_path(entry, store)
        try:
            there = path is not None and path.exists()
        except OSError:
            there = False
        if not there:
            missing.append((entry.name, entry.version, path))
    if missing:
        raise SnapshotArchiveMissing(missing)


async def restore(
    registry: Registry, entries: Iterable[ModelEntry], load_failures: dict[str, str]
) -> None:
    """Register each model version a TorchServe config snapshot records, from its archive in
    the store (or mserve's ``modelUrl``), with the settings it was running with (they win over
    the archive's model config, as in TorchServe's restore) and its default version. In
    TorchServe's layout a snapshot that names an archive no longer there stops the start, as
    TorchServe's does (:func:`check_archives`); otherwise one that fails is logged and listed
    in ``load_failures``, and the others start."""
    entries = list(entries)
    if not entries:
        return
    if registry.config.torchserve:
        check_archives(entries, registry.config.store_path)
    log.info("registering %d model version(s) from the TorchServe snapshot", len(entries))

    async def one(entry: ModelEntry) -> None:
        request = RegisterRequest(
            url=entry.url or entry.mar_name or "",
            model_name=entry.name,
            **request_fields(entry.get),  # minWorkers, ... (server/config/model_settings.py)
            trusted=True,
            at_startup=True,
        )
        try:
            model = await registry.register(request)
        except MserveError as exc:
            log.error("TorchServe snapshot model %s %s failed: %s",
                      entry.name, entry.version, exc.message)  # fmt: skip
            load_failures[entry.name] = f"failed: {exc.message}"
            if registry.config.torchserve:  # the next snapshots keep it (:func:`model_state`)
                registry.unrestored.append(
                    {"name": entry.name, "version": entry.version, "torchserve": _recorded(entry)}
                )
            return
        if entry.default_version:
            registry.defaults[entry.name] = model.version

    await asyncio.gather(*(one(e) for e in entries))
