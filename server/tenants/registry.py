"""The server's tenants: key lookup, quotas at admission, counts, and reloading their file.

A tenant is found from the sha256 of the key a request sends (the file holds hashes only). Its
quotas are checked before a request is queued, so a request over quota never takes a queue
slot: 429 with ``Retry-After`` from the bucket. Its weight is what the model queues' fair
queuing (server/models/fair.py) reads off each job. A reload updates tenants in place (a
tenant's buckets and in-flight count survive it); a broken file leaves the previous tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from server.errors import ConfigError, TooManyRequests
from server.tenants.file import DEFAULT, Quota, TenantSpec, read
from server.tenants.tokens import Usage

log = logging.getLogger(__name__)
RELOAD_POLL_S = 1.0


class QuotaExceeded(TooManyRequests):
    """A tenant's quota is spent: 429, ``Retry-After`` saying when its bucket has a token."""

    type = "QuotaExceededException"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # type: ignore[assignment]
        self.retry_after_exact_s = retry_after_s


class _Bucket:
    """A token bucket: ``rate`` tokens a second, up to ``burst``; a token quota's may be
    charged below zero (server/tenants/tokens.py)."""

    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.tokens, self.last = rate, burst, burst, time.monotonic()

    def wait_s(self, now: float) -> float:
        """Refill; how long until a token is there (0: one is)."""
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


class _Limits:
    """One quota's live state: its buckets (requests, generated tokens) and its count in
    flight."""

    __slots__ = ("bucket", "in_flight", "quota", "token_bucket")

    def __init__(self, quota: Quota) -> None:
        self.quota = quota
        self.in_flight = 0
        self.bucket = _new_bucket(None, quota.requests_per_second, quota.burst)
        self.token_bucket = _new_bucket(None, quota.tokens_per_second, quota.token_burst)

    def update(self, quota: Quota) -> None:
        if quota == self.quota:
            return
        self.quota = quota
        self.bucket = _new_bucket(self.bucket, quota.requests_per_second, quota.burst)
        self.token_bucket = _new_bucket(
            self.token_bucket, quota.tokens_per_second, quota.token_burst
        )


def _new_bucket(bucket: _Bucket | None, rate: float | None, burst: float | None) -> _Bucket | None:
    """The bucket of a quota's rate (None: no rate); one that was there keeps what it holds
    (a debt included) up to its new burst."""
    if not rate:
        return None
    if bucket is None:
        return _Bucket(rate, burst or 1.0)
    bucket.rate, bucket.burst = rate, burst or 1.0
    bucket.tokens = min(bucket.tokens, bucket.burst)
    return bucket


