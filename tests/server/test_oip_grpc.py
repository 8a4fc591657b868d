"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``) through Triton's
own gRPC client and its generated stubs, against the served torch MLP of test_oip_triton.py,
whose answers are checked against the same model run here: health, metadata, inference with
raw and with typed contents, requested outputs, Triton's stream, refusals with REST's messages,
token authorization.

Only tritonclient's modules define the ``inference`` messages in this process: ours
(server/rpc/protos/oip_pb2.py) would clash with them in protobuf's descriptor pool."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from tests.server.conftest import Server, http
from tests.server.test_oip_triton import FOLDER, _expected, _mlp_class

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

Code = grpc.StatusCode
TIMEOUT_S = 60
WRONG_SHAPE = (
    "input 'input__0' must have shape [-1, 256] (-1: any size), the request sends [2, 255]"
)


@pytest.fixture
def mlp(tmp_path: Path) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = _mlp_class()().eval()
    torch.save(model.state_dict(), tmp_path / "mlp.pt")
    return model


@pytest.fixture
def serve(mlp, tmp_path, make_archive, start_server):
    def start(config: dict | None = None) -> Server:
        make_archive("oip_models", "mlp_handler", "mlp", "--serialized-file",
                     str(tmp_path / "mlp.pt"), "--config-file", str(FOLDER / "mlp_config.yaml"))  # fmt: skip
        return start_server("mlp=mlp.mar", config=config)

    return start


@pytest.fixture
def channels() -> Iterator[list[grpc.Channel]]:
    opened: list[grpc.Channel] = []
    yield opened
    for channel in opened:
        channel.close()


def _client(server: Server):
    return tritonclient_grpc.InferenceServerClient(server.status["grpc_inference"])


def _stub(server: Server, channels: list[grpc.Channel]):
    channel = grpc.insecure_channel(server.status["grpc_inference"])
    channels.append(channel)
    return service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _input(x: np.ndarray):
    tensor = tritonclient_grpc.InferInput("input__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)  # raw_input_contents
    return tensor


def _refused(call, *args, **kwargs) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value.status(), caught.value.message()


def _typed_request(x: np.ndarray, **fields) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(**{"model_name": "mlp", **fields})
    entry = request.inputs.add(name="input__0", datatype="FP32", shape=list(x.shape))
    entry.contents.fp32_contents.extend(x.ravel().tolist())
    return request


def test_health_and_metadata(serve) -> None:
    server = serve()
    client = _client(server)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1.0")
    assert _refused(client.is_model_ready, "nosuch") == (
        str(Code.NOT_FOUND), "Model not found: nosuch"
    )  # fmt: skip
    metadata = client.get_model_metadata("mlp")
    assert (metadata.name, list(metadata.versions), metadata.platform) == ("mlp", ["1.0"], "mserve")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("input__0", "FP32", [-1, 256])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("output__0", "FP32", [-1, 10])
    ]
    assert _refused(client.get_model_metadata, "mlp", "9.9") == (
        str(Code.NOT_FOUND), "Model version 9.9 does not exist for model mlp"
    )  # fmt: skip
    server_metadata = client.get_server_metadata()
    assert server_metadata.name == "mserve"
    assert list(server_metadata.extensions) == ["binary_tensor_data"]


