"""TorchServe's ``ENABLE_TORCH_PROFILER``: ``BaseHandler`` profiles each batch's steps and
writes a Chrome trace, to ``pytorch_profiler/<model>`` under the worker's temporary folder or
where the handler's ``profiler_args`` say (TorchServe's test_pytorch_profiler.py cases). Served
by a real mserve, then in process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.server import conftest as serving
from tests.styles.test_base_handler import (  # noqa: F401  (load: fixture)
    EAGER,
    LINEAR,
    X,
    linear_model_dir,
    load,
    start,
)
from tests.styles.test_builtin_handlers import archive, store  # noqa: F401  (store: fixture)

start_server = serving.start_server


def _steps(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {e.get("name") for e in events} & {"preprocess", "inference", "postprocess", "explain"}


def test_each_batch_writes_a_trace(start_server, store, tmp_path) -> None:  # noqa: F811
    model = linear_model_dir(tmp_path)
    archive(store, "lin", str(LINEAR / "explain_handler.py"), "--serialized-file",
            str(tmp_path / "linear.pt"), "--model-file", str(LINEAR / "model.py"))  # fmt: skip
    server = start_server("lin=lin.mar", env={"ENABLE_TORCH_PROFILER": "true"})
    for row in (X, [0.0, 0.0, 0.0, 1.0]):
        reply = server.predict("lin", json.dumps(row), headers={"Content-Type": "application/json"})
        assert reply.status == 200, reply.body
        with torch.no_grad():
            torch.testing.assert_close(torch.tensor(reply.json()), model(torch.tensor(row)))
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    folder = Path(re.findall(r"Saving chrome trace to : (\S+)", log)[-1])
    assert folder.name == "lin" and folder.parent.name == "pytorch_profiler"
    assert str(folder).startswith(str(tmp_path))  # the sandbox's scratch folder, not /tmp
    traces = sorted(folder.glob("*.pt.trace.json"))
    assert len(traces) == 2
    assert all(_steps(t) == {"preprocess", "inference", "postprocess"} for t in traces)
    assert "Self CPU time total" in log  # the table of the costliest steps


def test_profiler_args_choose_what_and_where(load, tmp_path, monkeypatch) -> None:  # noqa: F811
    """TorchServe's override case: the handler's own profiler_args, its trace folder."""
    from torch.profiler import ProfilerActivity, tensorboard_trace_handler

    model = linear_model_dir(tmp_path)
    handler, ctx = load("explain_handler", EAGER)
    out = tmp_path / "traces"
    handler.instance.profiler_args = {"activities": [ProfilerActivity.CPU],
                                      "on_trace_ready": tensorboard_trace_handler(str(out))}  # fmt: skip
    monkeypatch.setenv("ENABLE_TORCH_PROFILER", "1")
    start(ctx, 2)
    answers = handler.handle([{"body": X}, {"body": "not numbers"}], ctx)
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(answers[0]), model(torch.tensor(X)))
    assert answers[1]["code"] == 400  # a rejected request keeps its place
    (trace,) = out.glob("*.pt.trace.json")
    assert _steps(trace) == {"preprocess", "inference", "postprocess"}
    assert [m["name"] for m in ctx.metrics.drain()] == ["HandlerTime"]

    monkeypatch.delenv("ENABLE_TORCH_PROFILER")
    handler.handle([{"body": X}], ctx)
    assert len(list(out.glob("*.pt.trace.json"))) == 1  # off again: no trace


@pytest.fixture(autouse=True)
def _quiet_torch_logs(caplog) -> None:
    caplog.set_level("WARNING", logger="torch")
