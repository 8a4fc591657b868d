"""TorchServe's gRPC APIs on real servers, called with stubs generated from our protos as a
TorchServe user's client would be: ping, predictions (unary, server streaming, bidirectional),
management, status codes, token authorization, model API control, TLS, gRPC off."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2

from server.auth import Unauthorized
from server.errors import (
    HandlerError,
    InvalidModel,
    ModelAlreadyExists,
    ModelApiDisabled,
    ModelVersionNotFound,
    TooManyRequests,
    WorkerTimeout,
)
from server.rpc import status as rpc_status
from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc, management_pb2_grpc
from server.rpc.protos import management_pb2 as mpb
from tests.server.conftest import Server
from tests.server.test_auth import _self_signed

Code = grpc.StatusCode
SECURE = {"disable_token_authorization": False, "enable_model_api": False}
TIMEOUT_S = 60


@pytest.fixture
def channels() -> Iterator[Callable[..., grpc.Channel]]:
    opened: list[grpc.Channel] = []

    def open_channel(
        target: str, credentials: grpc.ChannelCredentials | None = None
    ) -> grpc.Channel:
        channel = (
            grpc.secure_channel(target, credentials)
            if credentials
            else grpc.insecure_channel(target)
        )
        opened.append(channel)
        return channel

    yield open_channel
    for channel in opened:
        channel.close()


def _stubs(server: Server, open_channel: Callable[..., grpc.Channel]) -> tuple[Any, Any]:
    inference = inference_pb2_grpc.InferenceAPIsServiceStub(
        open_channel(server.status["grpc_inference"])
    )
    management = management_pb2_grpc.ManagementAPIsServiceStub(
        open_channel(server.status["grpc_management"])
    )
    return inference, management


def _predict(model: str, data: bytes | None = None, **fields: Any) -> ipb.PredictionsRequest:
    inputs = {} if data is None else {"data": data}
    return ipb.PredictionsRequest(model_name=model, input=inputs, **fields)


def _error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=TIMEOUT_S, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)  # a streaming call fails while it is read
    return err.value.code(), err.value.details()


def _key(server: Server, kind: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {server.key(kind)}")]


def test_status_codes_come_from_one_table() -> None:
    table = {
        Unauthorized("x", "realm", None): Code.UNAUTHENTICATED,
        ModelVersionNotFound("x"): Code.NOT_FOUND,
        InvalidModel("x"): Code.INVALID_ARGUMENT,
        ModelApiDisabled("x", ("GET",)): Code.PERMISSION_DENIED,
        ModelAlreadyExists("x"): Code.ABORTED,
        TooManyRequests("x"): Code.RESOURCE_EXHAUSTED,
        WorkerTimeout("x"): Code.DEADLINE_EXCEEDED,
        HandlerError("x"): Code.INTERNAL,
    }
    assert {error: rpc_status.code_of(error) for error in table} == table
    assert rpc_status.code_of_http(404) == Code.NOT_FOUND
    assert rpc_status.code_of_http(418) == Code.FAILED_PRECONDITION
    assert rpc_status.code_of_http(502) == Code.INTERNAL
    long = "x" * 10_000
    assert rpc_status.message(long).endswith(" ... (cut: 10000 characters in all)")


def test_ping_predictions_streams_and_errors(make_archive, start_server, channels) -> None:
    make_archive("grpc_io", "grpc_io", "io")
    server = start_server("io=io.mar")
    inference, _ = _stubs(server, channels)

    health = inference.Ping(empty_pb2.Empty(), timeout=TIMEOUT_S).health
    assert json.loads(health) == {"status": "Healthy"}

    # each input entry is one field of the handler's request, as bytes, and nothing else, as in
    # TorchServe: no body, no Content-Type header; the sequence id as its header
    answer = inference.Predictions(
        ipb.PredictionsRequest(
            model_name="io", input={"data": b"hello", "extra": b"\x00\xff"}, sequenceId="s-1"
        ),
        timeout=TIMEOUT_S,
    )
    report = json.loads(answer.prediction)
    assert report["data"] == "hello"
    assert report["extra"] == [0, 255]
    assert report["types"] == {"data": "bytes", "extra": "bytes"}
    assert report["keys"] == ["data", "extra"]
    assert (report["sequence"], report["content_type"]) == ("s-1", None)
    versioned = inference.Predictions(_predict("io", b"v", model_version="1.0"), timeout=TIMEOUT_S)
    assert json.loads(versioned.prediction)["data"] == "v"
    only_body = inference.Predictions(
        ipb.PredictionsRequest(model_name="io", input={"body": b"raw"}), timeout=TIMEOUT_S
    )
    assert json.loads(only_body.prediction)["types"] == {"body": "bytes"}
    nothing = inference.Predictions(ipb.PredictionsRequest(model_name="io"), timeout=TIMEOUT_S)
    assert json.loads(nothing.prediction)["keys"] == []  # no input entries: an empty request

    # errors: the REST message, TorchServe's codes
    rest = server.predict("nope", b"x").json()["message"]
    assert _error(inference.Predictions, _predict("nope", b"x")) == (Code.NOT_FOUND, rest)
    assert _error(inference.Predictions, _predict("io", b"x", model_version="9")) == (
        Code.NOT_FOUND, "Model version 9 does not exist for model io"
    )  # fmt: skip
    assert _error(inference.Predictions, _predict("", b"x")) == (
        Code.INVALID_ARGUMENT, "parameter 'model_name' is required"
    )  # fmt: skip
    code, message = _error(inference.Predictions, _predict("io", b"raise"))
    assert code == Code.INTERNAL
    assert "grpc_io was asked to fail" in message
    code, message = _error(inference.Predictions, _predict("io", b"status:404"))
    assert (code, message) == (Code.NOT_FOUND, "the handler set this status")

    # streamed answers: one message per chunk; a unary call gets them gathered
    chunks = [
        r.prediction
        for r in inference.StreamPredictions(_predict("io", b"stream:3"), timeout=TIMEOUT_S)
    ]
    assert b"".join(chunks) == b"part0;part1;part2;"
    assert len([c for c in chunks if c]) == 3
    ts_chunks = [
        r.prediction
        for r in inference.StreamPredictions(_predict("io", b"ts_stream:2"), timeout=TIMEOUT_S)
    ]
    assert ts_chunks == [b"ts0;", b"ts1;", b"last;"]
    whole = inference.Predictions(_predict("io", b"stream:3"), timeout=TIMEOUT_S).prediction
    assert whole == b"part0;part1;part2;"
    single = list(inference.StreamPredictions(_predict("io", b"plain"), timeout=TIMEOUT_S))
    assert len(single) == 1 and json.loads(single[0].prediction)["data"] == "plain"
    code, message = _error(inference.StreamPredictions, _predict("nope", b"x"))
    assert (code, message) == (Code.NOT_FOUND, rest)

    # bidirectional: answers in order, tagged; a failure is a status and the call goes on
    requests = [
        _predict("io", b"stream:2", sequenceId="a"),
        _predict("nope", b"x", sequenceId="a"),
        _predict("io", b"one", sequenceId="a"),
        _predict("io", b"no sequence"),
    ]
    answers = list(inference.StreamPredictions2(iter(requests), timeout=TIMEOUT_S))
    streamed = [a for a in answers if not a.HasField("status") and a.prediction]
    assert [a.prediction for a in streamed][:2] == [b"part0;", b"part1;"]
    assert json.loads(streamed[2].prediction)["data"] == "one"
    assert all(a.sequenceId == "a" for a in streamed)
    failed = [a for a in answers if a.HasField("status")]
    assert [(a.sequenceId, a.status.code, a.status.message) for a in failed] == [
        ("a", Code.NOT_FOUND.value[0], rest),
        ("", Code.INVALID_ARGUMENT.value[0],
         "parameter 'sequenceId' is required for StreamPredictions2"),
    ]  # fmt: skip

    # the request's id comes back in the trailing metadata (the client's, else ours), errors
    # included, as REST's X-Request-Id header does
    def echoed(call: Any) -> str:
        return dict(call.trailing_metadata())["x-request-id"]

    _, call = inference.Predictions.with_call(
        _predict("io", b"x"), metadata=[("x-request-id", "grpc-id-1")], timeout=TIMEOUT_S
    )
    assert echoed(call) == "grpc-id-1"
    _, call = inference.Predictions.with_call(_predict("io", b"x"), timeout=TIMEOUT_S)
    assert re.fullmatch(r"[0-9a-f]{32}", echoed(call))
    with pytest.raises(grpc.RpcError) as failed_call:
        inference.Predictions(_predict("nope", b"x"), metadata=[("x-request-id", "grpc-id-2")],
                              timeout=TIMEOUT_S)  # fmt: skip
    assert echoed(failed_call.value) == "grpc-id-2"
    stream = inference.StreamPredictions(
        _predict("io", b"stream:2"), metadata=[("x-request-id", "grpc-id-3")], timeout=TIMEOUT_S
    )
    assert len(list(stream)) >= 2 and echoed(stream) == "grpc-id-3"

    # gRPC answers count in TorchServe's metrics like REST ones
    metrics = server.cli("--status")  # the server is alive and well after all that
    assert "model io: ready" in metrics.stdout


def test_management_calls_as_rest_answers_them(make_archive, start_server, channels) -> None:
    make_archive("grpc_io", "grpc_io", "io")
    make_archive("grpc_io", "grpc_io", "io2", "--version", "2.0")
    server = start_server()
    _, management = _stubs(server, channels)

    def call(method: str, **fields: Any) -> str:
        request = getattr(mpb, f"{method}Request" if method != "Scale" else "ScaleWorkerRequest")
        return getattr(management, method if method != "Scale" else "ScaleWorker")(
            request(**fields), timeout=TIMEOUT_S
        ).msg

    assert json.loads(call("ListModels")) == {"models": []}
    assert call("RegisterModel", url="io.mar", synchronous=True) == (
        'Model "io" Version: 1.0 registered with 1 initial workers'
    )
    assert call("RegisterModel", url="io2.mar", model_name="io", initial_workers=1) == (
        'Model "io" Version: 2.0 registered; starting 1 workers'  # synchronous: false
    )
    assert _error(management.RegisterModel, mpb.RegisterModelRequest(url="io.mar")) == (
        Code.ABORTED, "Model version 1.0 for model io already exists"
    )  # fmt: skip
    # TorchServe reads gRPC's "" as not given: its REST answer for a missing url
    assert _error(management.RegisterModel, mpb.RegisterModelRequest(url="")) == (
        Code.INVALID_ARGUMENT, "Parameter url is required."
    )  # fmt: skip
    # TorchServe's words for a url holding "..", with the code of a refusal (TorchServe's layout:
    # its NOT_FOUND, tests/server/test_torchserve_management.py)
    assert _error(management.RegisterModel, mpb.RegisterModelRequest(url="../io.mar")) == (
        Code.PERMISSION_DENIED, "Relative path is not allowed in url: ../io.mar"
    )  # fmt: skip
    assert (
        _error(management.RegisterModel, mpb.RegisterModelRequest(url="io.mar", runtime="LSP"))[0]
        == Code.INVALID_ARGUMENT
    )
    listed = json.loads(call("ListModels", limit=1))
    assert listed == {"models": [{"modelName": "io", "modelUrl": "io.mar", "loadState": "loaded"}]}

    described = json.loads(call("DescribeModel", model_name="io", model_version="all"))
    assert sorted(d["modelVersion"] for d in described) == ["1.0", "2.0"]
    assert json.loads(call("DescribeModel", model_name="io"))[0]["modelVersion"] == "1.0"
    rest = server.manage("GET", "/models/io").json()
    assert json.loads(call("DescribeModel", model_name="io"))[0]["modelUrl"] == rest[0]["modelUrl"]

    assert call("SetDefault", model_name="io", model_version="2.0") == (
        'Default version successfully updated for model "io" to "2.0"'
    )
    assert _error(
        management.SetDefault, mpb.SetDefaultRequest(model_name="io", model_version="9")
    ) == (Code.NOT_FOUND, "Model version 9 does not exist for model io")
    assert call("Scale", model_name="io", min_worker=2, synchronous=True) == (
        "Workers scaled to 2 for model: io"
    )
    workers = json.loads(call("DescribeModel", model_name="io", model_version="2.0"))[0]
    assert (workers["minWorkers"], len(workers["workers"])) == (2, 2)
    assert call("Scale", model_name="io", model_version="1.0", min_worker=1) == (
        "Processing worker updates..."
    )
    assert _error(
        management.ScaleWorker, mpb.ScaleWorkerRequest(model_name="io", min_worker=3, max_worker=2)
    ) == (Code.INVALID_ARGUMENT, "max_worker (2) is less than min_worker (3)")
    assert _error(management.ScaleWorker, mpb.ScaleWorkerRequest(model_name="io", min_worker=-1)) == (
        Code.INVALID_ARGUMENT, "parameter 'min_worker' should be >= 0, found -1"
    )  # fmt: skip
    assert _error(management.ScaleWorker, mpb.ScaleWorkerRequest(model_name="nope")) == (
        Code.NOT_FOUND, "Model not found: nope"
    )  # fmt: skip

    assert call("UnregisterModel", model_name="io", model_version="1.0") == (
        'Model "io" version 1.0 unregistered'
    )
    assert call("UnregisterModel", model_name="io") == 'Model "io" version 2.0 unregistered'
    assert json.loads(call("ListModels")) == {"models": []}
    assert _error(management.UnregisterModel, mpb.UnregisterModelRequest(model_name="io")) == (
        Code.NOT_FOUND, "Model not found: io"
    )  # fmt: skip


def test_full_queue_and_worker_timeout(make_archive, start_server, channels) -> None:
    make_archive("grpc_io", "grpc_io", "io")
    server = start_server("io=io.mar", config={"job_queue_size": 1})
    inference, management = _stubs(server, channels)

    def call() -> grpc.StatusCode:
        try:
            inference.Predictions(_predict("io", b"sleep:0.5"), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            assert "queue is full (job_queue_size=1)" in exc.details()
            return exc.code()
        return Code.OK

    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: call(), range(6)))
    assert set(codes) == {Code.OK, Code.RESOURCE_EXHAUSTED}, codes

    management.RegisterModel(
        mpb.RegisterModelRequest(
            url="io.mar", model_name="slow", response_timeout=1, synchronous=True
        ),
        timeout=TIMEOUT_S,
    )
    code, message = _error(inference.Predictions, _predict("slow", b"sleep:30"))
    assert code == Code.DEADLINE_EXCEEDED
    assert "response_timeout" in message or "timed out" in message or "timeout" in message


def test_token_authorization_and_model_api_control(make_archive, start_server, channels) -> None:
    make_archive("grpc_io", "grpc_io", "io")
    server = start_server("io=io.mar", config=SECURE)
    inference, management = _stubs(server, channels)

    # Ping is a probe, as /ping is
    assert json.loads(inference.Ping(empty_pb2.Empty(), timeout=TIMEOUT_S).health)["status"]
    rest_401 = server.predict("io", b"x", headers={"Authorization": ""}).json()["message"]
    assert _error(inference.Predictions, _predict("io", b"x")) == (Code.UNAUTHENTICATED, rest_401)
    wrong = [("authorization", "Bearer not-the-key")]
    assert _error(inference.Predictions, _predict("io", b"x"), metadata=wrong) == (
        Code.UNAUTHENTICATED, "the key sent is not the inference key"
    )  # fmt: skip
    assert _error(inference.StreamPredictions, _predict("io", b"stream:1"), metadata=wrong) == (
        Code.UNAUTHENTICATED,
        "the key sent is not the inference key",
    )
    answer = inference.Predictions(
        _predict("io", b"ok"), metadata=_key(server, "inference"), timeout=TIMEOUT_S
    )
    assert json.loads(answer.prediction)["data"] == "ok"

    # the management port wants the management key
    assert _error(
        management.ListModels, mpb.ListModelsRequest(), metadata=_key(server, "inference")
    ) == (Code.UNAUTHENTICATED, "the key sent is not the management key")
    key = _key(server, "management")
    assert json.loads(management.ListModels(mpb.ListModelsRequest(), metadata=key,
                                            timeout=TIMEOUT_S).msg)["models"]  # fmt: skip
    # model API control: PERMISSION_DENIED, with REST's 405 message
    rest_405 = server.manage("POST", "/models?url=io.mar").json()["message"]
    assert _error(
        management.RegisterModel, mpb.RegisterModelRequest(url="io.mar"), metadata=key
    ) == (Code.PERMISSION_DENIED, rest_405)
    code, message = _error(
        management.UnregisterModel, mpb.UnregisterModelRequest(model_name="io"), metadata=key
    )
    assert code == Code.PERMISSION_DENIED
    assert message.startswith("unregistering models through the API is disabled")
    scaled = management.ScaleWorker(
        mpb.ScaleWorkerRequest(model_name="io", min_worker=1), metadata=key, timeout=TIMEOUT_S
    )
    assert scaled.msg == "Processing worker updates..."


def test_tls_and_grpc_off(make_archive, start_server, channels, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server = start_server(config={
        "enable_grpc_ssl": True, "certificate_file": str(cert), "private_key_file": str(key),
    })  # fmt: skip
    assert server.status["urls"]["grpc_inference"].startswith("grpcs://127.0.0.1:")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    secure = inference_pb2_grpc.InferenceAPIsServiceStub(
        channels(server.status["grpc_inference"], credentials)
    )
    assert json.loads(secure.Ping(empty_pb2.Empty(), timeout=TIMEOUT_S).health)
    plain, _ = _stubs(server, channels)
    code, _ = _error(plain.Ping, empty_pb2.Empty())
    assert code == Code.UNAVAILABLE  # a plaintext client gets no answer from a TLS port

    off = start_server(config={"grpc": False})
    assert "grpc_inference" not in off.status["urls"]
    assert off.status["grpc_inference"] is None
    assert "  grpc  " not in off.cli("--status").stdout
