"""ModelVersion supervision edge cases, driven directly (real processes, no HTTP)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.devices import GpuAllocator
from server.errors import InvalidModel
from server.models.settings import ModelSettings
from server.models.version import ModelVersion
from server.workers.launch import Launcher

HANDLERS = Path(__file__).resolve().parent.parent / "handlers"


def _model(python: str, launcher: Launcher) -> ModelVersion:
    settings = ModelSettings(
        batch_size=1, max_batch_delay_ms=1, response_timeout_s=10, startup_timeout_s=10,
        min_workers=1, max_workers=1, job_queue_size=10, device_ids=None,
    )  # fmt: skip
    return ModelVersion(
        name="probe", version="1.0", url="probe.mar", model_dir=HANDLERS / "probe",
        manifest={"model": {"modelName": "probe"}}, handler="probe:handle", settings=settings,
        model_yaml_config={}, python=python, gpus=GpuAllocator([]).plan("probe:1.0", None, None), launcher=launcher,
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


def test_restart_backoff_doubles_and_starts_again_after_a_worker_served_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Crashes in quick succession double the delay; a worker that served longer than
    BACKOFF_RESET_AFTER_S before dying restarts the sequence (read from the supervisor's log)."""
    import logging
    import os
    import signal
    import sys

    import server.models.version as model_module
    from server.workers.process import WorkerState

    monkeypatch.setattr(model_module, "BACKOFF_START_S", 0.2)
    monkeypatch.setattr(model_module, "BACKOFF_RESET_AFTER_S", 1.0)
    monkeypatch.setattr(model_module, "FAILURES_TO_GIVE_UP", 100)
    delays: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "restarting in" in message:
                delays.append(message.rsplit("restarting in ", 1)[1])

    handler = Collect()
    logging.getLogger("server.models.version").addHandler(handler)

    async def crash(model: ModelVersion, served_s: float) -> None:
        worker = model.slots[0].worker
        assert worker is not None and worker.pid is not None
        await asyncio.sleep(served_s)
        os.kill(worker.pid, signal.SIGKILL)
        for _ in range(300):  # until the replacement is ready
            await asyncio.sleep(0.05)
            now = model.slots[0].worker
            if now is not worker and now is not None and now.state is WorkerState.READY:
                return
        raise AssertionError("no replacement worker")

    async def scenario() -> None:
        launcher = Launcher(use_templates=False)
        model = _model(sys.executable, launcher)
        try:
            await model.scale(1, 1, synchronous=True)
            for _ in range(3):
                await crash(model, 0)  # dies at once: 0.2, 0.4, 0.8
            for _ in range(2):
                await crash(model, 1.2)  # served past the reset: 0.2, then 0.2 again
        finally:
            await model.stop(5)
            await launcher.close()

    try:
        asyncio.run(scenario())
    finally:
        logging.getLogger("server.models.version").removeHandler(handler)
    assert delays == ["0.2 s", "0.4 s", "0.8 s", "0.2 s", "0.2 s"]
