"""The Open Inference Protocol and KServe v1 over raw HTTP: every datatype both ways, flat and
nested data, the binary extension, the messages of refused requests, {"error"} bodies, what each
handler style receives."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from mserve_worker.oip.decode import to_array
from mserve_worker.oip.tensors import HEADER_LENGTH, RequestedOutput, Tensor
from mserve_worker.oip.wire import encode_request, parse_response
from tests.server.conftest import HANDLERS, Reply, http

FOLDER = HANDLERS / "oip_models"
JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture
def server(make_archive, start_server):
    cfg = lambda name: ("--config-file", str(FOLDER / name))  # noqa: E731
    make_archive("oip_models", "echo_tensors", "echo", *cfg("echo_config.yaml"))
    make_archive("oip_models", "echo_tensors", "plain")
    make_archive("oip_models", "echo_tensors", "typed", *cfg("typed_config.yaml"))
    make_archive("oip_models", "v2_sum", "v2sum")
    make_archive("oip_models", "hooks_double", "hooks")
    return start_server(*(f"{m}={m}.mar" for m in ("echo", "plain", "typed", "v2sum", "hooks")))


def _infer(server, model: str, doc: Any, headers: dict[str, str] | None = None) -> Reply:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    url = server.url("inference", f"/v2/models/{model}/infer")
    return http("POST", url, body, headers or JSON_HEADERS)


def _outputs(reply: Reply) -> dict[str, np.ndarray]:
    assert reply.status == 200, reply.body
    _, tensors = parse_response(reply.body, reply.headers.get(HEADER_LENGTH))
    return {t.name: to_array(t, np) for t in tensors}


def _error(reply: Reply, status: int) -> str:
    assert reply.status == status, reply.body
    body = reply.json()
    assert list(body) == ["error"], body
    return body["error"]


ARRAYS = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 128, 255]], np.uint8),
    "UINT16": np.array([[0, 1, 65535]], np.uint16),
    "UINT32": np.array([[0, 1, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[0, 1, 2**64 - 1]], np.uint64),
    "INT8": np.array([[-128, 0, 127]], np.int8),
    "INT16": np.array([[-32768, 0, 32767]], np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1]], np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], np.int64),
    "FP16": np.array([[0.5, -1.25, 65504.0]], np.float16),
    "FP32": np.array([[0.1, -2.5, 3e38]], np.float32),
    "FP64": np.array([[0.1, -2.5, 1e308]], np.float64),
    "BYTES": np.array([[b"a", b"\xff\x00bin", "é".encode()]], dtype=object),
}


def test_every_datatype_round_trips_in_json_and_in_binary(server) -> None:
    """The echo handler answers its decoded inputs: what comes back is what was sent, datatype
    and shape included; binary both ways for all, JSON both ways for all but FP16 (and BYTES
    that are not UTF-8)."""
    inputs = [Tensor(name.lower(), name, array.shape, array) for name, array in ARRAYS.items()]
    body, length = encode_request(inputs, [True] * len(inputs), request_id="all",
                                  parameters={"binary_data_output": True})  # fmt: skip
    reply = _infer(server, "echo", body, {HEADER_LENGTH: str(length)})
    assert reply.headers["Content-Type"] == "application/octet-stream"
    got = _outputs(reply)
    for name, array in ARRAYS.items():
        assert got[name.lower()].dtype == array.dtype, name
        assert got[name.lower()].tolist() == array.tolist(), name
    doc = json.loads(reply.body[: int(reply.headers[HEADER_LENGTH])])
    assert doc["id"] == "all" and doc["model_name"] == "echo" and doc["model_version"] == "1.0"
    assert {o["name"]: o["datatype"] for o in doc["outputs"]} == {n.lower(): n for n in ARRAYS}

    text = {n: a for n, a in ARRAYS.items() if n != "FP16"}
    text["BYTES"] = np.array([[b"a", b"bc", "é".encode()]], dtype=object)
    doc = {"inputs": [
        {"name": n.lower(), "datatype": n, "shape": list(a.shape),
         "data": [v.decode() for v in a.ravel()] if n == "BYTES" else a.ravel().tolist()}
        for n, a in text.items()
    ]}  # fmt: skip
    reply = _infer(server, "echo", doc)
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"] == "application/json"
    assert HEADER_LENGTH not in reply.headers
    answered = {o["name"]: o for o in reply.json()["outputs"]}
    for name, array in text.items():
        out = answered[name.lower()]
        assert (out["datatype"], out["shape"]) == (name, [1, 3]), name
        expected = [v.decode() for v in array.ravel()] if name == "BYTES" else array.ravel()
        assert out["data"] == list(expected) or np.allclose(out["data"], expected), name


def test_nested_and_flat_data_are_the_same_tensor(server) -> None:
    flat = {"name": "x", "datatype": "INT32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}
    nested = {**flat, "data": [[1, 2, 3], [4, 5, 6]]}
    for entry in (flat, nested):
        out = _outputs(_infer(server, "echo", {"inputs": [entry]}))["x"]
        assert out.tolist() == [[1, 2, 3], [4, 5, 6]] and out.dtype == np.int32
    scalar = {"name": "s", "datatype": "FP64", "shape": [], "data": 2.5}
    assert _outputs(_infer(server, "echo", {"inputs": [scalar]}))["s"].tolist() == 2.5


def test_requested_outputs_and_binary_per_output(server) -> None:
    a = Tensor("a", "FP32", (2,), np.array([1, 2], np.float32))
    b = Tensor("b", "INT64", (1,), np.array([7], np.int64))
    wanted = [RequestedOutput("b", False), RequestedOutput("a", True)]
    body, length = encode_request([a, b], [False, True], wanted)
    reply = _infer(server, "echo", body, {HEADER_LENGTH: str(length)})
    doc = json.loads(reply.body[: int(reply.headers[HEADER_LENGTH])])
    assert [o["name"] for o in doc["outputs"]] == ["b", "a"]
    assert doc["outputs"][0]["data"] == [7]
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": 8}
    assert _outputs(reply)["a"].tolist() == [1.0, 2.0]
    missing = {"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
               "outputs": [{"name": "zz"}]}  # fmt: skip
    assert _error(_infer(server, "echo", missing), 400) == (
        "model echo produced no output 'zz'; it produced a"
    )


REFUSALS = [
        ("echo", {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]},
         "input 'x' has 3 values; its shape [2, 2] holds 4"),
        ("echo", {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3]]},
         "input 'x': data does not nest as its shape [2, 2]: dimension 1 should hold 2 values,"
         " found 1 values"),
        ("echo", {"name": "x", "datatype": "FP32", "shape": [2], "data": [[1, 2]]},
         "input 'x': data does not nest as its shape [2]: dimension 0 should hold 2 values,"
         " found 1 values"),
        ("echo", {"name": "x", "datatype": "INT8", "shape": [1], "data": [200]},
         "input 'x' is INT8 but holds 200"),
        ("echo", {"name": "x", "datatype": "INT32", "shape": [1], "data": [1.5]},
         "input 'x' is INT32 but holds 1.5"),
        ("echo", {"name": "x", "datatype": "BOOL", "shape": [1], "data": [1]},
         "input 'x' is BOOL but holds 1"),
        ("echo", {"name": "x", "datatype": "FP16", "shape": [1], "data": [1.0]},
         "input 'x' is FP16, which JSON cannot carry: send it as binary data (binary_data_size"
         " and the Inference-Header-Content-Length header)"),
        ("echo", {"name": "x", "datatype": "FLOAT", "shape": [1], "data": [1.0]},
         "input 'x' has datatype 'FLOAT'; expected one of BOOL, UINT8, UINT16, UINT32, UINT64,"
         " INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES"),
        ("typed", {"name": "x", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]},
         "input 'x' must have shape [-1, 3] (-1: any size), the request sends [1, 4]"),
        ("typed", {"name": "x", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]},
         "input 'x' must be INT32, the request sends INT64"),
        ("typed", {"name": "y", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
         "model typed has no input 'y'; its inputs are 'x', 'label'"),
    ]  # fmt: skip


def test_refused_requests_say_what_is_wrong(server) -> None:
    """One server for all the cases: each (model, input, message) is a 400 with that message."""
    for model, entry, message in REFUSALS:
        assert _error(_infer(server, model, {"inputs": [entry]}), 400) == message, entry


def test_binary_and_signature_refusals(server) -> None:
    x = {"name": "x", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]}
    assert _error(_infer(server, "typed", {"inputs": [x]}), 400) == (
        "model typed needs input 'label', which the request lacks"
    )
    short = Tensor("x", "FP32", (4,), b"\0" * 12)
    body, length = encode_request([short], [True])
    assert _error(_infer(server, "echo", body, {HEADER_LENGTH: str(length)}), 400) == (
        "input 'x' of shape [4] and datatype FP32 needs 16 bytes of binary data, got 12"
    )
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                       "parameters": {"binary_data_size": 4}}]}  # fmt: skip
    assert _error(_infer(server, "echo", doc), 400) == (
        "input 'x' announces 4 bytes of binary data, but only 0 remain after the JSON (send the"
        " Inference-Header-Content-Length header with binary data)"
    )
    strings = Tensor("s", "BYTES", (2,), b"\x01\x00\x00\x00a")
    body, length = encode_request([strings], [True])
    assert _error(_infer(server, "echo", body, {HEADER_LENGTH: str(length)}), 400) == (
        "BYTES input 's' holds 1 elements, its shape holds 2"
    )
    assert _error(_infer(server, "echo", b"{nope"), 400).startswith(
        "the body is not valid JSON: Expecting property name"
    )
    assert _error(_infer(server, "echo", b"{}", {HEADER_LENGTH: "9"}), 400) == (
        "Inference-Header-Content-Length is '9'; it must be the length of the JSON part, between"
        " 0 and the body's 2 bytes"
    )
    assert _error(_infer(server, "typed", {"inputs": [[1, 2, 3]]}), 400) == (
        "inputs[0] must be an object with name, shape, datatype, data"
    )


def test_errors_on_kserve_paths_are_error_objects(server) -> None:
    assert _error(_infer(server, "nosuch", {"inputs": []}), 404) == "Model not found: nosuch"
    url = server.url("inference", "/v2/models/echo/infer")
    assert _error(http("GET", url), 405) == "method GET is not allowed here; use POST"
    fail = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
            "parameters": {"fail": True}}  # fmt: skip
    assert "RuntimeError: asked to fail" in _error(_infer(server, "echo", fail), 500)
    rename = {**fail, "parameters": {"rename": "label"}}
    rename["inputs"] = [
        {"name": "x", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
        {"name": "label", "datatype": "BYTES", "shape": [1], "data": ["a"]},
    ]
    rename["parameters"] = {"rename": "other"}
    assert _error(_infer(server, "typed", rename), 500) == (
        "model typed returned output 'other', which its signature does not declare"
        " (outputs: x, label)"
    )
    v1 = http("POST", server.url("inference", "/v1/models/nosuch:predict"), b"{}", JSON_HEADERS)
    assert _error(v1, 404) == "Model not found: nosuch"
    # TorchServe's own paths keep TorchServe's body
    other = http("POST", server.url("inference", "/predictions/nosuch"), b"{}", JSON_HEADERS)
    assert other.json()["type"] == "ModelNotFoundException"


def test_metadata_with_and_without_a_signature(server) -> None:
    typed = http("GET", server.url("inference", "/v2/models/typed")).json()
    assert typed["inputs"] == [
        {"name": "x", "datatype": "INT32", "shape": [-1, 3]},
        {"name": "label", "datatype": "BYTES", "shape": [1]},
    ]
    echo = http("GET", server.url("inference", "/v2/models/echo/versions/1.0")).json()
    assert (echo["name"], echo["versions"], echo["inputs"], echo["outputs"]) == (
        "echo",
        ["1.0"],
        [],
        [],
    )


def test_a_torchserve_handler_gets_its_usual_body(server) -> None:
    """Without kserveEnvelope the handler of TorchServe's style sees the body as on
    /predictions, on v2 (JSON and binary) and v1 alike; its v1 answer is wrapped."""
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.5]}]}
    got = _infer(server, "plain", doc).json()
    assert got == {"protocol": "", "operation": "", "type": "dict", "body": doc}
    body, length = encode_request([Tensor("x", "FP32", (1,), b"\0\0\0\0")], [True])
    got = _infer(
        server,
        "plain",
        body,
        {HEADER_LENGTH: str(length), "Content-Type": "application/octet-stream"},
    ).json()
    assert got["type"] == "bytes" and got["body"] == f"{len(body)} bytes"
    v1 = {"instances": [[1, 2], [3, 4]]}
    url = server.url("inference", "/v1/models/plain:predict")
    answer = http("POST", url, json.dumps(v1).encode(), JSON_HEADERS).json()
    assert answer == {"predictions": {"protocol": "v1", "operation": "", "type": "dict",
                                      "body": v1}}  # fmt: skip
    url = server.url("inference", "/v1/models/plain:explain")
    answer = http("POST", url, json.dumps(v1).encode(), JSON_HEADERS).json()
    assert answer["explanations"]["operation"] == "explain"


def test_v2_model_class_and_hooks_get_arrays_by_name(server) -> None:
    doc = {"id": "q", "inputs": [{"name": "x", "datatype": "INT16", "shape": [2, 2],
                                  "data": [1, 2, 3, 4]}]}  # fmt: skip
    reply = _infer(server, "v2sum", doc)
    outputs = {o["name"]: o for o in reply.json()["outputs"]}
    assert reply.json()["id"] == "q"
    assert outputs["total"]["data"] == [3, 7] and outputs["total"]["shape"] == [2]
    assert outputs["dtype"]["data"] == ["int16"] and outputs["dtype"]["datatype"] == "BYTES"
    legacy = _infer(server, "v2sum", {"inputs": [[1, 2], [3, 4]]})  # mlrun's rows, as before
    assert legacy.json()["outputs"] == [3, 7]
    doubled = _outputs(_infer(server, "hooks", {"inputs": [
        {"name": "a", "datatype": "UINT8", "shape": [2], "data": [1, 100]}]}))  # fmt: skip
    assert doubled["a"].dtype == np.uint8 and doubled["a"].tolist() == [2, 200]


def test_kserve_v1_predict_explain_and_readiness(server) -> None:
    body = json.dumps({"instances": [[1, 2], [3, 4]]}).encode()
    predict = http("POST", server.url("inference", "/v1/models/v2sum:predict"), body, JSON_HEADERS)
    assert predict.status == 200 and predict.json() == {"predictions": [3, 7]}
    ready = http("GET", server.url("inference", "/v1/models/v2sum"))
    assert ready.status == 200 and ready.json() == {"name": "v2sum", "ready": True}
    assert "v2sum" in http("GET", server.url("inference", "/v1/models")).json()["models"]
    explain = http("POST", server.url("inference", "/v1/models/v2sum:explain"), body, JSON_HEADERS)
    assert explain.status == 501 and "does not implement explain" in explain.json()["error"]
    bad = http("POST", server.url("inference", "/v1/models/v2sum:predict"), b"[1]", JSON_HEADERS)
    assert _error(bad, 400) == 'a KServe v1 request is a JSON object {"instances": [...]}'
    hooks = http("POST", server.url("inference", "/v1/models/hooks:predict"), body, JSON_HEADERS)
    assert hooks.json() == {"predictions": [[2, 4], [6, 8]]}


def test_kserve_paths_need_the_inference_key_but_health(make_archive, start_server) -> None:
    make_archive("oip_models", "v2_sum", "v2sum")
    server = start_server("v2sum=v2sum.mar", config={"disable_token_authorization": False})
    assert http("GET", server.url("inference", "/v2/health/live")).status == 200
    assert http("GET", server.url("inference", "/v2/health/ready")).status == 200
    doc = {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1, 2], "data": [1, 2]}]}
    refused = _infer(server, "v2sum", doc)
    assert _error(refused, 401).startswith("token authorization is on: send the inference key")
    for path in ("/v2", "/v2/models/v2sum", "/v1/models/v2sum", "/v1/models"):
        assert http("GET", server.url("inference", path)).status == 401, path
    reply = _infer(server, "v2sum", doc, {**JSON_HEADERS, **server.auth("inference")})
    assert reply.status == 200 and reply.json()["outputs"][0]["data"] == [3]


def test_a_bad_signature_fails_the_load_naming_the_entry(make_archive, start_server, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("inputs:\n  - {name: x, datatype: FLOAT32, shape: [1]}\n")
    make_archive("oip_models", "echo_tensors", "bad", "--config-file", str(config))
    server = start_server("bad=bad.mar", expect_ok=False)
    assert "model config 'inputs[0]'.datatype should be one of BOOL" in server.start_output
