"""``ts.handler_utils.micro_batching.MicroBatching``: TorchServe's micro-batching example handler
served by a real mserve (answers checked against the model, the pipeline seen in the worker's
log), and the class itself in process: splitting, order, threads per step, failures."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.server import conftest as serving
from tests.server.conftest import concurrently
from tests.styles.test_builtin_handlers import (
    CNN,
    assert_ranking,
    cnn_archive,
    cnn_names,
    imagenet_tensor,
    model_class,
    noise_png,
    post_image,
    seeded,
    store,  # noqa: F401  (fixture)
    topk,
)
from tests.styles.test_ts_namespace import ts_path  # noqa: F401  (fixture)

start_server = serving.start_server
HANDLER = Path(__file__).resolve().parent.parent / "handlers" / "micro_batching" / "mb_handler.py"


def test_torchserves_micro_batching_handler(start_server, store, tmp_path) -> None:  # noqa: F811
    config = tmp_path / "config.yaml"  # TorchServe's example config, with a batch to fill
    config.write_text(yaml.safe_dump({
        "batchSize": 8, "maxBatchDelay": 10000, "batchWait": "fill",
        "micro_batching": {"micro_batch_size": 2,
                           "parallelism": {"preprocess": 2, "inference": 1, "postprocess": 2}},
    }))  # fmt: skip
    cnn_archive(store, tmp_path, "mb", str(HANDLER), "-c", str(config))
    server = start_server("mb=mb.mar")

    pngs = [noise_png(seed) for seed in range(8)]
    replies = concurrently(*(lambda png=png: post_image(server, "mb", png) for png in pngs))
    cnn = seeded(model_class(CNN, "TinyCNN"))
    for png, reply in zip(pngs, replies, strict=True):
        assert_ranking(reply, topk(cnn, imagenet_tensor(png), cnn_names()))
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    seen = re.findall(r"micro-batch (\d+) of (\d+) requests in (\S+)", log)
    assert sorted((int(i), int(n)) for i, n, _ in seen) == [(i, 2) for i in range(4)]
    assert {thread for *_, thread in seen} <= {"micro-batching-preprocess-0",
                                               "micro-batching-preprocess-1"}  # fmt: skip


class Steps:
    """A handler's three steps over numbers, recording micro-batches and threads."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any, list[Any]]] = []
        self.handle: Any = None

    def _note(self, step: str, data: list[Any]) -> None:
        self.seen.append((step, self.handle.get_micro_batch_idx(), list(data)))

    def preprocess(self, data: list[Any]) -> list[Any]:
        self._note("preprocess", data)
        if "bad" in data:
            raise ValueError("cannot read 'bad'")
        time.sleep(0.01 * (len(data) % 3))  # micro-batches finish out of order
        return [x + 1 for x in data]

    def inference(self, data: list[Any]) -> list[Any]:
        self._note("inference", data)
        return [x * 10 for x in data]

    def postprocess(self, data: list[Any]) -> list[Any]:
        return [str(x) for x in data]


def _steps(size: int, parallelism: dict[str, int] | None = None) -> Steps:
    from ts.handler_utils.micro_batching import MicroBatching

    steps = Steps()
    steps.handle = MicroBatching(steps, size, parallelism)
    return steps


def test_batches_split_into_micro_batches_and_answer_in_order(ts_path) -> None:  # noqa: F811
    steps = _steps(3, {"preprocess": 3, "inference": 2})
    try:
        assert steps.handle.handle(list(range(8))) == [str((x + 1) * 10) for x in range(8)]
        pre = sorted((idx, data) for step, idx, data in steps.seen if step == "preprocess")
        assert pre == [(0, [0, 1, 2]), (1, [3, 4, 5]), (2, [6, 7])]
        assert steps.handle.get_micro_batch_idx() is None  # outside a step thread
        assert steps.handle.handle([]) == []
    finally:
        steps.handle.shutdown()


def test_threads_per_step_follow_parallelism(ts_path) -> None:  # noqa: F811
    steps = _steps(2)
    groups = steps.handle.thread_groups
    try:
        assert [len(groups[s]) for s in ("preprocess", "inference", "postprocess")] == [1, 1, 1]
        steps.handle.parallelism = {"preprocess": 2, "inference": 3, "postprocess": 4}
        assert [len(groups[s]) for s in ("preprocess", "inference", "postprocess")] == [2, 3, 4]
        steps.handle.parallelism = {"inference": 1}
        assert [len(groups[s]) for s in ("preprocess", "inference", "postprocess")] == [2, 1, 4]
        assert steps.handle.parallelism == {"preprocess": 2, "inference": 1, "postprocess": 4}
        before = threading.active_count()
        assert steps.handle.handle([1, 2, 3]) == ["20", "30", "40"]
        assert threading.active_count() == before
        with pytest.raises(ValueError, match=r"names 'decode'; the steps are preprocess, infer"):
            steps.handle.parallelism = {"decode": 1}
        with pytest.raises(ValueError, match=r"parallelism.inference must be a whole number of "
                           r"threads, at least 1; found 0"):  # fmt: skip
            steps.handle.parallelism = {"inference": 0}
    finally:
        steps.handle.shutdown()
    assert all(not group for group in groups.values())


def test_a_failing_step_fails_its_batch_and_the_pipeline_serves_on(ts_path) -> None:  # noqa: F811
    steps = _steps(2, {"preprocess": 2})
    try:
        with pytest.raises(ValueError, match="cannot read 'bad'"):
            steps.handle.handle([1, 2, "bad", 4, 5])
        # the failed micro-batch skipped inference; nothing of that batch is left behind
        assert [idx for step, idx, _ in steps.seen if step == "inference"].count(1) == 0
        assert steps.handle.handle([7]) == ["80"]
    finally:
        steps.handle.shutdown()


def test_micro_batching_in_a_handler_call(ts_path) -> None:  # noqa: F811
    """``MicroBatching`` as a handler's ``handle(data, context)``: the pipeline for
    predictions, ``HandlerTime`` recorded; a bad micro_batch_size says so."""
    from ts.handler_utils.micro_batching import MicroBatching
    from ts.torch_handler.base_handler import BaseHandler

    from mserve_worker.context import Context

    class Handler(Steps, BaseHandler):
        def __init__(self) -> None:
            Steps.__init__(self)

    context = Context(model_name="m", model_dir=".", manifest={}, batch_size=4, gpu_id=None,
                      server_name="mserve", server_version="test")  # fmt: skip
    context.start_batch([], "")
    handler = Handler()
    handler.handle = MicroBatching(handler, 2)
    try:
        assert handler.handle([1, 2, 3], context) == ["20", "30", "40"]
        assert handler.context is context
        assert [m["name"] for m in context.metrics.drain()] == ["HandlerTime"]
        handler.handle.micro_batch_size = 0
        with pytest.raises(
            ValueError, match="micro_batch_size must be a whole number >= 1, found 0"
        ):
            handler.handle([1], context)
    finally:
        handler.handle.shutdown()
