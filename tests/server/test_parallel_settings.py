"""parallelType, parallelLevel and the torchrun section as TorchServe reads them; GPUs drawn by
groups of parallelLevel; the TCP ports a parallel model's ranks may use."""

from __future__ import annotations

import logging

import pytest

from server.config.model_settings import Parallel, parallel_settings
from server.devices import GpuAllocator
from server.errors import InvalidModel
from server.workers.sandbox import peer_port_ranges


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"parallelType": "tp", "torchrun": {"nproc-per-node": 4}}, Parallel("tp", 4)),
        ({"parallelType": "PP", "parallelLevel": 2}, Parallel("pp", 2)),
        ({"parallelType": "custom", "parallelLevel": 4}, Parallel("custom", 4)),
        ({"parallelType": "pptp", "torchrun": {"nproc-per-node": 2, "OMP_NUMBER_THREADS": 3}},
         Parallel("pptp", 2, 3)),
        ({"parallelType": "tp", "torchrun": {}}, Parallel("tp", 1)),  # nproc-per-node: 1
        # TorchServe's none: a type without a level, a level without a type
        ({"parallelType": "tp"}, Parallel()),
        ({"torchrun": {"nproc-per-node": 2}}, Parallel()),
        ({}, Parallel()),
    ],
)  # fmt: skip
def test_parallel_settings_as_torchserve_reads_them(config, expected) -> None:
    assert parallel_settings(config, "m:1") == expected


def test_what_torchserve_ignores_is_ignored_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert parallel_settings({"parallelType": "xpp", "parallelLevel": 2}, "m:1") == Parallel()
        got = parallel_settings(
            {"parallelType": "tp", "torchrun": {"nproc-per-node": 2, "max-restarts": 3,
                                               "OMP_NUMBER_THREADS": "two"}}, "m:1"
        )  # fmt: skip
    assert got == Parallel("tp", 2, 1)
    text = caplog.text
    assert "model m:1: invalid parallelType 'xpp', should be pp, tp, pptp or custom" in text
    assert "model m:1: unsupported torchrun parameter max-restarts; ignored" in text
    assert "invalid torchrun.OMP_NUMBER_THREADS 'two', should be an integer >= 1; 1 used" in text


def test_what_cannot_be_started_is_refused() -> None:
    with pytest.raises(InvalidModel) as mismatch:
        parallel_settings(
            {"parallelType": "tp", "parallelLevel": 4, "torchrun": {"nproc-per-node": 2}}, "m:1"
        )
    assert mismatch.value.message == (
        "model m:1: parallelLevel 4 and torchrun.nproc-per-node 2 disagree; set one of them"
        " (each is the number of ranks of a worker)"
    )
    with pytest.raises(InvalidModel) as nodes:
        parallel_settings({"parallelType": "tp", "torchrun": {"nnodes": 2}}, "m:1")
    assert nodes.value.message == (
        "model m:1: torchrun.nnodes is 2: mserve starts a worker's ranks on its own machine"
        " only (nnodes 1)"
    )


def test_gpus_go_round_robin_by_groups() -> None:
    gpus = GpuAllocator(["6", "4", "5", "7"])
    tp = gpus.plan("tp:1", None, None, per_worker=2)
    assert [tp.draw() for _ in range(3)] == ["6,4", "5,7", "6,4"]
    assert gpus.plan("one:1", None, None).draw() == "5"  # the shared turn went on
    pinned = gpus.plan("p:1", [3, 1, 2], None, per_worker=2)
    assert [pinned.draw() for _ in range(3)] == ["7,4", "5,7", "4,5"]
    assert gpus.plan("c:1", None, "cpu", per_worker=2).draw() is None
    with pytest.raises(InvalidModel) as more:
        gpus.plan("big:1", None, None, per_worker=8)
    assert more.value.message == (
        "model big:1 needs 8 GPUs per worker (parallelLevel) but this server has 4"
    )


def test_peer_ports_are_the_ephemeral_range_less_the_servers_own(tmp_path) -> None:
    ephemeral = tmp_path / "range"
    ephemeral.write_text("32768\t60999\n")
    assert peer_port_ranges({8080, 40000, 32768}, str(ephemeral)) == (
        (32769, 39999), (40001, 60999),
    )  # fmt: skip
    assert peer_port_ranges(set(), str(tmp_path / "missing")) == ((32768, 60999),)
