"""TorchServe's metric formats: its log line (``Name.Unit:value|#dims|#hostname:h,...``) and
Prometheus's text format as TorchServe's frontend prints it, written by hand.

TorchServe exposes its metrics through the Java Prometheus simpleclient 0.9
(``TextFormat.write004``), and people grep that text, so its families here are written the
way that client writes them, not the way prometheus_client (Python) does: counters keep their
names (``Requests2XX``, no ``_total`` added), every label is followed by a comma
(``{Level="Host",Hostname="h",}``), a sample without labels has no braces, and numbers are
Java's ``Double.toString`` (``3.0``, ``1.0E-4``, ``1.2345678E7``; ``+Inf``, ``-Inf``, ``NaN``).
Both forms are valid text format 0.0.4: Prometheus's own parser reads either.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterable, Sequence

from server.linefile import LineFile
from server.metrics.handler import BUCKETS, Family

_NAME_OK = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


class MetricLog(LineFile):
    """One of TorchServe's metric log files. A line reaches the file at the end of the event
    loop's pass that wrote it, with the others of that pass in one write: TorchServe's own test
    reads the file right after its answer (a second's wait, as the access log has, made it find
    nothing), and under load one pass carries many lines. Outside an event loop, the metrics
    chore's flush (every second) and the stop write them."""

    _soon = False

    def add(self, line: str) -> None:
        self.append(f"{self.stamp()} - {line}\n")
        if not self._soon:
            try:
                asyncio.get_running_loop().call_soon(self._flush_soon)
            except RuntimeError:  # no loop here: the chore's flush writes it
                return
            self._soon = True

    def _flush_soon(self) -> None:
        self._soon = False
        self.flush()


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
            self.lines.append(_sample(name, zip(labels, values, strict=True), value))

    def histogram(self, family: Family) -> None:
        """Buckets (``le`` last among the labels), then count and sum, as simpleclient 0.9's
        Histogram lists its samples."""
        if not self._head(family.name, "histogram", family.unit):
            return
        name = _name(family.name)
        for values, stored in family.series.items():
            pairs = list(zip(family.labels, values, strict=True))
            for bound, count in zip(BUCKETS, stored, strict=False):  # then count and sum
                le = ("le", java_double(bound))
                self.lines.append(_sample(f"{name}_bucket", [*pairs, le], count))
            self.lines.append(_sample(f"{name}_count", pairs, stored[-2]))
            self.lines.append(_sample(f"{name}_sum", pairs, stored[-1]))

    def text(self) -> str:
        return "\n".join(self.lines) + "\n" if self.lines else ""


def _sample(name: str, labels: Iterable[tuple[str, str]], value: float) -> str:
    """One sample line as simpleclient's ``write004`` prints it: each label followed by a
    comma, no braces when there are no labels."""
    text = "".join(f'{_name(k)}="{_escape(v)}",' for k, v in labels)
    return f"{name}{{{text}}} {java_double(value)}" if text else f"{name} {java_double(value)}"


def _name(name: str) -> str:
    """A metric or label name as Prometheus allows it: a handler's ``latency-ms`` becomes
    ``latency_ms`` (a name it refuses would fail the whole scrape)."""
    if _NAME_OK.fullmatch(name):
        return name
    cleaned = _NAME_BAD.sub("_", name)
    return cleaned if cleaned[:1].isalpha() or cleaned[:1] == "_" else f"_{cleaned}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def java_double(value: float) -> str:
    """``value`` as simpleclient's ``doubleToGoString`` writes it: ``+Inf``/``-Inf``/``NaN``,
    else Java's ``Double.toString``: plain decimals from 10^-3 up to (not including) 10^7,
    ``d.dddE<exponent>`` outside, always a digit after the point, the shortest digits that
    read back as the same double (Java 19+; Python's ``repr`` picks the same digits)."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    digits, exponent = _shortest(abs(value))
    if -3 <= exponent < 7:
        if exponent >= 0:
            whole = digits[: exponent + 1].ljust(exponent + 1, "0")
            return f"{sign}{whole}.{digits[exponent + 1 :] or '0'}"
        return f"{sign}0.{'0' * (-exponent - 1)}{digits}"
    return f"{sign}{digits[0]}.{digits[1:] or '0'}E{exponent}"


def _shortest(value: float) -> tuple[str, int]:
    """The shortest significant digits of a positive finite double (no trailing zeros) and
    the power of ten of the first one: 1234.5 -> ("12345", 3), 0.001 -> ("1", -3)."""
    mantissa, _, exp_text = repr(value).partition("e")
    whole, _, fraction = mantissa.partition(".")
    raw = (whole + fraction).lstrip("0")
    leading = len(whole + fraction) - len(raw)  # zeros before the first significant digit
    exponent = len(whole) - 1 - leading + int(exp_text or 0)
    return raw.rstrip("0") or "0", exponent
