"""Shadow traffic: a share of the requests one version of a model answers is sent again to
another version of the same model, whose answer is compared with the client's and never
returned (docs/rollouts.md, Shadow).

Which requests: those answered by the *source* version, whether they named it or not (the
source is the model's default version at the time unless the settings name one); a request
the shadow version answers itself is never shadowed. ``share`` percent of them are mirrored,
counted out evenly (25 % is every fourth), not drawn.

Why the client can never be slowed or failed by it:

- Nothing is sent until the client's answer is settled: :meth:`Shadow.send` (the router's
  ``after_enqueue`` hook, server/rollouts/router.py) only adds a done callback to the primary
  job's future; the shadow request is queued from that callback, after the answer exists.
- The shadow has a lane of its own: at most ``concurrency`` shadow requests on the shadow
  version at once (0: as many as it has ready workers, at least one) and at most
  ``queue_size`` waiting for one of those places; past that a pair is dropped and counted. So a
  shadow never takes the primary version's queue places or workers, and takes at most
  ``concurrency`` of the shadow version's own.
- A shadow answer later than ``timeout_s`` is given up (the job is cancelled, the place freed)
  and counted; a shadow version that refuses (queue full, failed, no worker) is counted too.
  No task is started: everything runs from future callbacks on the event loop, so there is
  nothing to stop and nothing to leak when the shadow is replaced.

Each pair is compared by server/compare/ with the operator's tolerances; the counts by outcome
and by kind of difference are metrics (``mserve_shadow_requests_total{model,version,outcome}``,
``mserve_shadow_differences_total{model,version,kind}``, ``version`` the shadow's); the last
``samples`` differing pairs are kept for ``GET /models/{name}/shadow`` and written to the
inference log (when it is on for either version) as ``shadow_difference`` events; the two
versions' latencies, from queued to answered, are kept for the same pairs side by side.
"""

from __future__ import annotations

import base64
import collections
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from mserve_worker.protocol import RequestItem, ResponseItem
from server.compare import Answer, Comparison, compare
from server.errors import MserveError
from server.models.batching import Job
from server.models.registry import Registry
from server.models.version import ModelVersion
from server.rollouts.shadow_settings import ShadowSettings

log = logging.getLogger(__name__)

OUTCOMES = ("equal", "different", "dropped", "refused", "timed_out", "skipped")
# how much of each body a kept sample shows
SAMPLE_BODY_BYTES = 2048
# latencies kept per version for the p50/p99 shown (the most recent pairs)
LATENCY_WINDOW = 2048
# distinct differing fields counted (the rest are counted under "(others)")
MAX_FIELDS = 100
# answers larger than this (both bodies) are compared in a thread, at most MAX_COMPARING at once
THREAD_COMPARE_BYTES = 64 * 1024
MAX_COMPARING = 2


@dataclass
class _Pair:
    """A mirrored request with the primary's answer, waiting for (or in) the shadow lane."""

    item: RequestItem
    primary: Answer
    primary_s: float
    primary_version: str
    tenant: Any = None  # the client's (server/tenants/): the copy's lane, never its quota


