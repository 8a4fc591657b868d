"""The Open Inference Protocol through Triton's own HTTP client, against a served torch MLP whose
answers are checked against the same model run here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.server.conftest import HANDLERS

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

FOLDER = HANDLERS / "oip_models"


def _mlp_class() -> type:
    spec = importlib.util.spec_from_file_location("oip_mlp_handler", FOLDER / "mlp_handler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MLP


@pytest.fixture
def mlp(tmp_path: Path) -> torch.nn.Module:
    """The MLP with weights from a fixed seed, saved where the archive takes them from."""
    torch.manual_seed(1234)
    model = _mlp_class()().eval()
    torch.save(model.state_dict(), tmp_path / "mlp.pt")
    return model


@pytest.fixture
def client(mlp, tmp_path, make_archive, start_server):
    make_archive("oip_models", "mlp_handler", "mlp", "--serialized-file", str(tmp_path / "mlp.pt"),
                 "--config-file", str(FOLDER / "mlp_config.yaml"))  # fmt: skip
    server = start_server("mlp=mlp.mar")
    url = server.url("inference", "").removeprefix("http://")
    return tritonclient_http.InferenceServerClient(url)


def _expected(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()


def _input(x: np.ndarray, binary: bool):
    tensor = tritonclient_http.InferInput("input__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def test_health_and_metadata(client) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert not client.is_model_ready("nosuch")
    metadata = client.get_model_metadata("mlp")
    assert metadata["name"] == "mlp"
    assert metadata["versions"] == ["1.0"]
    assert metadata["inputs"] == [{"name": "input__0", "datatype": "FP32", "shape": [-1, 256]}]
    assert metadata["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 10]}]
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_equals_the_model_run_here(client, mlp, binary: bool) -> None:
    x = np.random.default_rng(7).standard_normal((3, 256), dtype=np.float32)
    wanted = [tritonclient_http.InferRequestedOutput("output__0", binary_data=binary)]
    result = client.infer("mlp", [_input(x, binary)], outputs=wanted, request_id="r-1")
    out = result.as_numpy("output__0")
    assert out.dtype == np.float32 and out.shape == (3, 10)
    np.testing.assert_allclose(out, _expected(mlp, x), rtol=1e-6, atol=1e-6)
    response = result.get_response()
    assert response["id"] == "r-1" and response["model_name"] == "mlp"
    assert ("parameters" in response["outputs"][0]) is binary


def test_infer_without_requested_outputs_answers_all_in_binary(client, mlp) -> None:
    x = np.ones((1, 256), dtype=np.float32)
    result = client.infer("mlp", [_input(x, True)])  # the client asks binary_data_output
    np.testing.assert_allclose(result.as_numpy("output__0"), _expected(mlp, x), rtol=1e-6)


def test_a_wrong_shape_is_refused_naming_the_input(client) -> None:
    x = np.zeros((2, 255), dtype=np.float32)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("mlp", [_input(x, True)])
    assert caught.value.status() == "400"
    assert caught.value.message() == (
        "input 'input__0' must have shape [-1, 256] (-1: any size), the request sends [2, 255]"
    )
    unknown = tritonclient_http.InferRequestedOutput("probs")
    with pytest.raises(InferenceServerException, match="model mlp has no output 'probs'"):
        client.infer("mlp", [_input(np.zeros((1, 256), np.float32), False)], outputs=[unknown])
