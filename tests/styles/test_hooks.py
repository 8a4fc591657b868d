"""Hooks + driver style: hooks files archived, served by a real mserve, queried over HTTP.

The seed's own hook examples (tests/handlers/hooks_{logging,multi,partial,skip}) run as written;
hooks_signatures covers every accepted hook signature, hooks_torch the pytorch driver (weights
made here with seed 0, outputs checked against torch), hooks_batch a batch of four. Load-time
misuse is checked in-process against folders written to tmp_path.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from mserve_worker.context import Context
from mserve_worker.contract import HandlerLoadError, LoadedHandler
from mserve_worker.loader import load_handler
from tests.conftest import ARCHIVER_SCRIPT, REPO
from tests.server import conftest as serving
from tests.server.conftest import HANDLERS, concurrently, http

# The real-server fixtures of tests/server, used here too.
make_archive = serving.make_archive
start_server = serving.start_server


def _config(tmp_path: Path, name: str, settings: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def _nulls(count: int) -> dict[str, Any]:
    return {"pipeline": [{"driver": "null"} for _ in range(count)]}


# Served over HTTP.


def test_seed_examples_and_signatures_over_http(make_archive, start_server, tmp_path) -> None:
    make_archive("hooks_logging", "hooks", "logging")
    make_archive("hooks_multi", "hooks", "multi", "-c", _config(tmp_path, "two", _nulls(2)))
    make_archive("hooks_partial", "hooks", "partial", "-c", _config(tmp_path, "two", _nulls(2)))
    make_archive("hooks_skip", "hooks", "skip", "-c", _config(tmp_path, "two", _nulls(2)))
    signatures = {
        "pipeline": [
            {"driver": "null", "options": {"threshold": 0.5}},
            {"driver": "null", "model_path": "any2", "options": {"labels": "a,b"}},
            {},
            {"driver": "NULL"},
            {"driver": "null"},
        ]
    }
    make_archive(
        "hooks_signatures", "hooks", "signatures", "-c", _config(tmp_path, "sig", signatures)
    )
    make_archive("hooks_logging", "hooks", "unknown", "-c", _config(tmp_path, "tf", {"driver": "tensorflow"}))  # fmt: skip
    names = ("logging", "multi", "partial", "skip", "signatures")
    server = start_server(*(f"{n}={n}.mar" for n in names))

    inputs = {"image": [[0.5, 1.0], [2.0, 3.5]], "label": "cat", "k": 3}
    for name in ("logging", "multi", "partial"):
        wrapped = server.predict(name, {"inputs": inputs})
        assert wrapped.status == 200, (name, wrapped.body)
        assert wrapped.headers["Content-Type"] == "application/json"
        assert wrapped.json() == inputs
        assert server.predict(name, inputs).json() == inputs  # the plain top-level form

    faces = server.predict("skip", {"face-boxes": [[1, 2, 3, 4]], "image": [1, 2]})
    assert faces.json() == {"face-boxes": [[1, 2, 3, 4]], "image": [1, 2]}
    no_faces = server.predict("skip", {"face-boxes": [], "image": [1, 2]})
    assert no_faces.status == 200 and no_faces.json() == {}

    reply = server.predict("signatures", {"inputs": {"x": [1, 2]}})
    assert reply.status == 200, reply.body
    report = reply.json()
    assert report["x"] == [1, 2]
    assert report["trace"] == [
        "pre0(inputs)",
        "post0(outputs, ctx, **['driver'])",
        "pre1(inputs, ctx)",
        "post1(outputs, **['driver'])",
        "pre2(inputs, **['driver'])",
        "pre3(inputs, ctx, **['driver'])",
        "post3(outputs, ctx)",
        "pre4(inputs, ctx, driver=NullDriver)",
        "post4(outputs)",
    ]
    assert report["order"] == ["post0", "pre1", "pre3", "post3", "pre4"]  # one ctx throughout
    assert report["request_id"] == reply.headers["X-Request-Id"]
    model_dir = Path(report["params"]["model_paths"][1]).parent
    assert report["params"] == {
        "labels": "a,b",
        "threshold": 0.5,
        "model_path": None,
        "model_paths": [None, str(model_dir / "any2"), None, None, None],
    }
    assert report["model_dir_set"]

    for body, headers, fragment in [
        (b"not json", {"Content-Type": "text/plain"}, "request body is not JSON"),
        (b"[1, 2]", {"Content-Type": "application/json"}, "request body is a JSON array"),
        (b'{"x": [[1, 2], [3]]}', {"Content-Type": "application/json"}, "input 'x' is not a rectangular array"),
        (b'{"inputs": {"x": 1}, "y": 2}', {"Content-Type": "application/json"}, "request body has 'y' next to 'inputs'"),
    ]:  # fmt: skip
        bad = server.predict("logging", body, headers=headers)
        assert bad.status == 400, body
        assert bad.json()["type"] == "InvalidInput"
        assert fragment in bad.json()["message"]
    # curl -d sends a form content type; a JSON body still works
    form = server.predict("logging", b'{"a": [1]}', headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert form.json() == {"a": [1]}

    explain = http("POST", server.url("inference", "/explanations/logging"), b"{}",
                   {"Content-Type": "application/json"})  # fmt: skip
    assert explain.status == 404
    assert "serves only predictions, not 'explain'" in explain.json()["message"]

    unknown = server.manage("POST", "/models?url=unknown.mar")
    assert unknown.status == 400
    assert "unknown driver 'tensorflow'; known drivers: null, pytorch" in unknown.json()["message"]


@pytest.fixture
def torch_models(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Seed-0 TinyNet / TwoInputs saved three ways: state dict, TorchScript, whole module."""
    sys.path.insert(0, str(HANDLERS / "hooks_torch"))
    try:
        import tinynet

        torch.manual_seed(0)
        tiny = tinynet.TinyNet().eval()
        two = tinynet.TwoInputs().eval()
        torch.save(tiny.state_dict(), tmp_path / "tiny_state.pt")
        with warnings.catch_warnings():  # newer torch deprecates scripting; archives still load
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.script(tiny).save(str(tmp_path / "scripted.pt"))
        torch.save(two, tmp_path / "two_module.pt")  # pickles tinynet.TwoInputs by reference
        yield {"tiny": tiny, "two": two}
    finally:
        sys.path.remove(str(HANDLERS / "hooks_torch"))
        sys.modules.pop("tinynet", None)


