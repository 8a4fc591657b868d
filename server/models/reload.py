"""Hot reload of a model version's handler code on its live workers (docs/hot-reload.md).

Two phases, so that the workers never end up split between two versions of the code: each
serving worker *prepares* in turn (imports the code on disk and loads a new handler beside the
old one, which keeps serving; what the handler keeps, sdk/keep.py, is not loaded again), and
only when every one of them has prepared are they all told to *commit* (switch). If one fails
(a syntax error, ``initialize`` raising, a worker lost or too slow), the others *abort* and
every worker serves the old code; the caller gets the error, naming the file and line.

One worker prepares at a time: the others serve meanwhile, so a reload whose new code pays a
long load (a handler that keeps nothing) costs the model one worker's capacity, never all of
it. The reload's frames travel in each worker's stream in turn with its batches, so no request
is refused or lost: those already sent to a worker that prepares wait for it (a pipeline's
worth at most), the rest are served by the others. Reloads of one version run one at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from mserve_worker.protocol import ABORT, COMMIT, PREPARE, Reloaded
from server.errors import BadRequest, HandlerLoadFailed, MserveError, WorkerDied
from server.models.slot import SERVING

if TYPE_CHECKING:
    from server.models.version import ModelVersion
    from server.workers.process import Worker

log = logging.getLogger(__name__)

_reload_ids = itertools.count(1)
# How long a worker may take to answer commit or abort (switching is a few assignments; the
# old handler's shutdown() runs in it): past this it is killed and restarted from disk.
STEP_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    """A reload that succeeded (or had nothing to do: ``workers`` 0)."""

    message: str
    workers: int
    code: dict[str, Any] | None
    seconds: float


class _Record:
    """A version's reloads: one at a time, counted, the last one kept for describe."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.reloads = 0
        self.failed = 0
        self.last: dict[str, Any] | None = None


_records: weakref.WeakKeyDictionary[ModelVersion, _Record] = weakref.WeakKeyDictionary()


def _record(model: ModelVersion) -> _Record:
    record = _records.get(model)
    if record is None:
        record = _records[model] = _Record()
    return record


def refusal(model: ModelVersion) -> str | None:
    """Why this version's handler cannot be hot-reloaded, or None."""
    if model.settings.continuous_batching:
        return (
            f"model {model.label} runs continuous batching, whose workers run their steps"
            " themselves: hot reload is not supported for it; restart its workers instead"
            " (scale to 0 and back)"
        )
    if model.settings.parallel.torchrun:
        return (
            f"model {model.label} is a parallel model (parallelType"
            f" {model.settings.parallel.type}): hot reload is not supported for its ranks;"
            " restart its workers instead (scale to 0 and back)"
        )
    return None


async def reload_version(model: ModelVersion, source: str = "api") -> Outcome:
    """Reload the handler's code on every serving worker of ``model``; raises
    :class:`HandlerLoadFailed` (the old code serves on) or :class:`BadRequest`. ``source``:
    who asked ("api", "watch"), for the log and describe."""
    why = refusal(model)
    if why is not None:
        raise BadRequest(why)
    record = _record(model)
    async with record.lock:
        started = time.monotonic()
        if model.residency is not None:  # a parked worker would wake with the old code
            model.residency.warm.unpark(model.label)
        try:
            outcome = await _reload(model, started)
        except MserveError as exc:
            _count(model, record, "failed", started, source, exc.message)
            log.error("model %s: hot reload (%s) failed, the old code serves on: %s",
                      model.label, source, exc.message)  # fmt: skip
            raise
        if outcome.workers:
            _count(model, record, "ok", started, source, None, outcome.code)
            log.info("model %s: handler code reloaded (%s) on %d worker(s) in %.3f s, code %s",
                     model.label, source, outcome.workers, outcome.seconds,
                     (outcome.code or {}).get("digest"))  # fmt: skip
        else:
            log.info("model %s: hot reload (%s): %s", model.label, source, outcome.message)
        return outcome


