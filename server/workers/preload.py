"""What each environment's worker template preloads: learned from the workers, remembered.

A worker reports the installed packages its handler imported (``mserve_worker.imports``). The
server remembers them per interpreter (one per model environment) and per model, in a small
JSON file beside the environment cache, so that the next start can start each template with
those imports at once, in parallel with its own start-up, before the model is even unpacked.
A template preloads the union for the models it serves in this run, never for models it does
not: an echo model's workers never carry torch because another model once needed it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mserve_worker.imports import valid_names
from server.rundir import write_json_atomic

log = logging.getLogger(__name__)

PRELOAD_FILE = "template-preload.json"
SCHEMA = 1
MAX_MODELS_PER_PYTHON = 256  # the least recently seen go first


class PreloadMemory:
    """The remembered imports, ``{python: {model name: [module, ...]}}``, read once at start
    and rewritten (atomically) only when a worker reports something new."""

    def __init__(self, folder: Path | None) -> None:
        """``folder``: where the file lives (the environment cache); None remembers nothing
        across starts."""
        self.path = folder / PRELOAD_FILE if folder is not None else None
        self._pythons: dict[str, dict[str, dict[str, Any]]] = self._read()

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("%s is unreadable (%s); templates learn their imports anew",
                        self.path, exc)  # fmt: skip
            return {}
        pythons: dict[str, dict[str, dict[str, Any]]] = {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return pythons
        for python, models in (data.get("pythons") or {}).items():
            if not isinstance(models, dict):
                continue
            for model, entry in models.items():
                try:
                    modules = valid_names(entry.get("modules"))
                    seen = float(entry.get("seen", 0))
                except (AttributeError, TypeError, ValueError) as exc:
                    log.warning("%s: ignoring the entry of %s (%s)", self.path, model, exc)
                    continue
                pythons.setdefault(python, {})[model] = {"modules": modules, "seen": seen}
        return pythons

    def modules(self, python: str, models: list[str]) -> list[str]:
        """What a template for ``python`` serving ``models`` should import: the union of what
        their workers were seen to import."""
        known = self._pythons.get(python, {})
        union: set[str] = set()
        for model in models:
            union.update(known.get(model, {}).get("modules", ()))
        return sorted(union)

    def pythons_for(self, models: list[str]) -> dict[str, list[str]]:
        """Each remembered interpreter that served any of ``models``, with those models."""
        out: dict[str, list[str]] = {}
        for python, known in self._pythons.items():
            mine = [m for m in models if m in known]
            if mine:
                out[python] = mine
        return out

    def knows(self, python: str, model: str) -> bool:
        """Whether a worker of ``model`` on ``python`` has ever reported its imports."""
        return model in self._pythons.get(python, {})

    def learn(
        self, python: str, model: str, imported: list[str], preloaded: list[str],
        assumed: Sequence[str] = (),
    ) -> bool:  # fmt: skip
        """Remember what a worker of ``model`` imported while loading (``imported``) when its
        template had already imported ``preloaded``; True when that is news (the file is
        rewritten then; a failed write is logged, what was learned still holds for this run).

        A forked worker cannot tell which of the template's modules its handler needs (they
        were there before it asked): what the model was known (or, at its first start,
        ``assumed`` from its source) to need among them is kept."""
        known = self._pythons.setdefault(python, {})
        entry = known.get(model)
        old = set(entry["modules"]) if entry is not None else set()
        modules = sorted(set(imported) | ((old | set(assumed)) & set(preloaded)))
        if entry is not None and entry["modules"] == modules:
            return False
        known[model] = {"modules": list(modules), "seen": time.time()}
        if len(known) > MAX_MODELS_PER_PYTHON:
            oldest = sorted(known, key=lambda m: known[m]["seen"])
            for stale in oldest[: len(known) - MAX_MODELS_PER_PYTHON]:
                del known[stale]
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # a cache: lost in a power cut, the next start learns again (no fsync on the
                # first start's path to its first answer)
                write_json_atomic(
                    self.path, {"schema": SCHEMA, "pythons": self._pythons}, durable=False
                )
            except OSError as exc:
                log.warning("could not save what templates preload to %s: %s", self.path, exc)
        return True
