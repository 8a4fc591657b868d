"""GPU discovery and round-robin assignment of workers to GPUs.

The server's GPUs are numbered 0 to n-1 (``deviceIds`` use these numbers). Without
``CUDA_VISIBLE_DEVICES`` in the server's environment, GPU i is physical device i; with it (say
``2,3``), GPU i is the i-th device listed, as CUDA itself numbers them. Each worker gets its one
GPU's physical id in ``CUDA_VISIBLE_DEVICES``, so inside it that GPU is ``cuda:0`` and the
handler's ``gpu_id`` is 0, while describe shows the physical id. A worker without a GPU gets
``CUDA_VISIBLE_DEVICES`` set empty, so nothing can touch a GPU by accident.

Workers of models without ``deviceIds`` share one round-robin counter across all models, starting
at GPU 0; a model with ``deviceIds`` goes round its own list with its own counter, as TorchServe
does. A worker slot draws its GPU once: a worker restarted after a crash keeps it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from server.errors import InvalidModel

log = logging.getLogger(__name__)

TORCH_PROBE_TIMEOUT_S = 60.0  # importing torch from a cold disk can take a while
# What a GPU driver leaves behind (NVIDIA, WSL2, ROCm). Without one torch sees no GPU either, so
# it is not asked: importing it would add seconds to every server start
# (docs/explanations/costs.md).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
# -c puts the working folder first on sys.path: drop it, so a stray torch/ there is not imported
_TORCH_PROBE = "import sys; sys.path.pop(0); import torch; print(torch.cuda.device_count())"


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The devices ``CUDA_VISIBLE_DEVICES`` lists, in order; None when it is not set.

    As in CUDA, an empty entry or a negative id ends the list, so ``""`` and ``"-1"`` hide
    every GPU. Entries are kept as written: indexes, or ``GPU-<uuid>`` / ``MIG-<uuid>``.
    """
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    devices = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def server_gpus(number_of_gpu: int | None, environ: Mapping[str, str]) -> list[str]:
    """The physical id of each server GPU, by server index.

    ``number_of_gpu`` (else detection) says how many; an operator's ``CUDA_VISIBLE_DEVICES`` says
    which, and caps the count at the devices it lists.
    """
    count = detect_gpu_count() if number_of_gpu is None else number_of_gpu
    visible = visible_devices(environ)
    if visible is None:
        return [str(i) for i in range(count)]
    if number_of_gpu is not None and number_of_gpu > len(visible):
        log.warning(
            "number_of_gpu is %d but CUDA_VISIBLE_DEVICES=%s lists %d device(s): using those",
            number_of_gpu, environ["CUDA_VISIBLE_DEVICES"], len(visible),
        )  # fmt: skip
    devices = visible[:count]
    if devices:
        log.info(
            "CUDA_VISIBLE_DEVICES=%s: server GPUs 0-%d are physical devices %s",
            environ["CUDA_VISIBLE_DEVICES"], len(devices) - 1, ",".join(devices),
        )  # fmt: skip
    return devices


def detect_gpu_count(driver_paths: Sequence[str] = GPU_DRIVER_PATHS) -> int:
    """Count the machine's GPUs; 0 when nothing can tell.

    ``nvidia-smi`` first. Without it, torch when the server's environment has it and a GPU
    driver is present, asked in a subprocess so that CUDA is never initialised in the server;
    ``find_spec`` and the driver check keep this free where torch could find nothing. Both
    count every device: ``CUDA_VISIBLE_DEVICES`` is applied afterwards, by :func:`server_gpus`.
    """
    exe = shutil.which("nvidia-smi")
    if exe is not None:
        return _count_with_nvidia_smi(exe)
    if importlib.util.find_spec("torch") is None:
        log.info("no nvidia-smi on PATH and no torch: serving on CPU (number_of_gpu overrides)")
        return 0
    if not any(os.path.exists(path) for path in driver_paths):
        log.info("no nvidia-smi on PATH, no GPU driver: serving on CPU (number_of_gpu overrides)")
        return 0
    return _count_with_torch()


def _count_with_nvidia_smi(exe: str) -> int:
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


