"""What a replay found: counts, differences by kind and by field, latencies recorded and
replayed, the worst pairs; as a JSON document for scripts (and the HTML report's input) and
the verdict against a threshold that gates a rollout."""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections import Counter
from typing import Any

from server.compare import Answer, Comparison
from server.replay.records import Recorded, Skipped

# distinct field paths counted one by one; more go under one row (a body keyed by ids must not
# make the report as large as the log)
_MAX_FIELDS = 500
_WORST = 20
_EXCERPT_BYTES = 2048
_KEEP_FAILURES = 20


def percentiles(values: array[float] | list[float]) -> dict[str, float | None]:
    """p50, p90 and p99 (nearest rank) of ``values``, in the values' unit; None when empty."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        if not ordered:
            out[name] = None
        else:
            out[name] = round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)
    out["count"] = len(ordered)  # type: ignore[assignment]
    return out


def _excerpt(body: bytes) -> str:
    text = body[:_EXCERPT_BYTES].decode("utf-8", "replace")
    return text + ("…" if len(body) > _EXCERPT_BYTES else "")


def _badness(comparison: Comparison) -> tuple[int, int, float]:
    """How bad a difference is, for the worst pairs: a status first, then how many
    differences, then how far the numbers went."""
    rel = comparison.max_rel_error if math.isfinite(comparison.max_rel_error) else 1e300
    return ("status" in comparison.kinds, comparison.difference_count, rel)  # type: ignore[return-value]


class Summary:
    """Outcomes added one by one as answers come (memory: two floats per record, the counts,
    and a bounded number of pairs)."""

    def __init__(self, target: str, inputs: list[str], options: dict[str, Any]) -> None:
        self.target = target
        self.inputs = inputs
        self.options = options
        self.model: str | None = None
        self.replayed = 0  # answered (any status)
        self.equal = 0
        self.bytes_equal = 0
        self.by_kind: Counter[str] = Counter()
        self.by_field: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.failure_samples: list[dict[str, str]] = []
        self.recorded_ms: array[float] = array("d")
        self.replayed_ms: array[float] = array("d")
        self.rankings = self.agreed = self.top1 = 0
        self.max_abs = self.max_rel = 0.0
        self._worst: list[tuple[Any, int, dict[str, Any]]] = []
        self._order = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._t0 = self._cpu0 = 0.0

    def started(self) -> None:
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def finished(self) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = time.process_time() - self._cpu0

    def add(
        self, record: Recorded, candidate: Answer, latency_s: float, comparison: Comparison
    ) -> None:
        self.model = self.model or record.model
        self.replayed += 1
        self.replayed_ms.append(latency_s * 1000)
        if record.microsec:
            self.recorded_ms.append(record.microsec / 1000)
        self.max_abs = max(self.max_abs, comparison.max_abs_error)
        self.max_rel = max(self.max_rel, comparison.max_rel_error)
        if comparison.top_k is not None:
            self.rankings += comparison.top_k.rankings
            self.agreed += comparison.top_k.agreed
            self.top1 += comparison.top_k.top1_agreed
        if comparison.equal:
            self.equal += 1
            self.bytes_equal += comparison.bytes_equal
            return
        self.by_kind.update(comparison.kinds)
        for path in comparison.fields:
            if path in self.by_field or len(self.by_field) < _MAX_FIELDS:
                self.by_field[path] += 1
            else:
                self.by_field["(other fields)"] += 1
        self._order += 1
        pair = {
            "id": record.id,
            "where": record.where,
            "recorded": {"status": record.status, "ms": record.microsec / 1000,
                         "body": _excerpt(record.response or b"")},
            "replayed": {"status": candidate.status, "ms": round(latency_s * 1000, 3),
                         "body": _excerpt(candidate.body)},
            "request": _excerpt(record.request),
            "comparison": comparison.to_dict(),
        }  # fmt: skip
        entry = (_badness(comparison), -self._order, pair)
        if len(self._worst) < _WORST:
            heapq.heappush(self._worst, entry)
        else:
            heapq.heappushpop(self._worst, entry)

    def failed(self, record: Recorded, kind: str, message: str) -> None:
        """A record that got no answer: the target unreachable, a timeout, a broken answer."""
        self.model = self.model or record.model
        if record.microsec:  # the recorded side counts every record sent
            self.recorded_ms.append(record.microsec / 1000)
        self.failures[kind] += 1
        if len(self.failure_samples) < _KEEP_FAILURES:
            self.failure_samples.append({"id": record.id, "where": record.where, "kind": kind,
                                         "message": message[:300]})  # fmt: skip

    @property
    def differing(self) -> int:
        return self.replayed - self.equal

    def verdict(self, max_differing: float) -> tuple[int, str]:
        """The exit code and why: 0 within the threshold; 1 more differing answers than the
        share allows; 3 nothing was answered (the target is down or every request failed);
        4 nothing to replay."""
        sent = self.replayed + sum(self.failures.values())
        if not sent:
            return 4, "nothing to replay: no record of the log could be sent"
        if not self.replayed:
            return 3, f"no answer from the target: {dict(self.failures)}"
        share = (self.differing + sum(self.failures.values())) / sent
        if share > max_differing:
            return (
                1,
                f"{share:.2%} of answers differ or failed, over the threshold {max_differing:.2%}",
            )
        return (
            0,
            f"{share:.2%} of answers differ or failed, within the threshold {max_differing:.2%}",
        )

    def to_dict(self, skipped: Skipped, max_differing: float) -> dict[str, Any]:
        code, reason = self.verdict(max_differing)
        sent = self.replayed + sum(self.failures.values())
        worst = [pair for _, _, pair in sorted(self._worst, reverse=True)]
        return {
            "target": self.target,
            "inputs": self.inputs,
            "model": self.model,
            "options": self.options,
            "counts": {
                "sent": sent,
                "answered": self.replayed,
                "equal": self.equal,
                "bytes_equal": self.bytes_equal,
                "differing": self.differing,
                "failed": dict(self.failures),
                "skipped": dict(skipped.counts),
            },
            "differing_share": (self.differing + sum(self.failures.values())) / sent
            if sent
            else 0.0,
            "threshold": max_differing,
            "passed": code == 0,
            "exit_code": code,
            "verdict": reason,
            "by_kind": dict(self.by_kind.most_common()),
            "by_field": dict(self.by_field.most_common()),
            "max_abs_error": self.max_abs if math.isfinite(self.max_abs) else None,
            "max_rel_error": self.max_rel if math.isfinite(self.max_rel) else None,
            "top_k": {
                "k": self.options.get("top_k", 0),
                "rankings": self.rankings,
                "agreed": self.agreed,
                "top1_agreed": self.top1,
            }
            if self.rankings
            else None,
            "latency_ms": {
                "recorded": percentiles(self.recorded_ms),
                "replayed": percentiles(self.replayed_ms),
            },
            "throughput_rps": round(self.replayed / self.wall_s, 1) if self.wall_s else None,
            "wall_s": round(self.wall_s, 3),
            # the replay's own CPU per record sent (reading, sending, comparing): what it costs
            # the machine next to the target
            "client_cpu_us": round(self.cpu_s / sent * 1e6, 1) if sent else None,
            "worst": worst,
            "failures": self.failure_samples,
            "skipped_places": skipped.places,
            # the raw latencies, for the HTML report's plots (capped: the plots need a shape)
            "latency_samples_ms": {
                "recorded": [round(x, 3) for x in self.recorded_ms[:20000]],
                "replayed": [round(x, 3) for x in self.replayed_ms[:20000]],
            },
        }