class Tenant:
    """A tenant as the request path sees it: name and weight (fair queuing), quotas, counts."""

    __slots__ = ("bounded", "limits", "model_limits", "name", "refused", "tokens", "weight")

    def __init__(self, spec: TenantSpec) -> None:
        self.name = spec.name
        self.weight = spec.weight
        self.limits = _Limits(spec.quota)
        self.model_limits: dict[str, _Limits] = {}
        self.refused: dict[str, int] = {}  # by model: requests over quota
        self.tokens: dict[str, int] = {}  # by model: generated tokens charged to token quotas
        self.bounded = False  # has any quota: without, admitting costs one test
        self.update(spec)

    def update(self, spec: TenantSpec) -> None:
        self.weight = spec.weight
        self.limits.update(spec.quota)
        for model, quota in spec.models.items():
            if model in self.model_limits:
                self.model_limits[model].update(quota)
            else:
                self.model_limits[model] = _Limits(quota)
        for model in [m for m in self.model_limits if m not in spec.models]:
            del self.model_limits[model]
        quota = spec.quota
        self.bounded = bool(
            spec.models or quota.requests_per_second or quota.in_flight
            or quota.tokens_per_second
        )  # fmt: skip

    def admit(
        self, model: str, future: asyncio.Future[Any], generative: bool = False
    ) -> Usage | None:
        """Let a request to ``model`` in, or raise QuotaExceeded. What it costs while it runs
        (None: nothing to count): under an ``in_flight`` quota it is counted in, and out when
        its answer has ended (a stream's last chunk); a ``generative`` model's tokens are
        charged to the token quotas as they come (its stream's ``meter``)."""
        if not self.bounded:  # the common case: one attribute read per request
            return None
        limits = self.limits
        per_model = self.model_limits.get(model)
        self._check(model, limits, per_model, generative)
        counted = [lim for lim in (limits, per_model) if lim is not None and lim.quota.in_flight]
        buckets = []
        if generative:
            buckets = [lim.token_bucket for lim in (limits, per_model)
                       if lim is not None and lim.token_bucket is not None]  # fmt: skip
        if not counted and not buckets:
            return None
        usage = Usage(counted, buckets, self.tokens, model)  # type: ignore[arg-type]
        future.add_done_callback(usage.settled)
        return usage

    def _check(
        self, model: str, limits: _Limits, per_model: _Limits | None, generative: bool
    ) -> None:
        now = time.monotonic()
        for scope, lim in (("", limits), (f" for model {model}", per_model)):
            if lim is None:
                continue
            most = lim.quota.in_flight
            if most is not None and lim.in_flight >= most:
                self._refuse(model)
                raise QuotaExceeded(
                    f"tenant {self.name} has {lim.in_flight} requests in flight{scope}, its"
                    f" quota (in_flight: {most})", 1.0,
                )  # fmt: skip
        waits = [
            (lim.bucket.wait_s(now), scope, lim)
            for scope, lim in (("", limits), (f" for model {model}", per_model))
            if lim is not None and lim.bucket is not None
        ]
        for wait_s, scope, lim in waits:
            if wait_s > 0:
                self._refuse(model)
                raise QuotaExceeded(
                    f"tenant {self.name} is over its quota{scope}"
                    f" ({lim.quota.requests_per_second:g} requests/s, burst"
                    f" {lim.quota.burst:g}); retry in {wait_s:.3f} s", wait_s,
                )  # fmt: skip
        if generative:  # tokens are charged as they come: only a debt or an empty bucket
            for scope, lim in (("", limits), (f" for model {model}", per_model)):
                bucket = None if lim is None else lim.token_bucket
                if bucket is not None and (wait_s := bucket.wait_s(now)) > 0:
                    self._refuse(model)
                    owed = f", {-bucket.tokens:.0f} tokens owed" if bucket.tokens < 0 else ""
                    raise QuotaExceeded(
                        f"tenant {self.name} is over its token quota{scope}"
                        f" ({lim.quota.tokens_per_second:g} tokens/s, burst"
                        f" {lim.quota.token_burst:g}{owed}); retry in {wait_s:.3f} s", wait_s,
                    )  # fmt: skip
        for _wait, _scope, lim in waits:
            lim.bucket.tokens -= 1  # type: ignore[union-attr]

    def _refuse(self, model: str) -> None:
        self.refused[model] = self.refused.get(model, 0) + 1


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class Tenants:
    """The tenants of ``path``; ``known_models``: the registered model names (a quota naming
    another is a mistake in the file)."""

    def __init__(self, path: Path, known_models: Callable[[], Iterable[str]]) -> None:
        self.path = path
        self._models = known_models
        # False until the startup models are registered: quotas' model names are checked from
        # then on (see :meth:`models_registered`)
        self.models_known = False
        self.by_name: dict[str, Tenant] = {}
        self.by_hash: dict[str, Tenant] = {}
        # keys already hashed and found (sha256 per request cost ~1 us); emptied by a reload,
        # so a removed key stops at once. Only keys of the file get in: bounded by it
        self._by_key: dict[str, Tenant] = {}
        # the server's own inference key (the default tenant's), hashed once and found in no
        # tenant of the file: compared in constant time, not hashed again (see own_key)
        self._own: str | None = None
        self.default = Tenant(TenantSpec(DEFAULT))
        self.reloads = {"ok": 0, "failed": 0}
        self._stamp: tuple[float, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self.load()  # a broken file at start fails the start

    def load(self) -> None:
        stamp = self._file_stamp()
        specs = read(self.path, self.known_models)
        self._apply(specs)
        self._stamp = stamp
        log.info(
            "tenants: %d from %s (%s)", len(self.by_name), self.path,
            ", ".join(f"{t.name} weight {t.weight:g}" for t in self.by_name.values()),
        )  # fmt: skip

    def known_models(self) -> Iterable[str] | None:
        return self._models() if self.models_known else None

    def models_registered(self) -> None:
        """The startup models are there: read the file again, checking the models its quotas
        name (a mistake is logged and the tenants read at start stay)."""
        self.models_known = True
        try:
            self._apply(read(self.path, self.known_models))
        except ConfigError as exc:
            log.error("tenants: %s; the tenants read at start stay in force", exc.message)

    def _apply(self, specs: dict[str, TenantSpec]) -> None:
        by_name: dict[str, Tenant] = {}
        by_hash: dict[str, Tenant] = {}
        if DEFAULT not in specs:
            specs = {DEFAULT: TenantSpec(DEFAULT), **specs}
        for name, spec in specs.items():
            tenant = self.default if name == DEFAULT else self.by_name.get(name)
            if tenant is None:
                tenant = Tenant(spec)
            else:
                tenant.update(spec)
            by_name[name] = tenant
            for digest in spec.key_hashes:
                by_hash[digest] = tenant
        self.by_name, self.by_hash, self._by_key = by_name, by_hash, {}
        self._own = None  # the new file may name it

    def of_key(self, key: str | None) -> Tenant | None:
        """The tenant whose key ``key`` is (None: no tenant's; the server's own inference key
        is the default tenant's, which its caller checks)."""
        if key is None:
            return None
        tenant = self._by_key.get(key)
        if tenant is None and self.by_hash:
            own = self._own  # ASCII (the server's keys are); compare_digest takes no other str
            if own is not None and key.isascii() and hmac.compare_digest(key, own):
                return None
            tenant = self.by_hash.get(key_hash(key))
            if tenant is not None:
                self._by_key[key] = tenant
        return tenant

    def own_key(self, key: str) -> None:
        """``key`` is the server's own inference key, just checked, and :meth:`of_key` found
        it in no tenant: it is not hashed again until the file is reloaded. Only what its
        caller checked gets in (one key: an unknown key is refused, never kept), and a rotated
        key needs no forgetting: it is still compared with the live key after this lookup."""
        if key.isascii():
            self._own = key

    def _file_stamp(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    def check_reload(self) -> bool | None:
        """Read the file again if it changed: True (reloaded), False (broken: the previous
        tenants stay, the log says why), None (unchanged)."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            specs = read(self.path, self.known_models)
        except ConfigError as exc:
            self.reloads["failed"] += 1
            log.error("tenants: %s; the previous tenants stay in force", exc.message)
            return False
        self._apply(specs)
        self.reloads["ok"] += 1
        log.info(
            "tenants: reloaded %s: %s", self.path,
            ", ".join(f"{t.name} weight {t.weight:g}" for t in self.by_name.values()),
        )  # fmt: skip
        return True

    def start(self) -> None:
        """Watch the file (a poll a second: a mounted ConfigMap changes by a symlink swap,
        which inotify on the file would miss)."""
        self._task = asyncio.create_task(self._watch(), name="tenants-watch")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_POLL_S)
            try:
                self.check_reload()
            except Exception:  # the chore's guard: one bad pass must not end reloads
                log.exception("tenants: reloading %s failed", self.path)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def families(self, queues: Iterable[tuple[str, Any]]) -> Iterator[Any]:
        """Prometheus families; the ``tenant`` label takes known tenants only (unknown keys
        are refused, never labelled). ``queues``: (model name, its versions' fair queues),
        which count what each tenant was served (server/models/fair.py)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["tenant", "model"]
        served = CounterMetricFamily(
            "mserve_tenant_requests_served", "Requests answered, by tenant", labels=labels
        )
        refused = CounterMetricFamily(
            "mserve_tenant_requests_refused", "Requests over the tenant's quota (429)",
            labels=labels,
        )  # fmt: skip
        tokens = CounterMetricFamily(
            "mserve_tenant_tokens_charged",
            "Generated tokens charged to the tenant's token quotas (tokens_per_second)",
            labels=labels,
        )
        weight = GaugeMetricFamily("mserve_tenant_weight", "Fair-queuing weight", labels=["tenant"])
        by_model: dict[tuple[str, str], int] = {}
        for model, queue in queues:
            for name, n in getattr(queue, "served", {}).items():
                if name in self.by_name:
                    by_model[(name, model)] = by_model.get((name, model), 0) + n
        for (name, model), n in by_model.items():
            served.add_metric([name, model], n)
        for tenant in self.by_name.values():
            for model, n in tenant.refused.items():
                refused.add_metric([tenant.name, model], n)
            for model, n in tenant.tokens.items():
                tokens.add_metric([tenant.name, model], n)
            weight.add_metric([tenant.name], tenant.weight)
        reloads = CounterMetricFamily(
            "mserve_tenants_reloads", "Reloads of tenants_file", labels=["outcome"]
        )
        for outcome, n in self.reloads.items():
            reloads.add_metric([outcome], n)
        yield from (served, refused, tokens, weight, reloads)
