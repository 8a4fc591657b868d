"""The pure parts of GPU discovery and assignment (server/devices.py)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from server.devices import (
    GpuAllocator,
    detect_gpu_count,
    server_gpus,
    shown_gpu_id,
    visible_devices,
    worker_env_for,
)
from server.errors import InvalidModel


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("2,3", ["2", "3"]),
        (" 3 , 1 ", ["3", "1"]),
        ("1,-1,2", ["1"]),  # as in CUDA, an invalid id ends the list
        ("GPU-8a1b,MIG-0c2d", ["GPU-8a1b", "MIG-0c2d"]),
    ],
)
def test_visible_devices(value: str | None, devices: list[str] | None) -> None:
    environ = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_devices(environ) == devices


def test_server_gpus_map_server_indexes_to_the_operators_devices() -> None:
    assert server_gpus(2, {}) == ["0", "1"]
    assert server_gpus(0, {"CUDA_VISIBLE_DEVICES": "2,3"}) == []
    assert server_gpus(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2"]
    assert server_gpus(2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert server_gpus(4, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]  # capped, with a warning
    assert server_gpus(2, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_shared_turn_and_own_turn() -> None:
    gpus = GpuAllocator(["6", "4", "5"])
    plain = gpus.plan("a:1", None, None)
    pinned = gpus.plan("p:1", [2, 0], "gpu")  # checking draws nothing
    assert [plain.draw() for _ in range(2)] == ["6", "4"]
    assert [pinned.draw() for _ in range(3)] == ["5", "6", "5"]
    assert gpus.plan("b:1", None, None).draw() == "5"  # the shared turn went on from a
    assert gpus.plan("c:1", None, "cpu").draw() is None
    assert gpus.plan("n:1", None, "neuron").draw() is None
    assert gpus.plan("d:1", None, None).draw() == "6"  # cpu models took no turn


def test_plans_that_cannot_be_met() -> None:
    gpus = GpuAllocator(["0", "1"])
    with pytest.raises(InvalidModel) as info:
        gpus.plan("m:1", [1, 2, 9, 2], None)
    assert info.value.message == (
        "model m:1: deviceIds [1, 2, 9, 2] name GPU(s) 2, 9 that this server does not have;"
        " it has 2 GPU(s), ids 0 to 1"
    )
    with pytest.raises(InvalidModel, match="deviceType cpu and deviceIds"):
        gpus.plan("m:1", [0], "cpu")
    cpu_only = GpuAllocator([])
    with pytest.raises(InvalidModel, match="deviceType gpu but this server has no GPU"):
        cpu_only.plan("m:1", None, "gpu")
    assert cpu_only.plan("m:1", [0], None).draw() is None  # a pinned archive still runs on CPU


def test_ids_as_describe_shows_them_and_the_worker_env() -> None:
    assert shown_gpu_id("3") == 3
    assert shown_gpu_id("GPU-8a1b") == "GPU-8a1b"
    assert shown_gpu_id(None) is None
    assert worker_env_for("4") == {"CUDA_VISIBLE_DEVICES": "4"}
    assert worker_env_for(None) == {"CUDA_VISIBLE_DEVICES": ""}


def test_detection_asks_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpu_count() == 3


def test_detection_falls_back_to_torch_without_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    driver = tmp_path / "nvidiactl"
    with caplog.at_level(logging.INFO, logger="server.devices"):
        assert detect_gpu_count(driver_paths=[str(driver)]) == 0
    assert "no GPU driver" in caplog.text  # torch was not asked: it could find nothing
    caplog.clear()
    driver.touch()  # as if a driver were loaded
    with caplog.at_level(logging.INFO, logger="server.devices"):
        assert detect_gpu_count(driver_paths=[str(driver)]) == 0
    assert "no nvidia-smi on PATH; torch reports 0 GPU(s)" in caplog.text  # a CPU build here