def test_pytorch_driver_over_http(make_archive, start_server, tmp_path, torch_models) -> None:
    tiny, two = torch_models["tiny"], torch_models["two"]
    state_cfg = {"driver": "pytorch", "options": {"model_class": "tinynet:TinyNet"}}
    make_archive("hooks_torch", "hooks", "state", "--serialized-file", str(tmp_path / "tiny_state.pt"), "-c", _config(tmp_path, "state", state_cfg))  # fmt: skip
    script_cfg = {"pipeline": [{"driver": "pytorch", "model_path": "scripted.pt"}]}
    make_archive("hooks_torch", "hooks", "script", "--extra-files", str(tmp_path / "scripted.pt"), "-c", _config(tmp_path, "script", script_cfg))  # fmt: skip
    make_archive("hooks_torch", "hooks", "module", "--serialized-file", str(tmp_path / "two_module.pt"), "-c", _config(tmp_path, "module", {"driver": "pytorch"}))  # fmt: skip
    example = REPO / "examples" / "hooks"  # archived as its README says
    subprocess.run([sys.executable, str(example / "make_weights.py"), str(tmp_path / "classifier.pt")], check=True, timeout=120)  # fmt: skip
    subprocess.run([ARCHIVER_SCRIPT, "--model-name", "classifier", "--handler", "hooks", "--model-path", str(example), "--serialized-file", str(tmp_path / "classifier.pt"), "-c", str(example / "model-config.yaml"), "--export-path", str(tmp_path / "store"), "--force"], check=True, timeout=120)  # fmt: skip
    server = start_server(
        "state=state.mar", "script=script.mar", "module=module.mar", "classifier=classifier.mar"
    )

    x = [[0.1, -0.2, 0.3, 0.4], [1.0, 2.0, -3.0, 0.5]]
    with torch.inference_mode():
        expected = tiny(torch.tensor(x)).tolist()
        linear, picked = two(torch.tensor(x), torch.tensor([0, 2]))
    for name, model_class in (("state", "TinyNet"), ("script", "RecursiveScriptModule")):
        reply = server.predict(name, {"inputs": {"x": x}})
        assert reply.status == 200, (name, reply.body)
        out = reply.json()
        assert set(out) == {"output", "hook_kwargs", "model_class", "training", "same_model"}
        assert torch.allclose(torch.tensor(out["output"]), torch.tensor(expected), atol=1e-6)
        assert out["hook_kwargs"] == ["driver", "model", "model_class"]
        assert out["model_class"] == model_class
        assert out["training"] is False and out["same_model"] is True

    reply = server.predict("module", {"x": x, "index": [0, 2]})  # two inputs, by name
    assert reply.status == 200, reply.body
    out = reply.json()
    assert out["model_class"] == "TwoInputs"
    assert torch.allclose(torch.tensor(out["output_0"]), linear, atol=1e-6)
    assert torch.allclose(torch.tensor(out["output_1"]), picked, atol=1e-6)

    skipped = server.predict("state", {"x": x, "skip": 1}).json()  # ml-serving-ignore
    assert skipped["x"] == x and "output" not in skipped and "ml-serving-ignore" not in skipped

    wrong = server.predict("state", {"x": [[1.0, 2.0]]})  # 2 features for a Linear(4, 3)
    assert wrong.status == 500
    assert wrong.json()["type"] == "DriverError"
    assert wrong.json()["message"].startswith("pytorch driver failed: RuntimeError")
    assert server.predict("state", {"x": x}).status == 200  # the worker carries on

    flowers = server.predict("classifier", {"inputs": {"features": [[5.1, 3.5, 1.4, 0.2]] * 2}})
    assert flowers.status == 200, flowers.body
    out = flowers.json()
    assert out["samples"] == 2 and len(out["labels"]) == 2
    assert set(out["labels"]) <= {"setosa", "versicolor", "virginica"}
    assert abs(sum(out["probabilities"][0]) - 1) < 1e-3