def _count_with_torch() -> int:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", _TORCH_PROBE],
            capture_output=True,
            text=True,
            timeout=TORCH_PROBE_TIMEOUT_S,
            check=True,
            env=env,
        )
        count = int(out.stdout.split()[-1])
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:]
        log.warning("asking torch for GPUs failed (%s): serving on CPU", " ".join(tail) or exc)
        return 0
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("asking torch for GPUs failed (%s): serving on CPU", exc)
        return 0
    log.info("no nvidia-smi on PATH; torch reports %d GPU(s)", count)
    return count


class GpuAllocator:
    """The server's GPUs, and the round-robin counter shared by models without ``deviceIds``."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)  # physical id of each server GPU
        self._next = 0

    @property
    def count(self) -> int:
        return len(self.devices)

    def plan(
        self, model_label: str, device_ids: Sequence[int] | None, device_type: str | None,
        per_worker: int = 1,
    ) -> GpuPlan:  # fmt: skip
        """How a model's workers get GPUs; ``InvalidModel`` when its model config cannot be met
        here. Checks only: no GPU is drawn until a worker slot starts.

        ``deviceType`` other than ``gpu`` (``cpu``, ``neuron``) gets no GPU; ``gpu`` on a server
        without GPUs is refused (TorchServe quietly runs it on the CPU instead). ``deviceIds``
        must all be GPUs of this server; on a server without GPUs they are ignored, so an archive
        pinned to GPUs still runs on a CPU-only machine. ``per_worker``: GPUs each worker takes
        (a parallel model's ``parallelLevel``), never more than the GPUs it may use.
        """
        ids = tuple(device_ids) if device_ids else None
        if device_type not in (None, "gpu"):
            if ids:
                raise InvalidModel(
                    f"model {model_label} has deviceType {device_type} and deviceIds {list(ids)}:"
                    " only a gpu model can be pinned to GPUs; remove one of the two"
                )
            return GpuPlan(self, None, use_gpu=False)
        if self.count == 0:
            if device_type == "gpu":
                raise InvalidModel(
                    f"model {model_label} has deviceType gpu but this server has no GPU"
                    " (number_of_gpu is 0, or none was detected); set deviceType: cpu in its"
                    " model config to run it on the CPU"
                )
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
        pool = len(ids) if ids else self.count
        if per_worker > pool:
            raise InvalidModel(
                f"model {model_label} needs {per_worker} GPUs per worker (parallelLevel) but"
                f" {'its deviceIds list' if ids else 'this server has'} {pool}"
            )
        return GpuPlan(self, ids, use_gpu=True, per_worker=per_worker)

    def draw(self, count: int = 1) -> list[int]:
        """The next ``count`` server GPU indexes on the shared counter."""
        indexes = [(self._next + i) % self.count for i in range(count)]
        self._next += count
        return indexes


class GpuPlan:
    """One model's way of drawing GPUs: none, its own ``deviceIds`` in turn, or the shared turn."""

    def __init__(
        self, allocator: GpuAllocator, device_ids: tuple[int, ...] | None, use_gpu: bool,
        per_worker: int = 1,
    ) -> None:  # fmt: skip
        self.allocator = allocator
        self.device_ids = device_ids
        self.use_gpu = use_gpu
        self.per_worker = per_worker
        self._next = 0

    def draw(self) -> str | None:
        """The physical id of the GPU for a new worker slot, or of its ``per_worker`` GPUs
        joined by commas (as ``CUDA_VISIBLE_DEVICES`` lists them: a parallel worker's group,
        the next ones in turn); None for a CPU worker."""
        if not self.use_gpu:
            return None
        if self.device_ids is None:
            indexes = self.allocator.draw(self.per_worker)
        else:
            n = len(self.device_ids)
            indexes = [self.device_ids[(self._next + i) % n] for i in range(self.per_worker)]
            self._next += self.per_worker
        return ",".join(self.allocator.devices[i] for i in indexes)


def shown_gpu_id(physical: str | None) -> int | str | None:
    """A physical id as describe shows it: a number when it is one (a UUID stays a string)."""
    return int(physical) if physical is not None and physical.isdigit() else physical


def worker_env_for(gpu: str | None) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": "" if gpu is None else gpu}
