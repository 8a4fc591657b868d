"""The host's CPU, memory, disk and GPU use, measured as TorchServe measures them (its
``metrics.py`` system metrics, once a minute): the metrics chore (server_metrics.py) runs
:func:`measure` in a thread and writes the values to ``/metrics`` and ``ts_metrics.log``.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence

import psutil

log = logging.getLogger(__name__)

# (name, unit, dimensions, value): one of TorchServe's system metrics
SystemValue = tuple[str, str, tuple[tuple[str, str], ...], float]
# TorchServe's system metrics: name, unit, dimension names (Hostname added), in its order
FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    *((name, unit, ("Level",)) for name, unit in (
        ("CPUUtilization", "Percent"), ("MemoryUsed", "Megabytes"),
        ("MemoryAvailable", "Megabytes"), ("MemoryUtilization", "Percent"),
        ("DiskUsage", "Gigabytes"), ("DiskUtilization", "Percent"),
        ("DiskAvailable", "Gigabytes"),
    )),
    *((name, unit, ("Level", "DeviceId")) for name, unit in (
        ("GPUMemoryUtilization", "Percent"), ("GPUMemoryUsed", "Megabytes"),
        ("GPUUtilization", "Percent"),
    )),
)  # fmt: skip


def measure(gpus: Sequence[str]) -> list[SystemValue]:
    """The host's values, then each of ``gpus``' (physical ids, in the order the server
    numbers them: its ``DeviceId``)."""
    host = (("Level", "Host"),)
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage("/")
    values: list[SystemValue] = [
        ("CPUUtilization", "Percent", host, psutil.cpu_percent()),
        ("MemoryUsed", "Megabytes", host, memory.used / 2**20),
        ("MemoryAvailable", "Megabytes", host, memory.available / 2**20),
        ("MemoryUtilization", "Percent", host, memory.percent),
        ("DiskUsage", "Gigabytes", host, disk.used / 2**30),
        ("DiskUtilization", "Percent", host, disk.percent),
        ("DiskAvailable", "Gigabytes", host, disk.free / 2**30),
    ]
    return values + _gpu_values(gpus)


def _gpu_values(gpus: Sequence[str]) -> list[SystemValue]:
    if not gpus:
        return []
    query = "index,utilization.gpu,utilization.memory,memory.used"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
             "-i", ",".join(gpus)],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("GPU metrics unavailable: %s", exc)
        return []
    by_physical = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4:
            by_physical[fields[0]] = fields[1:]
    values = []
    for device_id, physical in enumerate(gpus):
        found = by_physical.get(physical)
        if found is None:
            continue
        dims = (("Level", "Host"), ("DeviceId", str(device_id)))
        for (name, unit), raw in zip(
            (("GPUUtilization", "Percent"), ("GPUMemoryUtilization", "Percent"),
             ("GPUMemoryUsed", "Megabytes")),
            found,
            strict=True,
        ):  # fmt: skip
            try:
                values.append((name, unit, dims, float(raw)))
            except ValueError:  # "[N/A]" on devices that do not report it
                continue
    return values