def test_batch_of_four_answers_each_request(make_archive, start_server, tmp_path) -> None:
    config = _config(
        tmp_path, "batch", {"batchSize": 4, "maxBatchDelay": 1000, "batchWait": "fill"}
    )
    make_archive("hooks_batch", "hooks", "batch", "-c", config)
    server = start_server("batch=batch.mar")
    bodies = [{"x": [1, 2]}, {"fail": [7]}, "not json at all", {"inputs": {"x": [[3]]}}]
    good_first, failed, not_json, good_last = concurrently(
        *(partial(server.predict, "batch", b) for b in bodies)
    )

    for reply, x, doubled in ((good_first, [1, 2], [2, 4]), (good_last, [[3]], [[6]])):
        assert reply.status == 200, reply.body
        out = reply.json()
        assert out["x"] == x and out["doubled"] == doubled  # each caller gets its own
        assert out["batch_count"] == 4  # all four were one batch
        assert out["request_id"] == reply.headers["X-Request-Id"]
    assert failed.status == 500
    assert failed.json() == {
        "code": 500,
        "type": "HookError",
        "message": "preprocess hook 'preprocess' raised ValueError: asked to fail: [7]",
    }
    assert not_json.status == 400 and not_json.json()["type"] == "InvalidInput"
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "ValueError: asked to fail" in log  # the hook's traceback reaches the model's log


# Load-time misuse, in-process.