async def _reload(model: ModelVersion, started: float) -> Outcome:
    workers = [s.worker for s in model.slots if s.worker is not None and s.worker.state in SERVING]
    if not workers:
        return Outcome(
            f"no worker of model {model.label} is running: the next one to start loads the"
            " code on disk", 0, None, 0.0,
        )  # fmt: skip
    reload_id = next(_reload_ids)
    timeout_s = model.settings.startup_timeout_s
    prepared: list[Worker] = []
    failure: str | None = None
    code: dict[str, Any] | None = None
    for worker in workers:  # one at a time: the others serve meanwhile
        try:
            answer = await worker.reload_step(reload_id, PREPARE, timeout_s)
        except WorkerDied as exc:
            failure = f"worker {worker.id} was lost while preparing: {exc.message}"
            break
        if not answer.ok:
            failure = _failure(model, worker, answer)
            break
        prepared.append(worker)
        if code is not None and answer.code is not None and answer.code != code:
            failure = (
                f"the model's code changed on disk while its workers prepared (worker"
                f" {worker.id} found {answer.code.get('digest')}, an earlier one"
                f" {code.get('digest')}); reload again"
            )
            break
        code = answer.code
    if failure is not None:
        await _all(prepared, reload_id, ABORT)
        raise HandlerLoadFailed(failure)
    switched = await _all(prepared, reload_id, COMMIT)
    seconds = round(time.monotonic() - started, 4)
    lost = len(prepared) - switched
    note = f"; {lost} worker(s) lost meanwhile restart with the code on disk" if lost else ""
    return Outcome(
        f"handler of model {model.label} reloaded on {switched} worker(s) in {seconds:.3f} s"
        f"{note}", switched, code, seconds,
    )  # fmt: skip


async def _all(workers: list[Worker], reload_id: int, step: str) -> int:
    """Send ``step`` to every worker at once; how many did it. A worker that fails it is
    killed (reload_step does) and its slot restarts it with the code on disk."""
    answers = await asyncio.gather(
        *(w.reload_step(reload_id, step, STEP_TIMEOUT_S) for w in workers), return_exceptions=True
    )
    done = 0
    for worker, answer in zip(workers, answers, strict=True):
        if isinstance(answer, Reloaded) and answer.ok:
            done += 1
            continue
        why = answer.error if isinstance(answer, Reloaded) else getattr(answer, "message", answer)
        log.warning("worker %s of %s: reload %s failed: %s", worker.id, worker.model_label,
                    step, why)  # fmt: skip
        if isinstance(answer, Reloaded):  # it answered but could not: restart it from disk
            await worker.kill()
    return done


def _failure(model: ModelVersion, worker: Worker, answer: Reloaded) -> str:
    """The worker's error names the file and line of the user's code that raised."""
    return (
        f"handler of model {model.label} failed to reload on worker {worker.id}, the old code"
        f" serves on: {answer.error}"
    )


def _count(
    model: ModelVersion, record: _Record, outcome: str, started: float, source: str,
    error: str | None, code: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    if outcome == "ok":
        record.reloads += 1
    else:
        record.failed += 1
    record.last = {
        "at": time.time(),
        "outcome": outcome,
        "source": source,
        "seconds": round(time.monotonic() - started, 4),
        "error": error,
        "digest": (code or {}).get("digest"),
    }
    metrics = model.stats.metrics
    if metrics is not None:
        metrics.handler_reloaded(model.name, model.version, outcome)


def shown(model: ModelVersion) -> dict[str, Any]:
    """describe's ``handlerCode``: the code its workers run (the digest they agree on, or each
    one's), the files, and the reloads."""
    codes = [
        s.worker.code for s in model.slots
        if s.worker is not None and s.worker.state in SERVING and s.worker.code is not None
    ]  # fmt: skip
    digests = sorted({c.get("digest") for c in codes if isinstance(c.get("digest"), str)})
    record = _records.get(model)
    return {
        "digest": digests[0] if len(digests) == 1 else None,
        "workerDigests": digests if len(digests) > 1 else None,
        "files": codes[0].get("files") if codes else None,
        "reloads": record.reloads if record else 0,
        "failedReloads": record.failed if record else 0,
        "lastReload": _shown_last(record.last) if record and record.last else None,
    }


def _shown_last(last: dict[str, Any]) -> dict[str, Any]:
    at = datetime.fromtimestamp(last["at"], timezone.utc).isoformat(timespec="milliseconds")
    return {**last, "at": at.replace("+00:00", "Z")}
