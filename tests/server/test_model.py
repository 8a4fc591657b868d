"""ModelVersion supervision edge cases, driven directly (real processes, no HTTP)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from mserve_worker.protocol import RequestItem
from server.config.model_settings import ModelSettings
from server.devices import GpuAllocator
from server.errors import InvalidModel, ServiceUnavailable
from server.models.version import ModelVersion
from server.workers.launch import Launcher

HANDLERS = Path(__file__).resolve().parent.parent / "handlers"


def _model(
    python: str,
    launcher: Launcher,
    handler: str = "probe:handle",
    model_dir: Path = HANDLERS / "probe",
    max_retry_timeout_s: float = 10.0,
    model_yaml_config: dict | None = None,
) -> ModelVersion:
    settings = ModelSettings(
        batch_size=1, max_batch_delay_ms=1, response_timeout_s=10, startup_timeout_s=10,
        min_workers=1, max_workers=1, job_queue_size=10, device_ids=None,
        max_retry_timeout_s=max_retry_timeout_s,
    )  # fmt: skip
    return ModelVersion(
        name="probe", version="1.0", url="probe.mar", model_dir=model_dir,
        manifest={"model": {"modelName": "probe"}}, handler=handler, settings=settings,
        model_yaml_config=model_yaml_config or {}, python=python, gpus=GpuAllocator([]).plan("probe:1.0", None, None), launcher=launcher,
        server_version="test", max_payload_bytes=1 << 20, loaded_at_startup=False,
    )  # fmt: skip


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "exec"])
def test_missing_interpreter_fails_the_registration_instead_of_hanging(fork: bool) -> None:
    async def scenario() -> str:
        launcher = Launcher(use_templates=fork)
        model = _model("/nonexistent/bin/python", launcher)
        try:
            with pytest.raises(InvalidModel) as info:
                await asyncio.wait_for(model.scale(1, 1, synchronous=True), 30)
            return info.value.message
        finally:
            await model.stop(5)
            await launcher.close()

    message = asyncio.run(scenario())
    assert "cannot start a worker for probe:1.0 with /nonexistent/bin/python" in message


def _restart_delays() -> tuple[list[str], logging.Handler]:
    """The delays the supervisor's log gives its restarts ("restarting in 0.05 s"), collected
    by a handler to remove afterwards."""
    delays: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "restarting in" in message:
                delays.append(message.rsplit("restarting in ", 1)[1])

    handler = Collect()
    logging.getLogger("server.models.version").addHandler(handler)
    return delays, handler


def test_a_worker_that_cannot_load_is_retried_with_torchserves_backoff_until_the_window_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As TorchServe's WorkerThread: a slot whose worker fails to load retries it after 1, 1,
    2, 3, 5... units, and gives up once none has loaded for maxRetryTimeoutInSec since it was
    lost; with no other worker serving, the model is marked failed, naming the load error.
    The window holds at least three tries even when each exec'd worker takes a second to start
    (a busy machine, test files running side by side): with 1.5 s only one fitted there."""
    import sys

    import server.models.version as model_module

    monkeypatch.setattr(model_module, "BACKOFF_UNIT_S", 0.05)
    delays, handler = _restart_delays()

    async def scenario() -> tuple[str, str]:
        launcher = Launcher(use_templates=False)
        model = _model(sys.executable, launcher, handler="failing_init:FailingModel",
                       model_dir=HANDLERS / "recovery", max_retry_timeout_s=4)  # fmt: skip
        try:
            await model.scale(1, 1, synchronous=False)
            worker_id = model.slots[0].worker_id
            for _ in range(600):
                if model.failed is not None:
                    break
                await asyncio.sleep(0.05)
            assert model.failed is not None, "the model was not marked failed"
            with pytest.raises(ServiceUnavailable):
                model.enqueue(RequestItem("r1", "application/json", [], b"{}"))
            return model.failed, worker_id
        finally:
            await model.stop(5)
            await launcher.close()

    try:
        failed, worker_id = asyncio.run(scenario())
    finally:
        logging.getLogger("server.models.version").removeHandler(handler)
    units = [1, 1, 2, 3, 5, 8, 13, 21, 34, 55]  # TorchServe's backoff, in BACKOFF_UNIT_S
    steps = [f"{u * 0.05:.3g} s" for u in units]
    assert len(delays) >= 3 and delays == steps[: len(delays)], delays
    tries = len(delays) + 1
    assert failed.startswith(
        f"worker {worker_id} was lost {tries} times without loading again within"
        " maxRetryTimeoutInSec=4; last: handler of probe:1.0 failed to load: AssertionError"
    ), failed
    assert "in call5" in failed  # the handler's traceback


def test_a_worker_that_loaded_restarts_after_one_step_and_keeps_its_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that loaded, then died, starts its slot's backoff again (TorchServe's reset on
    load): each restart waits one unit, however many in a row, the model never fails, and the
    restarted worker keeps the slot's id, as a TorchServe worker keeps its port."""
    import os
    import signal
    import sys

    import server.models.version as model_module
    from server.workers.process import WorkerState

    monkeypatch.setattr(model_module, "BACKOFF_UNIT_S", 0.05)
    delays, handler = _restart_delays()

    async def crash(model: ModelVersion) -> None:
        worker = model.slots[0].worker
        assert worker is not None and worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        for _ in range(300):  # until the replacement is ready
            await asyncio.sleep(0.05)
            now = model.slots[0].worker
            if now is not worker and now is not None and now.state is WorkerState.READY:
                assert now.id == worker.id
                return
        raise AssertionError("no replacement worker")

    async def scenario() -> None:
        launcher = Launcher(use_templates=False)
        model = _model(sys.executable, launcher, max_retry_timeout_s=0.01)
        try:
            await model.scale(1, 1, synchronous=True)
            for _ in range(4):
                await crash(model)
            assert model.failed is None
        finally:
            await model.stop(5)
            await launcher.close()

    try:
        asyncio.run(scenario())
    finally:
        logging.getLogger("server.models.version").removeHandler(handler)
    assert delays == ["0.05 s"] * 4