@pytest.fixture
def load(tmp_path: Path) -> Iterator[Any]:
    """Write a hooks module (unique name) into a model folder and load it as the worker does."""
    added: list[str] = []
    folder = tmp_path / "model"
    folder.mkdir()

    def run(source: str, config: dict[str, Any] | None = None, style: str | None = None,
            serialized: str | None = None) -> LoadedHandler:  # fmt: skip
        name = f"hooks_{uuid.uuid4().hex[:8]}"
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
        added.append(name)
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        model = {"modelName": "m", "handler": name}
        if serialized:
            model["serializedFile"] = serialized
        context = Context("m", str(folder), {"model": model}, 1, None, "mserve", "0",
                          model_yaml_config=config)  # fmt: skip
        return load_handler(name, str(folder), context, style)

    run.folder = folder  # type: ignore[attr-defined]
    yield run
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    for name in [*added, "net"]:
        sys.modules.pop(name, None)


HOOK = "def preprocess(inputs):\n    return inputs\n"
NET = """
import torch
class Net(torch.nn.Linear):
    def __init__(self):
        super().__init__(2, 1)
class NotAModule:
    pass
"""


@pytest.mark.parametrize(
    ("source", "config", "message"),
    [
        (HOOK, {"driver": "onnx"}, "driver: unknown driver 'onnx'; known drivers: null, pytorch"),
        (HOOK, {"pipeline": [{}, {"driver": "openvino"}]}, "pipeline[1] (openvino driver): unknown driver 'openvino'"),
        (HOOK, {"pipeline": {"driver": "null"}}, "model config key 'pipeline' must be a non-empty list of stages"),
        (HOOK, {"pipeline": []}, "model config key 'pipeline' must be a non-empty list"),
        (HOOK, {"pipeline": ["null"]}, "model config key 'pipeline[0]' must be a mapping"),
        (HOOK, {"pipeline": [{"drivr": "null"}]}, "model config key 'pipeline[0].drivr' is not a stage setting; a stage has driver, model_path, options"),
        (HOOK, {"pipeline": [{}], "driver": "null"}, "model config sets both 'pipeline' and 'driver'"),
        (HOOK, {"drivers": "pytorch"}, "model config key 'drivers' is not a hooks-style setting; did you mean 'driver'?"),
        (HOOK, {"pipline": [{}]}, "did you mean 'pipeline'?"),
        (HOOK, {"driver": 3}, "model config key 'driver' must be a driver name, found 3"),
        (HOOK, {"model_path": ["a"]}, "model config key 'model_path' must be a file path"),
        (HOOK, {"options": "model_class=x:Y"}, "model config key 'options' must be a mapping"),
        (HOOK, {"options": {"model_dir": "/x"}}, "model config key 'options.model_dir': the server sets 'model_dir'"),
        ("preprocess = [lambda i: i, None]\n", None, "preprocess in 'hooks_"),
        ("preprocess = [lambda i: i, None]\n", None, "is a list of 2 hooks, but the model config gives 1 pipeline stage; give one entry per stage (None where a stage has no preprocess)"),
        ("postprocess = [lambda o: o, 'x']\n", _nulls(2), "postprocess[1] in 'hooks_"),
        ("postprocess = [lambda o: o, 'x']\n", _nulls(2), "is a str, not a function or None"),
        (HOOK + "postprocess = 'x'\n", None, "postprocess in 'hooks_"),
        (HOOK + "postprocess = 'x'\n", None, "is a str; it must be a function, a list of functions (None for no hook), or None"),
        ("def preprocess():\n    return {}\n", None, "preprocess hook 'preprocess' takes no inputs argument: it is preprocess(); accepted: (inputs), (inputs, ctx), (inputs, **kwargs) or (inputs, ctx, **kwargs)"),
        ("def postprocess(outputs, ctx, extra):\n    return outputs\n", None, "postprocess hook 'postprocess' is postprocess(outputs, ctx, extra): nothing to pass to extra; accepted:"),
        (HOOK + "init_hook = 3\n", None, "init_hook in 'hooks_"),
        (HOOK + "init_hook = 3\n", None, "is a int, not a function"),
        ("def init_hook(labels):\n    pass\n", None, "init_hook(labels) cannot be called with the model's params (model_dir, model_path, model_paths)"),
        ("VALUE = 1\n", None, "is served in the hooks style but defines none of init_hook, preprocess, postprocess"),
    ],
)  # fmt: skip
def test_load_errors_name_what_is_wrong(load, source, config, message) -> None:
    style = "hooks" if "VALUE" in source else None
    with pytest.raises(HandlerLoadError) as caught:
        load(source, config, style)
    assert message in str(caught.value)


