"""One registered model version: its settings, its job queue and its supervised workers.

Each worker slot (server/models/slot.py) is a task that starts a worker, serves batches from the
queue while it lives, and restarts it with TorchServe's backoff when it is lost, until no worker
has loaded for maxRetryTimeoutInSec. Scaling adds slots or retires them; a retiring worker
finishes its batch first, and idle workers are retired before busy ones. A model that loads on
demand starts its first slot from a request.

What the management API shows of it is server/models/describe.py. The rest stays one class, at
some 700 lines: admission, supervision and recovery, scaling and on-demand loading all read and
change the same slots, queue and failure state, and split apart they would pass it all around.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mserve_worker.protocol import RequestItem
from server import tenants
from server.config.model_settings import SEQUENCE_HEADERS, ModelSettings, whole, with_changes
from server.devices import GpuPlan, worker_env_for
from server.errors import (
    HandlerLoadFailed,
    InternalError,
    InvalidModel,
    LoadFailed,
    MserveError,
    RequestExpired,
    ServiceUnavailable,
    TooManyRequests,
)
from server.inference_log import InferenceLogger
from server.logs import OURS_ONLY, worker_facts
from server.metrics.model_stats import ModelStats
from server.metrics.server_metrics import Metrics
from server.models.batching import Job, JobQueue, QueueFull
from server.models.continuous import ContinuousPump
from server.models.fair import FairJobQueue
from server.models.pump import BatchPump
from server.models.residency import Residency
from server.models.sequences import Sequences
from server.models.slot import SERVING, Ended, Slot
from server.models.warm import Taken
from server.streaming import ChunkStream
from server.weights.scan import WeightsScan
from server.workers.launch import Launcher
from server.workers.process import Worker, WorkerSpec, WorkerState
from server.workers.sandbox import ModelSandbox

if TYPE_CHECKING:
    from server.signatures import SignatureRecord
    from server.tenants import Tenant
    from server.tracing import RequestTrace

log = logging.getLogger(__name__)
# TorchServe's words for the same events (its WorkerThread's), which its tests and runbooks
# wait for: logged in its layout only (server/logs.py)
_said_as_torchserve = logging.getLogger("org.pytorch.serve.wlm.WorkerThread")

_worker_ids = itertools.count(9000)  # TorchServe numbers workers from 9000

# A slot's lane (sequence batching) holds at most one request per sequence bound to it:
# maxNumSequence bounds it, not a size of its own.
LANE_SIZE = 1 << 30
# Restarting a lost worker, as TorchServe's WorkerThread does: the slot's n-th restart in a
# row waits BACKOFF_STEPS[n] x BACKOFF_UNIT_S (TorchServe's BACK_OFF, in seconds: 1, 1, 2, 3,
# 5, ..., the last step from then on); a worker that loads starts the sequence again. A slot
# whose worker has not loaded for the model's maxRetryTimeoutInSec since it was lost gives up.
# Workers that load, then die (the OOM killer, an operator, a node agent killing served
# workers), are restarted for as long as they keep loading: that is no handler that cannot
# load, and failing the model for them would turn a few 500s into 503s for everyone.
BACKOFF_STEPS = (0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597)
BACKOFF_UNIT_S = 1.0
# Loads on demand have no backoff (each request that finds no worker starts one): this many
# failed ones within FAILURE_WINDOW_S mark the model failed.
FAILURES_TO_GIVE_UP = 5
FAILURE_WINDOW_S = 120.0
# how long a wake waits for its model's worker being parked (parking takes milliseconds)
HANDOVER_WAIT_S = 2.0


class ModelVersion:
    def __init__(
        self,
        *,
        name: str,
        version: str,
        url: str,
        model_dir: Path,
        manifest: dict[str, Any],
        handler: str,
        settings: ModelSettings,
        model_yaml_config: dict[str, Any],
        python: str,
        gpus: GpuPlan,
        launcher: Launcher,
        server_version: str,
        max_payload_bytes: int,
        loaded_at_startup: bool,
        max_response_bytes: int | None = None,
        metrics: Metrics | None = None,
        service_envelope: str = "",
        sandbox: ModelSandbox | None = None,
        sequence_headers: tuple[str, str, str] = SEQUENCE_HEADERS,
    ) -> None:
        self.name = name
        self.version = version
        self.url = url
        self.model_dir = model_dir
        self.manifest = manifest
        self.handler = handler
        self.settings = settings
        self.model_yaml_config = model_yaml_config
        self.python = python
        self.gpus = gpus
        self.launcher = launcher
        self.server_version = server_version
        self.max_payload_bytes = max_payload_bytes
        self.max_response_bytes = max_response_bytes
        self.service_envelope = service_envelope
        self.sequence_headers = sequence_headers  # (id, start, end): ts_header_key_sequence_*
        self.sandbox = sandbox  # what its workers may reach; None: unconfined (sandbox: false)
        self.loaded_at_startup = loaded_at_startup
        # its answers' tokens count against tenants' token quotas (docs/generative.md, tenants.md)
        self.generative = model_yaml_config.get("generative") not in (None, False)
        # fair between tenants while the server has some (server/tenants/, server/models/fair.py)
        self.queue = (JobQueue if tenants.current is None else FairJobQueue)(
            settings.job_queue_size
        )
        self.slots: list[Slot] = []
        self._retiring: set[Slot] = set()
        self.sequences = (
            Sequences(
                self.label,
                lambda: self.settings,
                sequence_headers,
                self._lanes,
                lambda reason: self.stats.cancelled(reason),
            )
            if settings.sequence_batching
            else None
        )
        self.failed: str | None = None
        self.recent_failures: list[float] = []  # of loads on demand
        # TorchServe's count of requests in a row that got no answer in time (see _no_answer)
        self.unanswered = 0
        self.registered_at = time.time()
        self.stage: str | None = None  # what a loading model is doing (building environment, ...)
        self.env_key: str | None = None
        self.trusted = False  # registered by the operator (--models, snapshot), not the API
        self.weights_scan: WeightsScan | None = None  # its weights' scan (server/weights/)
        self.archive_sha256: str | None = None  # pinned in the snapshot (see server/download.py)
        self.handler_overridden = False
        self.signature: SignatureRecord | None = None  # its archive's (server/signatures.py)
        self.last_output = ""  # the last lines a failed worker printed, for describe
        # withheld server variables the model config names in allowedEnvVars (environ.py)
        self.worker_env = launcher.environment.for_model(
            model_yaml_config.get("allowedEnvVars") or (), self.label
        )
        self.stats = ModelStats(metrics, name, version)  # TorchServe's metrics
        # the handler metrics the metrics config declares: a handler's get_metric finds them
        self.declared_metrics = [] if metrics is None else metrics.declared_model_metrics()
        # loading on demand (server/models/residency.py): the server's residency keeper, whether the
        # model is ready to start workers (its environment built), when it was last asked for
        self.residency: Residency | None = None
        self.prepared = False
        self.last_used = time.monotonic()
        self.asked = 0  # requests queued: their rate weighs evictions (server/models/eviction.py)
        # records each sampled request for monitoring (server/inference_log/); None: off
        self.inference_log: InferenceLogger | None = None
        # the workflow this version is a node of (server/workflows/), else None
        self.workflow: str | None = None
        # a swap's new version (server/models/swap.py): a request finding no worker waits for
        # the swap's next one instead of loading one on demand
        self.held = False
        self.removing = False  # being unregistered: its workers are stopping

    @property
    def label(self) -> str:
        return f"{self.name}:{self.version}"

    # --- requests ---------------------------------------------------------------------------

    def ready_workers(self) -> int:
        return sum(
            1
            for s in self.slots
            if s.worker is not None and s.worker.state in (WorkerState.READY, WorkerState.BUSY)
        )

    def worker_states(self) -> list[str]:
        """Each worker's state, for ``mserve_workers{state}`` (server/metrics/server_metrics.py)."""
        return [s.worker.state.value for s in self.slots if s.worker is not None]

    def worker_load_ms(self) -> list[tuple[str, float]]:
        """(worker id, how long it took to load) of each worker that has loaded."""
        return [
            (s.worker.id, s.worker.load_ms)
            for s in self.slots
            if s.worker is not None and s.worker.load_ms is not None
        ]

    def worker_sandboxes(self) -> list[tuple[str, dict[str, Any] | None]]:
        """(worker id, how it confined itself) of each ready worker (None: not confined)."""
        return [
            (s.worker.id, s.worker.sandbox)
            for s in self.slots
            if s.worker is not None and s.worker.state in SERVING
        ]

    def queued(self) -> int:
        """Requests waiting: in the queue, or already sent to a worker that has not started them
        (see ``pipeline_depth``). ``job_queue_size`` bounds this number."""
        if self.sequences is not None:
            return self.sequences.waiting_requests() + self._waiting_in_workers()
        return len(self.queue) + self._waiting_in_workers()

    def _waiting_in_workers(self) -> int:
        n = 0  # a plain loop: per request, a generator under sum() costs twice as much
        for slot in self.slots:
            if slot.worker is not None:
                n += slot.worker.waiting_requests
        return n

    def pending(self) -> int:
        """Requests queued or being run by a worker."""
        busy = sum(
            1 for s in self.slots if s.worker is not None and s.worker.state is WorkerState.BUSY
        )
        return self.queued() + busy

    def healthy(self) -> bool:
        return self.failed is None and self.ready_workers() >= self.settings.min_workers

    def ready(self) -> bool:
        """Per-model readiness (KServe v1/v2, Triton's client): whether a request sent now is
        served. A model kept at zero workers that loads on demand counts as ready while
        unloaded, as ModelMesh reports its models in ``Standby``: the request waits for a
        load instead of failing. ``load_state`` says whether it is resident."""
        if self.failed is not None:
            return False
        return self.ready_workers() > 0 or (
            self.settings.min_workers == 0 and self.loads_on_demand()
        )

    def load_state(self) -> str:
        """``loaded`` (a worker serves), ``loading`` (workers, none ready yet) or ``unloaded``
        (no worker: the next request starts one when ``max_workers`` >= 1)."""
        if not self.slots:
            return "unloaded"
        return "loaded" if self.ready_workers() else "loading"

    def loads_on_demand(self) -> bool:
        """A request finding no worker starts one: max_workers 0 keeps TorchServe's 503."""
        return self.settings.max_workers >= 1 and self.prepared

    def enqueue(
        self, item: RequestItem, trace: RequestTrace | None = None, tenant: Tenant | None = None,
        charged: bool = True,
    ) -> Job:  # fmt: skip
        """Queue a request; the job's future gets its answer. A caller that goes away cancels
        the future and calls :meth:`withdraw`: the request is dropped if no worker has started
        it. Raises at once when the request cannot be queued (429 queue full, 503 no worker or
        failed model). ``trace``: the request's server span (server/tracing/). ``tenant``: who
        sent it (server/tenants/): over its quota, 429 before it takes a queue slot (and before
        a load on demand starts); ``charged`` False: its lane in the fair queue, not its quota
        (a shadow's copy of its request)."""
        if self.failed is not None:
            raise ServiceUnavailable(f"model {self.label} has failed: {self.failed}")
        load = not self.slots and not self.held
        if load and not self.loads_on_demand():
            raise ServiceUnavailable(  # TorchServe's words
                f'Model "{self.name}" has no worker to serve inference request. Please use'
                " scale workers API to add workers."
            )
        self.last_used = time.monotonic()
        self.asked += 1
        job = Job(item, self.queue.new_future())
        job.trace = trace
        if tenant is not None and not charged:
            job.tenant, tenant = tenant, None
        if tenant is not None:
            if trace is not None:
                trace.attributes["mserve.tenant"] = tenant.name
            # over quota: raises, and nothing is queued
            job.meter = tenant.admit(self.name, job.future, self.generative)
            job.tenant = tenant
        if load:  # after the quota: a request over it starts no load
            self._load_on_demand()
        try:
            if self.sequences is not None:
                if self.queued() >= self.queue.maxsize:
                    raise QueueFull
                self.sequences.admit(job)
            else:
                self.queue.put(job, self._waiting_in_workers())
        except QueueFull:
            job.future.cancel()  # counts it out of its tenant's requests in flight
            raise TooManyRequests(
                f"model {self.label} queue is full (job_queue_size={self.queue.maxsize})"
            ) from None
        timeout_ms = self.settings.client_timeout_ms
        if timeout_ms:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(timeout_ms / 1000, self._expire, job, timeout_ms)
            job.future.add_done_callback(functools.partial(_answered_in_time, timer))
        return job

    def withdraw(self, job: Job) -> None:
        """The caller of ``job`` went away (its future is cancelled). Still queued, it is skipped
        when popped; already sent, the worker skips it if it has not started its batch;
        generating (continuous batching), it leaves the next step."""
        if job.cancel("client"):
            self.stats.cancelled("client")

    def _lanes(self) -> list[JobQueue]:
        """The job queue of each live worker slot (sequence batching)."""
        return [slot.lane for slot in self.slots if slot.lane is not None]

    def _wake_all(self, gone: list[Slot] | None = None) -> None:
        """Make every waiting pump re-check its state (retire, stop): the queue's and the lanes'
        of the slots, retiring ones and ``gone`` ones included."""
        self.queue.wake_all()
        for slot in [*self.slots, *self._retiring, *(gone or ())]:
            if slot.lane is not None:
                slot.lane.wake_all()

    def _fail_queued(self, error: MserveError, gone: list[Slot] | None = None) -> None:
        """Fail every request that waits for a worker: in the queue, or in a slot's lane."""
        self.queue.fail_all(error)
        if self.sequences is not None:
            for slot in [*self.slots, *self._retiring, *(gone or ())]:
                if slot.lane is not None:
                    slot.lane.fail_all(error)
            self.sequences.close_all()

    def _expire(self, job: Job, timeout_ms: int) -> None:
        """``job``'s deadline passed (clientTimeoutInMills): unless it was answered, it stops
        and its caller gets a 504."""
        error = RequestExpired(
            f"request {job.item.request_id} to model {self.label} did not complete within"
            f" clientTimeoutInMills={timeout_ms} (queue time included); it was dropped"
        )
        if job.cancel("deadline", error):
            self.stats.cancelled("deadline")

    # --- workers ----------------------------------------------------------------------------

    def _spec(self, worker_id: str, gpu: str | None) -> WorkerSpec:
        init = {
            "model_name": self.name,
            "model_version": self.version,
            "worker_id": worker_id,
            "handler_style": (self.manifest.get("mserve") or {}).get("handlerStyle"),
            "model_dir": str(self.model_dir),
            "handler": self.handler,
            "manifest": self.manifest,
            "batch_size": self.settings.batch_size,
            "gpu_id": None if gpu is None else 0,  # the only GPU it can see is cuda:0
            "server_name": "mserve",
            "server_version": self.server_version,
            "limit_max_image_pixels": True,
            "model_yaml_config": self.model_yaml_config,
            "server_pid": os.getpid(),  # a busy worker exits when the server is gone
            "max_response_bytes": self.max_response_bytes,  # checked before the answer is sent
            "service_envelope": self.service_envelope,
            "continuous_batching": self.settings.continuous_batching,
            "sequence_headers": dict(
                zip(("id", "start", "end"), self.sequence_headers, strict=True)
            ),
        }
        if self.inference_log is not None:  # v2 model classes then say what they log
            init["inference_log"] = True
        if self.declared_metrics:
            init["model_metrics"] = self.declared_metrics
        env = {**self.worker_env, **worker_env_for(gpu)}
        if self.sandbox is not None:
            init["sandbox"] = self.sandbox.policy(gpu, self.python)
            env.update(self.sandbox.env())
        if self.residency is not None and self.residency.warm.enabled:
            # map checkpoints from the page cache, legacy ones copied once (docs/warm-tier.md)
            init.update(self.residency.warm.worker_init(
                self.name, self.version, init.get("sandbox"),
                self.sandbox.user if self.sandbox is not None else None,
            ))  # fmt: skip
        return WorkerSpec(
            python=self.python,
            model_dir=self.model_dir,
            init=init,
            env=env,
            max_payload_bytes=self.max_payload_bytes,
            parallel=self.settings.parallel,  # torchrun's ranks (server/workers/ranks.py)
        )

    def _note_failure(self, message: str) -> None:
        """A load on demand failed: enough of them in a row mark the model failed."""
        now = time.monotonic()
        self.recent_failures = [t for t in self.recent_failures if now - t < FAILURE_WINDOW_S]
        self.recent_failures.append(now)
        if len(self.recent_failures) >= FAILURES_TO_GIVE_UP and self.failed is None:
            self._mark_failed(
                f"{len(self.recent_failures)} worker failures within {FAILURE_WINDOW_S:g} s;"
                f" last: {message}"
            )

    def _mark_failed(self, reason: str) -> None:
        self.failed = reason
        log.error("model %s marked failed: %s", self.label, reason)
        # the requests that waited get the answer the next ones get
        self._fail_queued(ServiceUnavailable(f"model {self.label} has failed: {reason}"))

    async def _run_slot(self, slot: Slot) -> None:
        """Keep a worker running in ``slot`` until it retires, the slot gives up (see
        :meth:`_recover`) or the model fails: start one, serve it, restart it when it is lost. A
        failure of the supervision itself (a bug of ours, never the handler's) is logged with
        its traceback and handled as a lost worker: a start waiting on the slot gets it at
        once, otherwise the slot starts over after the backoff, so it neither hangs a
        registration nor leaves a model a worker short without a word."""
        gpu = self.gpus.draw()  # once per slot: a restarted worker keeps its GPU
        while not slot.retire.is_set() and self.failed is None:
            try:
                outcome = await self._run_worker(slot, gpu)
            except Exception as exc:
                log.exception("model %s: unexpected error supervising a worker", self.label,
                              extra=self._about(slot.worker_id))  # fmt: skip
                error = InternalError(
                    f"internal error supervising a worker of {self.label}: {exc!r}"
                )
                worker = slot.worker
                if worker is not None and worker.state is not WorkerState.STOPPED:
                    await worker.kill()
                if slot.first_start is not None and not slot.first_start.done():
                    slot.first_start.set_exception(error)
                    if not slot.keep_trying:
                        return
                outcome = error.message
            if outcome is Ended.FIRST_START_FAILED:
                return
            if outcome is Ended.RETIRED or not await self._recover(slot, outcome):
                break
        if slot.parking is not None:  # retired before its parked worker was handed over
            slot.parking.cancel()  # the park then stops it
        if slot.parked is not None:  # retired before its parked worker was woken
            slot.parked, parked = None, slot.parked
            await parked.stop(5.0)
        worker = slot.worker
        kept = slot.park and await self._parked(worker)  # (settles a wake waiting for it)
        if worker is not None and worker.state is not WorkerState.STOPPED and not kept:
            await worker.stop(5.0)
        if slot.lane is not None and self.sequences is not None and slot not in self.slots:
            self.sequences.unbind(slot.lane)  # its sequences go on elsewhere, state lost
        others = [s for s in self._retiring if s is not slot and s.task and not s.task.done()]
        if not self.slots and not others:  # the last worker is gone: nobody will run these
            self._fail_queued(ServiceUnavailable(f"model {self.label} has no workers left"))

    async def _parked(self, worker: Worker | None) -> bool:
        """Its slot retired by an eviction that keeps the model warm: park its idle worker in
        the warm tier rather than stop it (server/models/warm_keeper.py); whether it was.
        Never under sequence batching: a sequence's state lives in its handler."""
        if self.residency is None:
            return False
        return await self.residency.keeper.park(self, worker, allowed=self.sequences is None)

    async def _woken(self, slot: Slot, parked: Worker) -> Worker | None:
        """The parked worker its admission took, woken and put in ``slot``; None when it
        cannot serve as it is (its settings changed since it was parked, or it failed to wake:
        it is stopped and a new one starts)."""
        if parked.spec != self._spec(parked.id, parked.gpu):
            log.info("model %s: its parked worker %s was started with other settings; a new"
                     " one starts", self.label, parked.id)  # fmt: skip
            await parked.stop(5.0)
            return None
        if not parked.unpark():
            log.warning("model %s: its parked worker %s was lost while parked (%s); a new one"
                        " starts", self.label, parked.id, parked.exit_text())  # fmt: skip
            await parked.kill()
            return None
        slot.worker_id, slot.worker = parked.id, parked
        log.info("model %s: parked worker %s serves again", self.label, parked.id,
                 extra=self._about(parked.id))  # fmt: skip
        return parked

    async def _handed_over(self, parking: asyncio.Future[Any]) -> Worker | None:
        """The worker the park under way hands over (None when it was not parked), waited
        for at most ``HANDOVER_WAIT_S``; past it the park stops its worker and a new one
        starts here."""
        try:
            worker = await asyncio.wait_for(parking, HANDOVER_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("model %s: its worker being parked did not come within %g s; a new one"
                        " starts", self.label, HANDOVER_WAIT_S)  # fmt: skip
            return None
        return worker if isinstance(worker, Worker) else None

    async def _started(self, slot: Slot, gpu: str | None) -> Worker | str | Ended:
        """A new worker started in ``slot`` and ready; else why its start failed, or
        FIRST_START_FAILED (its caller was told)."""
        worker = Worker(slot.worker_id, self.label, gpu, self._spec(slot.worker_id, gpu))
        slot.worker = worker
        try:
            try:
                await worker.start(self.settings.startup_timeout_s, self.launcher)
            except OSError as exc:  # the interpreter could not even be started
                await worker.kill()
                raise HandlerLoadFailed(
                    f"cannot start a worker for {self.label} with {self.python}: {exc}"
                ) from exc
        except InvalidModel as exc:
            if worker.timed_out:
                self._no_answer(worker)
            log.error(  # in TorchServe's layout its traceback and WorkerThread lines say it
                "model %s: %s", self.label, exc.message,
                extra={**self._about(worker.id), **OURS_ONLY},
            )  # fmt: skip
            self.last_output = worker.tail()
            if slot.first_start is not None and not slot.first_start.done():
                slot.first_start.set_exception(exc)
                if not slot.keep_trying:
                    return Ended.FIRST_START_FAILED
            return exc.message
        return worker

    async def _run_worker(self, slot: Slot, gpu: str | None) -> str | Ended:
        """One worker's life in ``slot``: started (or its parked worker woken), served until
        it retires or is lost. Returns why it was lost, or how it ended otherwise."""
        parked, slot.parked = slot.parked, None
        if slot.parking is not None:  # asked for while its last worker was being parked
            parking, slot.parking = slot.parking, None
            parked = await self._handed_over(parking)
        worker = await self._woken(slot, parked) if parked is not None else None
        if worker is None:
            worker = await self._started(slot, gpu)
            if not isinstance(worker, Worker):
                return worker
        if slot.first_start is not None and not slot.first_start.done():
            slot.first_start.set_result(None)
        if slot.on_ready is not None:  # a scale from 0: the first one ready counts the wake
            slot.on_ready, ready = None, slot.on_ready
            ready(worker)
        slot.backoff_step = 0
        if slot.recovering_since is not None:
            slot.recovering_since, slot.losses = None, 0
            _said_as_torchserve.info(
                "Auto recovery succeeded, reset recoveryStartTS", extra=self._about(worker.id)
            )
        woken = worker is parked  # a parked worker's load was counted when it loaded
        if self.stats.metrics is not None and worker.load_ms is not None and not woken:
            self.stats.metrics.worker_loaded(self.name, self.version, worker.id, worker.load_ms)
        queue, others_serve = self.queue, lambda: bool(self.slots)
        if slot.lane is not None:  # a lane's requests wait for this slot alone
            queue, others_serve = slot.lane, lambda: False
        pump = (ContinuousPump if self.settings.continuous_batching else BatchPump)(
            self.label,
            queue,
            self.settings,
            self.stats,
            others_serve,
            self.inference_log,
        )
        ended = await pump.serve(worker, slot.retire)
        if ended is None:
            return Ended.RETIRED
        self.last_output = worker.tail()
        if worker.timed_out:  # we kill it for a slow or hung batch
            self._no_answer(worker)
        return ended

    def _no_answer(self, worker: Worker) -> None:
        """``worker`` passed its startup or response timeout and is killed: TorchServe's two
        lines (its count of requests in a row without an answer, which an answer from the
        worker that timed out starts again), which its tests and runbooks wait for."""
        if worker.answered_batches:
            self.unanswered = 0
        self.unanswered += 1
        about = self._about(worker.id)
        _said_as_torchserve.error(
            "Number or consecutive unsuccessful inference %d", self.unanswered, extra=about
        )
        _said_as_torchserve.error(
            "Backend worker error\norg.pytorch.serve.wlm.WorkerInitializationException:"
            " Backend worker did not respond in given time", extra=about,
        )  # fmt: skip

    def _about(self, worker_id: str) -> dict[str, str]:
        """The facts a log line about one of its workers carries (server/logs.py)."""
        return worker_facts(self.name, self.version, worker_id)

    async def _recover(self, slot: Slot, why: str) -> bool:
        """``slot`` lost its worker (``why``): restart it after the backoff, as TorchServe's
        WorkerThread retries (its console lines said in its layout), unless no worker has
        loaded in the slot for maxRetryTimeoutInSec since it was lost: then the slot gives up
        (False). The model is marked failed when no other worker serves it, which answers its
        requests 503 with the reason; otherwise it serves on with fewer workers (``/ping`` says
        Unhealthy below minWorkers) until it is scaled again."""
        worker = slot.worker
        loaded = worker is not None and worker.load_ms is not None
        state = "WORKER_MODEL_LOADED" if loaded else "WORKER_STARTED"
        about = self._about(slot.worker_id)  # TorchServe's lines, on its worker's thread
        _said_as_torchserve.info("%s Worker disconnected. %s", slot.worker_id, state, extra=about)
        now = time.monotonic()
        slot.losses += 1
        if slot.recovering_since is None:
            slot.recovering_since = now
            _said_as_torchserve.info(
                "Auto recovery start timestamp: %d", time.time() * 1000, extra=about
            )
        else:
            _said_as_torchserve.warning("Auto recovery failed again", extra=about)
        window = max(0.0, float(self.settings.max_retry_timeout_s))
        if now - slot.recovering_since >= window:
            self._give_up(slot, why, window)
            return False
        slot.backoff_step = min(slot.backoff_step + 1, len(BACKOFF_STEPS) - 1)
        delay = BACKOFF_STEPS[slot.backoff_step] * BACKOFF_UNIT_S
        first_line = why.partition("\n")[0].rstrip(": ")
        log.warning("model %s: %s; restarting in %g s", self.label, first_line, delay, extra=about)
        _said_as_torchserve.info(
            "Retry worker: %s in %g seconds.", slot.worker_id, delay, extra=about
        )
        await self._sleep_unless_retired(slot, delay)
        return True

    def _give_up(self, slot: Slot, why: str, window: float) -> None:
        tries = "once" if slot.losses == 1 else f"{slot.losses} times"
        reason = (
            f"worker {slot.worker_id} was lost {tries} without loading again within"
            f" maxRetryTimeoutInSec={whole(window)}; last: {why}"
        )
        serving = [
            s for s in self.slots if s is not slot and s.worker and s.worker.state in SERVING
        ]
        if not serving:
            self._mark_failed(reason)
            return
        log.error(
            "model %s: %s; it is not restarted: the model serves with %d worker(s) until it"
            " is scaled again", self.label, reason, len(serving),
            extra=self._about(slot.worker_id),
        )  # fmt: skip
        if slot in self.slots:
            self.slots.remove(slot)
            self._wake_all([slot])

    async def _sleep_unless_retired(self, slot: Slot, delay_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(slot.retire.wait(), delay_s)

    def _add_slot(self, wait: bool, on_demand: bool = False, keep_trying: bool = False) -> Slot:
        # only a synchronous caller (or a request waiting for an on-demand load) waits on the
        # first start; otherwise failures take the normal restart-with-backoff path instead of
        # ending the slot. ``keep_trying``: the caller is told of a failed first start and the
        # slot takes that path all the same
        first = asyncio.get_running_loop().create_future() if wait or on_demand else None
        slot = Slot(
            str(next(_worker_ids)), first_start=first, on_demand=on_demand, keep_trying=keep_trying
        )
        if self.sequences is not None:  # fair between tenants too, counted as the queue's
            queue = self.queue
            slot.lane = (
                FairJobQueue(LANE_SIZE, queue.served)
                if isinstance(queue, FairJobQueue)
                else JobQueue(LANE_SIZE)
            )
        run = self._run_on_demand(slot) if on_demand else self._run_slot(slot)
        slot.task = asyncio.create_task(run, name=f"{self.label}-slot")
        self.slots.append(slot)
        if self.sequences is not None:
            self.sequences.slot_added()
        return slot

    # --- on demand --------------------------------------------------------------------------

    def _load_on_demand(self) -> None:
        """A request found no worker: start one. The request queues meanwhile; if the load
        fails, everything queued fails with its error. Called synchronously from ``enqueue``,
        so concurrent first requests find this slot and start no other."""
        slot = self._add_slot(wait=False, on_demand=True)
        assert slot.first_start is not None
        slot.first_start.add_done_callback(functools.partial(self._loaded, slot, time.monotonic()))
        log.info("model %s: a request found no worker; loading on demand", self.label)

    async def _run_on_demand(self, slot: Slot) -> None:
        if self.residency is not None:
            try:
                # room in the budget, evicting if need be; what it takes from the warm tier
                taken = await self.residency.admit(self)
                slot.taken, slot.parking = taken.files, taken.parking
                if isinstance(taken.worker, Worker):
                    slot.parked = taken.worker
            except MserveError as exc:
                if slot.first_start is not None and not slot.first_start.done():
                    slot.first_start.set_exception(exc)
                return
        await self._run_slot(slot)

    def _loaded(self, slot: Slot, started: float, future: asyncio.Future[None]) -> None:
        """An on-demand load ended: count it; a failed one fails the requests that waited."""
        error = None if future.cancelled() else future.exception()
        seconds = time.monotonic() - started
        source = ""  # where its weights came from, with the warm tier on
        if self.residency is not None:
            source = self.residency.loaded(self, seconds, error is None, slot.taken, slot.worker)
        if error is None:
            log.info("model %s loaded on demand in %.2f s%s", self.label, seconds, source)
            return
        if slot in self.slots:
            self.slots.remove(slot)
        message = error.message if isinstance(error, MserveError) else str(error)
        failed_load = isinstance(error, InvalidModel)
        if failed_load:
            error = LoadFailed(f"model {self.label} could not be loaded: {message}")
        if not self.slots:
            self._fail_queued(error)
        if failed_load:  # repeated ones mark the model failed, as crashing workers do
            self._note_failure(message)

    def idle_since(self) -> float | None:
        """When the model was last asked for, if it could be unloaded now: workers beyond
        ``min_workers``, every one of them ready (none busy or starting), nothing queued."""
        if len(self.slots) <= self.settings.min_workers or self.queued():
            return None
        for slot in self.slots:
            if slot.worker is None or slot.worker.state is not WorkerState.READY:
                return None
        return self.last_used

    def unload(self, why: str, park: bool = False) -> list[asyncio.Task[None]]:
        """Retire the workers beyond ``min_workers`` if :meth:`idle_since` allows it; the tasks
        that end when they have stopped (or, ``park``, been parked in the warm tier when it
        keeps them). A request arriving meanwhile starts a worker again."""
        if self.idle_since() is None:
            return []
        retired = self.slots[self.settings.min_workers :]
        self._retire(retired, park)
        log.info("model %s: %s %d idle worker(s) (%s)", self.label,
                 "parking or stopping" if park else "stopping", len(retired), why)  # fmt: skip
        return [s.task for s in retired if s.task is not None]

    def _retire(self, retired: list[Slot], park: bool = False) -> None:
        for slot in retired:
            slot.park = park
            slot.retire.set()
            self.slots.remove(slot)
            self._retiring.add(slot)  # owned until its worker has stopped
            if slot.task is not None:
                slot.task.add_done_callback(lambda _t, s=slot: self._retiring.discard(s))
        self._wake_all()

    def mapped_files(self) -> list[tuple[str, int]]:
        """The checkpoints its workers mapped (what the warm tier keeps when it is evicted)."""
        files = {f for s in self.slots if s.worker is not None for f in s.worker.mapped}
        return sorted(files)

    def live_workers(self, retiring: bool = True) -> list[tuple[int | None, bool]]:
        """(pid, still starting) of every worker not yet stopped, retiring ones included unless
        ``retiring`` is false (their memory is in use until they exit); the pid is None until
        its process is started."""
        out = []
        for slot in (*self.slots, *self._retiring) if retiring else self.slots:
            w = slot.worker
            if w is not None and w.state is not WorkerState.STOPPED:
                out.append((w.pid, w.state is WorkerState.STARTING))
        return out

    async def scale(
        self, min_workers: int, max_workers: int | None, synchronous: bool, source: str = "api",
        keep_trying: bool = False,
    ) -> None:  # fmt: skip
        """Bring the worker count to ``min_workers``; with ``synchronous`` wait for them.
        ``keep_trying`` (a startup model in TorchServe's layout): new workers that fail to load
        are retried with the backoff, as lost workers are, while this raises their first error.

        New workers must fit the server's budget (server/models/residency.py) like loads on demand:
        idle models are evicted for them, or the call waits up to ``load_wait_s`` and raises
        :class:`BudgetExhausted` with the settings left as they were. The new ``min_workers``
        is set before that wait, so evictions meanwhile leave this model's workers alone."""
        before, started = self.settings, time.monotonic()
        self.settings = with_changes(
            self.settings,
            source,
            min_workers=min_workers,
            max_workers=max(max_workers or 0, min_workers),
        )
        wanted = self.settings
        adding = min_workers - len(self.slots)
        taken = Taken()  # what the admission took from the warm tier
        if adding > 0 and self.residency is not None:
            try:
                taken = await self.residency.admit(self, adding)
            except MserveError:
                if self.settings is wanted:  # no other scale request changed them meanwhile
                    self.settings = before
                raise
        self.failed = None
        self.recent_failures = []
        # no await since the admission: the slots exist before the next one is counted
        from_0 = not self.slots and source is not None  # a scale request (not a registration)
        new = [
            self._add_slot(synchronous, keep_trying=keep_trying)
            for _ in range(min_workers - len(self.slots))
        ]
        if new and from_0 and self.residency is not None:  # a wake, as a load on demand's
            ready = self.residency.keeper.wake(self, started, taken.files)
            for slot in new:
                slot.on_ready = ready
        if isinstance(taken.worker, Worker):  # its parked worker: woken in a new slot
            if new:
                new[0].parked = taken.worker
            elif self.residency is not None:  # another start took the room meanwhile
                self.residency.warm.stop_later(taken.worker)
        if taken.parking is not None:  # its worker being parked: handed to a new slot
            if new:
                new[0].parking = taken.parking
            else:
                taken.parking.cancel()
        retire = len(self.slots) - min_workers
        retired: list[Slot] = []
        if retire > 0:
            order = sorted(self.slots, key=lambda s: not s.idle)  # idle ones first
            retired = order[:retire]
            files = self.mapped_files()  # scaled to 0 by hand: its weights go warm, as idle
            self._retire(retired, park=min_workers == 0)
            if not self.slots and self.residency is not None:
                self.residency.keep_warm(self, files, parking=True)
        if synchronous:
            await self._await_started(new, keep_trying)
            await asyncio.gather(*(s.task for s in retired if s.task is not None))

    async def _await_started(self, slots: list[Slot], keep_trying: bool = False) -> None:
        starts = [s.first_start for s in slots if s.first_start is not None]
        outcomes = await asyncio.gather(*starts, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            if not keep_trying:  # the slots go; kept, they retry (see :meth:`_recover`)
                for slot in slots:
                    slot.retire.set()
                    if slot in self.slots:
                        self.slots.remove(slot)
                self._wake_all(slots)
            first = errors[0]
            raise first if isinstance(first, MserveError) else InvalidModel(str(first))

    async def stop(self, deadline_s: float) -> None:
        """Stop every worker; queued jobs fail with 503 (in-flight batches finish first)."""
        self.removing = True
        slots, self.slots = [*self.slots, *self._retiring], []
        for slot in slots:
            slot.retire.set()
        self._wake_all(slots)
        tasks = [s.task for s in slots if s.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for task in pending:
                task.cancel()
            for slot in slots:
                if slot.worker is not None:
                    await slot.worker.kill()
        self._fail_queued(ServiceUnavailable(f"model {self.label} was unregistered"), slots)
        if self.inference_log is not None:
            await self.inference_log.close(deadline_s)
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.remove_scratch)


def _answered_in_time(timer: asyncio.TimerHandle, future: asyncio.Future[Any]) -> None:
    """A request's future is done: its deadline timer (and the request it holds) goes, unless
    the answer is a stream, which the deadline still bounds."""
    if (
        future.cancelled()
        or future.exception() is not None
        or type(future.result()) is not ChunkStream
    ):
        timer.cancel()