class Shadow:
    """One model's shadow: the lane, the counts, the samples (the router's ``Shadow``)."""

    def __init__(
        self, name: str, settings: ShadowSettings, registry: Registry, counters: Any = None
    ) -> None:
        """``counters``: (requests, differences) prometheus counters, or None."""
        self.name = name
        self.settings = settings
        self.registry = registry
        self._counters = counters
        self.since = time.time()
        self._credit = 0.0
        self.waiting: collections.deque[_Pair] = collections.deque()
        self.in_flight = 0
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.kinds: collections.Counter[str] = collections.Counter()
        self.fields: collections.Counter[str] = collections.Counter()
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=settings.samples)
        self.latency: dict[str, collections.deque[float]] = {
            "primary": collections.deque(maxlen=LATENCY_WINDOW),
            "shadow": collections.deque(maxlen=LATENCY_WINDOW),
        }
        self.max_abs_error = 0.0
        self.max_rel_error = 0.0
        self.top_k = [0, 0, 0]  # rankings, agreed, top1 agreed
        self.closed = False  # replaced or removed: what is in flight settles, nothing starts
        self.comparing = 0  # large pairs being compared in a thread

    # --- the request path ------------------------------------------------------------------

    def send(self, model: ModelVersion, item: RequestItem, job: Job) -> None:
        settings = self.settings
        if model.version == settings.version or item.cached or self.closed:
            return
        if model.version != (settings.source or self.registry.defaults.get(self.name)):
            return
        self._credit += settings.share
        if self._credit < 100.0:
            return
        self._credit -= 100.0
        # the body may be a view of the connection's buffer, reused once the answer is written
        copy = RequestItem(item.request_id, item.content_type, list(item.headers),
                           bytes(item.body), dict(item.params), item.op, item.api)  # fmt: skip
        job.future.add_done_callback(
            functools.partial(
                self._primary_settled, copy, job.enqueued_at, model.version, job.tenant
            )
        )

    def _primary_settled(
        self, item: RequestItem, enqueued_at: float, version: str, tenant: Any, future: Any
    ) -> None:
        # The frontend's own callback may come after this one on the same future: the shadow
        # is taken on the loop's next pass, once the client's answer has been written.
        future.get_loop().call_soon(
            self._primary_done, item, time.monotonic() - enqueued_at, version, tenant, future
        )

    def _primary_done(
        self, item: RequestItem, primary_s: float, version: str, tenant: Any, future: Any
    ) -> None:
        answer = _answer(future)
        if answer is None or self.closed:  # the client went away, the answer streams
            self._count("skipped")
            return
        pair = _Pair(item, answer, primary_s, version, tenant)
        if self.in_flight < self._concurrency():
            self._start(pair)
        elif len(self.waiting) < self.settings.queue_size:
            self.waiting.append(pair)
        else:
            self._count("dropped")

    def close(self) -> None:
        """Replaced or removed: the waiting pairs are dropped (counted), nothing more starts."""
        self.closed = True
        while self.waiting:
            self.waiting.popleft()
            self._count("skipped")

    def _concurrency(self) -> int:
        if self.settings.concurrency:
            return self.settings.concurrency
        model = self.registry.models.get(self.name, {}).get(self.settings.version)
        return max(1, model.ready_workers()) if model is not None else 1

    def _start(self, pair: _Pair) -> None:
        model = self.registry.models.get(self.name, {}).get(self.settings.version)
        if model is None:
            self._count("refused")
            return
        try:
            # in the client's tenant's lane of the fair queue, not charged to its quotas: the
            # shadow is the operator's, bounded by its own concurrency and queue
            job = model.enqueue(pair.item, None, pair.tenant, charged=False)
        except MserveError as exc:
            log.debug("shadow %s refused a request: %s", model.label, exc.message)
            self._count("refused")
            return
        self.in_flight += 1
        loop = job.future.get_loop()
        timer = loop.call_later(self.settings.timeout_s, job.cancel, "deadline")
        job.future.add_done_callback(
            functools.partial(self._shadow_done, pair, job.enqueued_at, timer)
        )

    def _shadow_done(self, pair: _Pair, enqueued_at: float, timer: Any, future: Any) -> None:
        timer.cancel()
        self.in_flight -= 1
        try:
            if future.cancelled():
                self._count("timed_out")
            else:
                answer = _answer(future)
                if answer is None:  # a stream: not compared, and nobody reads it
                    future.result().cancel()
                    self._count("skipped")
                else:
                    self._compare(pair, answer, time.monotonic() - enqueued_at, future)
        finally:
            while self.waiting and self.in_flight < self._concurrency():
                self._start(self.waiting.popleft())

    def _compare(self, pair: _Pair, answer: Answer, shadow_s: float, future: Any) -> None:
        """Small answers are compared here; large ones in a thread, so that the event loop
        every client's request goes through is never held for a long walk (at most
        MAX_COMPARING at once: past that the pair is dropped and counted)."""
        options = self.settings.compare
        if len(pair.primary.body) + len(answer.body) <= THREAD_COMPARE_BYTES:
            self._compared(pair, answer, shadow_s, compare(pair.primary, answer, options))
            return
        if self.comparing >= MAX_COMPARING:
            self._count("dropped")
            return
        self.comparing += 1
        loop = future.get_loop()
        work = loop.run_in_executor(None, compare, pair.primary, answer, options)
        work.add_done_callback(functools.partial(self._compared_apart, pair, answer, shadow_s))

    def _compared_apart(self, pair: _Pair, answer: Answer, shadow_s: float, work: Any) -> None:
        self.comparing -= 1
        if work.cancelled() or work.exception() is not None:  # the server is stopping
            self._count("skipped")
            return
        self._compared(pair, answer, shadow_s, work.result())

    def _compared(self, pair: _Pair, answer: Answer, shadow_s: float, result: Comparison) -> None:
        self.latency["primary"].append(pair.primary_s)
        self.latency["shadow"].append(shadow_s)
        self.max_abs_error = max(self.max_abs_error, result.max_abs_error)
        self.max_rel_error = max(self.max_rel_error, result.max_rel_error)
        if result.top_k is not None:
            self.top_k[0] += result.top_k.rankings
            self.top_k[1] += result.top_k.agreed
            self.top_k[2] += result.top_k.top1_agreed
        if result.equal:
            self._count("equal")
            return
        self._count("different")
        for kind in result.kinds:
            self.kinds[kind] += 1
            if self._counters is not None:
                self._counters[1].labels(self.name, self.settings.version, kind).inc()
        for path in result.fields:
            if path in self.fields or len(self.fields) < MAX_FIELDS:
                self.fields[path] += 1
            else:
                self.fields["(others)"] += 1
        sample = self._sample(pair, answer, shadow_s, result)
        if self.samples.maxlen:
            self.samples.append(sample)
        self._log(pair, sample, result)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._counters is not None:
            self._counters[0].labels(self.name, self.settings.version, outcome).inc()

    def _sample(
        self, pair: _Pair, answer: Answer, shadow_s: float, result: Comparison
    ) -> dict[str, Any]:
        item = pair.item
        return {
            "at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "request_id": item.request_id,
            "request": _shown_body(item.content_type, bytes(item.body)),
            "primary": {
                "version": pair.primary_version,
                "status": pair.primary.status,
                "latency_ms": round(pair.primary_s * 1000, 3),
                **_shown_body(pair.primary.content_type, pair.primary.body),
            },
            "shadow": {
                "version": self.settings.version,
                "status": answer.status,
                "latency_ms": round(shadow_s * 1000, 3),
                **_shown_body(answer.content_type, answer.body),
            },
            "comparison": result.to_dict(),
        }

    def _log(self, pair: _Pair, sample: dict[str, Any], result: Comparison) -> None:
        """The differing pair as an event in the inference log of either version, when on."""
        versions = self.registry.models.get(self.name, {})
        loggers = []
        for version in (pair.primary_version, self.settings.version):
            model = versions.get(version)
            logger = model.inference_log if model is not None else None
            if logger is not None and logger not in loggers:
                loggers.append(logger)
        if not loggers:
            return
        message = (
            f"shadow {self.settings.version} differs from {pair.primary_version}:"
            f" {', '.join(result.kinds)} at {', '.join(result.fields[:5])}"
        )
        for logger in loggers:
            logger.event("shadow_difference", message, sample)

    # --- what is shown and saved ---------------------------------------------------------

    def shown(self) -> dict[str, Any]:
        """The ``shadow`` part of describe's ``traffic`` section: settings, counts, latencies
        side by side (the samples are under ``GET /models/{name}/shadow``)."""
        settings = self.settings
        compared = self.counts["equal"] + self.counts["different"]
        rankings, agreed, top1 = self.top_k
        return {
            "settings": settings.to_json(),
            "since": datetime.fromtimestamp(self.since, timezone.utc).isoformat(timespec="seconds"),
            "counts": dict(self.counts),
            "difference_ratio": round(self.counts["different"] / compared, 6) if compared else 0,
            "waiting": len(self.waiting),
            "in_flight": self.in_flight,
            "differences": dict(self.kinds),
            "fields": dict(self.fields.most_common(20)),
            "max_abs_error": _finite(self.max_abs_error),
            "max_rel_error": _finite(self.max_rel_error),
            "top_k": {"rankings": rankings, "agreed": agreed, "top1_agreed": top1}
            if rankings
            else None,
            "latency_ms": {
                "primary": _percentiles(self.latency["primary"]),
                "shadow": _percentiles(self.latency["shadow"]),
            },
            "samples_kept": len(self.samples),
        }

    def inspected(self) -> dict[str, Any]:
        """``GET /models/{name}/shadow``: what describe shows, and the kept samples."""
        return {**self.shown(), "samples": list(self.samples)}

    def to_json(self) -> dict[str, Any]:
        return self.settings.to_json()


