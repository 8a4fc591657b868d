"""The registered workflows: registration (all of its models, or none), unregistration,
listing, describing and predicting.

A workflow's nodes are registered as models named ``<workflow>__<node>``, as TorchServe names
them: a model node from its ``url`` (resolved as a registration's: the model store,
``allowed_paths``, ``allowed_urls``), a function node from the unpacked ``.war`` with
``<handler>:<function>`` as its handler. They are listed, described and scaled like any model,
are not saved in snapshots (neither is the workflow, as in TorchServe), and go when the workflow
is unregistered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archiver.workflow import is_valid_workflow_name
from server.download import is_remote, relative_path_refusal
from server.errors import (
    ArchiveNotAllowed,
    BadRequest,
    ModelNotFound,
    ModelVersionNotFound,
    MserveError,
)
from server.models.registry import RegisterRequest, Registry
from server.store import resolve_url
from server.workflows.archive import UnpackedWorkflow, functions_manifest, unpack_workflow
from server.workflows.errors import InvalidWorkflow, WorkflowAlreadyExists, WorkflowNotFound
from server.workflows.execute import Request, run
from server.workflows.spec import NODE_SEPARATOR, Node, WorkflowSpec, parse_spec

log = logging.getLogger(__name__)

MAX_PAGE = 100  # TorchServe's paging of GET /workflows


@dataclass(frozen=True)
class Workflow:
    name: str
    url: str
    spec: WorkflowSpec
    models: dict[str, str]  # node -> its registered model
    unpacked: UnpackedWorkflow


class RegistrationFailed(MserveError):
    """One or more of a workflow's models could not be registered; none of them is kept. The
    status and type are the first failure's."""

    def __init__(self, message: str, cause: MserveError) -> None:
        super().__init__(message)
        self.status = cause.status
        self.type = cause.type


