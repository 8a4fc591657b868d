"""What each model version was measured to take, kept across restarts.

Admission (server/models/residency.py) needs to know, before it starts a worker, what that
worker will take: a declared size is a guess the model's author makes once and never updates,
so the server measures instead. A ready worker's PSS is read from /proc (psutil), its weights'
pages held in the warm tier from the server's own mapping (server/models/warm.py), and the
time from a request finding no worker to the worker ready, split by where the weights came
from (``cold``: read from disk and unpickled; ``warm``: mapped from the page cache). The last
of each is kept per model version in ``<run_dir>/footprints.json``, so the first load after a
restart is admitted on what that model took last time, not on the mean of the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from server.rundir import write_json_atomic

log = logging.getLogger(__name__)

FOOTPRINTS_FILE = "footprints.json"
SCHEMA = 1
MAX_ENTRIES = 4096  # the least recently measured go first
# A worker's PSS moves by pages from one read to the next; the file is rewritten only when a
# figure moves by more than this, so steady serving does not rewrite it every few seconds.
RESAVE_AFTER_BYTES = 2**20


@dataclass
class Footprint:
    """One model version, as last measured (None: never seen)."""

    worker_bytes: int | None = None  # a ready worker's PSS
    warm_bytes: int | None = None  # its weights' pages, when the warm tier last held them
    load_s: float | None = None  # request finding no worker -> worker ready, weights cold
    wake_s: float | None = None  # the same, weights in the warm tier
    seen: float = 0.0  # epoch seconds of the last change

    def reload_s(self, warm: bool) -> float | None:
        """What bringing it back costs: its wake time when it would be warm (its load time
        while no wake was measured yet), else its load time."""
        if warm and self.wake_s is not None:
            return self.wake_s
        return self.load_s if self.load_s is not None else self.wake_s

    def shown(self) -> dict[str, float | int | None]:
        """describe's ``footprint`` (camelCase, as the rest of describe)."""
        return {
            "workerPssBytes": self.worker_bytes,
            "warmBytes": self.warm_bytes,
            "coldLoadSeconds": self.load_s,
            "warmWakeSeconds": self.wake_s,
        }


class Footprints:
    """``{model label: Footprint}``, read once at start, written atomically (by the residency
    chore, at most once a second) when a figure changed."""

    def __init__(self, folder: Path | None) -> None:
        """``folder``: the run dir; None keeps nothing across starts (unit use)."""
        self.path = folder / FOOTPRINTS_FILE if folder is not None else None
        self._entries: dict[str, Footprint] = self._read()
        self._dirty = False

    def _read(self) -> dict[str, Footprint]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("%s is unreadable (%s); model footprints are measured anew",
                        self.path, exc)  # fmt: skip
            return {}
        entries: dict[str, Footprint] = {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return entries
        for label, raw in (data.get("models") or {}).items():
            try:
                entries[str(label)] = Footprint(
                    worker_bytes=_whole(raw.get("worker_bytes")),
                    warm_bytes=_whole(raw.get("warm_bytes")),
                    load_s=_seconds(raw.get("load_s")),
                    wake_s=_seconds(raw.get("wake_s")),
                    seen=float(raw.get("seen", 0)),
                )
            except (AttributeError, TypeError, ValueError) as exc:
                log.warning("%s: ignoring the entry of %s (%s)", self.path, label, exc)
        return entries

    def get(self, label: str) -> Footprint:
        """The model's footprint (an empty one, not kept, when never measured)."""
        return self._entries.get(label) or Footprint()

    def known_worker_bytes(self) -> list[int]:
        return [f.worker_bytes for f in self._entries.values() if f.worker_bytes is not None]

    def worker(self, label: str, size_bytes: int) -> None:
        """A ready worker of ``label`` was measured at ``size_bytes`` (PSS)."""
        entry = self._entry(label)
        if entry.worker_bytes is None or abs(entry.worker_bytes - size_bytes) > RESAVE_AFTER_BYTES:
            self._dirty = True
        entry.worker_bytes = size_bytes
        entry.seen = time.time()

    def warm(self, label: str, size_bytes: int) -> None:
        """The warm tier holds ``size_bytes`` of ``label``'s weights' pages."""
        entry = self._entry(label)
        self._dirty |= entry.warm_bytes != size_bytes
        entry.warm_bytes = size_bytes
        entry.seen = time.time()

    def loaded(self, label: str, seconds: float, warm: bool) -> None:
        """A load on demand of ``label`` took ``seconds``; ``warm``: a wake from the tier."""
        entry = self._entry(label)
        if warm:
            entry.wake_s = round(seconds, 4)
        else:
            entry.load_s = round(seconds, 4)
        entry.seen = time.time()
        self._dirty = True

    def _entry(self, label: str) -> Footprint:
        entry = self._entries.get(label)
        if entry is None:
            entry = self._entries[label] = Footprint()
            if len(self._entries) > MAX_ENTRIES:
                oldest = min(self._entries, key=lambda k: self._entries[k].seen)
                del self._entries[oldest]
        return entry

    async def save(self) -> None:
        """Write the file if a figure changed since the last write (a failed write is logged;
        the figures still hold for this run): the figures read here, the file written in a
        thread, since the server's chore saves them every second under a load of many models,
        and a file written and renamed waits for a filesystem busy with weights being read
        and dropped."""
        if self._dirty and self.path is not None:
            await asyncio.to_thread(self._write, self.path, self._content())

    def _content(self) -> dict[str, object]:
        self._dirty = False
        models = {label: asdict(f) for label, f in self._entries.items()}
        return {"schema": SCHEMA, "models": models}

    @staticmethod
    def _write(path: Path, content: dict[str, object]) -> None:
        try:
            # a cache: lost in a power cut, the next loads measure again
            write_json_atomic(path, content, durable=False)
        except OSError as exc:
            log.warning("could not save model footprints to %s: %s", path, exc)


def _whole(value: object) -> int | None:
    if value is None:
        return None
    number = int(value)  # type: ignore[call-overload]
    if number < 0:
        raise ValueError(f"negative size {number}")
    return number


def _seconds(value: object) -> float | None:
    if value is None:
        return None
    number = float(value)  # type: ignore[arg-type]
    if number < 0:
        raise ValueError(f"negative duration {number}")
    return number
