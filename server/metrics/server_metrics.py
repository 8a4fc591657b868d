"""The metrics port (8082) and every metric behind it: ours (``mserve_*``), TorchServe's default
metrics under TorchServe's names, types and labels, the metrics handlers record through
``context.metrics``, and TorchServe's metric log files.

TorchServe's ``metrics_mode`` decides where TorchServe's metrics go: ``prometheus`` (ours
default) puts them all on ``/metrics``; ``log`` writes them, one line per update in TorchServe's
format, to ``ts_metrics.log`` (the frontend's) and ``model_metrics.log`` (the handlers'); ``legacy``
keeps ``ts_inference_requests_total``, ``ts_inference_latency_microseconds`` and
``ts_queue_latency_microseconds`` on ``/metrics`` and logs the rest. Our own ``mserve_*`` metrics
are on ``/metrics`` in every mode.

Cost on the prediction path: a request adds to a few floats held by its model version
(model_stats.py here: no label lookups, no dicts built); the text is made when ``/metrics`` is
scraped (formats.py). Handler metrics are kept by handler.py, the host's system metrics measured
by system.py.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import socket
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

from mserve_worker.protocol import MetricEntry
from server import tenants, tracing
from server.errors import ConfigError
from server.http import Connection, Request
from server.metrics import system
from server.metrics.formats import MetricLog, PromText, metric_line
from server.metrics.handler import HandlerMetrics, MetricsConfig, default_families
from server.metrics.model_stats import (
    AnsweredJob,
    ObservedModel,
    ObservedResidency,
    request_ids,
    worker_name,
)
from server.metrics.system import SystemValue

log = logging.getLogger(__name__)

# the upper bounds of mserve_request_latency_seconds (prometheus_client's default buckets)
LATENCY_BUCKETS = tuple(b for b in Histogram.DEFAULT_BUCKETS if b != float("inf"))
_LATENCY_LE = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]

METRICS_MODES = ("prometheus", "log", "legacy")
# The three metrics TorchServe's legacy mode still serves in Prometheus's format.
LEGACY_PROMETHEUS = (
    "ts_inference_requests_total",
    "ts_inference_latency_microseconds",
    "ts_queue_latency_microseconds",
)
# mserve_workers{state}: every state is listed for every model version, 0 included, so that a
# dashboard's stacked series and an alert's "no READY worker" have a sample to read
WORKER_STATES = ("STARTING", "READY", "BUSY", "STOPPING", "STOPPED")
SYSTEM_METRICS_INTERVAL_S = 60.0  # TorchServe collects its system metrics once a minute
LOG_FLUSH_S = 1.0  # the longest a metric log line waits in memory


# --- the hub ------------------------------------------------------------------------------


class Metrics:
    """Every metric of the server, and the metrics port's text.

    Ours are prometheus_client metrics (``mserve_*``); gauges are read from the registry at
    scrape time. TorchServe's are plain numbers kept by each model version
    (:class:`ModelStats`) and here, written out at scrape time."""

    def signature_failure(self, reason: str, action: str) -> None:
        self.archive_signature_failures.labels(reason, action).inc()

    def __init__(
        self,
        mode: str = "prometheus",
        config: MetricsConfig | None = None,
        log_dir: Path | None = None,
        hostname: str | None = None,
        gpus: Sequence[str] = (),
        auto_detect: bool = True,
        system_metrics: bool = True,
        uuid_label: bool = True,
    ) -> None:
        """``config``: a metrics_config file's (None: TorchServe's default model_metrics,
        HandlerTime and PredictionTime). ``log_dir``: where ts_metrics.log and model_metrics.log
        are made at start (``log`` and ``legacy`` modes need it; TorchServe's log4j makes them
        in every mode). ``auto_detect``: keep handler metrics the config does not declare.
        ``system_metrics``: measure the host each minute. ``uuid_label``: the ``ts_inference_*``
        counters carry TorchServe 0.7's ``uuid`` beside 0.8's ``hostname`` (mserve's layout, so
        that queries written for either match); TorchServe's layout has 0.8's alone."""
        self.prom = CollectorRegistry()
        self.requests = Counter(
            "mserve_requests", "Inference requests answered", ["model", "version", "code"],
            registry=self.prom,
        )  # fmt: skip
        # mserve_request_latency_seconds{model}: per model, the count of each of LATENCY_BUCKETS
        # and +Inf, then the sum; cumulated at scrape (collect). A prometheus_client Histogram
        # costs a lock and two inc() calls per observation, on the frontend's hot path.
        self._latency: dict[str, list[float]] = {}
        # mserve_time_to_first_token_seconds{model}: the same rows for streamed answers, from
        # the request's arrival to its first chunk going out (every API: a generative model's
        # time to first token)
        self._first_token: dict[str, list[float]] = {}
        # loading on demand, idle unloads and evictions (server/models/residency.py)
        self.model_loads = Counter(
            "mserve_model_loads", "Workers started for a model that had none (on demand)",
            ["model", "version", "outcome"], registry=self.prom,
        )  # fmt: skip
        self.model_evictions = Counter(
            "mserve_model_evictions", "Idle models scaled down to minWorkers",
            ["model", "version", "reason"], registry=self.prom,
        )  # fmt: skip
        # the warm tier (server/models/warm.py): loads on demand by where the weights came
        # from (tier: warm, cold), and models dropped from warm to cold (reason)
        self.model_wakes = Counter(
            "mserve_model_wakes",
            "Models back from no worker (a load on demand, a scale from 0) by the tier of their"
            " weights",
            ["model", "version", "tier"], registry=self.prom,
        )  # fmt: skip
        self.warm_drops = Counter(
            "mserve_warm_tier_drops", "Models dropped from the warm tier to cold, by reason",
            ["model", "version", "reason"], registry=self.prom,
        )  # fmt: skip
        # in-place swaps of a model's version (server/models/swap.py), by how they ended
        self.model_swaps = Counter(
            "mserve_model_swaps", "In-place swaps of a model's version, by outcome",
            ["model", "outcome"], registry=self.prom,
        )  # fmt: skip
        # hot reloads of a model's handler code (server/models/reload.py): ok or failed
        self.handler_reloads = Counter(
            "mserve_handler_reloads", "Hot reloads of a model's handler code, by outcome",
            ["model", "version", "outcome"], registry=self.prom,
        )  # fmt: skip
        self.cancelled = Counter(
            "mserve_requests_cancelled", "Requests stopped before their answer was complete",
            ["model", "version", "reason"], registry=self.prom,
        )  # fmt: skip
        self.load_seconds = Histogram(
            "mserve_model_load_seconds", "From a request finding no worker to the worker ready",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=self.prom,
        )  # fmt: skip
        # inference logging (server/inference_log/): records sent, dropped (a sink's queue was
        # full) or failed (not delivered after its retries), per model version and sink
        self.inference_log_records = Counter(
            "mserve_inference_log_records", "Inference log records by sink and outcome",
            ["model", "version", "sink", "outcome"], registry=self.prom,
        )  # fmt: skip
        # archives whose signature failed its check at registration (server/signatures.py),
        # by reason (unsigned, invalid, untrusted, mismatch) and action (refused, warned)
        self.archive_signature_failures = Counter(
            "mserve_archive_signature_failures", "Archive signatures that failed their check",
            ["reason", "action"], registry=self.prom,
        )  # fmt: skip
        # weights files a registration's scan flagged (server/weights/), by verdict (dangerous,
        # unknown, unscannable) and action (refused under require, warned under warn)
        self.weights_flagged = Counter(
            "mserve_weights_flagged_files", "Weights files flagged by the registration's scan",
            ["model", "version", "verdict", "action"], registry=self.prom,
        )  # fmt: skip
        # canary rollouts (server/rollouts/canary.py): the canary's share of its model's
        # traffic, and how rollouts ended (promoted, rolled_back, aborted)
        self.canary_share = Gauge(
            "mserve_canary_share_percent", "A running canary's share of its model's traffic",
            ["model", "version"], registry=self.prom,
        )  # fmt: skip
        self.canary_ends = Counter(
            "mserve_canary_outcomes", "Canary rollouts ended, by outcome",
            ["model", "version", "outcome"], registry=self.prom,
        )  # fmt: skip
        self._models: Callable[[], Iterable[ObservedModel]] = tuple
        self._residency: ObservedResidency | None = None
        # (certificate file, its notAfter in epoch seconds) of the TLS listeners
        self._certificates: list[tuple[str, float]] = []
        # answers counted since the last scrape, by (model, version, code): a plain number per
        # request, added to ``requests`` when scraped (its inc() is four calls and a lock)
        self._answers: dict[tuple[str, str, int], list[int]] = {}
        # generative models (server/openai/): [prompt, generated] tokens of the usage the OpenAI
        # API reported, by (model, version); mserve_prompt_tokens_total and
        # mserve_generated_tokens_total when scraped
        self._tokens: dict[tuple[str, str], list[int]] = {}
        self.prom.register(self)  # type: ignore[arg-type]
        if mode not in METRICS_MODES:
            raise ConfigError(f"metrics_mode: {mode!r} is not one of {', '.join(METRICS_MODES)}")
        self.mode = mode
        self.hostname = hostname or socket.gethostname()
        self.uuid = str(uuid.uuid4())  # TorchServe labels its ts_* counters with one per start
        self.uuid_label = uuid_label
        self.gpus = tuple(gpus)
        # Requests2XX, 4XX, 5XX (1XX and 3XX count as 5XX, as TorchServe counts them)
        self.statuses = [0.0, 0.0, 0.0]
        self.queue_ms: float | None = None
        self.system: list[SystemValue] = []
        declared = dict(config.model) if config else default_families()
        self.frontend = config.frontend if config else None  # None: every frontend metric
        self.handler = HandlerMetrics(declared, self.hostname, auto_detect)
        self.system_metrics = system_metrics
        self.log_frontend = mode in ("log", "legacy")
        self.log_model = mode in ("log", "legacy")
        self.ts_log: MetricLog | None = None
        self.model_log: MetricLog | None = None
        if self.log_frontend and log_dir is None:
            raise ValueError("metrics_mode log and legacy need a log dir")
        if log_dir is not None:
            files = [_open_log(log_dir / n) for n in ("ts_metrics.log", "model_metrics.log")]
            if self.log_frontend:  # in prometheus mode they stay empty, as TorchServe's do
                self.ts_log, self.model_log = files
            else:
                for sink in files:
                    if sink is not None:
                        sink.close()

    def watch(
        self, models: Callable[[], Iterable[ObservedModel]], residency: ObservedResidency
    ) -> None:
        """Where the scrape-time metrics read the registered model versions and residency."""
        self._models = models
        self._residency = residency

    def watch_certificate(self, path: str, not_after: float) -> None:
        """The TLS certificate the listeners serve, for its expiry gauge (the alert rules in
        deploy/prometheus/ warn weeks ahead)."""
        self._certificates.append((path, not_after))

    # --- updates ------------------------------------------------------------------------

    def status(self, status: int) -> None:
        """An HTTP answer on the inference or management port (``Requests2XX`` ...)."""
        index = 0 if 200 <= status < 300 else 1 if 400 <= status < 500 else 2
        self.statuses[index] += 1
        if self.log_frontend:
            self.log_ts(("Requests2XX", "Requests4XX", "Requests5XX")[index], "Count", 1, ())

    def answered(
        self, model: ObservedModel, code: int, seconds: float | None,
        counts: list[float] | None = None, job: AnsweredJob | None = None,
    ) -> None:  # fmt: skip
        """Count one answer; label children are cached (``labels()`` costs more than ``inc()``).
        ``counts`` and ``job`` (a worker's answer): TorchServe's latency counters."""
        key = (model.name, model.version, code)
        tally = self._answers.get(key)
        if tally is None:
            tally = self._answers[key] = [0]
            self.requests.labels(model.name, model.version, str(code))  # listed from now on
        tally[0] += 1
        if seconds is None:
            return
        _observe(self._latency, model.name, seconds)
        if counts is None or job is None:
            return
        queue_s = job.sent_at - job.enqueued_at if job.sent_at else 0.0
        counts[1] += seconds * 1e6
        counts[2] += queue_s * 1e6
        self.queue_ms = queue_s * 1000
        if self.log_frontend:
            dims = (
                ("model_name", model.name),
                ("model_version", model.stats.label(counts is model.stats.named)),
            )
            self.log_ts("ts_inference_latency_microseconds", "Microseconds", seconds * 1e6, dims)
            self.log_ts("ts_queue_latency_microseconds", "Microseconds", queue_s * 1e6, dims)
            self.log_ts("QueueTime", "Milliseconds", self.queue_ms, ())

    def first_chunk(self, model: ObservedModel, seconds: float) -> None:
        """A streamed answer's first chunk went out ``seconds`` after its request arrived."""
        _observe(self._first_token, model.name, seconds)

    def tokens(self, model: ObservedModel, prompt: int, generated: int) -> None:
        """A generative request's usage (what its answer reported, or a stream's so far)."""
        key = (model.name, model.version)
        counts = self._tokens.get(key)
        if counts is None:
            counts = self._tokens[key] = [0, 0]
        counts[0] += prompt
        counts[1] += generated

    def handler_reloaded(self, name: str, version: str, outcome: str) -> None:
        """``outcome``: ``ok`` (every worker switched) or ``failed`` (the old code serves)."""
        self.handler_reloads.labels(name, version, outcome).inc()

    def rollout_share(self, name: str, version: str, percent: float) -> None:
        self.canary_share.labels(name, version).set(percent)

    def rollout_ended(self, name: str, version: str, outcome: str) -> None:
        self.canary_ends.labels(name, version, outcome).inc()

    def request_cancelled(self, name: str, version: str, reason: str) -> None:
        """``reason``: ``client`` (it went away) or ``deadline`` (clientTimeoutInMills)."""
        self.cancelled.labels(name, version, reason).inc()

    def model_loaded(self, name: str, version: str, seconds: float, ok: bool) -> None:
        outcome = "ok" if ok else "failed"
        self.model_loads.labels(name, version, outcome).inc()
        if ok:
            self.load_seconds.observe(seconds)

    def model_evicted(self, name: str, version: str, reason: str) -> None:
        """``reason``: ``idle`` (idle_unload_s) or ``budget`` (room for another model)."""
        self.model_evictions.labels(name, version, reason).inc()

    def model_woken(self, name: str, version: str, tier: str) -> None:
        """A model that had no worker has one ready (a load on demand, or a scale request from 0
        workers); ``tier``: ``warm`` (its worker mapped the weights the warm tier kept) or
        ``cold``."""
        self.model_wakes.labels(name, version, tier).inc()

    def warm_dropped(self, name: str, version: str, reason: str) -> None:
        """``reason``: ``budget``, ``too_big``, ``stale`` or ``unregistered``."""
        self.warm_drops.labels(name, version, reason).inc()

    def model_swapped(self, name: str, outcome: str) -> None:
        """``outcome``: ``done``, ``rolled_back`` or ``failed`` (the rollback failed too)."""
        self.model_swaps.labels(name, outcome).inc()

    def worker_loaded(self, name: str, version: str, worker_id: str, load_ms: float) -> None:
        if self.log_frontend:
            dims = (("WorkerName", worker_name(name, version, worker_id)),)
            self.log_ts("WorkerLoadTime", "Milliseconds", load_ms, dims)

    def declared_model_metrics(self) -> list[dict[str, Any]]:
        """The handler metrics the metrics config declares (its ``model_metrics``; without a
        config, TorchServe's HandlerTime and PredictionTime), for the workers: as TorchServe's
        worker reads metrics.yaml, a handler's ``get_metric`` finds them without defining them."""
        return [
            {"name": f.name, "type": f.type, "unit": f.unit,
             "dimensions": [label for label in f.labels if label != "Hostname"]}
            for f in self.handler.families.values() if f.declared
        ]  # fmt: skip

    def builtin_series(self, name: str, model_name: str) -> list[float] | None:
        """The stored value of HandlerTime or PredictionTime for one model; None when the
        metrics config leaves it out and auto-detection is off (TorchServe drops it then)."""
        family = self.handler.families.get(name)
        if family is None and self.handler.auto_detect:
            family = self.handler.families[name] = default_families()[name]
        if family is None:
            return None
        dims = {"ModelName": model_name, "Level": "Model", "Hostname": self.hostname}
        if set(family.labels) != set(dims):
            return None  # redeclared with other dimensions: the handler's own entries fill it
        return self.handler.series(family, tuple(dims[label] for label in family.labels))

    def handler_entries(
        self, model_name: str, entries: list[MetricEntry], jobs: Sequence[AnsweredJob]
    ) -> None:
        for entry in entries:
            applied = self.handler.add(model_name, entry)
            if applied is not None and self.log_model:
                family, values = applied
                ids = entry.request_id or request_ids(jobs)
                dims = tuple(zip(family.labels[:-1], values[:-1], strict=True))
                self.log_model_line(entry.name, family.unit, entry.value, dims, ids)

    # --- log mode -----------------------------------------------------------------------

    def log_ts(self, name: str, unit: str, value: float, dims: tuple[tuple[str, str], ...]) -> None:
        """A frontend metric update, in TorchServe's form, to ts_metrics.log; in legacy mode
        the three ts_* counters are served on /metrics instead."""
        if self.ts_log is None or (self.mode == "legacy" and name in LEGACY_PROMETHEUS):
            return
        if self.frontend is not None and name not in self.frontend:
            return
        if name not in LEGACY_PROMETHEUS:
            dims = (
                (("Level", "Host"), *dims)
                if name != "WorkerLoadTime"
                else (*dims, ("Level", "Host"))
            )
        self.ts_log.add(metric_line(name, unit, value, dims, self.hostname))

    def log_model_line(
        self, name: str, unit: str, value: float, dims: Iterable[tuple[str, str]], ids: str
    ) -> None:
        if self.model_log is not None and name in self.handler.families:
            self.model_log.add(metric_line(name, unit, value, dims, self.hostname, ids))

    def flush_logs(self) -> None:
        for sink in (self.ts_log, self.model_log):
            if sink is not None:
                sink.flush()

    def close(self) -> None:
        for sink in (self.ts_log, self.model_log):
            if sink is not None:
                sink.close()

    # --- system metrics -----------------------------------------------------------------

    def record_system(self, values: list[SystemValue]) -> None:
        self.system = values
        if self.ts_log is not None:
            for name, unit, dims, value in values:
                if self.frontend is None or name in self.frontend:
                    self.ts_log.add(metric_line(name, unit, value, dims, self.hostname))

    async def run(self) -> None:
        """The server's metrics chore: system metrics every minute, log lines every second."""
        loop = asyncio.get_running_loop()
        next_system = 0.0
        while True:
            if self.system_metrics and loop.time() >= next_system:
                next_system = loop.time() + SYSTEM_METRICS_INTERVAL_S
                try:
                    self.record_system(await asyncio.to_thread(system.measure, self.gpus))
                except (OSError, psutil.Error) as exc:
                    log.warning("could not collect system metrics: %s", exc)
            self.flush_logs()
            await asyncio.sleep(LOG_FLUSH_S)

    # --- scrape -------------------------------------------------------------------------

    def describe(self) -> list[Any]:
        """The families :meth:`collect` can yield, without samples: the registry maps their
        names to this collector, so TorchServe's ``?name[]=`` filter finds them too."""
        gauges = ("mserve_queue_depth", "mserve_workers_ready", "mserve_requests_pending",
                  "mserve_worker_memory_bytes", "mserve_worker_memory_budget_bytes",
                  "mserve_models_loaded", "mserve_worker_confined", "mserve_workers",
                  "mserve_workers_min", "mserve_queue_capacity",
                  "mserve_tls_certificate_expiry_timestamp_seconds")  # fmt: skip
        counters = ("mserve_prompt_tokens", "mserve_generated_tokens")
        return [
            *(GaugeMetricFamily(n, "") for n in gauges),
            *(CounterMetricFamily(n, "") for n in counters),
            self._latency_family(),
            self._first_token_family(),
        ]

    def collect(self) -> Any:
        queue = GaugeMetricFamily("mserve_queue_depth", "Jobs waiting", labels=["model", "version"])
        workers = GaugeMetricFamily(
            "mserve_workers_ready", "Ready workers", labels=["model", "version"]
        )
        # queued requests + busy workers (a batch counts once): over mserve_workers_ready, the
        # load per worker an autoscaler holds steady (docs/kubernetes.md); what a stop drains
        pending = GaugeMetricFamily(
            "mserve_requests_pending", "Requests queued, plus workers busy with a batch",
            labels=["model", "version"],
        )  # fmt: skip
        # 1: the worker applied the sandbox's Landlock rules; 0: it runs unconfined (the
        # sandbox is off, or the kernel has no Landlock): describe says why
        confined = GaugeMetricFamily(
            "mserve_worker_confined", "Workers confined by the sandbox (1) or not (0)",
            labels=["model", "version", "worker"],
        )  # fmt: skip
        labels = ["model", "version"]
        by_state = GaugeMetricFamily(
            "mserve_workers", "Workers by state", labels=["model", "version", "state"]
        )
        # what an alert compares with: minWorkers 0 (loads on demand) may have no worker at all;
        # the queue is full (503s) at mserve_queue_depth == mserve_queue_capacity
        floor = GaugeMetricFamily("mserve_workers_min", "minWorkers", labels=labels)
        capacity = GaugeMetricFamily("mserve_queue_capacity", "job_queue_size", labels=labels)
        for mv in self._models():
            queue.add_metric([mv.name, mv.version], mv.queued())
            workers.add_metric([mv.name, mv.version], mv.ready_workers())
            pending.add_metric([mv.name, mv.version], mv.pending())
            states = mv.worker_states()
            for state in WORKER_STATES:
                by_state.add_metric([mv.name, mv.version, state], states.count(state))
            floor.add_metric([mv.name, mv.version], mv.settings.min_workers)
            capacity.add_metric([mv.name, mv.version], mv.settings.job_queue_size)
            for worker_id, report in mv.worker_sandboxes():
                applied = bool(report and "landlock-files" in (report.get("applied") or ()))
                confined.add_metric([mv.name, mv.version, worker_id], float(applied))
        yield queue
        yield workers
        yield pending
        yield confined
        yield by_state
        yield floor
        yield capacity
        yield self._latency_family()
        if self._first_token:
            yield self._first_token_family()
        if self._tokens:
            yield from self._token_families()
        if self._certificates:
            expiry = GaugeMetricFamily(
                "mserve_tls_certificate_expiry_timestamp_seconds",
                "The TLS certificate's notAfter, in epoch seconds", labels=["file"],
            )  # fmt: skip
            for path, not_after in self._certificates:
                expiry.add_metric([path], not_after)
            yield expiry
        if tracing.current is not None:
            dropped = CounterMetricFamily(
                "mserve_trace_spans_dropped", "Spans not exported, by reason (server/tracing/)",
                labels=["reason"],
            )  # fmt: skip
            for reason, spans in tracing.current.dropped().items():
                dropped.add_metric([reason], spans)
            yield dropped
        if tenants.current is not None:  # per-tenant counts (server/tenants/)
            yield from tenants.current.families((mv.name, mv.queue) for mv in self._models())
        residency = self._residency
        if residency is None:
            return
        memory = GaugeMetricFamily(
            "mserve_worker_memory_bytes", "Workers' memory (PSS), as last measured"
        )
        memory.add_metric([], residency.memory_bytes)
        yield memory
        if residency.budget_bytes is not None:
            budget = GaugeMetricFamily(
                "mserve_worker_memory_budget_bytes", "worker_memory_budget_mb, in bytes"
            )
            budget.add_metric([], residency.budget_bytes)
            yield budget
        loaded = GaugeMetricFamily("mserve_models_loaded", "Model versions with workers")
        loaded.add_metric([], residency.loaded_models())
        yield loaded
        warm = residency.warm
        if warm.budget_bytes is not None:
            held = GaugeMetricFamily(
                "mserve_warm_tier_bytes",
                "Evicted models' weights kept in the page cache, and their parked workers' PSS",
            )
            held.add_metric([], warm.bytes)
            yield held
            budget = GaugeMetricFamily(
                "mserve_warm_tier_budget_bytes", "warm_tier_budget_mb, in bytes"
            )
            budget.add_metric([], warm.budget_bytes)
            yield budget
            models = GaugeMetricFamily("mserve_models_warm", "Model versions in the warm tier")
            models.add_metric([], len(warm.entries))
            yield models
            parked = GaugeMetricFamily(
                "mserve_warm_tier_parked_workers",
                "Evicted models' idle workers kept alive, parked in the warm tier",
            )
            parked.add_metric([], warm.parked)
            yield parked

    def _token_families(self) -> list[CounterMetricFamily]:
        labels = ["model", "version"]
        prompt = CounterMetricFamily(
            "mserve_prompt_tokens", "Prompt tokens of generative requests", labels=labels
        )
        generated = CounterMetricFamily(
            "mserve_generated_tokens", "Tokens generated for generative requests", labels=labels
        )
        for (name, version), (p, g) in list(self._tokens.items()):
            prompt.add_metric([name, version], p)
            generated.add_metric([name, version], g)
        return [prompt, generated]

    def _latency_family(self) -> HistogramMetricFamily:
        """``mserve_request_latency_seconds``, as a prometheus_client Histogram with its default
        buckets would write it."""
        return _histogram(
            "mserve_request_latency_seconds", "Inference latency, frontend to frontend",
            self._latency,
        )  # fmt: skip

    def _first_token_family(self) -> HistogramMetricFamily:
        return _histogram(
            "mserve_time_to_first_token_seconds",
            "Streamed answers: from the request's arrival to its first chunk sent",
            self._first_token,
        )

    def _count_answers(self) -> None:
        """Add the answers counted since the last scrape to ``mserve_requests_total``."""
        for (name, version, code), tally in self._answers.items():
            if tally[0]:
                self.requests.labels(name, version, str(code)).inc(tally[0])
                tally[0] = 0

    def exposition(self, names: set[str] | None = None) -> bytes:
        """Ours, then TorchServe's, in Prometheus's text format; only the metrics ``names``
        names when given (TorchServe's ``?name[]=...``)."""
        self._count_answers()
        ours = generate_latest(self.prom if not names else self.prom.restricted_registry(names))
        return ours + self.torchserve_text(names).encode("utf-8")

    def torchserve_text(self, names: set[str] | None = None) -> str:
        if self.mode == "log":
            return ""
        out = PromText(names)
        out.only = self.frontend  # a metrics config's ts_metrics section picks frontend metrics
        models = list(self._models())
        host = self.hostname
        first = 0 if self.uuid_label else 1  # TorchServe 0.8 dropped 0.7's uuid
        ts_labels = ("uuid", "model_name", "model_version", "hostname")[first:]
        for index, name in enumerate(LEGACY_PROMETHEUS):
            rows = []
            for mv in models:
                for named, counts in ((False, mv.stats.unnamed), (True, mv.stats.named)):
                    if counts[0] or counts[1]:
                        labels = (self.uuid, mv.name, mv.stats.label(named), host)[first:]
                        rows.append((labels, counts[index]))
            out.family(name, "counter", ("Count", "Microseconds", "Microseconds")[index],
                       ts_labels, rows)  # fmt: skip
        if self.mode == "legacy":
            return out.text()  # TorchServe's legacy mode: no handler metrics on /metrics either
        host_labels = ("Level", "Hostname")
        for i, name in enumerate(("Requests2XX", "Requests4XX", "Requests5XX")):
            rows = [(("Host", host), self.statuses[i])] if self.statuses[i] else []
            out.family(name, "counter", "Count", host_labels, rows)
        out.family("QueueTime", "gauge", "Milliseconds", host_labels,
                   [] if self.queue_ms is None else [(("Host", host), self.queue_ms)])  # fmt: skip
        thread = [
            mv.stats.worker_thread_ms for mv in models if mv.stats.worker_thread_ms is not None
        ]
        out.family("WorkerThreadTime", "gauge", "Milliseconds", host_labels,
                   [(("Host", host), thread[-1])] if thread else [])  # fmt: skip
        loads = []
        for mv in models:
            for worker_id, load_ms in mv.worker_load_ms():
                loads.append(((worker_name(mv.name, mv.version, worker_id), "Host", host), load_ms))
        out.family("WorkerLoadTime", "gauge", "Milliseconds", ("WorkerName", "Level", "Hostname"),
                   loads)  # fmt: skip
        # every system family, as TorchServe registers them at start: without samples until
        # measured, and for good with disable_system_metrics (GPU ones on a host without GPUs)
        for name, unit, labels in system.FAMILIES:
            rows = [
                ((*(v for _k, v in dims), host), value)
                for measured, _unit, dims, value in self.system
                if measured == name
            ]
            out.family(name, "gauge", unit, (*labels, "Hostname"), rows)
        out.only = None
        for family in self.handler.families.values():
            if family.type == "histogram":
                out.histogram(family)
            else:
                rows = [(values, stored[0]) for values, stored in family.series.items()]
                out.family(family.name, family.type, family.unit, family.labels, rows)
        return out.text()


class MetricsAPI:
    """The router of the metrics port: ``GET /metrics`` in Prometheus's text format."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def route(self, conn: Connection, req: Request) -> None:
        if req.parts != ["metrics"]:
            raise req.not_found()
        req.allow("GET")
        names = None
        if req.query_string:
            query = parse_qsl(req.query_string.decode("utf-8", "replace"))
            names = {value for key, value in query if key == "name[]"} or None
        content_type = "text/plain; version=0.0.4; charset=utf-8"
        body = self.metrics.exposition(names)
        conn.answer(req, 200, [["Content-Type", content_type]], body)


def _open_log(path: Path) -> MetricLog | None:
    """One of TorchServe's metric log files, opened for appending (its folder made); None, with
    a warning, where it cannot be written: TorchServe starts without it too."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return MetricLog(path)
    except OSError as exc:
        log.warning("cannot write %s (%s): its metrics are not logged", path, exc.strerror or exc)
        return None


def _observe(rows: dict[str, list[float]], name: str, seconds: float) -> None:
    """One observation in ``name``'s row: a count per LATENCY_BUCKETS bound and +Inf, then the
    sum (cumulated at scrape, see _histogram)."""
    row = rows.get(name)
    if row is None:
        row = rows[name] = [0.0] * (len(LATENCY_BUCKETS) + 2)
    row[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # the first bound >= it: "le"
    row[-1] += seconds


def _histogram(
    name: str, documentation: str, rows: dict[str, list[float]]
) -> HistogramMetricFamily:
    """Per-model rows as a prometheus_client Histogram with its default buckets writes them."""
    family = HistogramMetricFamily(name, documentation, labels=["model"])
    for model, row in rows.items():
        buckets, total = [], 0.0
        for bound, count in zip(_LATENCY_LE, row[:-1], strict=True):
            total += count
            buckets.append((bound, total))
        family.add_metric([model], buckets, row[-1])
    return family