def test_infer_with_raw_and_typed_contents_equals_the_model_run_here(serve, mlp, channels) -> None:
    server = serve()
    client = _client(server)
    x = np.random.default_rng(7).standard_normal((3, 256), dtype=np.float32)
    wanted = [tritonclient_grpc.InferRequestedOutput("output__0")]
    result = client.infer("mlp", [_input(x)], outputs=wanted, request_id="r-1")
    out = result.as_numpy("output__0")
    assert out.dtype == np.float32 and out.shape == (3, 10)
    np.testing.assert_allclose(out, _expected(mlp, x), rtol=1e-6, atol=1e-6)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("r-1", "mlp", "1.0")

    # no requested outputs: every output
    every = client.infer("mlp", [_input(x[:1])])
    np.testing.assert_allclose(every.as_numpy("output__0"), _expected(mlp, x[:1]), rtol=1e-6)

    # typed contents (tritonclient always sends raw ones: its stub, as a KServe client would)
    stub = _stub(server, channels)
    answer, call = stub.ModelInfer.with_call(
        _typed_request(x, id="typed"), metadata=[("x-request-id", "oip-1")], timeout=TIMEOUT_S
    )
    assert answer.id == "typed"
    # the call's request id comes back in the trailing metadata (the client's, else ours),
    # errors included, as REST's X-Request-Id header does
    assert dict(call.trailing_metadata())["x-request-id"] == "oip-1"
    _, call = stub.ModelInfer.with_call(_typed_request(x), timeout=TIMEOUT_S)
    assert len(dict(call.trailing_metadata())["x-request-id"]) == 32
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(_typed_request(x, model_name="nosuch"),
                        metadata=[("x-request-id", "oip-2")], timeout=TIMEOUT_S)  # fmt: skip
    assert dict(refused.value.trailing_metadata())["x-request-id"] == "oip-2"
    (output,) = answer.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("output__0", "FP32", [3, 10])
    typed = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(3, 10)
    np.testing.assert_allclose(typed, _expected(mlp, x), rtol=1e-6, atol=1e-6)


def test_refusals_carry_rests_messages(serve, channels) -> None:
    server = serve()
    client = _client(server)
    bad = np.zeros((2, 255), dtype=np.float32)
    assert _refused(client.infer, "mlp", [_input(bad)]) == (
        str(Code.INVALID_ARGUMENT), WRONG_SHAPE
    )  # fmt: skip
    body = {"inputs": [{"name": "input__0", "datatype": "FP32", "shape": [2, 255],
                        "data": [0.0] * 510}]}  # fmt: skip
    rest = http("POST", server.url("inference", "/v2/models/mlp/infer"), json.dumps(body).encode())
    assert rest.status == 400 and rest.json()["error"] == WRONG_SHAPE  # the same message
    unknown = [tritonclient_grpc.InferRequestedOutput("probs")]
    ok = np.zeros((1, 256), np.float32)
    assert _refused(client.infer, "mlp", [_input(ok)], outputs=unknown) == (
        str(Code.INVALID_ARGUMENT), "model mlp has no output 'probs'; its outputs are 'output__0'"
    )  # fmt: skip
    assert _refused(client.infer, "nosuch", [_input(ok)]) == (
        str(Code.NOT_FOUND), "Model not found: nosuch"
    )  # fmt: skip

    stub = _stub(server, channels)

    def error(request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=TIMEOUT_S)
        return caught.value.code(), caught.value.details()

    short = _typed_request(np.zeros((1, 255), np.float32))
    short.inputs[0].shape[:] = [1, 256]
    assert error(short) == (
        Code.INVALID_ARGUMENT,
        "input 'input__0' has 255 values in fp32_contents; its shape [1, 256] holds 256",
    )
    wrong_field = _typed_request(ok)
    wrong_field.inputs[0].contents.int_contents.append(1)
    assert error(wrong_field) == (
        Code.INVALID_ARGUMENT,
        "input 'input__0' is FP32, whose contents go in fp32_contents; the request fills"
        " int_contents",
    )
    both = _typed_request(ok)
    both.raw_input_contents.append(ok.tobytes())
    assert error(both) == (
        Code.INVALID_ARGUMENT,
        "input 'input__0' has contents, but the request sends raw_input_contents; send its"
        " data in one of them",
    )
    raw_short = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\0" * 8])
    raw_short.inputs.add(name="input__0", datatype="FP32", shape=[1, 256])
    assert error(raw_short) == (
        Code.INVALID_ARGUMENT,
        "input 'input__0' of shape [1, 256] and datatype FP32 needs 1024 bytes of binary data,"
        " got 8",
    )
    narrow = service_pb2.ModelInferRequest(model_name="mlp")
    narrow.inputs.add(name="input__0", datatype="INT8", shape=[2]).contents.int_contents.extend(
        [1, 300]
    )
    assert error(narrow) == (Code.INVALID_ARGUMENT, "input 'input__0' is INT8 but holds 300")
    assert error(service_pb2.ModelInferRequest()) == (
        Code.INVALID_ARGUMENT, "parameter 'model_name' is required"
    )  # fmt: skip


