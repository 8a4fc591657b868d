"""GPU discovery and round-robin assignment of workers to GPUs.

Each worker gets one physical GPU through ``CUDA_VISIBLE_DEVICES``; inside the worker that GPU
is ``cuda:0``, so the handler's ``gpu_id`` is 0 while describe shows the physical id. With no
GPU, ``CUDA_VISIBLE_DEVICES`` is set empty so nothing can touch a GPU by accident.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence

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
    """Round-robin across all models, starting at GPU 0; ``device_ids`` restricts a model."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0

    def assign(self, device_ids: Sequence[int] | None = None) -> int | None:
        """The physical GPU for the next worker, or None on a CPU-only server."""
        if self.count == 0:
            return None
        choices = [d for d in device_ids if 0 <= d < self.count] if device_ids else None
        if device_ids and not choices:
            raise ValueError(
                f"deviceIds {list(device_ids)} name no GPU of this server (it has {self.count})"
            )
        pool = choices or list(range(self.count))
        gpu = pool[self._next % len(pool)]
        self._next += 1
        return gpu


def worker_env_for(gpu: int | None) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": "" if gpu is None else str(gpu)}