class Workflows:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.workflows: dict[str, Workflow] = {}
        self._claimed: set[str] = set()  # names being registered
        self._unpacked_in_use: Counter[str] = Counter()  # registrations under way, by sha256

    @property
    def cache(self) -> Path:
        return self.registry.config.run_path / "workflows"

    def get(self, name: str) -> Workflow:
        workflow = self.workflows.get(name)
        if workflow is None:
            raise WorkflowNotFound(f"Workflow not found: {name}")
        return workflow

    async def register(
        self, url: str | None, workflow_name: str | None = None,
        response_timeout_s: float | None = None, startup_timeout_s: float | None = None,
    ) -> Workflow:  # fmt: skip
        """Register the ``.war`` at ``url`` and every model of its DAG, or nothing at all."""
        config = self.registry.config
        if url is None:
            raise BadRequest("Parameter url is required.")
        if url == "":
            raise WorkflowNotFound("Workflow not found in workflow store: (empty url)")
        refusal = relative_path_refusal(url)
        if refusal is not None:  # TorchServe's words; its 404 in its layout
            raise (WorkflowNotFound if config.torchserve else ArchiveNotAllowed)(refusal)
        if workflow_name is not None and not is_valid_workflow_name(workflow_name):
            raise BadRequest(
                f"workflow_name {workflow_name!r} is not a valid name (letters, digits, '_',"
                " '-' and '.', starting with a letter or digit)"
            )
        if workflow_name is not None:
            self._check_free(workflow_name)
        unpacked = await self._fetch(url, workflow_name)
        self._unpacked_in_use[unpacked.sha256] += 1
        try:
            return await self._register(unpacked, workflow_name, response_timeout_s,
                                        startup_timeout_s)  # fmt: skip
        finally:
            self._unpacked_in_use[unpacked.sha256] -= 1
            if not self._unpacked_in_use[unpacked.sha256]:
                del self._unpacked_in_use[unpacked.sha256]

    async def _register(
        self, unpacked: UnpackedWorkflow, workflow_name: str | None,
        response_timeout_s: float | None, startup_timeout_s: float | None,
    ) -> Workflow:  # fmt: skip
        url = unpacked.url
        name = workflow_name or unpacked.manifest.workflow_name
        if not is_valid_workflow_name(name):
            self._forget(unpacked)
            raise InvalidWorkflow(f"workflow archive {url}: its name {name!r} is not a valid name")
        try:
            self._check_free(name)
        except BaseException:
            self._forget(unpacked)
            raise
        self._claimed.add(name)
        try:
            spec = parse_spec(
                unpacked.spec_text, unpacked.manifest.spec_file, name, unpacked.handler_source,
                unpacked.manifest.handler,
            )  # fmt: skip
            models = {n.name: f"{name}{NODE_SEPARATOR}{n.name}" for n in spec.nodes}
            taken = sorted(m for m in models.values() if m in self.registry.models)
            if taken:
                raise WorkflowAlreadyExists(
                    f"workflow {name} cannot register its models: {', '.join(taken)} already"
                    " registered"
                )
            if any(n.is_function for n in spec.nodes):
                await asyncio.to_thread(functions_manifest, unpacked)
            await self._register_models(name, spec, models, unpacked, response_timeout_s,
                                        startup_timeout_s)  # fmt: skip
            workflow = Workflow(name, unpacked.url, spec, models, unpacked)
            self.workflows[name] = workflow
        except BaseException:
            self._forget(unpacked)
            raise
        finally:
            self._claimed.discard(name)
        log.info("registered workflow %s from %s: %s", name, unpacked.url, spec.dag_text)
        return workflow

    def _check_free(self, name: str) -> None:
        if name in self.workflows or name in self._claimed:
            raise WorkflowAlreadyExists(f"Workflow {name} is already registered.")

    async def _fetch(self, url: str, workflow_name: str | None) -> UnpackedWorkflow:
        config, registry = self.registry.config, self.registry
        if is_remote(url):
            downloader = registry.downloader
            with downloader.tracking(url, workflow_name, False) as progress:
                fetched = await downloader.fetch(url, progress, sha256=None, trusted=False)
                try:
                    return await asyncio.to_thread(
                        unpack_workflow, fetched.path, fetched.url, self.cache, fetched.sha256
                    )
                except InvalidWorkflow:
                    self._discard_download(fetched.url, fetched.sha256)
                    raise
        store = config.workflow_store_path
        try:
            path = resolve_url(url, store, config.allowed_paths, False, config.allowed_urls)
        except ModelNotFound:  # TorchServe's words
            raise WorkflowNotFound(f"Workflow not found in workflow store: {url}") from None
        return await asyncio.to_thread(unpack_workflow, path, url, self.cache)

    async def _register_models(
        self, name: str, spec: WorkflowSpec, models: dict[str, str],
        unpacked: UnpackedWorkflow, response_timeout_s: float | None,
        startup_timeout_s: float | None,
    ) -> None:  # fmt: skip
        async def one(node: Node) -> None:
            s = node.settings
            if node.is_function:
                url, trusted = str(unpacked.folder), True
                handler: str | None = f"{unpacked.manifest.handler}:{node.name}"
            else:
                assert node.url is not None
                url, handler, trusted = node.url, None, False
                refusal = relative_path_refusal(url)
                if refusal is not None:
                    raise ArchiveNotAllowed(refusal)
            model = await self.registry.register(RegisterRequest(
                url=url,
                model_name=models[node.name],
                handler=handler,
                batch_size=s.batch_size,
                max_batch_delay_ms=s.max_batch_delay_ms,
                response_timeout_s=response_timeout_s,
                initial_workers=s.min_workers,
                max_workers=s.max_workers,
                startup_timeout_s=startup_timeout_s,
                trusted=trusted,
            ))  # fmt: skip
            model.workflow = name

        outcomes = await asyncio.gather(*(one(n) for n in spec.nodes), return_exceptions=True)
        failures = [
            (node, out) for node, out in zip(spec.nodes, outcomes, strict=True)
            if isinstance(out, BaseException)
        ]  # fmt: skip
        if not failures:
            self.registry.changed()  # the snapshot leaves the workflow's models out
            return
        await self._unregister_models(models)
        for _, out in failures:
            if not isinstance(out, MserveError):
                raise out
        said = "; ".join(
            f"node {node.name} (model {models[node.name]}): {out}" for node, out in failures
        )
        first = failures[0][1]
        assert isinstance(first, MserveError)
        raise RegistrationFailed(
            f"workflow {name} failed to register, and none of its models was kept: {said}", first
        )

    async def _unregister_models(self, models: Mapping[str, str]) -> None:
        for model in models.values():
            with contextlib.suppress(ModelNotFound, ModelVersionNotFound):  # never there, or gone
                await self.registry.unregister(model, None)

    def _forget(self, unpacked: UnpackedWorkflow) -> None:
        """A registration that failed leaves nothing: its unpacked folder and its download go
        unless a registered workflow uses the same bytes."""
        if any(w.unpacked.sha256 == unpacked.sha256 for w in self.workflows.values()):
            return
        if self._unpacked_in_use[unpacked.sha256] > 1:  # another registration of these bytes
            return
        shutil.rmtree(unpacked.folder, ignore_errors=True)
        if is_remote(unpacked.url):
            self._discard_download(unpacked.url, unpacked.sha256)

    def _discard_download(self, url: str, sha256: str) -> None:
        try:
            self.registry.downloader.discard(url, sha256)
        except OSError as exc:
            log.warning("could not remove the cached download of %s: %s", url, exc)

    async def unregister(self, name: str) -> Workflow:
        workflow = self.get(name)
        del self.workflows[name]
        await self._unregister_models(workflow.models)
        self._forget(workflow.unpacked)
        log.info("unregistered workflow %s", name)
        return workflow

    def page(self, params: Mapping[str, str], limit: int | None, start: int) -> dict[str, Any]:
        """``GET /workflows``, paged as TorchServe pages it."""
        if limit is None or not 0 <= limit <= MAX_PAGE:
            limit = MAX_PAGE
        names = sorted(self.workflows)
        out: dict[str, Any] = {
            "workflows": [
                {"workflowName": n, "workflowUrl": self.workflows[n].url}
                for n in names[start : start + limit]
            ]
        }
        if start + limit < len(names):
            out["nextPageToken"] = str(start + limit)
        return out

    def describe(self, name: str) -> list[dict[str, Any]]:
        workflow = self.get(name)
        s = workflow.spec.defaults
        out: dict[str, Any] = {
            "workflowName": name,
            "workflowUrl": workflow.url,
            "minWorkers": s.min_workers,
            "maxWorkers": s.max_workers,
            "batchSize": s.batch_size,
            "maxBatchDelay": s.max_batch_delay_ms,
            "workflowDag": workflow.spec.dag_text,
        }
        if not self.registry.config.torchserve:
            out["nodes"] = [
                {
                    "name": n.name,
                    "model": workflow.models[n.name],
                    "kind": "function" if n.is_function else "model",
                    "next": list(n.children),
                    "retryAttempts": n.settings.retry_attempts,
                    "timeoutMs": n.settings.timeout_ms,
                }
                for n in workflow.spec.nodes
            ]
        return [out]

    async def predict(
        self, name: str, request: Request, max_response_bytes: int
    ) -> tuple[bytes, str]:
        workflow = self.get(name)
        return await run(
            name, workflow.spec, workflow.models, self.registry, request, max_response_bytes
        )
