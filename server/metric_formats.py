"""TorchServe's metric formats: its log line (``Name.Unit:value|#dims|#hostname:h,...``) and
Prometheus's text format written by hand, because TorchServe's counters keep their names as
they are (``Requests2XX``, not the ``Requests2XX_total`` prometheus_client's counters write)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from server.handler_metrics import BUCKETS, Family

_NAME_OK = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


class MetricLog:
    """One of TorchServe's metric log files: lines kept in memory and written every second."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (owned, closed)
        self._lines: list[str] = []
        self._stamp_second = -1
        self._stamp = ""

    def add(self, line: str) -> None:
        now = time.time()
        second = int(now)
        if second != self._stamp_second:
            self._stamp_second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(second))
        self._lines.append(f"{self._stamp},{int((now - second) * 1000):03d} - {line}\n")

    def flush(self) -> None:
        if self._lines:
            self._file.write("".join(self._lines))
            self._lines.clear()
            self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()


def metric_line(
    name: str, unit: str, value: float, dims: Iterable[tuple[str, str]], hostname: str,
    request_ids: str | None = None,
) -> str:  # fmt: skip
    """TorchServe's log form of one update: ``Name.Unit:value|#dims|#hostname:h,...``."""
    text = ",".join(f"{k}:{v}" for k, v in dims)
    ids = f",requestID:{request_ids}" if request_ids else ""
    return (
        f"{name}.{unit}:{float(value)!r}|#{text}|#hostname:{hostname}{ids},"
        f"timestamp:{int(time.time())}"
    )


class PromText:
    """Prometheus's text format, written by hand for TorchServe's names."""

    def __init__(self, names: set[str] | None = None) -> None:
        self.lines: list[str] = []
        self.seen: set[str] = set()
        self.names = names
        self.only: frozenset[str] | None = None  # further, while set: these names only

    def _head(self, name: str, kind: str, unit: str) -> bool:
        name = _name(name)
        if name in self.seen:  # e.g. a handler metric named like a frontend one
            return False
        if self.names and name not in self.names:
            return False
        if self.only is not None and name not in self.only:
            return False
        self.seen.add(name)
        self.lines.append(f"# HELP {name} Torchserve prometheus {kind} metric with unit: {unit}")
        self.lines.append(f"# TYPE {name} {kind}")
        return True

    def family(
        self, name: str, kind: str, unit: str, labels: Sequence[str],
        rows: Iterable[tuple[Sequence[str], float]],
    ) -> None:  # fmt: skip
        if not self._head(name, kind, unit):
            return
        name = _name(name)
        for values, value in rows:
            self.lines.append(f"{name}{{{_labels(labels, values)}}} {_number(value)}")

    def histogram(self, family: Family) -> None:
        if not self._head(family.name, "histogram", family.unit):
            return
        name = _name(family.name)
        for values, stored in family.series.items():
            labels = _labels(family.labels, values)
            for bound, count in zip(BUCKETS, stored, strict=False):  # then count and sum
                le = "+Inf" if bound == math.inf else repr(bound)
                self.lines.append(f'{name}_bucket{{{labels},le="{le}"}} {_number(count)}')
            self.lines.append(f"{name}_count{{{labels}}} {_number(stored[-2])}")
            self.lines.append(f"{name}_sum{{{labels}}} {_number(stored[-1])}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n" if self.lines else ""


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    return ",".join(f'{_name(k)}="{_escape(v)}"' for k, v in zip(names, values, strict=True))


def _name(name: str) -> str:
    """A metric or label name as Prometheus allows it: a handler's ``latency-ms`` becomes
    ``latency_ms`` (a name it refuses would fail the whole scrape)."""
    if _NAME_OK.fullmatch(name):
        return name
    cleaned = _NAME_BAD.sub("_", name)
    return cleaned if cleaned[:1].isalpha() or cleaned[:1] == "_" else f"_{cleaned}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value))
