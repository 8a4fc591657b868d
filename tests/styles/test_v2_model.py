"""V2 model classes (mlrun's V2ModelServer contract) served by a real mserve over HTTP.

The fixture model in tests/handlers/v2_linear is a linear model whose weights the test pickles
with a fixed seed, so every output is checked against the same arithmetic done here.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mserve_worker.context import Context
from mserve_worker.contract import HandlerLoadError, LoadedHandler
from mserve_worker.loader import load_handler
from mserve_worker.sdk.v2_model import V2ModelServer
from server.model_envs import copy_runtime
from tests.conftest import ARCHIVER_SCRIPT, REPO
from tests.server import conftest as serving
from tests.server.conftest import Reply, concurrently, http

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
        answer = reply.json()  # {"error"} on infer/explain (OIP), TorchServe's body elsewhere
        text = answer["error"] if path.endswith(("/infer", "/explain")) else answer["message"]
        assert text.startswith(message), answer
    assert post(server, "/v2/models/linear/infer", {"inputs": [[0, 0, 0]]}).status == 200


def test_batch_answers_each_request_on_its_own(make_archive, start_server, linear, tmp_path):
    archive(
        make_archive,
        linear,
        tmp_path,
        "batched",
        "batchSize: 4\nmaxBatchDelay: 500\nbatchWait: fill\n",
    )
    server = start_server("batched=batched.mar")
    rng = random.Random(99)
    bodies: list[Any] = [
        {"id": f"r{i}", "inputs": [[rng.uniform(-2, 2) for _ in range(FEATURES)]]} for i in range(3)
    ]
    bodies.append({"id": "bad", "inputs": "not a list"})  # only this caller gets the 400
    replies: list[Reply] = concurrently(
        *(partial(post, server, "/v2/models/batched/infer", body) for body in bodies)
    )
    for i, body in enumerate(bodies[:3]):
        assert replies[i].status == 200, replies[i].body
        answer = replies[i].json()
        assert answer["id"] == body["id"]
        assert answer["outputs"] == [expected(linear, body["inputs"][0], 0.0)]
    assert replies[3].status == 400
    assert replies[3].json()["error"] == 'Expected "inputs" to be a list'
    # all four travelled in one batch: the three valid ones were predicted in the same call
    assert {replies[i].json()["batch_size"] for i in range(3)} == {4}


def test_the_example_runs_as_its_readme_says(start_server, tmp_path) -> None:
    """examples/v2_model: archived with the README's command, served, and asked over HTTP."""
    example = REPO / "examples" / "v2_model"
    store = tmp_path / "store"
    store.mkdir()
    archived = subprocess.run(
        [ARCHIVER_SCRIPT, "--model-name", "iris", "--handler", str(example / "iris_model.py"),
         "--serialized-file", str(example / "model.json"),
         "--extra-files", str(example / "classes.json"),
         "-c", str(example / "model-config.yaml"), "--export-path", str(store), "--force"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert archived.returncode == 0, archived.stderr
    server = start_server("iris=iris.mar")
    rows = [[5.1, 3.5, 1.4, 0.2], [5.9, 3.0, 4.2, 1.5], [6.3, 3.3, 6.0, 2.5]]
    reply = post(server, "/v2/models/iris/infer", {"id": "r1", "inputs": rows})
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert (answer["id"], answer["model_name"], answer["model_version"]) == ("r1", "iris", "1.0")
    assert [[c["class"] for c in top] for top in answer["outputs"]] == [
        ["setosa", "versicolor"], ["versicolor", "virginica"], ["virginica", "versicolor"],
    ]  # fmt: skip
    assert answer["outputs"][0][0]["probability"] == pytest.approx(0.9878, abs=1e-4)
    explained = post(server, "/v2/models/iris/explain", {"inputs": rows[1:2]}).json()
    assert explained["outputs"] == [
        {"setosa": [0, 0, pytest.approx(-16.8), 0], "versicolor": [0, 0, 0, 0],
         "virginica": [0, 0, pytest.approx(16.8), 0]},
    ]  # fmt: skip
    classes = post(server, "/v2/models/iris/classes", b"", {"Content-Type": "text/plain"})
    assert classes.json() == {"classes": ["setosa", "versicolor", "virginica"], "top_k": 2}


# In-process: the real loader and Context, with model folders written to tmp_path.


def make_context(model_dir: Path, config: dict[str, Any] | None = None, **model: str) -> Context:
    return Context(
        model_name="m", model_dir=str(model_dir), batch_size=4, gpu_id=None,
        manifest={"model": {"modelName": "m", "handler": "v2m", **model}},
        server_name="mserve", server_version="0", model_yaml_config=config, model_version="2.0",
    )  # fmt: skip


@pytest.fixture
def load_v2(tmp_path: Path) -> Iterator[Callable[..., tuple[LoadedHandler, Context]]]:
    """``load_v2(source, config=None)``: write ``v2m.py`` and load it as the worker
    does; the module is forgotten and sys.path restored afterwards."""
    folder = tmp_path / "model"
    folder.mkdir()
    saved = list(sys.path)

    def load(source: str, config: dict[str, Any] | None = None, style: str | None = None):
        (folder / "v2m.py").write_text(
            "from mserve_worker.sdk.v2_model import V2ModelServer\n" + textwrap.dedent(source)
        )
        sys.path.insert(0, str(folder))
        context = make_context(folder, config)
        return load_handler("v2m", str(folder), context, style), context

    yield load
    sys.path[:] = saved
    sys.modules.pop("v2m", None)


def serve(handler: LoadedHandler, context: Context, op: str, *bodies: Any) -> list[tuple[int, Any]]:
    """One batch through the handler: ``(status, output)`` per request."""
    context.start_batch(
        [
            SimpleNamespace(request_id=f"r{i}", headers=[["X-N", str(i)]])
            for i in range(len(bodies))
        ],
        op,
    )
    outputs = handler.handle([{"body": b} for b in bodies], context)
    return [(context.get_response_status(i)[0], out) for i, out in enumerate(outputs)]


@pytest.mark.parametrize(
    ("source", "config", "message"),
    [
        ("class M(V2ModelServer):\n    def load(self): pass\n", None,
         "v2m:M subclasses V2ModelServer but does not define predict(); a v2 model class needs "
         "load() (read the model, see get_model()) and predict(request)"),
        ("class M(V2ModelServer):\n    def predict(self, request): return 1\n", None,
         "v2m:M subclasses V2ModelServer but does not define load()"),
        ("class M:\n    def load(self, path): pass\n    def predict(self, request): return 1\n",
         None, "v2m:M.load(self, path) cannot be called as load(self)"),
        ("class M:\n    def load(self): pass\n    def predict(self): return 1\n",
         None, "v2m:M.predict(self) cannot be called as predict(self, request)"),
        ("class M:\n    def __init__(self, weights): pass\n    def load(self): pass\n"
         "    def predict(self, request): return 1\n", None,
         "cannot create v2m:M: __init__(weights) (missing a required argument: 'weights'); the "
         "server passes context, name, model_path and the model config's 'params' as keyword "
         "arguments"),
        ("class M(V2ModelServer):\n    def load(self): pass\n    def predict(self, r): return 1\n",
         {"params": [1, 2]}, "model config key 'params' must be a mapping of parameter names to "
         "values for v2m:M, found list"),
        ("class M(V2ModelServer):\n    def load(self): pass\n    def predict(self, r): return 1\n",
         {"params": {"name": "x", "model_path": "/"}}, "model config 'params' of v2m:M sets "
         "model_path, name, which the server sets itself; rename those parameters"),
    ],
)  # fmt: skip
def test_misuse_fails_the_load_with_a_clear_message(load_v2, source, config, message) -> None:
    with pytest.raises(HandlerLoadError) as caught:
        load_v2(source, config)
    assert str(caught.value) == message or str(caught.value).startswith(message)


def test_a_failing_load_is_the_users_own_exception(load_v2) -> None:
    source = """
    class M(V2ModelServer):
        def load(self):
            self.get_model(suffix=".onnx")
        def predict(self, request):
            return []
    """
    with pytest.raises(
        ValueError,
        match=r"get_model\(suffix='.onnx'\) needs exactly one file ending with '.onnx' in .*; found: none",
    ):
        load_v2(source)


def test_get_model_picks_the_serialized_file_or_the_one_with_the_suffix(tmp_path: Path) -> None:
    for name in ("a.pkl", "b.pkl", "w.json", "labels.json", "handler.py"):
        (tmp_path / name).write_text(name)
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "words.txt").write_text("x")
    (tmp_path / "MAR-INF").mkdir()
    (tmp_path / "MAR-INF" / "MANIFEST.json").write_text("{}")
    (tmp_path / "cfg.yaml").write_text("")

    def model(**manifest: str) -> V2ModelServer:
        context = SimpleNamespace(manifest={"model": manifest})
        return V2ModelServer(context=context, name="m", model_path=str(tmp_path))

    path, extra = model(serializedFile="b.pkl", configFile="cfg.yaml").get_model(".pkl")
    assert Path(path).name == "b.pkl"
    assert sorted(extra) == [
        "a",
        "a.pkl",
        "labels",
        "labels.json",
        "vocab/words",
        "vocab/words.txt",
        "w",
        "w.json",
    ]
    assert extra["vocab/words"] == str(tmp_path / "vocab" / "words.txt")
    assert extra["labels"].get() == b"labels.json" and extra["labels"].local() == extra["labels"]
    path, extra = model(serializedFile="b.pkl").get_model()
    assert Path(path).name == "b.pkl"
    assert "cfg.yaml" in extra  # only the manifest's configFile is left out
    with pytest.raises(
        ValueError, match=r"needs exactly one file ending with '.pkl' .*; found: a.pkl, b.pkl"
    ):
        model().get_model(".pkl")
    with pytest.raises(ValueError, match="the manifest names no serializedFile"):
        model().get_model()
    with pytest.raises(
        ValueError, match=r"\(serializedFile is 'b.pkl'\); found: labels.json, w.json"
    ):
        model(serializedFile="b.pkl").get_model(".json")
    (tmp_path / "labels.json").unlink()
    path, extra = model(serializedFile="b.pkl").get_model(".json")
    assert Path(path).name == "w.json" and "b.pkl" in extra


def test_a_plain_class_with_load_and_predict(load_v2) -> None:
    source = """
    class Doubler:
        def __init__(self, context=None, name=None, **params):
            self.context, self.name, self.params = context, name, params
        def load(self):
            self.factor = self.params["factor"]
        def predict(self, request):
            return [x * self.factor for x in request["inputs"]]
    """
    handler, context = load_v2(source, {"params": {"factor": 2}})
    assert handler.style == "v2-model"
    assert serve(handler, context, "", {"inputs": [1, 2]}, {"inputs": 3}, "text", {"inputs": [5]}) == [
        (200, {"id": "r0", "model_name": "m", "outputs": [2, 4], "model_version": "2.0"}),
        (400, {"code": 400, "type": "InvalidRequest", "message": 'Expected "inputs" to be a list'}),
        (400, {"code": 400, "type": "InvalidRequest",
               "message": 'the infer request must be a JSON object like {"inputs": [...]}, got str'}),
        (200, {"id": "r3", "model_name": "m", "outputs": [10], "model_version": "2.0"}),
    ]  # fmt: skip
    explained = serve(handler, context, "explain", {"inputs": [1]})
    assert explained == [
        (501, {"code": 501, "type": "NotImplemented",
               "message": "model m does not implement explain(request); its class Doubler must "
                          "define it to serve this operation"}),
    ]  # fmt: skip


def test_the_archive_style_settles_a_class_that_also_has_handle(load_v2) -> None:
    source = """
    class Both:
        def load(self): pass
        def predict(self, request): return "predicted"
        def handle(self, data, context): return ["handled"] * len(data)
    """
    handler, context = load_v2(source, style="v2-model")
    assert handler.style == "v2-model"
    assert serve(handler, context, "", {"inputs": []})[0][1]["outputs"] == "predicted"


def test_preprocess_paths_operations_metrics_and_logging(load_v2, capfd) -> None:
    source = """
    class M(V2ModelServer):
        def load(self):
            self.context.logger.info("loaded", rows=3)
        def preprocess(self, request, operation):
            if isinstance(request, str):  # a text body becomes a v2 request
                request = {"inputs": [float(v) for v in request.split(",")]}
            return request
        def predict(self, request):
            if not request["inputs"]:
                raise RuntimeError("nothing to add up")
            self.set_metric("total", sum(request["inputs"]))
            return sum(request["inputs"])
        def op_echo(self, event):
            return {"body": event.body, "path": event.path, "n": event.headers["x-n"]}
        def op_ok(self, event):
            return self.context.Response(status_code=202)
    """
    handler, context = load_v2(source, {"params": {"input_path": "data", "result_path": "out"}})
    assert "INFO mserve.v2_model.m: loaded rows=3" in capfd.readouterr().err
    bodies = [{"data": {"inputs": [1, 2]}, "keep": 1}, {"data": "3,4"}, {"data": {"inputs": []}}]
    got = serve(handler, context, "", *bodies)
    assert got[0] == (200, {"data": {"inputs": [1, 2]}, "keep": 1,
                            "out": {"id": "r0", "model_name": "m", "outputs": 3, "model_version": "2.0"}})  # fmt: skip
    assert got[1] == (
        200,
        {
            "data": "3,4",
            "out": {"id": "r1", "model_name": "m", "outputs": 7.0, "model_version": "2.0"},
        },
    )
    assert got[2] == (500, {"code": 500, "type": "InternalServerError",
                            "message": "M.predict failed: RuntimeError: nothing to add up"})  # fmt: skip
    assert "request r2: predict failed" in capfd.readouterr().err
    assert [(m["name"], m["value"], m["request_id"]) for m in context.metrics.drain()] == [
        ("total", 3, "r0"), ("total", 7.0, "r1"),
    ]  # fmt: skip
    # The body of a predict request may name the operation, as mlrun allows.
    assert serve(handler, context, "", {"operation": "echo", "x": 1}) == [
        (200, {"body": {"operation": "echo", "x": 1}, "path": "echo", "n": "0"}),
    ]
    assert serve(handler, context, "", {"x": 1})[0] == (400, {
        "code": 400, "type": "InvalidRequest", "message": "input_path 'data': the request body has no 'data' there"
    })  # fmt: skip
    assert serve(handler, context, "ok", b"") == [(202, b"")]
    assert serve(handler, context, "echo", b"\x00")[0] == (
        200,
        {"body": b"\x00", "path": "echo", "n": "0"},
    )
    assert serve(handler, context, "nope", {})[0][0] == 404


def _old_python() -> str | None:
    found = sorted(Path.home().glob(".pyenv/versions/3.8*/bin/python"))
    return os.environ.get("OLD_PYTHON_FOR_WORKER_TESTS") or (str(found[-1]) if found else None)


_OLD_MODEL = """
import json
from mserve_worker.sdk.v2_model import V2ModelServer

class Scaler(V2ModelServer):
    def load(self):
        model_file, extra = self.get_model(suffix=".json")
        with open(model_file) as f:
            self.scale = json.load(f)["scale"] * self.get_param("boost", 1)
        self.context.logger.info("loaded", extra=sorted(extra))
    def predict(self, request):
        self.set_metric("n", len(request["inputs"]))
        return [x * self.scale for x in request["inputs"]]
    def op_info(self, event):
        return self.context.Response(body=json.dumps(event.fields), status_code=201)
"""

# Every branch of the adapter once, on the oldest Python a model environment may use.
_OLD_SCRIPT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from types import SimpleNamespace
from mserve_worker.context import Context
from mserve_worker.loader import load_handler
ctx = Context("m", sys.argv[1], {"model": {"serializedFile": "w.json"}}, 2, None, "mserve", "0",
              model_yaml_config={"params": {"boost": 10}}, model_version="3")
handler = load_handler("scaler", sys.argv[1], ctx)
print(handler.style)
for op, bodies in (("", [{"inputs": [1, 2]}, {"inputs": 1}, "x", {"inputs": ["a"]}]),
                   ("explain", [{"inputs": []}]), ("info", [{"q": 1}]), ("nope", [{}])):
    ctx.start_batch([SimpleNamespace(request_id="r%d" % i, headers=[]) for i in range(len(bodies))], op)
    rows = [dict(body=b, q="1") for b in bodies]
    for i, out in enumerate(handler.handle(rows, ctx)):
        print(ctx.get_response_status(i)[0], out.get("outputs", out.get("type")) if isinstance(out, dict) else out)
print([m["value"] for m in ctx.metrics.drain()])
"""


def test_the_style_runs_on_python_3_8(tmp_path: Path) -> None:
    """The worker SDK runs in model environments as old as Python 3.8: load and serve there."""
    python = _old_python()
    if python is None:
        pytest.skip("no Python 3.8 here (set OLD_PYTHON_FOR_WORKER_TESTS to one)")
    copy_runtime(tmp_path / "lib")
    model = tmp_path / "model"
    model.mkdir()
    (model / "scaler.py").write_text(_OLD_MODEL)
    (model / "w.json").write_text('{"scale": 0.5}')
    (model / "labels.txt").write_text("a")
    result = subprocess.run([python, "-c", _OLD_SCRIPT, str(model), str(tmp_path / "lib")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "INFO mserve.v2_model.m: loaded extra=['labels', 'labels.txt']" in result.stderr
    assert result.stdout.splitlines() == [
        "v2-model",
        "200 [5.0, 10.0]",
        "400 InvalidRequest",
        "400 InvalidRequest",
        "500 InternalServerError",
        "501 NotImplemented",
        '201 {"q": "1"}',
        "404 OperationNotFound",
        "[2, 1]",  # set_metric ran in both predict calls, the failed one included
    ]
