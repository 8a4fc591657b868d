"""ModelVersion supervision edge cases, driven directly (real processes, no HTTP)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.devices import GpuAllocator
from server.errors import InvalidModel
from server.model import ModelSettings, ModelVersion
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
        launcher.allow_warming()
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
