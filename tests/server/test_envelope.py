"""TorchServe's server-wide request envelopes (``service_envelope``): a real server started from
TorchServe's config.properties, or from mserve's own YAML key, serving real workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml

from mserve_worker.oip.tensors import HEADER_LENGTH, Tensor
from mserve_worker.oip.wire import encode_request, parse_response
from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc
from tests.server.conftest import Reply, http

JSON_HEADERS = {"Content-Type": "application/json"}


def _post(server: Any, path: str, doc: Any) -> Reply:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return http("POST", server.url("inference", path), body, JSON_HEADERS)


def _opt_out(tmp_path: Path) -> str:
    path = tmp_path / "opt_out.yaml"
    path.write_text(yaml.safe_dump({"kserveEnvelope": False}))
    return str(path)


def test_kserve_envelope_splits_instances_into_batch_rows(
    tmp_path: Path, make_archive, start_server
) -> None:
    """config.properties with service_envelope=kserve (KServe's runtime sets it through
    TS_SERVICE_ENVELOPE instead: tests/deploy/test_entry_command.py). Each instance is one row
    of the handler's batch; the answer holds one prediction per instance."""
    make_archive("envelope", "rows", "rows")
    make_archive("envelope", "rows", "own", "--config-file", _opt_out(tmp_path))
    props = tmp_path / "config.properties"
    props.write_text("service_envelope=kserve\n")
    server = start_server("rows=rows.mar", "own=own.mar", extra=("--ts-config", str(props)))
    instances = [[1, 2], {"data": "aGk="}, "three"]
    reply = _post(server, "/v1/models/rows:predict", {"instances": instances})
    assert reply.status == 200, reply.body
    assert reply.json() == {
        "predictions": [{"row": row, "rows": 3, "explain": False} for row in instances]
    }
    reply = _post(server, "/v1/models/rows:explain", {"instances": [7]})
    assert reply.json() == {"explanations": [{"row": 7, "rows": 1, "explain": True}]}
    # TorchServe's paths read the envelope's shape too; another body goes through as usual
    reply = _post(server, "/predictions/rows", {"instances": [1, 2]})
    assert reply.json() == {
        "predictions": [{"row": r, "rows": 2, "explain": False} for r in (1, 2)]
    }
    reply = _post(server, "/predictions/rows", {"hello": 1})
    assert reply.json() == {"row": {"hello": 1}, "rows": 1, "explain": False}
    # TorchServe's gRPC Predictions goes through the envelope too (its "data" input)
    with grpc.insecure_channel(server.status["grpc_inference"]) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = ipb.PredictionsRequest(
            model_name="rows", input={"data": b'{"instances": [4, 5]}'}
        )
        answer = json.loads(stub.Predictions(request, timeout=60).prediction)
    assert answer == {"predictions": [{"row": r, "rows": 2, "explain": False} for r in (4, 5)]}
    # errors: one request at a time, in KServe's {"error"} shape
    reply = _post(server, "/v1/models/rows:predict", {"instances": [1, "bad", 3]})
    assert (reply.status, reply.json()) == (422, {"error": "instance 1 is bad"})
    reply = _post(server, "/v1/models/rows:predict", {"instances": []})
    assert reply.status == 400
    assert reply.json() == {
        "error": "the request's 'instances' is empty: there is nothing to predict"
    }
    reply = _post(server, "/v1/models/rows:predict", {"instances": [1, "short"]})
    assert reply.status == 500
    assert (
        "got 1 results for a batch of 2 (each instance of an enveloped request is one)"
        in (reply.json()["error"])
    )
    # a model whose config says kserveEnvelope: false gets the request whole, as before
    reply = _post(server, "/v1/models/own:predict", {"instances": [1, 2, 3]})
    assert reply.json() == {
        "predictions": {"row": {"instances": [1, 2, 3]}, "rows": 1, "explain": False}
    }


def test_kservev2_envelope_from_the_yaml_key(tmp_path: Path, make_archive, start_server) -> None:
    """service_envelope: kservev2 gives every TorchServe-style model decoded tensors, as its own
    kserveEnvelope: true would, on the v2 paths and on /predictions; a model can opt out."""
    make_archive("oip_models", "echo_tensors", "echo")
    make_archive("oip_models", "echo_tensors", "own", "--config-file", _opt_out(tmp_path))
    server = start_server("echo=echo.mar", "own=own.mar", config={"service_envelope": "kservev2"})
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    body, length = encode_request([Tensor("x", "FP32", array.shape, array)], [False])
    headers = {"Content-Type": "application/json"}
    if length is not None:
        headers[HEADER_LENGTH] = str(length)
    for path in ("/v2/models/echo/infer", "/predictions/echo"):
        reply = http("POST", server.url("inference", path), body, headers)
        assert reply.status == 200, (path, reply.body)
        doc, tensors = parse_response(reply.body, reply.headers.get(HEADER_LENGTH))
        assert doc["model_name"] == "echo"
        assert [(t.name, t.datatype, list(t.shape)) for t in tensors] == [("x", "FP32", [2, 3])]
    # a plain body on /predictions is no v2 request: the handler gets it as usual
    reply = _post(server, "/predictions/echo", {"hello": 1})
    assert reply.json()["body"] == {"hello": 1}
    # opted out: the v2 body reaches the handler as it came
    reply = http("POST", server.url("inference", "/v2/models/own/infer"), body, headers)
    assert reply.status == 200, reply.body
    assert reply.json()["protocol"] == ""
