"""Registered models and versions, and the registration flow.

Setting precedence, highest first: registration API parameters, the archive's model config
(TorchServe names: batchSize, maxBatchDelay, ...), the server config's ``models`` entry for that
name and version (TorchServe's per-model settings in config.properties), the server config.
Describe shows each effective value and, under ``settingSources``, where it came from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from archiver import Manifest
from mserve_worker.protocol import MAX_U32
from server import tracing
from server.config import ModelEntry, ServerConfig
from server.config.model_settings import SETTINGS, ModelSettings, parallel_settings, whole
from server.devices import GpuAllocator
from server.download import Downloader, Progress, is_remote
from server.errors import (
    InvalidModel,
    ModelAlreadyExists,
    ModelNotFound,
    ModelVersionNotFound,
    MserveError,
    UnsafeWeights,
)
from server.inference_log.logger import build as build_inference_log
from server.metrics.server_metrics import Metrics
from server.model_envs import EnvCache, EnvRequest, normalise_requirements
from server.models.residency import Residency
from server.models.swap import Swap, Swaps
from server.models.version import ModelVersion
from server.redaction import PathRedactor
from server.signatures import Signatures
from server.store import UnpackedModel, resolve_url, unpack
from server.weights import policy as weights_policy
from server.weights.scan import WeightsScan
from server.workers.build_sandbox import BuildSandbox
from server.workers.launch import Launcher
from server.workers.process import default_python
from server.workers.sandbox import Sandbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegisterRequest:
    url: str
    model_name: str | None = None
    handler: str | None = None
    batch_size: int | None = None
    max_batch_delay_ms: int | None = None
    batch_wait: str | None = None  # "busy" or "fill" (see ModelSettings)
    response_timeout_s: float | None = None
    initial_workers: int | None = None
    max_workers: int | None = None
    startup_timeout_s: float | None = None
    runtime: str | None = None  # TorchServe's runtime parameter, checked by the API
    synchronous: bool = True
    trusted: bool = False  # the operator's --models flag may name any local path
    at_startup: bool = False
    sha256: str | None = None  # the archive's digest the registration pins (server/download.py)
    idle_unload_s: float | None = None  # 0: never (server/models/residency.py)
    # inference logging (server/inference_log/policy.py checks them)
    inference_log: str | None = None
    inference_log_sample: int | None = None
    inference_log_batch: int | None = None
    inference_log_url: str | None = None
    inference_log_file: bool | None = None
    inference_log_redact: tuple[str, ...] | None = None
    # a stricter archive_signatures than the server's (server/signatures.py)
    archive_signatures: str | None = None
    weights_scan: str | None = None  # a stricter weights_scan (server/weights/policy.py)
    # min and max workers when neither the request nor the archive names them (TorchServe's
    # layout: 0 for a registration through the API); None: the config's models entry, then
    # default_workers_per_model
    workers_default: int | None = None


def effective_settings(
    request: RegisterRequest,
    archive_config: dict[str, Any],
    config: ServerConfig,
    entry: ModelEntry | None = None,
) -> ModelSettings:
    """``entry``: the server config's ``models`` entry for this name and version."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        name, key = setting.attr, setting.key
        api = getattr(request, setting.request) if setting.request else None
        if api is not None:
            values[name], sources[name] = api, "api"
        elif archive_config.get(key) is not None:
            values[name], sources[name] = archive_config[key], "archive"
        elif name in ("min_workers", "max_workers") and request.workers_default is not None:
            values[name], sources[name] = request.workers_default, "api"
        elif entry is not None and entry.get(key) is not None:
            values[name], sources[name] = entry.get(key), "models"
        else:
            values[name], sources[name] = getattr(config, setting.default), "server"
    values["max_workers"] = max(values["max_workers"], values["min_workers"])
    values["idle_unload_s"] = values["idle_unload_s"] or None  # 0: never
    device_ids = archive_config.get("deviceIds")
    return ModelSettings(
        **values,
        device_ids=tuple(device_ids) if device_ids else None,
        device_type=archive_config.get("deviceType"),
        sources=sources,
    )


