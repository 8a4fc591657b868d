"""A Serve replica of one model version: the handler runs in the replica's own process, loaded
and called by the worker's service (mserve_worker/service.py) as in a worker, only without the
socket, so every handler style, the ``context`` contract, per-request errors and the Open
Inference Protocol codec work as they do under ``mserve``.

The replica stands where an mserve worker stands; Ray is its supervisor (restarts, placement,
GPU assignment) and ``serve.batch`` its batcher, with the model's ``batchSize`` and
``maxBatchDelay``. Batches run one at a time, in a thread, so the replica keeps taking requests
while the handler works.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

from ray import serve

from mserve_worker.protocol import ProtocolError, RequestItem, ResponseItem, checked_response
from mserve_worker.service import BatchFailed, HandlerService, LoadFailed
from server.store import unpack

# What a replica answers for a request whose batch failed as a whole: the handler raised or
# returned the wrong number of results. The ingress turns it into the error body of its path.
BATCH_FAILED = "batch-failed"


class ReplicaLoadError(RuntimeError):
    """The handler did not load; Serve reports the deployment as failed with this message."""


class ModelReplica:
    """Constructed by Serve with the plan's ``replica`` spec (server/rayserve/plan.py)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        started = time.monotonic()
        self.label = f"{spec['model_name']}:{spec['model_version']}"
        self.python: str | None = None  # the model's own environment, if it has requirements
        # once per node: the first replica unpacks into the cache, the others find it there
        unpacked = unpack(
            Path(spec["archive"]), spec["archive"], Path(spec["cache_dir"]), spec["sha256"]
        )
        if spec.get("env"):
            self._use_env(spec["env"], unpacked.model_dir, Path(spec["cache_dir"]))
        context = serve.get_replica_context()
        init = {
            **spec,
            "model_dir": str(unpacked.model_dir),
            # Ray sets CUDA_VISIBLE_DEVICES to the replica's GPU: it is cuda:0 here
            "gpu_id": 0 if spec.get("use_gpu") else None,
            "worker_id": context.replica_tag if context is not None else str(os.getpid()),
            "server_name": "mserve",
        }
        try:
            self.service = HandlerService.load(init)  # as a worker loads it
        except LoadFailed as exc:
            raise ReplicaLoadError(
                f"model {self.label}: the handler failed to load: {exc.error}"
            ) from None
        self.style = self.service.style
        self.load_s = round(time.monotonic() - started, 3)
        self.batch_ids = itertools.count(1)
        self.infer_batch.set_max_batch_size(spec["batch_size"])
        self.infer_batch.set_batch_wait_timeout_s(spec["max_batch_delay_ms"] / 1000.0)

    def _use_env(self, env: dict[str, Any], model_dir: Path, cache_dir: Path) -> None:
        """The archive's requirements, from mserve's environment cache on this node (built by
        the first replica that needs it, under the cache's lock), ahead of the replica's own
        packages on ``sys.path``, as a layered mserve environment has them."""
        from server.model_envs import EnvCache, EnvRequest

        wheelhouse = model_dir / env["wheelhouse"] if env.get("wheelhouse") else None
        cache = EnvCache(cache_dir / "envs")
        python = cache.ensure(EnvRequest(env["requirements"], self.label, wheelhouse))
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        site_packages = Path(python).parent.parent / "lib" / version / "site-packages"
        sys.path.insert(0, str(site_packages))
        self.python = python

    async def infer(self, item: RequestItem) -> ResponseItem | tuple[str, str]:
        """One request; answered from the batch it joins."""
        return await self.infer_batch(item)

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0)
    async def infer_batch(self, items: list[RequestItem]) -> list[ResponseItem | tuple[str, str]]:
        return await asyncio.to_thread(self._run, items)

    def _run(self, items: list[RequestItem]) -> list[ResponseItem | tuple[str, str]]:
        try:
            responses, _handler_ms, _metrics = self.service.serve(next(self.batch_ids), items)
            answers = []
            for i, r in enumerate(responses):
                # the wire's rules hold here too; a body goes to the ingress as bytes (pickled)
                _entry, body = checked_response(r, f"responses[{i}]")
                plain = r.body if type(r.body) is bytes else bytes(body)
                answers.append(ResponseItem(r.status, plain, r.content_type, r.headers))
        except BatchFailed as exc:
            return [(BATCH_FAILED, f"handler of {self.label} failed: {exc.error}")] * len(items)
        except ProtocolError as exc:
            error = f"handler of {self.label} failed: invalid handler result: {exc}"
            return [(BATCH_FAILED, error)] * len(items)
        return answers

    def info(self) -> dict[str, Any]:
        """Which process answers, and how its handler loaded (tests, ``status``)."""
        return {"pid": os.getpid(), "style": self.style, "load_s": self.load_s,
                "environment": self.python}  # fmt: skip

    def ready(self) -> bool:
        return True

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.shutdown()