def test_a_slot_that_gives_up_leaves_the_model_serving_with_its_other_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One worker of two is lost and its replacements cannot load (one bad GPU, say): its slot
    gives up after maxRetryTimeoutInSec, as a TorchServe worker stops retrying, and the model
    serves on with the other worker instead of failing; a scale adds the slot back."""
    import json
    import os
    import signal
    import sys

    import server.models.version as model_module

    monkeypatch.setattr(model_module, "BACKOFF_UNIT_S", 0.05)
    marker = tmp_path / "fail_loads"

    async def scenario() -> None:
        launcher = Launcher(use_templates=False)
        model = _model(sys.executable, launcher, handler="gated:Gated",
                       model_dir=HANDLERS / "recovery", max_retry_timeout_s=0.5,
                       model_yaml_config={"fail_if": str(marker)})  # fmt: skip
        try:
            await model.scale(2, 2, synchronous=True)
            lost, kept = model.slots
            assert lost.worker is not None and kept.worker is not None
            marker.touch()  # from now on no worker loads
            os.kill(lost.worker.pid or 0, signal.SIGKILL)
            for _ in range(300):
                if model.slots == [kept]:
                    break
                await asyncio.sleep(0.05)
            assert model.slots == [kept] and model.failed is None
            assert not model.healthy()  # below minWorkers: /ping says Unhealthy
            job = model.enqueue(RequestItem("r1", "application/json", [], b"{}"))
            answer = await asyncio.wait_for(job.future, 30)
            assert answer.status == 200
            assert json.loads(bytes(answer.body))["pid"] == kept.worker.pid
            marker.unlink()
            await model.scale(2, 2, synchronous=True)
            assert len(model.slots) == 2 and model.healthy()
        finally:
            await model.stop(5)
            await launcher.close()

    asyncio.run(scenario())
    gave_up = [r.getMessage() for r in caplog.records if "it is not restarted" in r.getMessage()]
    assert gave_up and "the model serves with 1 worker(s) until it is scaled again" in gave_up[0]
    assert "without loading again within maxRetryTimeoutInSec=0.5; last: handler of" in gave_up[0]


def test_a_supervision_error_fails_the_waiting_start_at_once_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug of ours while starting a worker (an exception no start path expects) reaches the
    registration that waits on it, with its traceback in the log, instead of killing the slot
    silently and leaving the registration waiting forever."""
    import sys

    from server.errors import InternalError
    from server.workers.process import Worker

    async def broken_start(self: Worker, timeout_s: float, launcher: Launcher) -> None:
        raise RuntimeError("injected by the test")

    monkeypatch.setattr(Worker, "start", broken_start)

    async def scenario() -> InternalError:
        launcher = Launcher(use_templates=False)
        model = _model(sys.executable, launcher)
        try:
            with pytest.raises(InternalError) as info:
                await asyncio.wait_for(model.scale(1, 1, synchronous=True), 30)
            assert model.slots == []
            return info.value
        finally:
            await model.stop(5)
            await launcher.close()

    error = asyncio.run(scenario())
    assert error.status == 500
    assert "internal error supervising a worker of probe:1.0" in error.message
    assert "injected by the test" in error.message
    logged = [r for r in caplog.records if "unexpected error supervising" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the traceback, for the bug report


def test_a_supervision_error_after_the_start_restarts_the_slot_with_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same failure once the model serves: the slot kills what it held, waits the
    backoff and starts a new worker, which serves."""
    import json
    import os
    import sys

    import server.models.version as model_module
    from mserve_worker.protocol import RequestItem
    from server.models.pump import BatchPump
    from server.workers.process import WorkerState

    monkeypatch.setattr(model_module, "BACKOFF_UNIT_S", 0.1)
    serve = BatchPump.serve
    calls = []

    async def serve_once_broken(self: BatchPump, worker, retire):  # type: ignore[no-untyped-def]
        calls.append(worker.pid)
        if len(calls) == 1:
            raise RuntimeError("injected by the test")
        return await serve(self, worker, retire)

    monkeypatch.setattr(BatchPump, "serve", serve_once_broken)

    async def scenario() -> dict:
        launcher = Launcher(use_templates=False)
        model = _model(sys.executable, launcher)
        try:
            await asyncio.wait_for(model.scale(1, 1, synchronous=True), 30)
            for _ in range(300):  # until the replacement serves
                worker = model.slots[0].worker
                if len(calls) == 2 and worker is not None and worker.state is WorkerState.READY:
                    break
                await asyncio.sleep(0.05)
            first = calls[0]
            assert first is not None
            with pytest.raises(ProcessLookupError):  # the first worker was killed
                for _ in range(100):
                    os.kill(first, 0)
                    await asyncio.sleep(0.05)
            job = model.enqueue(RequestItem("r1", "application/json", [], b"{}"))
            answer = await asyncio.wait_for(job.future, 30)
            assert answer.status == 200
            return json.loads(bytes(answer.body))
        finally:
            await model.stop(5)
            await launcher.close()

    report = asyncio.run(scenario())
    assert report["pid"] == calls[1] != calls[0]