def test_torchserves_package_name_is_served_too(serve, mlp, channels) -> None:
    """TorchServe's open_inference_grpc.proto names the service
    ``org.pytorch.serve.grpc.openinference.GRPCInferenceService``, with the same messages."""
    server = serve({"disable_token_authorization": False})
    channel = grpc.insecure_channel(server.status["grpc_inference"])
    channels.append(channel)
    service = "/org.pytorch.serve.grpc.openinference.GRPCInferenceService"
    live = channel.unary_unary(f"{service}/ServerLive",
                               request_serializer=service_pb2.ServerLiveRequest.SerializeToString,
                               response_deserializer=service_pb2.ServerLiveResponse.FromString)  # fmt: skip
    assert live(service_pb2.ServerLiveRequest(), timeout=TIMEOUT_S).live  # a probe: no key
    infer = channel.unary_unary(f"{service}/ModelInfer",
                                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                response_deserializer=service_pb2.ModelInferResponse.FromString)  # fmt: skip
    x = np.random.default_rng(5).standard_normal((2, 256), dtype=np.float32)
    with pytest.raises(grpc.RpcError) as caught:
        infer(_typed_request(x), timeout=TIMEOUT_S)
    assert caught.value.code() == Code.UNAUTHENTICATED
    key = [("authorization", f"Bearer {server.key('inference')}")]
    answer = infer(_typed_request(x), metadata=key, timeout=TIMEOUT_S)
    out = np.frombuffer(answer.raw_output_contents[0], dtype="<f4").reshape(2, 10)
    np.testing.assert_allclose(out, _expected(mlp, x), rtol=1e-6, atol=1e-6)


def test_stream_answers_each_request_in_order(serve, mlp) -> None:
    server = serve()
    client = _client(server)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        x = np.random.default_rng(3).standard_normal((2, 256), dtype=np.float32)
        client.async_stream_infer("mlp", [_input(x)], request_id="first")
        client.async_stream_infer("mlp", [_input(np.zeros((2, 255), np.float32))])
        client.async_stream_infer("mlp", [_input(x[:1])], request_id="third")
        got = [answers.get(timeout=TIMEOUT_S) for _ in range(3)]
    finally:
        client.stop_stream()
    (first, no_error), (none, error), (third, _) = got
    assert no_error is None and none is None
    assert first.get_response().id == "first"
    np.testing.assert_allclose(first.as_numpy("output__0"), _expected(mlp, x), rtol=1e-6)
    assert error.message() == WRONG_SHAPE
    assert third.get_response().id == "third"


def test_token_authorization(serve) -> None:
    server = serve({"disable_token_authorization": False})
    client = _client(server)
    # the probes are exempt, as /v2/health/live and /v2/health/ready are
    assert client.is_server_live() and client.is_server_ready()
    rest_401 = http("POST", server.url("inference", "/v2/models/mlp/infer"), b"{}").json()["error"]
    ok = np.zeros((1, 256), np.float32)
    assert _refused(client.infer, "mlp", [_input(ok)]) == (str(Code.UNAUTHENTICATED), rest_401)
    assert _refused(client.get_server_metadata) == (str(Code.UNAUTHENTICATED), rest_401)
    assert _refused(client.is_model_ready, "mlp") == (str(Code.UNAUTHENTICATED), rest_401)
    wrong = {"authorization": "Bearer not-the-key"}
    assert _refused(client.infer, "mlp", [_input(ok)], headers=wrong) == (
        str(Code.UNAUTHENTICATED), "the key sent is not the inference key"
    )  # fmt: skip
    key = {"authorization": f"Bearer {server.key('inference')}"}
    assert client.infer("mlp", [_input(ok)], headers=key).as_numpy("output__0").shape == (1, 10)
    assert client.is_model_ready("mlp", headers=key)

    # without the exemptions the probes need the key too
    strict = _client(serve({"disable_token_authorization": False, "token_exempt_paths": []}))
    assert _refused(strict.is_server_live)[0] == str(Code.UNAUTHENTICATED)
    assert _refused(strict.is_server_ready)[0] == str(Code.UNAUTHENTICATED)


