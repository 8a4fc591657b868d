"""A canary rollout: a new version's share of a model's traffic goes up step by step, while a
guard compares its answers with the baseline's over the same window; a breach rolls it back at
once, the last step held without one promotes it to the default version.

Latency is judged on the handler's own time on each request's batch, as its worker reports it.
Every wait before depends on the share each version gets, which the rollout changes on purpose
(a canary at 5 % waits for nobody, its baseline at 95 % for many): measured end to end, a
version three times slower looked faster than its baseline until half the traffic reached it,
and from its batch going to a worker (which queues batches ahead), a good version at 100 % was
twice its baseline's at 50 % (scripts/bench_rollout.py). Errors count whatever they were.

Each ``window_s`` the guard judges the answers both versions gave in the window (or since the
last judgement, while the canary has fewer than ``min_requests``): the canary breaches when its
5xx ratio is above the baseline's plus ``max_error_ratio``, or its p99 latency is above
``max_p99_ratio`` times the baseline's, or its median above ``max_p50_ratio`` times the
baseline's (either above ``p99_floor_ms``, below which latency is noise). The median catches a
version slower on every request at once, where the baseline's p99 under load is mostly noise
(CPU contention on a shared machine).

When the baseline had too few answers in the window (at 100 %, none), its last judged
window stands for it. A step moves on when ``interval_s`` has passed and the canary was judged
on at least ``min_requests`` answers in it. A request counts when its answer (or error) comes
back; one whose client left does not.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from server.errors import BadRequest, MserveError
from server.metrics.server_metrics import Metrics
from server.models.batching import Job
from server.models.registry import Registry
from server.rollouts.policy import CanaryPlan, parse_canary

log = logging.getLogger(__name__)

RUNNING, PAUSED, PROMOTED, ROLLED_BACK, ABORTED = (
    "running", "paused", "promoted", "rolled_back", "aborted"
)  # fmt: skip
ACTIVE = frozenset((RUNNING, PAUSED))
# latencies kept per version and window (beyond: a uniform sample of them)
MAX_SAMPLES = 20_000

SplitCallback = Callable[[str, tuple[tuple[str, float], ...]], None]
EndCallback = Callable[[str, bool], None]


class _Window:
    """One version's answers since the last judgement."""

    __slots__ = ("count", "errors", "latencies")

    def __init__(self) -> None:
        self.count = 0
        self.errors = 0
        self.latencies: list[float] = []

    def add(self, error: bool, latency_s: float) -> None:
        self.count += 1
        self.errors += error
        if len(self.latencies) < MAX_SAMPLES:
            self.latencies.append(latency_s)
        else:  # reservoir: each answer equally likely to be kept
            at = random.randrange(self.count)
            if at < MAX_SAMPLES:
                self.latencies[at] = latency_s

    def p99(self) -> float:
        """The lower 99th percentile: below 100 answers, the second slowest, so that one
        outlier (a page-in, a GC pause) in a small window breaches nothing."""
        ordered = sorted(self.latencies)
        return ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0

    def p50(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[(len(ordered) - 1) // 2] if ordered else 0.0

    def ratio(self) -> float:
        return self.errors / self.count if self.count else 0.0


class Canary:
    """One rollout's state; the router owns it (server/rollouts/router.py)."""

    def __init__(
        self, name: str, plan: CanaryPlan, split: SplitCallback, ended: EndCallback,
        saved: Callable[[], None], registry: Registry, metrics: Metrics | None,
    ) -> None:  # fmt: skip
        self.name = name
        self.plan = plan
        self.state = RUNNING
        self.step = 0
        self.reason: str | None = None
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.judged = 0  # windows judged
        self.last: dict[str, Any] | None = None  # the last judgement, as describe shows it
        self._split, self._ended, self._saved = split, ended, saved
        self._registry = registry
        self._metrics = metrics
        self._step_started = time.monotonic()
        self._step_requests = 0
        self._windows = {plan.version: _Window(), plan.baseline: _Window()}
        self._baseline_ref: tuple[float, float, float] | None = None  # (errors, p99, p50)
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def restored(
        cls, name: str, saved: dict[str, Any], versions: list[str], default: str,
        split: SplitCallback, ended: EndCallback, saved_cb: Callable[[], None],
        registry: Registry, metrics: Metrics | None,
    ) -> Canary:  # fmt: skip
        """A canary from the snapshot (its step's interval starts again)."""
        plan = parse_canary(saved.get("plan"), versions, default, f"snapshot canary of {name}")
        canary = cls(name, plan, split, ended, saved_cb, registry, metrics)
        state = saved.get("state")
        if state not in (RUNNING, PAUSED, PROMOTED, ROLLED_BACK, ABORTED):
            raise BadRequest(f"snapshot canary of {name}: unknown state {state!r}")
        step = saved.get("step", 0)
        if not isinstance(step, int) or not 0 <= step < len(plan.steps):
            raise BadRequest(f"snapshot canary of {name}: step {step!r} is not in the plan")
        canary.state, canary.step, canary.reason = state, step, saved.get("reason")
        canary.started_at = float(saved.get("started_at") or canary.started_at)
        canary.ended_at = saved.get("ended_at")
        return canary

    # --- state ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def share(self) -> float:
        return self.plan.steps[self.step]

    def start(self) -> None:
        log.info(
            "canary of %s: version %s over %s, steps %s %% every %g s, guard window %g s",
            self.name, self.plan.version, self.plan.baseline,
            "/".join(f"{s:g}" for s in self.plan.steps), self.plan.interval_s, self.plan.window_s,
        )  # fmt: skip
        self._apply()
        self._schedule()
        self._gauge()

    def resume_after_restart(self) -> None:
        if self.active:
            log.info("canary of %s resumes at step %d (%g %%), %s", self.name, self.step + 1,
                     self.share, self.state)  # fmt: skip
            self._apply()
            self._schedule()
        self._gauge()

    def _apply(self) -> None:
        share = self.share
        weights = ((self.plan.baseline, 100.0 - share), (self.plan.version, share))
        self._split(self.name, weights)

    def _schedule(self) -> None:
        self.stop()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.plan.window_s, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # --- the answers ---------------------------------------------------------------------------

    def watch(self, version: str, job: Job) -> None:
        if version in self._windows and self.state in ACTIVE:
            job.future.add_done_callback(functools.partial(self._answered, version, job))

    def _answered(self, version: str, job: Job, future: asyncio.Future[Any]) -> None:
        """One answer of a watched version, in the window open when it came back. Errors are
        judged at once: a canary whose 5xx ratio over ``min_requests`` answers is already past
        the bound is rolled back without waiting for the window's end (latency waits for it:
        a few answers' percentiles are noise)."""
        window = self._windows.get(version)
        if window is None or future.cancelled() or not self.active:
            return
        error = future.exception()
        if error is not None:
            status = error.status if isinstance(error, MserveError) else 500
        else:
            status = getattr(future.result(), "status", 200)
        window.add(status >= 500, _took_s(job))
        plan = self.plan
        if status < 500 or version != plan.version or window.count < plan.min_requests:
            return
        baseline = self._windows[plan.baseline]
        ref = self._baseline_ref[0] if self._baseline_ref is not None else baseline.ratio()
        if window.ratio() > ref + plan.max_error_ratio:
            breach = self._judge()
            if breach is not None:
                self._end(ROLLED_BACK, breach)

    def _tick(self) -> None:
        self._timer = None
        if not self.active:
            return
        breach = self._judge()
        if breach is not None:
            self._end(ROLLED_BACK, breach)
            return
        if (
            self.state == RUNNING
            and time.monotonic() - self._step_started >= self.plan.interval_s
            and self._step_requests >= self.plan.min_requests
        ):
            self._advance()
        if self.active:
            self._schedule()

    def _judge(self) -> str | None:
        """The window's verdict: None (no breach, or too few answers yet), or why it breached."""
        plan = self.plan
        canary, baseline = self._windows[plan.version], self._windows[plan.baseline]
        if canary.count < plan.min_requests:
            return None  # keep gathering: the windows go on until the canary has enough
        if baseline.count >= plan.min_requests or (self._baseline_ref is None and baseline.count):
            self._baseline_ref = (baseline.ratio(), baseline.p99(), baseline.p50())
        ref_ratio, ref_p99, ref_p50 = self._baseline_ref or (0.0, 0.0, 0.0)
        ratio, p99, p50 = canary.ratio(), canary.p99(), canary.p50()
        self.judged += 1
        self._step_requests += canary.count
        self.last = {
            "canary": {"requests": canary.count, "errorRatio": round(ratio, 4),
                       "p50Ms": round(p50 * 1000, 3), "p99Ms": round(p99 * 1000, 3)},
            "baseline": {"requests": baseline.count, "errorRatio": round(ref_ratio, 4),
                         "p50Ms": round(ref_p50 * 1000, 3), "p99Ms": round(ref_p99 * 1000, 3)},
        }  # fmt: skip
        self._windows = {plan.version: _Window(), plan.baseline: _Window()}
        if ratio > ref_ratio + plan.max_error_ratio:
            return (
                f"error ratio {ratio:.3f} of version {plan.version} ({canary.errors} of"
                f" {canary.count} answers 5xx) is above the baseline {plan.baseline}'s"
                f" {ref_ratio:.3f} + max_error_ratio {plan.max_error_ratio:g}"
            )
        if (
            self._baseline_ref is not None
            and p99 * 1000 > plan.p99_floor_ms
            and p99 > ref_p99 * plan.max_p99_ratio
        ):
            return (
                f"p99 latency {p99 * 1000:.1f} ms of version {plan.version} is above"
                f" max_p99_ratio {plan.max_p99_ratio:g} x the baseline {plan.baseline}'s"
                f" {ref_p99 * 1000:.1f} ms"
            )
        if (
            self._baseline_ref is not None
            and p50 * 1000 > plan.p99_floor_ms
            and p50 > ref_p50 * plan.max_p50_ratio
        ):
            return (
                f"median latency {p50 * 1000:.1f} ms of version {plan.version} is above"
                f" max_p50_ratio {plan.max_p50_ratio:g} x the baseline {plan.baseline}'s"
                f" {ref_p50 * 1000:.1f} ms"
            )
        return None

    def _advance(self) -> None:
        if self.step + 1 >= len(self.plan.steps):
            self._end(PROMOTED, f"every step held without a breach ({self.judged} windows judged)")
            return
        self.step += 1
        self._step_started = time.monotonic()
        self._step_requests = 0
        log.info("canary of %s: version %s now gets %g %% of the traffic", self.name,
                 self.plan.version, self.share)  # fmt: skip
        self._apply()
        self._gauge()
        self._saved()

    # --- the operator --------------------------------------------------------------------------

    def pause(self) -> None:
        self._must_be_active("pause")
        self.state = PAUSED
        log.info("canary of %s paused at %g %%", self.name, self.share)
        self._saved()

    def resume(self) -> None:
        self._must_be_active("resume")
        if self.state == RUNNING:
            return
        self.state = RUNNING
        self._step_started = time.monotonic()  # the step's interval starts again
        log.info("canary of %s resumed at %g %%", self.name, self.share)
        self._saved()

    def promote(self) -> None:
        self._must_be_active("promote")
        self._end(PROMOTED, "promoted by the operator")

    def abort(self) -> None:
        self._must_be_active("abort")
        self._end(ABORTED, "aborted by the operator")

    def end_outside(self, reason: str) -> None:
        """Ended by something else than the guard or the operator (a version went away)."""
        self._end(ABORTED, reason)

    def _must_be_active(self, what: str) -> None:
        if not self.active:
            raise BadRequest(
                f"cannot {what} the canary of model {self.name}: it has ended ({self.state}:"
                f" {self.reason})"
            )

    def _end(self, state: str, reason: str) -> None:
        self.stop()
        self.state, self.reason, self.ended_at = state, reason, time.time()
        plan = self.plan
        if state == PROMOTED:
            log.info("canary of %s: version %s promoted to the default version (%s)",
                     self.name, plan.version, reason)  # fmt: skip
            if plan.version in self._registry.models.get(self.name, {}):
                self._registry.set_default(self.name, plan.version)
        else:
            log.log(
                logging.ERROR if state == ROLLED_BACK else logging.WARNING,
                "canary of %s: version %s %s to %s: %s", self.name, plan.version,
                "rolled back" if state == ROLLED_BACK else "aborted, traffic back",
                plan.baseline, reason,
            )  # fmt: skip
        if self._metrics is not None:
            self._metrics.rollout_ended(self.name, plan.version, state)
        self._gauge()
        self._event(state, reason)
        self._ended(self.name, state == PROMOTED)

    def _gauge(self) -> None:
        if self._metrics is not None:
            share = self.share if self.active else (100.0 if self.state == PROMOTED else 0.0)
            self._metrics.rollout_share(self.name, self.plan.version, share)

    def _event(self, state: str, reason: str) -> None:
        """The outcome in the inference log of the canary's version, when it logs."""
        model = self._registry.models.get(self.name, {}).get(self.plan.version)
        if model is not None and model.inference_log is not None:
            model.inference_log.event(f"canary.{state}", reason, self.to_json())

    # --- shown ---------------------------------------------------------------------------------

    def shown(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "version": plan.version,
            "baseline": plan.baseline,
            "state": self.state,
            "step": self.step + 1,
            "steps": list(plan.steps),
            "share": self.share if self.active else None,
            "reason": self.reason,
            "startedAt": self.started_at,
            "endedAt": self.ended_at,
            "stepElapsedS": round(time.monotonic() - self._step_started, 3)
            if self.active
            else None,
            "windowsJudged": self.judged,
            "lastWindow": self.last,
            "plan": plan.to_json(),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "state": self.state,
            "step": self.step,
            "reason": self.reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


def _took_s(job: Job) -> float:
    """The handler's own time on the job's batch, as its worker reported it; without one (the
    batch failed, a step of continuous batching), the time since the batch went to a worker,
    else since the job was queued."""
    sent = job.sent
    if sent is not None:
        batch = sent[1].future
        if batch.done() and not batch.cancelled() and batch.exception() is None:
            meta = getattr(batch.result(), "meta", None)
            handler_ms = meta.get("handler_ms") if isinstance(meta, dict) else None
            if type(handler_ms) is float:
                return handler_ms / 1000
    return time.monotonic() - (job.sent_at or job.enqueued_at)
