"""The pure parts of GPU discovery and assignment (server/devices.py)."""

from __future__ import annotations

import pytest

from server.devices import GpuAllocator, shown_gpu_id, worker_env_for
from server.errors import InvalidModel


def test_shared_turn_and_own_turn() -> None:
    gpus = GpuAllocator(["6", "4", "5"])
    plain = gpus.plan("a:1", None)
    pinned = gpus.plan("p:1", [2, 0])  # checking draws nothing
    assert [plain.draw() for _ in range(2)] == ["6", "4"]
    assert [pinned.draw() for _ in range(3)] == ["5", "6", "5"]
    assert gpus.plan("b:1", None).draw() == "5"  # the shared turn went on from a


def test_plans_that_cannot_be_met() -> None:
    gpus = GpuAllocator(["0", "1"])
    with pytest.raises(InvalidModel) as info:
        gpus.plan("m:1", [1, 2, 9, 2])
    assert info.value.message == (
        "model m:1: deviceIds [1, 2, 9, 2] name GPU(s) 2, 9 that this server does not have;"
        " it has 2 GPU(s), ids 0 to 1"
    )
    assert GpuAllocator([]).plan("m:1", [0]).draw() is None  # a pinned archive still runs on CPU


def test_ids_as_describe_shows_them_and_the_worker_env() -> None:
    assert shown_gpu_id("3") == 3
    assert shown_gpu_id("GPU-8a1b") == "GPU-8a1b"
    assert shown_gpu_id(None) is None
    assert worker_env_for("4") == {"CUDA_VISIBLE_DEVICES": "4"}
    assert worker_env_for(None) == {"CUDA_VISIBLE_DEVICES": ""}
