"""End to end: a parallel model's worker as torchrun's ranks (parallelType tp, 2 ranks on CPU
with gloo). TorchServe's own tensor-parallel test handler (test/pytest/test_parallelism.py),
served by a real mserve: each rank joins the process group in initialize, and every request is
an all_reduce across the ranks."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.server.conftest import HANDLERS, pid_alive, wait_until

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

TP = HANDLERS / "tensor_parallel"


def _archive(make_archive, name: str = "tp", config: Path = TP / "model-config.yaml") -> None:
    make_archive("tensor_parallel", "handler", name, "--model-file", str(TP / "model.py"),
                 "-c", str(config))  # fmt: skip


def _ranks(server, model: str = "tp") -> list[dict]:
    reply = server.predict(model, b"ranks")
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


def test_each_request_is_an_all_reduce_across_the_ranks(make_archive, start_server) -> None:
    _archive(make_archive)
    server = start_server("tp=tp.mar")
    reply = server.predict("tp", b"42")
    assert reply.status == 200, reply.body
    chunked = {k.lower(): v for k, v in reply.headers.items()}.get("transfer-encoding")
    assert chunked == "chunked"  # rank 0's intermediate chunk, then the sum
    assert reply.body == b"0" + str(2 * 42).encode()
    assert server.predict("tp", b"5").body == b"010"  # the ranks stay in step

    ranks = _ranks(server)
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "2"), ("1", "1", "2"),
    ]  # fmt: skip
    assert {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
    assert len({r["MASTER_PORT"] for r in ranks}) == 1
    assert len({r["TORCHELASTIC_RUN_ID"] for r in ranks}) == 1
    # torchrun's OMP_NUMBER_THREADS, 1 unless the model config says (TorchServe's default)
    assert [(r["OMP_NUM_THREADS"], r["threads"]) for r in ranks] == [("1", 1), ("1", 1)]

    described = server.manage("GET", "/models/tp").json()[0]
    assert (described["parallelType"], described["parallelLevel"]) == ("tp", 2)
    (worker,) = described["workers"]
    assert worker["pid"] == ranks[0]["pid"]  # the worker the server talks to is rank 0
    # every rank confined; TCP only on the ephemeral ports the ranks rendezvous and talk on
    assert {"landlock-files", "landlock-tcp"} <= set(worker["sandbox"]["applied"])
    assert worker["sandbox"]["peer_ports"] == [
        [int(p) for p in r.split("-")] for r in described["sandbox"]["peerPorts"]
    ]


def test_killing_rank_1_restarts_the_whole_group(make_archive, start_server) -> None:
    _archive(make_archive)
    server = start_server("tp=tp.mar")
    old = _ranks(server)
    os.kill(old[1]["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(old[0]["pid"]), 30, "rank 0 to go with rank 1")

    def answers() -> bool:
        return server.predict("tp", b"3").body == b"06"

    wait_until(answers, 120, "the group started again")
    new = _ranks(server)
    assert {r["pid"] for r in new}.isdisjoint(r["pid"] for r in old)
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert f"rank 1 (pid {old[1]['pid']}) was killed by SIGKILL" in log


def test_custom_takes_parallel_level_gpus_per_worker_in_one_process(
    make_archive, start_server, tmp_path: Path
) -> None:
    """parallelType custom: no ranks, one process given the worker's GPUs (vLLM's way);
    workers take their groups of GPUs round robin."""
    config = tmp_path / "custom.yaml"
    config.write_text('parallelType: "custom"\nparallelLevel: 2\nminWorkers: 2\n')
    make_archive("probe", "probe:handle", "custom", "-c", str(config))
    server = start_server("custom=custom.mar", config={"number_of_gpu": 4})
    described = server.manage("GET", "/models/custom").json()[0]
    assert (described["parallelType"], described["parallelLevel"]) == ("custom", 2)
    assert [w["gpuId"] for w in described["workers"]] == ["0,1", "2,3"]
    report = server.predict("custom", {}).json()
    assert report["cuda_visible_devices"] in ("0,1", "2,3")
    assert report["gpu_id"] == 0


def test_parallel_type_without_a_level_is_none_as_in_torchserve(
    make_archive, start_server, tmp_path: Path
) -> None:
    config = tmp_path / "typeonly.yaml"
    config.write_text('parallelType: "tp"\n')
    make_archive("probe", "probe:handle", "typeonly", "-c", str(config))
    server = start_server("typeonly=typeonly.mar")
    described = server.manage("GET", "/models/typeonly").json()[0]
    assert (described["parallelType"], described["parallelLevel"]) == ("", 0)
    assert server.predict("typeonly", {}).status == 200
