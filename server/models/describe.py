"""A model version described as TorchServe's ``GET /models/{name}[/{version}]`` answers: its
fields with TorchServe's names, types and values, then ours (where each setting came from, the
load state, a failure and the last lines its worker printed, the sandbox)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from server.config.model_settings import shown
from server.devices import shown_gpu_id
from server.models import reload
from server.models.slot import SERVING

if TYPE_CHECKING:
    from server.models.version import ModelVersion


def describe(model: ModelVersion) -> dict[str, Any]:
    """TorchServe's describe fields with its types and values, then ours."""
    s = model.settings
    workers = []
    for slot in model.slots:
        w = slot.worker
        if w is None:
            continue
        workers.append(
            {
                "id": w.id,
                "startTime": _timestamp(w.started_at),
                # TorchServe's two values: READY when it serves (busy or not), else
                # UNLOADING; "state" says which of ours (STARTING, BUSY, STOPPING, ...)
                "status": "READY" if w.state in SERVING else "UNLOADING",
                "state": w.state.value,
                "memoryUsage": w.rss_bytes(),
                "pid": w.pid,
                "gpu": w.gpu is not None,
                "gpuId": shown_gpu_id(w.gpu),
                "gpuUsage": "N/A",
                "sandbox": w.sandbox,
            }
        )
    queued = model.queued()
    return {
        "modelName": model.name,
        "modelVersion": model.version,
        "modelUrl": model.url,
        "runtime": model.manifest.get("runtime", "python"),
        "handler": model.handler,
        **shown(s),  # minWorkers, maxWorkers, batchSize, ... (server/config/model_settings.py)
        "parallelType": s.parallel.type,  # "" is TorchServe's none
        "parallelLevel": s.parallel.level,
        "deviceType": "gpu" if model.gpus.use_gpu else "cpu",
        "deviceIds": list(s.device_ids) if s.device_ids else None,
        "jobQueueStatus": {
            "remainingCapacity": max(0, s.job_queue_size - queued),
            "pendingRequests": queued,
        },
        "queueDepth": queued,
        "settingSources": s.sources,
        "loadedAtStartup": model.loaded_at_startup,
        "loadState": model.load_state(),
        # measured, not declared: a worker's PSS, its weights in the warm tier, load and wake
        # times (server/models/footprints.py), kept across restarts
        "footprint": model.residency.shown(model) if model.residency is not None else None,
        "status": "FAILED" if model.failed else ("READY" if model.healthy() else "LOADING"),
        "stage": model.stage,
        "failure": model.failed,
        "lastOutput": model.last_output.splitlines() if model.failed else None,
        # the code its handler runs and its hot reloads (server/models/reload.py)
        "handlerCode": reload.shown(model),
        # who signed its archive, and when that was checked (server/signatures.py)
        "signature": model.signature.shown() if model.signature is not None else None,
        "python": model.python,
        "environment": model.env_key,
        "sandbox": model.sandbox.shown() if model.sandbox is not None else None,
        # weightsScan (above) is the mode; this, what its scan found (None: off)
        "weightsScanResult": model.weights_scan.shown() if model.weights_scan else None,
        "workers": workers,
    }


def _timestamp(epoch_s: float) -> str:
    """UTC with milliseconds, TorchServe's form: 2024-05-01T12:00:00.123Z."""
    millis = int(epoch_s * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch_s)) + f".{millis:03d}Z"
