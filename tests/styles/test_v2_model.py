"""V2 model classes (mlrun's V2ModelServer contract) served by a real mserve over HTTP.

The fixture model in tests/handlers/v2_linear is a linear model whose weights the test pickles
with a fixed seed, so every output is checked against the same arithmetic done here.
"""

from __future__ import annotations

import json
import pickle
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.server import conftest as serving
from tests.server.conftest import Reply, http

# The real-server fixtures of tests/server, used here too.
make_archive = serving.make_archive
start_server = serving.start_server

FEATURES = 3
LABELS = {"0": "low", "1": "high"}


@pytest.fixture
def linear(tmp_path: Path) -> dict[str, Any]:
    """Weights, bias and the files the archive ships: model.pkl, labels.json, a model config."""
    rng = random.Random(1234)
    model = {"weights": [rng.uniform(-1, 1) for _ in range(FEATURES)], "bias": rng.uniform(-1, 1)}
    files = tmp_path / "files"
    files.mkdir()
    (files / "model.pkl").write_bytes(pickle.dumps(model))
    (files / "labels.json").write_text(json.dumps(LABELS))
    return {**model, "files": files}


def archive(make_archive, linear, tmp_path: Path, name: str, config: str) -> None:
    (tmp_path / f"{name}.yaml").write_text(config)
    files = linear["files"]
    make_archive(
        "v2_linear", "linear_model", name,
        "--serialized-file", str(files / "model.pkl"),
        "--extra-files", str(files / "labels.json"),
        "-c", str(tmp_path / f"{name}.yaml"),
    )  # fmt: skip


def expected(linear: dict[str, Any], row: list[float], threshold: float) -> dict[str, Any]:
    score = sum(x * w for x, w in zip(row, linear["weights"], strict=True)) + linear["bias"]
    return {"score": pytest.approx(score), "label": LABELS[str(int(score > threshold))]}


def post(server, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return http("POST", server.url("inference", path), data, hdrs)


CONFIG = "params:\n  threshold: 0.25\n  greeting: hello\n"


def test_infer_explain_and_custom_operations(make_archive, start_server, linear, tmp_path):
    archive(make_archive, linear, tmp_path, "linear", CONFIG)
    server = start_server("linear=linear.mar")
    rows = [[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]]

    reply = post(server, "/v2/models/linear/infer", {"id": "req-1", "inputs": rows})
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"] == "application/json"
    assert reply.json() == {
        "id": "req-1",
        "model_name": "linear",
        "model_version": "1.0",
        "outputs": [expected(linear, r, 0.25) for r in rows],
        "batch_size": 1,
    }
    # The other predict paths, and no "id": the request id is the response's id.
    for path in ("/v2/models/linear/versions/1.0/predict", "/predictions/linear"):
        reply = post(server, path, {"inputs": rows[:1]})
        assert reply.status == 200, (path, reply.body)
        assert reply.json()["id"] == reply.headers["X-Request-Id"]
        assert reply.json()["outputs"] == [expected(linear, rows[0], 0.25)]

    explained = post(server, "/v2/models/linear/explain", {"inputs": rows[:1]}).json()
    assert explained["outputs"]["contributions"] == [
        pytest.approx([x * w for x, w in zip(rows[0], linear["weights"], strict=True)])
    ]
    assert explained["outputs"]["bias"] == pytest.approx(linear["bias"])
    torchserve_path = post(server, "/explanations/linear", {"inputs": rows[:1]})
    assert torchserve_path.json()["outputs"] == explained["outputs"]

    described = post(
        server, "/v2/models/linear/describe?verbose=1", {"any": ["json"]}, {"X-Test": "42"}
    )
    assert described.status == 200, described.body
    report = described.json()
    assert report == {
        "path": "describe",
        "method": "POST",
        "id": described.headers["X-Request-Id"],
        "body": {"any": ["json"]},
        "fields": {"verbose": "1"},
        "x_test": "42",
        "model_file": "model.pkl",
        "extra_data": ["labels", "labels.json"],
        "threshold": 0.25,
        "greeting": "hello",
        "version": "1.0",
        "ready": True,
    }
    teapot = post(server, "/v2/models/linear/teapot", b"", {"Content-Type": "text/plain"})
    assert (teapot.status, teapot.body) == (418, b"short and stout")
    assert teapot.headers["Content-Type"] == "text/plain" and teapot.headers["X-Pot"] == "tea"

    ready = http("GET", server.url("inference", "/v2/models/linear/ready"))
    assert ready.status == 200 and ready.json()["ready"] is True


ERRORS = [
    ("/v2/models/linear/infer", {"id": 1}, 400, 'Expected key "inputs" in request body'),
    ("/v2/models/linear/infer", {"inputs": "1,2,3"}, 400, 'Expected "inputs" to be a list'),
    ("/v2/models/linear/infer", [1, 2], 400,
     'the infer request must be a JSON object like {"inputs": [...]}, got list'),
    ("/v2/models/linear/explain", {"inputs": 3}, 400, 'Expected "inputs" to be a list'),
    ("/v2/models/linear/infer", {"inputs": [[1, 2]]}, 500,
     "LinearModel.predict failed: ValueError: matmul"),
    ("/v2/models/linear/train", {}, 404,
     "model linear has no operation 'train' (no op_train method); "
     "available: infer, predict, explain, describe, teapot"),
]  # fmt: skip


def test_request_errors_answer_their_caller(make_archive, start_server, linear, tmp_path):
    archive(make_archive, linear, tmp_path, "linear", CONFIG)
    server = start_server("linear=linear.mar")
    for path, body, status, message in ERRORS:
        reply = post(server, path, body)
        assert reply.status == status, (path, body, reply.body)
        assert reply.json()["code"] == status
        assert reply.json()["message"].startswith(message), reply.json()
    assert post(server, "/v2/models/linear/infer", {"inputs": [[0, 0, 0]]}).status == 200


def test_batch_answers_each_request_on_its_own(make_archive, start_server, linear, tmp_path):
    archive(make_archive, linear, tmp_path, "batched", "batchSize: 4\nmaxBatchDelay: 500\n")
    server = start_server("batched=batched.mar")
    rng = random.Random(99)
    bodies: list[Any] = [
        {"id": f"r{i}", "inputs": [[rng.uniform(-2, 2) for _ in range(FEATURES)]]} for i in range(3)
    ]
    bodies.append({"id": "bad", "inputs": "not a list"})  # only this caller gets the 400
    replies: dict[int, Reply] = {}

    def send(i: int) -> None:
        replies[i] = post(server, "/v2/models/batched/infer", bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, body in enumerate(bodies[:3]):
        assert replies[i].status == 200, replies[i].body
        answer = replies[i].json()
        assert answer["id"] == body["id"]
        assert answer["outputs"] == [expected(linear, body["inputs"][0], 0.0)]
    assert replies[3].status == 400
    assert replies[3].json()["message"] == 'Expected "inputs" to be a list'
    # all four travelled in one batch: the three valid ones were predicted in the same call
    assert {replies[i].json()["batch_size"] for i in range(3)} == {4}