def test_pytorch_driver_load_errors(load) -> None:
    (load.folder / "net.py").write_text(textwrap.dedent(NET))
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(2, 1).state_dict(), load.folder / "state.pt")
    torch.save(torch.nn.Linear(3, 1).state_dict(), load.folder / "other.pt")
    torch.save(torch.nn.Linear(2, 1), load.folder / "module.pt")

    def error(config: dict[str, Any], serialized: str | None = None) -> str:
        with pytest.raises(HandlerLoadError) as caught:
            load(HOOK, config, serialized=serialized)
        return str(caught.value)

    pytorch = {"driver": "pytorch"}
    assert "pytorch driver needs a weights file: set 'model_path' in the model config or archive the model with --serialized-file" in error(pytorch)  # fmt: skip
    missing = error({**pytorch, "model_path": "missing.pt"})
    assert "pytorch driver: model_path" in missing and "missing.pt' is not a file; " in missing
    assert "state.pt" in missing  # what the folder does have
    assert "holds a state dict; set option 'model_class'" in error(pytorch, "state.pt")
    with_class = {**pytorch, "model_path": "state.pt"}
    assert "option 'model_class' 'nowhere:Net': module 'nowhere' not found" in error({**with_class, "options": {"model_class": "nowhere:Net"}})  # fmt: skip
    assert "module 'net' has no 'Missing'" in error({**with_class, "options": {"model_class": "net:Missing"}})  # fmt: skip
    assert "is not a torch.nn.Module subclass" in error({**with_class, "options": {"model_class": "net.NotAModule"}})  # fmt: skip
    assert "the state dict in" in error({**pytorch, "model_path": "other.pt", "options": {"model_class": "net:Net"}})  # fmt: skip
    assert "is not a plain state dict" in error({**pytorch, "model_path": "module.pt", "options": {"model_class": "net:Net"}})  # fmt: skip
    loaded = load(HOOK, {**with_class, "options": {"model_class": "net.Net"}})  # dotted form works
    assert loaded.style == "hooks"
    assert type(loaded.instance.stages[0].driver.model).__name__ == "Net"


def test_wrapped_hooks_get_what_their_wrapper_forwards(load) -> None:
    source = """
    import functools

    def plain(func):
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper

    def wraps(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper

    @plain
    def first(inputs):
        return {**inputs, "first": "inputs alone"}

    @wraps
    def second(inputs, ctx, driver):
        return {**inputs, "second": [ctx.request_id, type(driver).__name__]}

    preprocess = [first, second]
    """
    handler = load(source, _nulls(2))
    context = Context("m", str(load.folder), {"model": {}}, 1, None, "mserve", "0")
    context.start_batch([SimpleNamespace(request_id="r-1", headers=[["X-A", "1"]])])
    [out] = handler.handle([{"body": {"x": [1]}}], context)
    assert out == {"x": [1], "first": "inputs alone", "second": ["r-1", "NullDriver"]}


def test_detection_ignores_an_imported_preprocess(load) -> None:
    source = "from json import loads as preprocess\n"
    with pytest.raises(HandlerLoadError) as caught:
        load(source)
    assert "fits no handler style" in str(caught.value)
    assert load(source, style="hooks").style == "hooks"  # naming the style forces it
    assert load("def init_hook(**params):\n    pass\n").style == "hooks"