# datatype -> (numpy dtype, typed contents field, values)
DATATYPES = {
    "BOOL": ("|b1", "bool_contents", [True, False, True, True]),
    "UINT8": ("|u1", "uint_contents", [0, 1, 254, 255]),
    "UINT16": ("<u2", "uint_contents", [0, 1, 2, 65535]),
    "UINT32": ("<u4", "uint_contents", [0, 1, 2, 2**32 - 1]),
    "UINT64": ("<u8", "uint64_contents", [0, 1, 2, 2**64 - 1]),
    "INT8": ("|i1", "int_contents", [-128, -1, 0, 127]),
    "INT16": ("<i2", "int_contents", [-32768, -1, 0, 32767]),
    "INT32": ("<i4", "int_contents", [-(2**31), -1, 0, 2**31 - 1]),
    "INT64": ("<i8", "int64_contents", [-(2**63), -1, 0, 2**63 - 1]),
    "FP32": ("<f4", "fp32_contents", [0.5, -1.25, 3.0e38, 0.0]),
    "FP64": ("<f8", "fp64_contents", [0.1, -1.0e300, 2.5, 0.0]),
}


def test_every_datatype_and_parameters_through_an_echo_model(
    make_archive, start_server, channels
) -> None:
    """Typed contents of every datatype, BYTES, and FP16 in raw contents come back as raw
    output contents, unchanged; the request's parameters reach the handler."""
    for name, config in (("echo", ["--config-file", str(FOLDER / "echo_config.yaml")]),
                         ("plain", [])):  # fmt: skip
        make_archive("oip_models", "echo_tensors", name, *config)
    server = start_server("echo=echo.mar", "plain=plain.mar")
    stub = _stub(server, channels)
    request = service_pb2.ModelInferRequest(model_name="echo", id="all")
    for datatype, (_, field, values) in DATATYPES.items():
        entry = request.inputs.add(name=datatype.lower(), datatype=datatype, shape=[2, 2])
        getattr(entry.contents, field).extend(values)
    request.inputs.add(name="text", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
        [b"caf\xc3\xa9", b"\x00\xff"]
    )
    answer = stub.ModelInfer(request, timeout=TIMEOUT_S)
    assert answer.id == "all" and answer.model_name == "echo"
    got = dict(zip((o.name for o in answer.outputs), answer.raw_output_contents, strict=True))
    for output in answer.outputs:
        assert list(output.shape) == ([2] if output.name == "text" else [2, 2])
    for datatype, (dtype, _, values) in DATATYPES.items():
        expected = np.array(values, dtype=dtype).tobytes()
        assert got[datatype.lower()] == expected, datatype
    assert got["text"] == b"\x05\x00\x00\x00caf\xc3\xa9\x02\x00\x00\x00\x00\xff"

    half = np.array([1.5, -2.0, 65504.0], dtype="<f2")
    raw = service_pb2.ModelInferRequest(model_name="echo", raw_input_contents=[half.tobytes()])
    raw.inputs.add(name="h", datatype="FP16", shape=[3])
    raw.parameters["rename"].string_param = "renamed"
    answer = stub.ModelInfer(raw, timeout=TIMEOUT_S)
    assert [(o.name, o.datatype) for o in answer.outputs] == [("renamed", "FP16")]
    assert answer.raw_output_contents[0] == half.tobytes()

    def error(request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=TIMEOUT_S)
        return caught.value.code(), caught.value.details()

    raw.parameters["fail"].bool_param = True
    code, message = error(raw)
    assert code == Code.INTERNAL and "asked to fail" in message
    typed_fp16 = service_pb2.ModelInferRequest(model_name="echo")
    typed_fp16.inputs.add(name="h", datatype="FP16", shape=[1])
    assert error(typed_fp16) == (
        Code.INVALID_ARGUMENT,
        "input 'h' is FP16, which typed contents cannot carry: send it in raw_input_contents",
    )
    # a TorchServe handler without kserveEnvelope answers in its own words, not in tensors
    plain = service_pb2.ModelInferRequest(model_name="plain", raw_input_contents=[b"\0" * 4])
    plain.inputs.add(name="x", datatype="FP32", shape=[1])
    code, message = error(plain)
    assert code == Code.INTERNAL
    assert message == (
        "the answer of model plain:1.0 is not an Open Inference Protocol response (it has no"
        " 'outputs' list); a TorchServe-style handler gets and answers tensors with"
        " kserveEnvelope: true in its model config (docs/handlers.md)"
    )
