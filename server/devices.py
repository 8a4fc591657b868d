"""GPU discovery and round-robin assignment of workers to GPUs.

Each worker gets one physical GPU through ``CUDA_VISIBLE_DEVICES``; inside the worker that GPU
is ``cuda:0``, so the handler's ``gpu_id`` is 0 while describe shows the physical id. With no
GPU, ``CUDA_VISIBLE_DEVICES`` is set empty so nothing can touch a GPU by accident.

Workers of models without ``deviceIds`` share one round-robin counter across all models, starting
at GPU 0; a model with ``deviceIds`` goes round its own list with its own counter, as TorchServe
does. A worker slot draws its GPU once: a worker restarted after a crash keeps it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence

from server.errors import InvalidModel

log = logging.getLogger(__name__)


def detect_gpu_count() -> int:
    """Count NVIDIA GPUs with ``nvidia-smi``; 0 when it is missing or fails.

    torch is not imported to ask: it costs seconds of startup, and without the NVIDIA driver
    (which ships nvidia-smi) it would not see CUDA devices either.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        log.info("no nvidia-smi on PATH: serving on CPU (set number_of_gpu to override)")
        return 0
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): serving on CPU", exc)
        return 0
    count = len([line for line in out.stdout.splitlines() if line.strip()])
    log.info("nvidia-smi reports %d GPU(s)", count)
    return count


class GpuAllocator:
    """The server's GPUs, and the round-robin counter shared by models without ``deviceIds``."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)  # physical id of each server GPU
        self._next = 0

    @property
    def count(self) -> int:
        return len(self.devices)

    def plan(self, model_label: str, device_ids: Sequence[int] | None) -> GpuPlan:
        """How a model's workers get GPUs; ``InvalidModel`` when its ``deviceIds`` name a GPU
        this server does not have. Checks only: no GPU is drawn until a worker slot starts.

        On a server without GPUs ``deviceIds`` are ignored, so an archive pinned to GPUs still
        runs on a CPU-only machine.
        """
        ids = tuple(device_ids) if device_ids else None
        if self.count == 0:
            if ids:
                log.info("model %s: no GPU on this server, deviceIds %s ignored", model_label,
                         list(ids))  # fmt: skip
            return GpuPlan(self, None, use_gpu=False)
        if ids:
            missing = sorted({i for i in ids if not 0 <= i < self.count})
            if missing:
                raise InvalidModel(
                    f"model {model_label}: deviceIds {list(ids)} name GPU(s)"
                    f" {', '.join(map(str, missing))} that this server does not have;"
                    f" it has {self.count} GPU(s), ids 0 to {self.count - 1}"
                )
        return GpuPlan(self, ids, use_gpu=True)

    def draw(self) -> int:
        """The next server GPU index on the shared counter."""
        index = self._next % self.count
        self._next += 1
        return index


class GpuPlan:
    """One model's way of drawing GPUs: none, its own ``deviceIds`` in turn, or the shared turn."""

    def __init__(
        self, allocator: GpuAllocator, device_ids: tuple[int, ...] | None, use_gpu: bool
    ) -> None:
        self.allocator = allocator
        self.device_ids = device_ids
        self.use_gpu = use_gpu
        self._next = 0

    def draw(self) -> str | None:
        """The physical id of the GPU for a new worker slot; None for a CPU worker."""
        if not self.use_gpu:
            return None
        if self.device_ids is None:
            index = self.allocator.draw()
        else:
            index = self.device_ids[self._next % len(self.device_ids)]
            self._next += 1
        return self.allocator.devices[index]


def shown_gpu_id(physical: str | None) -> int | str | None:
    """A physical id as describe shows it: a number when it is one (a UUID stays a string)."""
    return int(physical) if physical is not None and physical.isdigit() else physical


def worker_env_for(gpu: str | None) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": "" if gpu is None else gpu}
