"""ONNX serialized files: ``BaseHandler`` opens a ``.onnx`` file with onnxruntime, as
TorchServe's does. A model exported by ``torch.onnx`` is served by a real mserve through
TorchServe's ONNX test handler shape (``self.model.run``) and through the default steps; the
answers are the torch model's (TorchServe's own test checks only that a prediction succeeds).
Without onnxruntime, the load fails naming the package."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from mserve_worker.sdk.base_handler import ModelLoadError
from tests.server import conftest as serving
from tests.server.conftest import HANDLERS, concurrently
from tests.styles.test_base_handler import load  # noqa: F401  (fixture)
from tests.styles.test_builtin_handlers import (  # noqa: F401  (store: fixture)
    LINEAR,
    archive,
    model_class,
    seeded,
    store,
)
from tests.styles.test_ts_namespace import ts_path  # noqa: F401  (fixture)

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (the test extra has it)")
pytest.importorskip("onnx", reason="torch.onnx.export needs onnx (the test extra has it)")

start_server = serving.start_server
ONNX = HANDLERS / "onnx_models"
ROWS = [[1.0, -2.0, 0.5, 3.0], [0.0, 0.0, 0.0, 1.0], [0.25, 4.0, -1.0, 2.0]]


def export(model: torch.nn.Module, path) -> None:
    """As TorchServe's test exports its toy model: input modelInput, a dynamic batch."""
    torch.onnx.export(
        model, (torch.zeros(1, 4),), str(path), dynamo=False, input_names=["modelInput"],
        output_names=["modelOutput"],
        dynamic_axes={"modelInput": {0: "batch_size"}, "modelOutput": {0: "batch_size"}},
    )  # fmt: skip


def test_onnx_model_served_with_onnxruntime(start_server, store, tmp_path) -> None:  # noqa: F811
    model = seeded(model_class(LINEAR, "Linear4"))
    export(model, tmp_path / "linear.onnx")
    config = tmp_path / "batch.yaml"
    config.write_text("batchSize: 3\nmaxBatchDelay: 10000\nbatchWait: fill\n")
    for name, handler in (("ts_shape", "onnx_handler.py"), ("plain", "plain_onnx.py")):
        archive(store, name, str(ONNX / handler), "--serialized-file",
                str(tmp_path / "linear.onnx"), "-c", str(config))  # fmt: skip
    server = start_server("ts_shape=ts_shape.mar", "plain=plain.mar")
    with torch.no_grad():
        expected = model(torch.tensor(ROWS))
    for name in ("ts_shape", "plain"):
        replies = concurrently(*(
            lambda row=row, name=name: server.predict(name, json.dumps(row),
                                           headers={"Content-Type": "application/json"})
            for row in ROWS
        ))  # fmt: skip
        assert [r.status for r in replies] == [200] * 3, [r.body for r in replies]
        got = torch.tensor([r.json() for r in replies])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_without_onnxruntime_the_load_names_the_package(
    load,  # noqa: F811
    ts_path,  # noqa: F811
    tmp_path,
    monkeypatch,
) -> None:
    export(torch.nn.Linear(4, 3), tmp_path / "linear.onnx")
    (tmp_path / "plain_onnx.py").write_text((ONNX / "plain_onnx.py").read_text())
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as where it is not installed
    with pytest.raises(ModelLoadError) as failed:
        load("plain_onnx", {"serializedFile": "linear.onnx"})
    assert str(failed.value) == (
        "linear.onnx is an ONNX model, which BaseHandler runs with onnxruntime, and this "
        "model's environment cannot import it (import of onnxruntime halted; None in "
        "sys.modules): install onnxruntime (onnxruntime-gpu for CUDA) in the model's "
        "environment (requirements.txt), or pip install it next to the server"
    )