def _with_runtime(manifest: dict[str, Any], runtime: str | None) -> dict[str, Any]:
    """The registration's ``runtime`` replaces the archive's, as TorchServe records it."""
    return {**manifest, "runtime": runtime} if runtime else manifest


class Registry:
    def __init__(
        self, config: ServerConfig, gpus: GpuAllocator, server_version: str, launcher: Launcher,
        metrics: Metrics | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.metrics = metrics
        self.gpus = gpus
        self.launcher = launcher
        self.server_version = server_version
        self.models: dict[str, dict[str, ModelVersion]] = {}
        self.defaults: dict[str, str] = {}
        # set once the startup models (snapshot, load_models) have loaded or failed: until then
        # the health checks say "not ready", so a load balancer (a Kubernetes readiness probe)
        # sends nothing to a server whose models are still loading
        self.started = False
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._listeners: list[tuple[str, Callable[[], None]]] = []  # see on_change
        # snapshot entries that failed to restore at start: written back into every snapshot
        self.unrestored: list[dict[str, Any]] = []
        self.sandbox = Sandbox(config)  # what each model's workers may reach
        # archive signatures checked before unpacking (server/signatures.py)
        self.signatures = Signatures(
            config, metrics.signature_failure if metrics is not None else None
        )
        self.envs = EnvCache(  # builds run code of the requirements: confined as workers are
            config.env_path, protected=config.protected_packages, sandbox=BuildSandbox.of(config)
        )
        self.downloader = Downloader(config)
        # which models keep workers: idle unload, the memory budget (server/models/residency.py)
        self.residency = Residency(config, metrics)
        self.residency.watch(self.all)
        # in-place swaps of a model's version, running or ended (server/models/swap.py)
        self.swaps = Swaps(metrics)
        # server paths out of error answers and describe's worker output (server/redaction.py)
        self.redact = PathRedactor.for_server(
            config.run_path, config.store_path, config.env_path, config.log_path,
            config.allowed_paths,
        )  # fmt: skip

    def get(self, name: str, version: str | None = None) -> ModelVersion:
        versions = self.models.get(name)
        if not versions:
            raise ModelNotFound(f"Model not found: {name}")
        key = version or self.defaults[name]
        if key not in versions:
            raise ModelVersionNotFound(f"Model version {key} does not exist for model {name}")
        return versions[key]

    def versions(self, name: str) -> list[ModelVersion]:
        if name not in self.models:
            raise ModelNotFound(f"Model not found: {name}")
        return list(self.models[name].values())

    def all(self) -> list[ModelVersion]:
        return [mv for versions in self.models.values() for mv in versions.values()]

    def healthy(self) -> bool:
        """What /ping, /v2/health/ready and their gRPC twins answer: the startup models have
        loaded (or failed) and every model has its minWorkers ready."""
        return self.started and all(mv.healthy() for mv in self.all())

    async def register(self, request: RegisterRequest) -> ModelVersion:
        cfg = self.config
        verify = self.signatures.checker(
            request.archive_signatures, request.model_name, request.url, request.at_startup
        )
        if is_remote(request.url):
            with self.downloader.tracking(
                request.url, request.model_name, request.at_startup
            ) as progress:
                unpacked = await self._download(request, progress, verify)
        else:
            path = resolve_url(
                request.url, cfg.store_path, cfg.allowed_paths, request.trusted, cfg.allowed_urls
            )
            unpacked = await asyncio.to_thread(
                unpack, path, request.url, cfg.run_path / "unpacked", None, request.sha256, verify
            )
        manifest = unpacked.manifest
        name = request.model_name or manifest.model.model_name
        version = manifest.model.model_version
        settings = effective_settings(
            request, unpacked.model_config, cfg, cfg.model_entry(name, version)
        )
        parallel = parallel_settings(unpacked.model_config, f"{name}:{version}")
        settings = replace(settings, parallel=parallel)
        settings = self.signatures.applied(settings, unpacked.signature)
        settings, weights = await self._check_weights(request, unpacked, settings, name, version)
        if parallel.broadcast and parallel.ranks > 1 and settings.continuous_batching:
            raise InvalidModel(
                f"model {name}:{version}: continuousBatching with parallelType"
                f" {parallel.type} is not supported: each rank would form its own steps; use"
                " parallelType custom, or pp"
            )
        # checks deviceIds and deviceType before any worker starts; draws no GPU
        gpus = self.gpus.plan(f"{name}:{version}", settings.device_ids, settings.device_type,
                              parallel.gpus)  # fmt: skip
        sandbox = self.sandbox.model(name, version, unpacked.model_dir, unpacked.model_config,
                                     ranks=parallel.torchrun)  # fmt: skip
        counter = self.metrics.inference_log_records if self.metrics is not None else None
        inference_log = build_inference_log(name, version, settings, cfg, counter)
        async with self._lock:
            if version in self.models.get(name, {}):
                raise ModelAlreadyExists(f"Model version {version} for model {name} already exists")
            model = ModelVersion(
                name=name,
                version=version,
                url=unpacked.url,
                model_dir=unpacked.model_dir,
                manifest=_with_runtime(manifest.to_json(), request.runtime),
                handler=request.handler or manifest.model.handler,
                settings=settings,
                model_yaml_config=unpacked.model_config,
                python=default_python(),
                gpus=gpus,
                launcher=self.launcher,
                server_version=self.server_version,
                # a batch of the largest requests, or a result of the largest answers, within
                # what a frame can say at all
                max_payload_bytes=min(
                    MAX_U32,
                    settings.batch_size
                    * max(cfg.max_request_size_bytes, cfg.max_response_size_bytes)
                    + (1 << 20),
                ),
                loaded_at_startup=request.at_startup,
                max_response_bytes=cfg.max_response_size_bytes,
                sequence_headers=(
                    cfg.sequence_id_header,
                    cfg.sequence_start_header,
                    cfg.sequence_end_header,
                ),
                metrics=self.metrics,
                service_envelope=cfg.service_envelope,
                sandbox=sandbox,
            )
            model.trusted = request.trusted
            model.weights_scan = weights
            model.residency = self.residency
            if inference_log is not None:
                model.inference_log = inference_log
                inference_log.start()
            # the snapshot pins it: a restore uses the same bytes (the cached download)
            model.archive_sha256 = unpacked.sha256 if is_remote(request.url) else request.sha256
            model.handler_overridden = request.handler is not None
            model.signature = unpacked.signature
            self.models.setdefault(name, {})[version] = model
            self.defaults.setdefault(name, version)
        log.info(
            "registering %s (%s) from %s with %d worker(s)",
            model.label, model.handler, unpacked.url, settings.min_workers,
        )  # fmt: skip
        try:
            env = self._env_request(model, unpacked.manifest, unpacked.model_config, request)
        except BaseException:
            await self._drop(model)
            raise
        if request.synchronous:
            # TorchServe's layout retries a startup model's workers as it does lost ones
            retry = request.at_startup and cfg.torchserve
            try:
                await self._prepare(model, env, wait=True, keep_trying=retry)
            except MserveError as exc:
                if not (request.at_startup and model.prepared):
                    await self._drop(model)
                    raise
                if retry and model.slots and model.failed is None:
                    self._keep_retrying(model, exc)
                else:
                    self._keep_failed(model, exc)
            except BaseException:
                await self._drop(model)
                raise
            self.changed()
        else:
            self.changed()
            task = asyncio.create_task(self._prepare_in_background(model, env))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return model

    async def _download(
        self, request: RegisterRequest, progress: Progress, verify: Any = None
    ) -> UnpackedModel:
        """Fetch an http(s) registration URL (server/download.py), then unpack it like any
        archive; describe lists it under ``progress`` meanwhile."""
        fetched = await self.downloader.fetch(
            request.url, progress, sha256=request.sha256, trusted=request.trusted
        )
        progress.stage = "unpacking"
        cache = self.config.run_path / "unpacked"
        try:
            return await asyncio.to_thread(
                unpack, fetched.path, fetched.url, cache, fetched.sha256, None, verify
            )
        except InvalidModel:  # not an archive, or refused: nothing will ever use these bytes
            self._discard_download(fetched.url, fetched.sha256)
            raise

    async def _check_weights(
        self, request: RegisterRequest, unpacked: UnpackedModel, settings: ModelSettings,
        name: str, version: str,
    ) -> tuple[ModelSettings, WeightsScan | None]:  # fmt: skip
        """weights_scan before any worker starts (server/weights/policy.py); a refusal removes
        what this registration unpacked or downloaded, unless a registered model uses it."""
        cache = self.config.run_path / "unpacked"
        counter = self.metrics.weights_flagged if self.metrics is not None else None
        try:
            return await weights_policy.admit(
                unpacked.model_dir, unpacked.sha256, cache, settings, self.config.weights_scan,
                self.config.model_entry(name, version), unpacked.model_config,
                f"{name}:{version}", counter, request.weights_scan,
            )  # fmt: skip
        except UnsafeWeights:
            if all(mv.model_dir != unpacked.model_dir for mv in self.all()):
                weights_policy.discard_unpacked(unpacked.model_dir, cache)
                if is_remote(request.url) and unpacked.sha256:
                    self._discard_download(unpacked.url, unpacked.sha256)
            raise

    def _env_request(
        self,
        model: ModelVersion,
        manifest: Manifest,
        config: dict[str, Any],
        request: RegisterRequest,
    ) -> EnvRequest | None:
        """What the model's own environment must hold, or None to run on the server's python."""
        req_name = manifest.model.requirements_file
        if not req_name or not self.config.install_py_dep_per_model:
            return None
        try:
            text = (model.model_dir / req_name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidModel(f"cannot read {req_name} from {model.url}: {exc}") from exc
        if not normalise_requirements(text):
            return None
        wheels = (manifest.extra.get("mserve") or {}).get("wheelhouse")
        return EnvRequest(
            requirements=text,
            model_label=model.label,
            wheelhouse=(model.model_dir / wheels) if wheels else None,
            isolated=bool(config.get("isolatedEnv", False)),
        )

    async def _prepare(
        self, model: ModelVersion, env: EnvRequest | None, wait: bool, keep_trying: bool = False
    ) -> None:
        """Build (or reuse) the model's environment, then start its workers (``keep_trying``:
        see :meth:`ModelVersion.scale`)."""
        with tracing.span("mserve.model.load", **{
            "mserve.model": model.name, "mserve.model_version": model.version
        }):  # fmt: skip
            if env is not None:
                model.stage = "building environment"
                with tracing.span("mserve.environment.build", **{"mserve.model": model.label}):
                    # the key walks installed distributions (tens of ms): off the loop, like
                    # the build
                    model.env_key = await asyncio.to_thread(self.envs.key, env)
                    model.python = await asyncio.to_thread(self.envs.ensure, env)
            model.stage = "starting workers" if wait else None
            model.prepared = True  # from now on a request finding no worker starts one
            await model.scale(
                model.settings.min_workers, model.settings.max_workers, wait, source=None,
                keep_trying=keep_trying,
            )  # fmt: skip
            model.stage = None

    def _keep_failed(self, model: ModelVersion, error: MserveError) -> None:
        """A model given at start (``--models``, ``load_models``, a snapshot) whose workers
        could not load stays registered, marked failed as the breaker marks one: describe shows
        the failure, requests get 503 naming it, ``/ping`` is Unhealthy, and the snapshot keeps
        it, until a scale (``PUT /models/{name}?min_worker=N``) tries again or it is
        unregistered. In TorchServe's layout this comes only once its workers gave up
        retrying (:meth:`_keep_retrying`), or when none could be started at all."""
        model.stage = None
        if model.failed is None:  # else its workers gave up already, and said so
            model.failed = error.message
        log.error(
            "startup model %s failed to load: %s (kept as failed: requests get 503 until it is"
            " scaled again or unregistered)", model.label, error.message,
        )  # fmt: skip

    def _keep_retrying(self, model: ModelVersion, error: MserveError) -> None:
        """TorchServe's layout: a startup model whose workers failed their first load is not
        failed yet. They are retried with the backoff for maxRetryTimeoutInSec, as TorchServe
        retries them (server/models/version.py), requests waiting in its queue meanwhile; the
        start goes on. A slot that gives up with no worker serving marks the model failed."""
        model.stage = None
        log.warning(
            "startup model %s failed to load: %s; its workers are retried for up to"
            " maxRetryTimeoutInSec=%s s, requests waiting meanwhile",
            model.label, error.message, whole(model.settings.max_retry_timeout_s),
        )  # fmt: skip

    async def _prepare_in_background(self, model: ModelVersion, env: EnvRequest | None) -> None:
        try:
            await self._prepare(model, env, wait=False)
        except MserveError as exc:
            model.stage = None
            model.failed = exc.message
            log.error("model %s failed to load: %s", model.label, exc.message)

    async def close(self) -> None:
        self.downloader.close()
        await self.swaps.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def on_change(self, what: str, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change of the registered models, versions, defaults or
        worker counts (the snapshot, the status file); ``what`` it keeps names it in the log."""
        self._listeners.append((what, listener))

    def changed(self) -> None:
        """Registered models, versions, defaults or worker counts changed: tell the listeners."""
        for what, listener in self._listeners:
            try:
                listener()
            except OSError as exc:  # a full disk must not fail the API call that got here
                log.error("could not save the %s: %s", what, exc)

    def envs_in_use(self) -> set[str]:
        return {mv.env_key for mv in self.all() if mv.env_key}

    async def _drop(self, model: ModelVersion) -> None:
        await model.stop(5.0)
        await self.residency.forget(model)  # its weights leave the warm tier
        versions = self.models.get(model.name, {})
        if versions.get(model.version) is model:
            del versions[model.version]
        if not versions:
            self.models.pop(model.name, None)
            self.defaults.pop(model.name, None)
        elif self.defaults.get(model.name) == model.version:
            self.defaults[model.name] = next(iter(versions))

    async def unregister(self, name: str, version: str | None) -> ModelVersion:
        model = self.get(name, version)  # no version: the default one, as TorchServe does
        await self._drop(model)
        if model.archive_sha256 and is_remote(model.url):
            self._discard_download(model.url, model.archive_sha256)
        self.changed()
        log.info("unregistered %s", model.label)
        return model

    def _discard_download(self, url: str, sha256: str) -> None:
        """Delete a cached download (its model was unregistered, or it is no archive) unless a
        registered model uses it."""
        if any((mv.url, mv.archive_sha256) == (url, sha256) for mv in self.all()):
            return
        try:
            self.downloader.discard(url, sha256)
        except OSError as exc:
            log.warning("could not remove the cached download of %s: %s", url, exc)

    def forget_unrestored(self, name: str, version: str | None) -> int:
        """Drop snapshot entries of ``name`` (one ``version``, or all) that failed to restore;
        how many were dropped."""
        keep = [
            e for e in self.unrestored
            if e.get("name") != name or (version is not None and e.get("version") != version)
        ]  # fmt: skip
        dropped = len(self.unrestored) - len(keep)
        if dropped:
            self.unrestored = keep
            self.changed()
            log.info("removed %d unrestored snapshot entr%s of %s", dropped,
                     "y" if dropped == 1 else "ies", name)  # fmt: skip
        return dropped

    def start_swap(
        self, source: ModelVersion, target: ModelVersion, workers: int, unregister: bool = False,
        overlap: bool = False,
    ) -> Swap:  # fmt: skip
        """Replace ``source`` by ``target`` in place (server/models/swap.py); ``unregister``:
        unregister ``source`` once it has no worker left; ``overlap``: start each worker of
        ``target`` before draining one of ``source`` (the budget passed by one worker)."""

        async def drop() -> None:
            await self.unregister(source.name, source.version)

        swap = Swap(source, target, workers, self.residency, self.set_default, self.changed,
                    drop if unregister else None, self.metrics,
                    routes=self.defaults.get(source.name) == source.version,
                    overlap=overlap)  # fmt: skip
        return self.swaps.start(swap)

    def set_default(self, name: str, version: str) -> None:
        self.get(name, version)
        self.defaults[name] = version
        self.changed()
