"""The per-model entries of the server config: TorchServe's ``models`` key (each model version's
settings in config.properties) and ``model_snapshot`` (the models a TorchServe snapshot records),
read into :class:`ModelEntry` values under TorchServe's names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.config.model_settings import ENTRY_SETTINGS, Setting
from server.errors import ConfigError

# A model version's settings in the ``models`` key and in a TorchServe snapshot are those of
# ENTRY_SETTINGS (model_settings.py), under TorchServe's names: integers, where a value <= 0
# means "not set", as TorchServe reads them; and mserve's batchWait (one of BATCH_WAITS, when a
# batch waits for more requests; the first is the default).


@dataclass(frozen=True)
class ModelEntry:
    """One model version of the ``models`` key (TorchServe's per-model settings in
    config.properties) or of ``model_snapshot`` (the models TorchServe's snapshot records)."""

    name: str
    version: str
    settings: tuple[tuple[str, int | str], ...] = ()  # (archive model-config key, value) pairs
    default_version: bool = False
    mar_name: str | None = None
    url: str | None = None  # mserve's modelUrl in a snapshot it wrote (server/ts_snapshot.py)

    def get(self, key: str) -> int | str | None:
        return next((v for k, v in self.settings if k == key), None)


def _entry_value(setting: Setting, raw: Any, key: str, where: str) -> int | str | None:
    """One setting of a ``models`` or snapshot entry; None: unset (0 or less, which TorchServe
    reads as "not given", except a snapshot's worker counts)."""
    if setting.unit == "choice":
        if raw is False and "off" in setting.choices:  # YAML reads a bare off as false
            raw = "off"
        if raw not in setting.choices:
            raise ConfigError(
                f"{where} {setting.key} should be one of {', '.join(setting.choices)},"
                f" found {raw!r}"
            )
        return str(raw)
    try:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        number = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} {setting.key} should be an integer, found {raw!r}") from None
    kept_zero = key == "model_snapshot" and setting.zero_kept
    return number if number > 0 or (number == 0 and kept_zero) else None


def parse_model_entries(value: Any, key: str, source: str) -> tuple[ModelEntry, ...]:
    """``{"name": {"version": {"minWorkers": 1, ...}}}`` as a mapping or its JSON text; for
    ``model_snapshot``, TorchServe's snapshot object whose ``models`` holds that mapping.
    Unknown parameters are ignored (TorchServe ignores them; newer versions add some)."""
    where = f"{source}: '{key}'"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where} is not valid JSON: {exc}") from None
    if key == "model_snapshot" and isinstance(value, dict):
        value = value.get("models", {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where} should map model names to versions, found {value!r}")
    out = []
    for name, versions in value.items():
        if not isinstance(versions, dict):
            raise ConfigError(f"{where}: model {name!r} should map versions to settings")
        for version, params in versions.items():
            if not isinstance(params, dict):
                raise ConfigError(f"{where}: {name} {version} should be an object of settings")
            settings = []
            for setting in ENTRY_SETTINGS:
                raw = params.get(setting.key)
                if raw is not None:
                    value = _entry_value(setting, raw, key, f"{where}: {name} {version}")
                    if value is not None:
                        settings.append((setting.key, value))
            default = params.get("defaultVersion", False)
            if not isinstance(default, bool):
                raise ConfigError(
                    f"{where}: {name} {version} defaultVersion should be true or false,"
                    f" found {default!r}"
                )
            mar = params.get("marName")
            if mar is not None and (not isinstance(mar, str) or not mar):
                raise ConfigError(f"{where}: {name} {version} marName should be a file name")
            if key == "model_snapshot" and mar is None:
                raise ConfigError(f"{where}: {name} {version} has no marName (the archive)")
            url = params.get("modelUrl")
            if url is not None and (not isinstance(url, str) or not url):
                raise ConfigError(f"{where}: {name} {version} modelUrl should be a string")
            out.append(ModelEntry(str(name), str(version), tuple(settings), default, mar, url))
    return tuple(out)