def _answer(future: Any) -> Answer | None:
    """The answer a client got from a settled job's future; None when there is none to compare
    (cancelled, or a stream)."""
    if future.cancelled():
        return None
    error = future.exception()
    if error is not None:
        if isinstance(error, MserveError):
            return Answer(error.status, json.dumps(error.body()).encode(), "application/json")
        return Answer(500, b"", "")
    result = future.result()
    if type(result) is not ResponseItem:  # a ChunkStream: its answer is still coming
        return None
    return Answer(result.status, bytes(result.body), result.content_type or "")


def _shown_body(content_type: str, body: bytes) -> dict[str, Any]:
    shown = body[:SAMPLE_BODY_BYTES]
    out: dict[str, Any] = {"content_type": content_type, "bytes": len(body)}
    try:
        out["body"] = shown.decode()
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(shown).decode()
    if len(body) > SAMPLE_BODY_BYTES:
        out["truncated"] = True
    return out


def _percentiles(window: collections.deque[float]) -> dict[str, Any]:
    if not window:
        return {"count": 0, "p50": None, "p99": None}
    ordered = sorted(window)
    n = len(ordered)

    def at(q: float) -> float:
        return round(ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] * 1000, 3)

    return {"count": n, "p50": at(0.5), "p99": at(0.99)}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
