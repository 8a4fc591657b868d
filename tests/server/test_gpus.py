"""End to end: GPU assignment. No GPU here: ``number_of_gpu`` makes the server hand out GPUs, and
the probe handler reports the ``CUDA_VISIBLE_DEVICES`` and ``gpu_id`` its worker sees."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from tests.server.conftest import pid_alive, template_ready, wait_until


def _gpu_ids(server, model: str) -> list:
    return [w["gpuId"] for w in server.manage("GET", f"/models/{model}").json()[0]["workers"]]


def _config(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def test_round_robin_across_models_and_device_ids_on_their_own_counter(
    make_archive, start_server, tmp_path: Path
) -> None:
    pinned = _config(tmp_path, "pinned", "deviceIds: [2, 0]\nminWorkers: 3\n")
    make_archive("probe", "probe:handle", "pinned", "-c", pinned)
    make_archive("probe", "probe:handle", "a")
    make_archive("probe", "probe:handle", "b")
    server = start_server(config={"number_of_gpu": 3})
    assert server.manage("POST", "/models?url=pinned.mar").status == 200
    for name in ("a", "b"):
        assert server.manage("POST", f"/models?url={name}.mar&initial_workers=2").status == 200
    # pinned goes round its own list; registering it took no turn from the shared counter
    assert _gpu_ids(server, "pinned") == [2, 0, 2]
    assert _gpu_ids(server, "a") + _gpu_ids(server, "b") == [0, 1, 2, 0]
    described = server.manage("GET", "/models/pinned").json()[0]
    assert described["deviceIds"] == [2, 0]
    seen = {server.predict("pinned", {}).json()["cuda_visible_devices"] for _ in range(12)}
    assert seen <= {"2", "0"}
    report = server.predict("a", {}).json()
    assert report["gpu_id"] == 0  # the one GPU a worker can see is its cuda:0


def test_cpu_only_server_hides_gpus(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"number_of_gpu": 0})
    report = server.predict("probe", {}).json()
    assert report["gpu_id"] is None
    assert report["cuda_visible_devices"] == ""


def test_a_restarted_worker_keeps_its_gpu(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server(config={"number_of_gpu": 2})
    assert server.manage("POST", "/models?url=probe.mar&initial_workers=2").status == 200
    assert _gpu_ids(server, "probe") == [0, 1]
    for slot in (1, 0):  # the shared turn is at GPU 0 now: a fresh draw would give slot 1 GPU 0
        old = server.worker_pids("probe")[slot]
        os.kill(old, signal.SIGKILL)

        def replaced(old: int = old, slot: int = slot) -> bool:
            # an idle worker's death is noticed when a request is sent to it
            server.predict("probe", {})
            workers = server.manage("GET", "/models/probe").json()[0]["workers"]
            return workers[slot]["pid"] != old and workers[slot]["status"] == "READY"

        wait_until(replaced, 60, "the killed worker's replacement")
        assert _gpu_ids(server, "probe") == [0, 1]  # not piled onto one GPU
    seen = {server.predict("probe", {}).json()["cuda_visible_devices"] for _ in range(20)}
    assert seen <= {"0", "1"}


def test_device_ids_the_server_lacks_are_a_clear_400(
    make_archive, start_server, tmp_path: Path
) -> None:
    make_archive("probe", "probe:handle", "far", "-c", _config(tmp_path, "far", "deviceIds: [5]\n"))
    partly = _config(tmp_path, "partly", "deviceIds: [0, 5, 7]\n")
    make_archive("probe", "probe:handle", "partly", "-c", partly)
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"number_of_gpu": 2})
    far = server.manage("POST", "/models?url=far.mar")
    assert far.status == 400
    assert far.json() == {
        "code": 400,
        "type": "InvalidModelException",
        "message": "model far:1.0: deviceIds [5] name GPU(s) 5 that this server does not have;"
        " it has 2 GPU(s), ids 0 to 1",
    }
    part = server.manage("POST", "/models?url=partly.mar")
    assert part.status == 400
    assert "deviceIds [0, 5, 7] name GPU(s) 5, 7 that" in part.json()["message"]
    assert server.manage("GET", "/models/partly").status == 404
    assert server.predict("probe", {}).status == 200
    # the next worker still gets GPU 1: the refused models took no round-robin turn
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    assert _gpu_ids(server, "probe") == [0, 1]


def test_device_ids_the_server_lacks_fail_at_startup_and_restore_not_the_daemon(
    make_archive, start_server, tmp_path: Path
) -> None:
    make_archive("probe", "probe:handle", "far", "-c", _config(tmp_path, "far", "deviceIds: [5]\n"))
    make_archive(
        "probe", "probe:handle", "pinned", "-c", _config(tmp_path, "p", "deviceIds: [1]\n")
    )
    make_archive("probe", "probe:handle", "probe")
    first = start_server("far=far.mar", "probe=probe.mar", config={"number_of_gpu": 2})
    assert "model far: failed: model far:1.0: deviceIds [5] name GPU(s) 5" in first.start_output
    assert first.predict("probe", {}).status == 200
    assert first.manage("POST", "/models?url=pinned.mar").status == 200
    assert first.cli("--stop").returncode == 0
    # restored from the snapshot on a server with one GPU: pinned fails, the rest serves
    second = start_server(run_dir=first.run_dir, config={"number_of_gpu": 1})
    assert pid_alive(second.pid)
    assert "deviceIds [1] name GPU(s) 1 that this server does not have" in second.start_output
    assert second.predict("probe", {}).status == 200


def test_device_type(make_archive, start_server, tmp_path: Path) -> None:
    cpu = _config(tmp_path, "cpu", "deviceType: cpu\n")
    make_archive("probe", "probe:handle", "cpu", "-c", cpu)
    gpu = _config(tmp_path, "gpu", "deviceType: gpu\n")
    make_archive("probe", "probe:handle", "gpu", "-c", gpu)
    both = _config(tmp_path, "both", "deviceType: cpu\ndeviceIds: [1]\n")
    make_archive("probe", "probe:handle", "both", "-c", both)
    server = start_server("cpu=cpu.mar", "gpu=gpu.mar", config={"number_of_gpu": 2})
    workers = server.manage("GET", "/models/cpu").json()[0]["workers"]
    assert [(w["gpu"], w["gpuId"]) for w in workers] == [(False, None)]
    report = server.predict("cpu", {}).json()
    assert (report["cuda_visible_devices"], report["gpu_id"]) == ("", None)
    assert _gpu_ids(server, "gpu") == [0]  # the cpu model took no GPU turn
    assert server.manage("GET", "/models/gpu").json()[0]["deviceType"] == "gpu"
    refused = server.manage("POST", "/models?url=both.mar")
    assert refused.status == 400
    assert refused.json()["message"] == (
        "model both:1.0 has deviceType cpu and deviceIds [1]: only a gpu model can be pinned"
        " to GPUs; remove one of the two"
    )
    cpu_only = start_server(config={"number_of_gpu": 0})
    no_gpu = cpu_only.manage("POST", "/models?url=gpu.mar")
    assert no_gpu.status == 400
    assert no_gpu.json()["message"] == (
        "model gpu:1.0 has deviceType gpu but this server has no GPU (number_of_gpu is 0, or"
        " none was detected); set deviceType: cpu in its model config to run it on the CPU"
    )
    assert cpu_only.manage("POST", "/models?url=cpu.mar").status == 200


def test_cuda_visible_devices_of_the_server_maps_gpus_to_physical_ids(
    make_archive, start_server, tmp_path: Path
) -> None:
    """Started with CUDA_VISIBLE_DEVICES=6,4, server GPU 0 is device 6 and GPU 1 device 4; the
    template it forks workers from sees no GPU at all."""
    make_archive("probe", "probe:handle", "probe")
    make_archive(
        "probe", "probe:handle", "pinned", "-c", _config(tmp_path, "p", "deviceIds: [1]\n")
    )
    server = start_server(
        config={"number_of_gpu": 3}, env={"CUDA_VISIBLE_DEVICES": "6,4"}
    )  # more than it lists: capped at the two it lists
    assert server.status["gpus"] == 2
    assert server.manage("POST", "/models?url=probe.mar&initial_workers=2").status == 200
    assert server.manage("POST", "/models?url=pinned.mar").status == 200
    assert _gpu_ids(server, "probe") == [6, 4]
    assert _gpu_ids(server, "pinned") == [4]
    assert server.predict("pinned", {}).json()["cuda_visible_devices"] == "4"
    seen = {server.predict("probe", {}).json()["cuda_visible_devices"] for _ in range(20)}
    assert seen <= {"6", "4"}

    wait_until(lambda: template_ready(server), 120, "the worker template")
    assert server.manage("PUT", "/models/probe?min_worker=3&synchronous=true").status == 200
    assert _gpu_ids(server, "probe") == [6, 4, 6]
    forked = server.worker_pids("probe")[2]
    template = psutil.Process(forked).ppid()
    assert template != server.pid
    assert psutil.Process(template).environ()["CUDA_VISIBLE_DEVICES"] == ""
    for _ in range(100):
        report = server.predict("probe", {}).json()
        if report["pid"] == forked:
            break
    else:
        raise AssertionError("the forked worker took no request")
    assert (report["cuda_visible_devices"], report["gpu_id"]) == ("6", 0)


def test_a_worker_that_cannot_use_its_gpu_says_why(make_archive, start_server) -> None:
    """A handler that finds no CUDA runs on the CPU without a word (TorchServe's fall back):
    the server warns, naming the worker, its GPU and torch's reason (here a CPU-only torch, the
    usual cause; on an H100 it was the sandbox keeping CUDA from starting)."""
    make_archive("torch_import", "torchy:handle", "torchy")
    make_archive("probe", "probe:handle", "probe")
    server = start_server("torchy=torchy.mar", "probe=probe.mar", config={"number_of_gpu": 1})
    assert server.predict("torchy", {}).status == 200
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    warned = [line for line in log.splitlines() if "cannot use it" in line]
    assert len(warned) == 1, warned  # the probe's worker imports no torch: nothing to say
    assert "WARNING" in warned[0] and "of torchy:1.0 was given GPU 0 but cannot use it" in warned[0]
    import torch

    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is a CPU-only build" in warned[0]
    else:  # a CUDA build on a machine whose server was told of a GPU that is not there
        assert "finds no usable GPU" in warned[0]
