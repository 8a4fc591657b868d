"""Operations beyond predict: /explanations, the KServe v2 paths, and the handler-style override.

Real mserve daemons and workers; the `operations` handler reports what the worker asked of it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tests.server.conftest import http


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    reply = http(
        "POST",
        server.url("inference", path),
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return reply.status, reply.json()


def test_explanations_and_v2_paths_reach_the_handler(make_archive, start_server) -> None:
    make_archive("operations", "operations", "ops", "--version", "2.0")
    server = start_server("ops=ops.mar")

    status, out = _post(server, "/predictions/ops", {"x": 1})
    assert status == 200 and out["operation"] == "" and out["explain_header"] is None
    # TorchServe's handlers look for an `explain: True` header; ours also get the operation.
    status, out = _post(server, "/explanations/ops", {"x": 2})
    assert (status, out["operation"], out["explain_header"]) == (200, "explain", "True")
    assert out["body"] == {"x": 2}
    status, out = _post(server, "/explanations/ops/2.0", {"x": 3})
    assert (status, out["operation"]) == (200, "explain")

    status, out = _post(server, "/v2/models/ops/infer", {"inputs": []})
    assert (status, out["operation"]) == (200, "")
    status, out = _post(server, "/v2/models/ops/versions/2.0/explain", {"inputs": []})
    assert (status, out["operation"]) == (200, "explain")
    status, out = _post(server, "/v2/models/ops/versions/2.0/train_step", {"inputs": []})
    assert (status, out["operation"]) == (200, "train_step")
    status, out = _post(server, "/v2/models/ops/not-a-name", {})
    # errors on the v2 paths are the Open Inference Protocol's {"error": message}
    assert status == 400 and "'not-a-name' is not a valid name" in out["error"]
    status, out = _post(server, "/v2/models/ops/versions/9.9/infer", {})
    assert status == 404 and "9.9" in out["error"] and list(out) == ["error"]
    status, out = _post(server, "/explanations/nope", {})
    assert status == 404 and out["type"] == "ModelNotFoundException"

    ready = http("GET", server.url("inference", "/v2/models/ops/ready"))
    assert ready.status == 200 and ready.json() == {"name": "ops", "version": "2.0", "ready": True}
    meta = http("GET", server.url("inference", "/v2/models/ops/versions/2.0")).json()
    assert meta["name"] == "ops" and meta["versions"] == ["2.0"]
    assert http("GET", server.url("inference", "/v2/health/live")).json() == {"live": True}
    assert http("GET", server.url("inference", "/v2/health/ready")).json() == {"ready": True}

    server.manage("PUT", "/models/ops?min_worker=0&max_worker=0&synchronous=true")
    not_ready = http("GET", server.url("inference", "/v2/models/ops/ready"))
    assert not_ready.status == 503 and not_ready.json()["ready"] is False


def test_a_batch_mixing_operations_calls_the_handler_once_per_operation(
    make_archive, start_server, tmp_path: Path
) -> None:
    config = tmp_path / "batch.yaml"
    config.write_text("batchSize: 4\nmaxBatchDelay: 1500\nbatchWait: fill\n")
    make_archive("operations", "operations", "ops", "-c", str(config))
    server = start_server("ops=ops.mar")
    paths = ["/predictions/ops", "/explanations/ops", "/predictions/ops", "/explanations/ops"]
    results: dict[int, tuple[int, dict]] = {}

    def send(i: int) -> None:
        results[i] = _post(server, paths[i], {"i": i})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for i, (status, out) in results.items():
        assert status == 200
        assert out["body"] == {"i": i}
        assert out["operation"] == ("explain" if i % 2 else "")
        assert out["batch"] == 2  # the batch of 4 was split by operation, two calls of 2
    assert sorted(out["call"] for _, out in results.values()) == [1, 1, 2, 2]


def test_handler_style_override_settles_an_ambiguous_class(make_archive, start_server) -> None:
    make_archive("ambiguous", "ambiguous", "guess")
    make_archive("ambiguous", "ambiguous", "named", "--handler-style", "handler-class")
    server = start_server("named=named.mar")
    reply = server.predict("named", {"x": 1})
    assert reply.status == 200 and reply.json() == {"via": "handle"}

    failed = server.manage("POST", "/models?url=guess.mar&synchronous=true")
    assert failed.status >= 400
    message = failed.json()["message"]
    assert "fits several styles (handler-class, v2-model)" in message
    assert "--handler-style" in message
