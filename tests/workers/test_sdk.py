"""The handler SDK that runs inside a worker: Context, Metrics, payload codec, handler loader.

Handlers load from real model folders: the fixtures in tests/handlers/ and folders written to
tmp_path. Module names repeat across tests ("handler", "echo"), so the ``load`` fixture removes
what each test imported from its model folders and restores sys.path afterwards; the checks that
need a clean interpreter (relative imports, the oldest supported Python) run in a subprocess.
"""

from __future__ import annotations

import ast
import email.policy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from email.mime.application import MIMEApplication
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mserve_worker import context as context_module
from mserve_worker import contract as contract_module
from mserve_worker import loader as loader_module
from mserve_worker import payload as payload_module
from mserve_worker import runtime as runtime_module
from mserve_worker import service as service_module
from mserve_worker.context import Context, Metrics
from mserve_worker.contract import HandlerLoadError, LoadedHandler
from mserve_worker.loader import load_handler
from mserve_worker.payload import PayloadError, decode_request, encode_output
from server.model_envs import copy_runtime

HANDLERS = Path(__file__).resolve().parent.parent / "handlers"
WORKERS = Path(context_module.__file__).resolve().parent


def make_context(model_dir: str | Path = "/models/m", **overrides: Any) -> Context:
    values: dict[str, Any] = {
        "model_name": "m",
        "model_dir": str(model_dir),
        "manifest": {"model": {"modelName": "m", "handler": "h:handle"}},
        "batch_size": 4,
        "gpu_id": None,
        "server_name": "mserve",
        "server_version": "0.1.0",
    }
    values.update(overrides)
    return Context(**values)


def request(request_id: str, headers: list[list[str]] | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, headers=headers or [])


# Loading handlers: isolation.

Loader = Callable[..., LoadedHandler]


@pytest.fixture
def load(tmp_path: Path) -> Iterator[Loader]:
    """``load(handler, model_dir)``: model_dir first on sys.path (as the runtime does), then load.

    Afterwards, modules imported from the model folders are forgotten and sys.path is restored.
    """
    saved_path = list(sys.path)
    before = set(sys.modules)
    folders: list[Path] = []

    def run(handler: str, model_dir: Path, context: Context | None = None) -> LoadedHandler:
        folders.append(model_dir)
        sys.path.insert(0, str(model_dir))
        return load_handler(handler, str(model_dir), context or make_context(model_dir))

    yield run
    sys.path[:] = saved_path
    roots = [str(f.resolve()) for f in folders] + [str(tmp_path.resolve())]
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if any(os.path.realpath(where).startswith(root + os.sep) for root in roots):
            del sys.modules[name]


def write_model(folder: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return folder


# Entry forms.


@pytest.mark.parametrize("handler", ["echo:handle", "echo", "echo.py", "src/echo.py"])
def test_module_function_is_called_once_with_none_at_load(load: Loader, handler: str) -> None:
    ctx = make_context(HANDLERS / "echo_fn", model_name="echo-model")
    loaded = load(handler, HANDLERS / "echo_fn", ctx)
    echo = sys.modules["echo"]

    assert loaded.style == "module-function"
    assert echo.CALLS == [("init", "echo-model")]
    assert loaded.handle([{"body": b"a"}, {"body": "b"}], ctx) == [b"a", "b"]
    assert echo.CALLS == [("init", "echo-model"), ("batch", 2)]


def test_named_function_other_than_handle(load: Loader) -> None:
    ctx = make_context(HANDLERS / "echo_fn", model_name="shouty")
    loaded = load("echo:shout", HANDLERS / "echo_fn", ctx)
    assert loaded.style == "module-function"
    assert sys.modules["echo"].CALLS == [("shout-init", "shouty")]
    assert loaded.handle([{"body": "hi"}], ctx) == ["HI"]


def test_empty_batch_does_not_reach_the_handler(load: Loader) -> None:
    ctx = make_context(HANDLERS / "echo_fn")
    loaded = load("echo", HANDLERS / "echo_fn", ctx)
    assert loaded.handle([], ctx) == []
    assert sys.modules["echo"].CALLS == [("init", "m")]


@pytest.mark.parametrize(
    "handler",
    # the last: TorchServe's fallback from a function the module lacks to its one class
    ["cls_handler", "cls_handler:UpperHandler", "cls_handler.py:handle"],
)
def test_handler_class_is_created_and_initialised_once(load: Loader, handler: str) -> None:
    ctx = make_context(HANDLERS / "cls_handler", model_name="upper")
    loaded = load(handler, HANDLERS / "cls_handler", ctx)
    module = sys.modules["cls_handler"]

    assert loaded.style == "handler-class"
    assert isinstance(loaded.instance, module.UpperHandler)
    assert loaded.instance.initialize_calls == 1
    assert loaded.instance.context is ctx
    assert module.EVENTS == ["created", ("initialize", "upper")]
    assert loaded.handle([{"body": "x"}, {"body": "y"}], ctx) == ["X", "Y"]
    loaded.shutdown()
    assert module.EVENTS[-1] == "shutdown"


def test_dotted_module_class(load: Loader) -> None:
    ctx = make_context(HANDLERS / "pkg_handler", model_name="pkg")
    loaded = load("mypkg.service:Service", HANDLERS / "pkg_handler", ctx)
    assert loaded.style == "handler-class"
    assert loaded.instance.initialized_with == [ctx]
    assert loaded.handle([{}, {}], ctx) == [
        {"index": 0, "model": "pkg"},
        {"index": 1, "model": "pkg"},
    ]
    loaded.shutdown()
    assert loaded.instance.stopped


def test_instance_with_handle_method(load: Loader) -> None:
    ctx = make_context(HANDLERS / "pkg_handler")
    loaded = load("mypkg.service:service", HANDLERS / "pkg_handler", ctx)
    assert loaded.style == "class-instance"
    assert loaded.instance is sys.modules["mypkg.service"].service
    assert loaded.instance.initialized_with == [ctx]
    assert loaded.handle([{}], ctx) == [{"index": 0, "model": "m"}]


def test_plain_callable_instance_gets_the_init_call(load: Loader) -> None:
    ctx = make_context(HANDLERS / "pkg_handler")
    loaded = load("mypkg.service:plain_callable", HANDLERS / "pkg_handler", ctx)
    assert loaded.style == "class-instance"
    assert loaded.handle([{"body": "ab"}], ctx) == ["abab"]
    assert loaded.instance.calls == [None, [{"body": "ab"}]]
    loaded.shutdown()  # no shutdown method: nothing to do


def test_mms_service_module_uses_its_handle_function(load: Loader) -> None:
    ctx = make_context(HANDLERS / "mms_service", batch_size=2)
    loaded = load("model_handler", HANDLERS / "mms_service", ctx)
    module = sys.modules["model_handler"]
    assert loaded.style == "module-function"
    assert module.LOG == ["initialize"]
    assert module._service.batch_size == 2
    assert loaded.handle([{}, {}], ctx) == ["OK", "OK"]


def test_handler_returning_none_is_passed_through(load: Loader, tmp_path: Path) -> None:
    model = write_model(tmp_path, {"quiet.py": "def handle(data, context):\n    return None\n"})
    ctx = make_context(model)
    assert load("quiet", model, ctx).handle([{"body": b""}], ctx) is None


def test_module_package_with_init(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path,
        {
            "pkgh/__init__.py": "def handle(data, context):\n    return data and ['pkg'] * len(data)\n"
        },
    )
    ctx = make_context(model)
    loaded = load("pkgh", model, ctx)
    assert loaded.style == "module-function"
    assert loaded.handle([{}], ctx) == ["pkg"]


# Loading handlers: what the user is told.


def test_several_handler_classes_are_named(load: Loader) -> None:
    with pytest.raises(HandlerLoadError) as caught:
        load("multi", HANDLERS / "multi_cls")
    assert str(caught.value) == (
        "module 'multi' defines 2 handler classes (FirstHandler, SecondHandler); "
        "name the one to use in the handler, e.g. 'multi:FirstHandler'"
    )


def test_no_fallback_class_among_several(load: Loader) -> None:
    with pytest.raises(HandlerLoadError) as caught:
        load("multi.py:handle", HANDLERS / "multi_cls")
    assert str(caught.value) == (
        "module 'multi' has no attribute 'handle', and no single handler class to use in its "
        "place; it defines 2 handler classes (FirstHandler, SecondHandler); name one, e.g. "
        "'multi:FirstHandler'"
    )


def test_import_error_inside_the_handler_surfaces_as_itself(load: Loader) -> None:
    with pytest.raises(ModuleNotFoundError) as caught:
        load("broken", HANDLERS / "bad_import")
    assert caught.value.name == "mserve_test_missing_dependency"
    assert "No module named 'mserve_test_missing_dependency'" in str(caught.value)
    frames = [Path(entry.path).name for entry in caught.traceback]
    assert "broken.py" in frames


def test_missing_handler_module_lists_the_python_files(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path,
        {"handler.py": "", "model.py": "", "lib/__init__.py": "", "notes.txt": "x"},
    )
    with pytest.raises(HandlerLoadError) as caught:
        load("hanlder:handle", model)
    assert str(caught.value) == (
        f"handler module 'hanlder' not found in {model}; it has: handler.py, model.py, lib/"
    )


def test_missing_module_in_an_empty_folder(load: Loader, tmp_path: Path) -> None:
    with pytest.raises(HandlerLoadError, match=r"not found in .*; it has: no \.py files$"):
        load("nothere", tmp_path)


def test_missing_submodule_of_a_model_package(load: Loader, tmp_path: Path) -> None:
    model = write_model(tmp_path, {"lib/__init__.py": "", "lib/other.py": ""})
    with pytest.raises(HandlerLoadError, match=r"^handler module 'lib\.nope' not found in"):
        load("lib.nope:H", model)


def test_missing_attribute_lists_what_the_module_defines(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path,
        {
            "h.py": """
                import os
                from json import dumps

                def handle(data, context):
                    return data

                def _private():
                    pass

                class Net:
                    pass
            """
        },
    )
    with pytest.raises(HandlerLoadError) as caught:
        load("h:fn", model)
    assert str(caught.value) == (
        "module 'h' has no attribute 'fn', and no single handler class to use in its place; "
        "it defines: handle, Net"
    )


def test_not_callable_entry_point(load: Loader) -> None:
    with pytest.raises(HandlerLoadError) as caught:
        load("mypkg.service:NOT_CALLABLE", HANDLERS / "pkg_handler")
    assert str(caught.value) == (
        "handler 'mypkg.service:NOT_CALLABLE' is a int, not a function, a class or an object "
        "with a handle method"
    )


def test_module_without_entry_point(load: Loader, tmp_path: Path) -> None:
    model = write_model(tmp_path, {"h.py": "class Net:\n    pass\n\ndef predict(x):\n    pass\n"})
    with pytest.raises(HandlerLoadError) as caught:
        load("h", model)
    message = str(caught.value)
    assert message.startswith(
        "module 'h' fits no handler style: it has no handle(data, context) function and no "
        "class or hooks a style needs; it defines: Net, predict. Each style needs: "
    )
    for style in ("module-function:", "handler-class:", "kernel:", "v2-model:", "hooks:"):
        assert style in message


def test_class_without_handle_method(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path, {"h.py": "class Half:\n    def initialize(self, ctx):\n        pass\n"}
    )
    with pytest.raises(HandlerLoadError) as caught:
        load("h", model)
    assert str(caught.value).startswith(
        "handler class 'h:Half' has no handle(data, context) method. Each style needs: "
    )


def test_class_that_needs_constructor_arguments(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path,
        {
            "h.py": """
                class H:
                    def __init__(self, path):
                        self.path = path

                    def handle(self, data, context):
                        return data
            """
        },
    )
    with pytest.raises(HandlerLoadError) as caught:
        load("h:H", model)
    assert (
        str(caught.value)
        == "handler class 'h:H' cannot be created without arguments: __init__(path)"
    )


def test_model_shipping_our_package_name_is_refused(load: Loader, tmp_path: Path) -> None:
    files = {"h.py": "def handle(d, c):\n    return d\n", "mserve_worker/__init__.py": ""}
    model = write_model(tmp_path, files)
    with pytest.raises(HandlerLoadError) as caught:
        load("h", model)
    assert str(caught.value) == (
        "model ships a top-level module 'mserve_worker' that clashes with mserve's own package "
        f"of that name; rename it (found in {model})"
    )
    assert "h" not in sys.modules  # refused before importing anything


def test_data_folder_named_server_is_not_a_clash(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path, {"h.py": "def handle(d, c):\n    return d\n", "server/weights.bin": ""}
    )
    assert load("h", model).style == "module-function"


def test_handler_named_like_an_imported_module(load: Loader, tmp_path: Path) -> None:
    model = write_model(tmp_path, {"json.py": "def handle(d, c):\n    return d\n"})
    with pytest.raises(HandlerLoadError) as caught:
        load("json", model)
    assert str(caught.value) == (
        f"handler module 'json' in {model} has the name of a module the worker has already "
        f"imported ({json.__file__}), so Python would use that one; rename the handler file"
    )


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        ("", "the manifest names no handler; expected module, module:function or pkg.module:Class"),
        (
            "a:b:c",
            "handler 'a:b:c' has more than one ':'; expected module, module:function or pkg.module:Class",
        ),
        (
            "my-handler",
            "handler 'my-handler': 'my-handler' is not a Python module name; expected module, module:function or pkg.module:Class",
        ),
        (
            "h:",
            "handler 'h:': '' after ':' is not a Python name; expected module, module:function or pkg.module:Class",
        ),
    ],
)
def test_malformed_handler_strings(
    load: Loader, tmp_path: Path, handler: str, message: str
) -> None:
    with pytest.raises(HandlerLoadError) as caught:
        load(handler, tmp_path)
    assert str(caught.value) == message


def test_errors_raised_while_initialising_propagate(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path,
        {
            "h.py": """
                class H:
                    def initialize(self, context):
                        raise RuntimeError("Missing the model.pt file")

                    def handle(self, data, context):
                        return data
            """
        },
    )
    with pytest.raises(RuntimeError, match=r"^Missing the model\.pt file$"):
        load("h", model)


def test_loaded_package_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """The child-side modules work as a plain folder on sys.path: relative imports, no server."""
    args = _copy_workers_and_script(tmp_path)
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["module-function", "[b'x']", "no server, no archiver"]


def _old_python() -> str | None:
    """The oldest Python a model environment may use, when this machine has it."""
    for candidate in (os.environ.get("OLD_PYTHON_FOR_WORKER_TESTS"), shutil.which("python3.8")):
        if not candidate:
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 8))"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    return None


def test_sdk_runs_on_python_3_8(tmp_path: Path) -> None:
    python = _old_python()
    if python is None:
        pytest.skip("no Python 3.8 here (set OLD_PYTHON_FOR_WORKER_TESTS to one)")
    args = _copy_workers_and_script(tmp_path)
    result = subprocess.run([python, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["module-function", "[b'x']", "no server, no archiver"]


# Run by a bare interpreter with the three modules copied into a plain folder: every public
# entry point once, so that the oldest supported Python executes all the code paths it parses.
_SMOKE = r"""
import sys

model, lib = sys.argv[1], sys.argv[2]
sys.path[:0] = [model, lib]
from renamed_worker.context import Context
from renamed_worker.loader import load_handler
from renamed_worker.payload import PayloadError, decode_request, encode_output

class Req:
    def __init__(self, request_id, headers):
        self.request_id, self.headers = request_id, headers

ctx = Context("m", model, {}, 2, None, "mserve", "0")
loaded = load_handler("h:handle", model, ctx)
print(loaded.style)
ctx.start_batch([Req("a", [["X-Id", "7"]]), Req("b", [])])
ctx.set_response_status(201, "made", idx=1)
ctx.set_response_content_type(0, "text/csv")
ctx.metrics.add_time("t", 1.5, idx=1)
assert ctx.get_request_header(0, "x-id") == "7"
assert ctx.get_response_status(1) == (201, "made")
assert ctx.get_response_content_type(0) == "text/csv"
assert ctx.metrics.drain()[0]["request_id"] == "b"
form = (
    b"--B\r\nContent-Disposition: form-data; name=\"f\"; filename=\"x\"\r\n\r\n\x00\r\n"
    b"--B\r\nContent-Disposition: form-data; name=\"t\"\r\n\r\nhi\r\n--B--\r\n"
)
batch = [
    decode_request("", [], memoryview(b"x"), {}),
    decode_request("multipart/form-data; boundary=B", [], form, {"q": "1"}),
]
assert batch[1] == {"f": b"\x00", "t": b"hi", "q": "1"}, batch[1]
assert decode_request("application/x-www-form-urlencoded", [], b"a=1", {}) == {"a": b"1", "body": b"a=1"}
assert decode_request("text/plain; charset=latin-1", [], b"\xe9", {}) == {"body": "\xe9"}
print(loaded.handle(batch[:1], ctx))
assert encode_output({"a": [1]}) == (b'{"a":[1]}', "application/json")
try:
    decode_request("application/json", [], b"{", {})
except PayloadError:
    pass
else:
    raise AssertionError("no PayloadError")
assert "server" not in sys.modules and "archiver" not in sys.modules
print("no server, no archiver")
"""


def _copy_workers_and_script(tmp_path: Path) -> list[str]:
    """Arguments (after the interpreter) that run the smoke script against copied modules."""
    copy_runtime(tmp_path / "runtime")  # renamed below: relative imports must not care
    shutil.copytree(tmp_path / "runtime" / "mserve_worker", tmp_path / "lib" / "renamed_worker")
    model = write_model(
        tmp_path / "model",
        {"h.py": "def handle(data, context):\n    return data and [r['body'] for r in data]\n"},
    )
    script = tmp_path / "smoke.py"
    script.write_text(_SMOKE)
    return ["-I", str(script), str(model), str(tmp_path / "lib")]


def _import_time_modules(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Absolute imports run at import time: module level and inside top-level if/try blocks,
    not inside functions or classes (where handlers import torch, numpy, Pillow lazily)."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, (ast.If, ast.Try, ast.ExceptHandler)):
            pending.extend(ast.iter_child_nodes(node))  # type: ignore[arg-type]


def test_child_modules_import_only_the_standard_library() -> None:
    sdk_modules = sorted((WORKERS / "sdk").glob("*.py"))
    assert {"base_handler.py", "image_classifier.py", "text_classifier.py"} <= {
        p.name for p in sdk_modules
    }
    others = [
        Path(m.__file__)  # type: ignore[arg-type]
        for m in (context_module, payload_module, loader_module, contract_module, service_module,
                  runtime_module)
    ]  # fmt: skip
    for path in sdk_modules + others:
        for lineno, name in _import_time_modules(ast.parse(path.read_text())):
            top = name.split(".")[0]
            assert top == "__future__" or top in sys.stdlib_module_names, (
                f"{path.name}:{lineno} imports {name}"
            )


# Context.


def test_context_model_facts() -> None:
    manifest = {"model": {"modelName": "m", "serializedFile": "w.pt"}}
    ctx = make_context(
        "/models/m", manifest=manifest, gpu_id=1, model_yaml_config={"handler": {"topk": 3}}
    )
    assert ctx.model_name == "m"
    assert ctx.manifest is manifest
    assert ctx.system_properties == {
        "model_dir": "/models/m",
        "gpu_id": 1,
        "batch_size": 4,
        "server_name": "mserve",
        "server_version": "0.1.0",
        "limit_max_image_pixels": True,
    }
    assert ctx.model_yaml_config == {"handler": {"topk": 3}}
    assert make_context().model_yaml_config == {}
    assert isinstance(make_context().metrics, Metrics)
    assert ctx.request_ids == {}


def test_request_ids_and_headers() -> None:
    ctx = make_context()
    ctx.start_batch(
        [
            request(
                "r-0", [["Content-Type", "application/json"], ["X-Trace", "a"], ["x-trace", "b"]]
            ),
            request("r-1", [["Accept", "text/plain"]]),
        ]
    )
    assert ctx.request_ids == {0: "r-0", 1: "r-1"}
    assert ctx.get_request_id() == "r-0"
    assert ctx.get_request_id(1) == "r-1"
    assert ctx.get_request_header(0, "content-type") == "application/json"
    assert ctx.get_request_header(0, "CONTENT-TYPE") == "application/json"
    assert ctx.get_request_header(0, "X-TRACE") == "a, b"
    assert ctx.get_request_header(1, "content-type") is None
    assert ctx.get_all_request_header(0) == {"Content-Type": "application/json", "X-Trace": "a, b"}
    assert ctx.get_all_request_header(1) == {"Accept": "text/plain"}
    assert ctx.request_processor[1].get_request_property("accept") == "text/plain"


def test_response_settings_per_request_and_reset_by_start_batch() -> None:
    ctx = make_context()
    ctx.start_batch([request("a"), request("b")])
    assert ctx.get_response_status(0) == (200, "")

    ctx.set_response_status(404, "no such user", idx=1)
    ctx.set_response_header(1, "X-Reason", "lookup")
    ctx.set_response_header(1, "x-reason", "lookup again")
    ctx.set_response_content_type(0, "image/png")
    ctx.set_response_header(1, "Content-Type", "text/csv")

    assert ctx.get_response_status(0) == (200, "")
    assert ctx.get_response_status(1) == (404, "no such user")
    assert ctx.get_response_headers(0) == {}
    assert ctx.get_response_headers(1) == {"x-reason": "lookup again"}
    assert ctx.get_response_content_type(0) == "image/png"
    assert ctx.get_response_content_type(1) == "text/csv"

    ctx.set_all_response_status(503, "busy")
    assert [ctx.get_response_status(i) for i in range(2)] == [(503, "busy"), (503, "busy")]

    ctx.start_batch([request("c"), request("d"), request("e")])
    for i in range(3):
        assert ctx.get_response_status(i) == (200, "")
        assert ctx.get_response_headers(i) == {}
        assert ctx.get_response_content_type(i) is None
    assert ctx.request_ids == {0: "c", 1: "d", 2: "e"}


def test_bad_status_code() -> None:
    ctx = make_context()
    ctx.start_batch([request("a")])
    with pytest.raises(
        ValueError, match=r"^response status must be an int from 100 to 599, got 42$"
    ):
        ctx.set_response_status(42)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.get_request_id(2),
        lambda c: c.get_request_header(2, "x"),
        lambda c: c.get_all_request_header(-1),
        lambda c: c.set_response_status(500, "", 2),
        lambda c: c.set_response_header(2, "x", "y"),
        lambda c: c.set_response_content_type(2, "text/plain"),
        lambda c: c.get_response_status(2),
        lambda c: c.get_response_headers(2),
        lambda c: c.get_response_content_type(2),
    ],
)
def test_index_out_of_range(call: Callable[[Context], Any]) -> None:
    ctx = make_context()
    ctx.start_batch([request("a"), request("b")])
    with pytest.raises(
        IndexError, match=r"out of range: the current batch has 2 requests \(valid: 0 to 1\)$"
    ):
        call(ctx)


def test_index_before_any_batch() -> None:
    with pytest.raises(IndexError) as caught:
        make_context().get_request_id()
    assert str(caught.value) == "request index 0 is out of range: there is no current batch"


# Metrics.


def test_metrics_record_and_drain() -> None:
    ctx = make_context()
    ctx.start_batch([request("r-0"), request("r-1")])
    m = ctx.metrics
    m.add_time("InferenceTime", 12.5, idx=1)
    m.add_time("Load", 2, unit="s")
    m.add_counter("Hits", 3, idx=0)
    m.add_size("Payload", 1.5, unit="kB")
    m.add_percent("GpuUtil", 87)
    m.add_metric("Tokens", 42, 0, "count", dimensions=[("Lang", "en")])
    entries = m.drain()
    assert entries[0] == {
        "name": "InferenceTime",
        "value": 12.5,
        "unit": "ms",
        "kind": "time",
        "request_id": "r-1",
        "dimensions": [],
    }
    assert [tuple(e.values()) for e in entries[1:]] == [
        ("Load", 2, "s", "time", None, []),
        ("Hits", 3, "count", "counter", "r-0", []),
        ("Payload", 1.5, "kB", "size", None, []),
        ("GpuUtil", 87, "percent", "percent", None, []),
        ("Tokens", 42, "count", "metric", "r-0", [["Lang", "en"]]),
    ]
    assert m.drain() == []
    json.dumps(entries)  # travels to the parent as is


def test_metrics_keep_the_newest_entries() -> None:
    m = Metrics()
    for i in range(1005):
        m.add_counter("c", i)
    entries = m.drain()
    assert len(entries) == 1000
    assert entries[0]["value"] == 5 and entries[-1]["value"] == 1004
    assert m.dropped == 5


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda m: m.add_time("t", 1, unit="min"),
            ValueError,
            "time metric 't': unit must be one of ('ms', 's'), got 'min'",
        ),
        (
            lambda m: m.add_size("s", 1, unit="TB"),
            ValueError,
            "size metric 's': unit must be one of ('MB', 'kB', 'GB', 'B'), got 'TB'",
        ),
        (
            lambda m: m.add_counter("c", "3"),
            TypeError,
            "metric 'c': value must be a number, got str '3'",
        ),
        (
            lambda m: m.add_counter("c", True),
            TypeError,
            "metric 'c': value must be a number, got bool True",
        ),
        (lambda m: m.add_metric("", 1), ValueError, "metric name must be a non-empty str, got ''"),
        (
            lambda m: m.add_counter("c", 1, idx=3),
            IndexError,
            "metric 'c': idx 3 is not a request of this batch (batch has 1 requests)",
        ),
    ],
)
def test_metric_errors(call: Callable[[Metrics], Any], error: type, message: str) -> None:
    ctx = make_context()
    ctx.start_batch([request("only")])
    with pytest.raises(error) as caught:
        call(ctx.metrics)
    assert str(caught.value) == message


# Decoding requests.


def test_json_body_and_query_params() -> None:
    data = decode_request(
        "application/json", [], b'{"text": "hi", "n": [1, 2]}', {"topk": "3", "body": "clash"}
    )
    assert data == {"body": {"text": "hi", "n": [1, 2]}, "topk": "3"}


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", "application/vnd.api+json", "Application/JSON"],
)
def test_json_variants(content_type: str) -> None:
    assert decode_request(content_type, [], '["é"]'.encode(), {}) == {"body": ["é"]}


def test_json_in_another_charset() -> None:
    body = '{"w": "café"}'.encode("latin-1")
    assert decode_request("application/json; charset=latin-1", [], body, {}) == {
        "body": {"w": "café"}
    }


def test_content_type_from_headers_when_not_given() -> None:
    headers = [["Accept", "*/*"], ["Content-Type", "application/json"]]
    assert decode_request("", headers, b"[1]", {}) == {"body": [1]}
    assert decode_request("", {"content-type": "text/plain"}, b"x", {}) == {"body": "x"}


@pytest.mark.parametrize(
    ("content_type", "body", "message"),
    [
        (
            "application/json",
            b'{"a": ',
            "request body is not valid JSON (Content-Type 'application/json'): Expecting value: line 1 column 7 (char 6)",
        ),
        ("application/json", b"", "request body is empty but Content-Type is 'application/json'"),
        (
            "application/json",
            b"\xff\xfe\xfd",
            "request body is not valid utf-16-le text (Content-Type 'application/json'): truncated data at byte 2",
        ),
        (
            "application/json",
            b'"\xff"',
            "request body is not valid utf-8 text (Content-Type 'application/json'): invalid start byte at byte 1",
        ),
        (
            "application/json; charset=utf-8",
            b'"\xff"',
            "request body is not valid utf-8 text (Content-Type 'application/json; charset=utf-8'): invalid start byte at byte 1",
        ),
        (
            "text/plain; charset=klingon",
            b"x",
            "unknown charset 'klingon' in Content-Type 'text/plain; charset=klingon'",
        ),
        (
            "multipart/form-data",
            b"x",
            "multipart request has no boundary in Content-Type 'multipart/form-data'",
        ),
    ],
)
def test_bad_request_bodies(content_type: str, body: bytes, message: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_request(content_type, [], body, {})
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, ValueError)


def test_text_with_charset() -> None:
    assert decode_request("text/plain; charset=latin-1", [], "naïve".encode("latin-1"), {}) == {
        "body": "naïve"
    }
    assert decode_request("text/csv", [], b"a,b\n\xff", {}) == {"body": "a,b\n\ufffd"}


@pytest.mark.parametrize("content_type", ["application/octet-stream", "image/png", ""])
def test_binary_bodies_stay_bytes(content_type: str) -> None:
    data = decode_request(content_type, [], memoryview(b"\x89PNG\r\n"), {"q": "1"})
    assert data == {"body": b"\x89PNG\r\n", "q": "1"}
    assert type(data["body"]) is bytes


BOUNDARY = "----mserveBoundary7MA4YWxk"


def multipart(*parts: tuple[bytes, bytes]) -> bytes:
    """Parts as (header lines, content), joined by hand the way browsers and curl send them."""
    out = b"preamble is ignored\r\n"
    for head, content in parts:
        out += b"--" + BOUNDARY.encode() + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n"
    return out + b"--" + BOUNDARY.encode() + b"--\r\nepilogue\r\n"


def file_part(name: str, content_type: str | None = None) -> bytes:
    head = f'Content-Disposition: form-data; name="{name}"; filename="{name}.x"'
    return (head + (f"\r\nContent-Type: {content_type}" if content_type else "")).encode()


def test_multipart_fields_are_typed_as_torchserve_types_them() -> None:
    """Plain fields are bytes; files are typed by their content type (JSON parsed, text/* as
    UTF-8, bytes otherwise or when that fails); there is no raw ``body``."""
    image = bytes(range(256)) + b"\r\n--not-the-boundary\r\n" + b"\r\n"
    body = multipart(
        (file_part("data", "image/png"), image),
        (b'Content-Disposition: form-data; name="caption"', "un café".encode()),
        (b'Content-Disposition: form-data; name="declared"\r\nContent-Type: text/plain', b"t"),
        (b'Content-Disposition: form-data; name="empty"', b""),
        (file_part("untyped"), b"\x00raw"),
        (file_part("doc", "application/json"), b'{"k": ["v", 1]}'),
        (file_part("doc_utf8", "application/json; charset=utf-8"), b"[1]"),
        (file_part("not_json", "application/json"), b"{oops"),
        (file_part("note", "text/plain"), "héllo".encode()),
        (file_part("csv", "text/csv; charset=latin-1"), "é".encode("latin-1")),
        (file_part("blob", "application/octet-stream"), b"\xff\x00"),
        (
            b'Content-Disposition: form-data; name="b64"; filename="x"\r\nContent-Transfer-Encoding: base64',
            b"aGVsbG8=",
        ),
    )
    data = decode_request(
        f'multipart/form-data; boundary="{BOUNDARY}"',
        [],
        body,
        {"caption": "query loses", "topk": "2"},
    )
    assert data == {
        "data": image,
        "caption": "un café".encode(),
        "declared": b"t",  # a plain field, whatever its part says: bytes, as in TorchServe
        "empty": b"",
        "untyped": b"\x00raw",
        "doc": {"k": ["v", 1]},
        "doc_utf8": [1],
        "not_json": b"{oops",
        "note": "héllo",
        "csv": "é".encode("latin-1"),  # not UTF-8: its bytes, as TorchServe's worker falls back
        "blob": b"\xff\x00",
        "b64": b"hello",
        "topk": "2",
    }


def test_multipart_from_the_stdlib_encoder() -> None:
    """A body written by another encoder: quoted boundary, base64 parts, extra part headers."""
    form = MIMEMultipart("form-data", policy=email.policy.HTTP)
    file_part = MIMEApplication(b"\x00\x01\r\n", policy=email.policy.HTTP)
    file_part.add_header("Content-Disposition", "form-data", name="file", filename="a.bin")
    text_part = MIMEText("héllo", "plain", "utf-8", policy=email.policy.HTTP)
    text_part.add_header("Content-Disposition", "form-data", name="text")
    form.attach(file_part)
    form.attach(text_part)
    body = form.as_bytes().partition(b"\r\n\r\n")[2]
    data = decode_request(form["Content-Type"], [], body, {})
    assert data == {"file": b"\x00\x01\r\n", "text": "héllo".encode()}


def test_multipart_field_named_body_is_a_field_like_any() -> None:
    body = multipart((b'Content-Disposition: form-data; name="body"', b"field"))
    assert decode_request(f"multipart/form-data; boundary={BOUNDARY}", [], body, {}) == {
        "body": b"field"
    }
    empty = f"--{BOUNDARY}--\r\n".encode()  # a form with no field: an empty input
    assert decode_request(f"multipart/form-data; boundary={BOUNDARY}", [], empty, {}) == {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"no boundary here", f"multipart body does not contain its boundary '{BOUNDARY}'"),
        (
            b"--"
            + BOUNDARY.encode()
            + b'\r\nContent-Disposition: form-data; name="a"\r\n\r\ntruncat',
            "multipart body ends inside part 1: no closing boundary (the upload may be truncated)",
        ),
        (
            multipart((b"Content-Type: text/plain", b"x")),
            'multipart part 1 has no name (expected Content-Disposition: form-data; name="..."), found None',
        ),
        (
            b"--" + BOUNDARY.encode() + b"\r\nno blank line\r\n--" + BOUNDARY.encode() + b"--",
            "multipart part 1 has no blank line after its headers",
        ),
    ],
)
def test_bad_multipart(body: bytes, message: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decode_request(f"multipart/form-data; boundary={BOUNDARY}", [], body, {})
    assert str(caught.value).startswith(message)


def test_urlencoded_form() -> None:
    data = decode_request(
        "application/x-www-form-urlencoded",
        [],
        b"text=caf%C3%A9+au+lait&n=3&empty=",
        {"n": "query loses", "lang": "fr"},
    )
    assert data == {
        "text": "café au lait".encode(),
        "n": b"3",
        "empty": b"",
        "lang": "fr",
        "body": b"text=caf%C3%A9+au+lait&n=3&empty=",  # kept beside the fields (payload.py)
    }


# Encoding outputs.


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"\x00\x01", (b"\x00\x01", "application/octet-stream")),
        (bytearray(b"ab"), (b"ab", "application/octet-stream")),
        (memoryview(b"cd"), (b"cd", "application/octet-stream")),
        ("café", ("café".encode(), "text/plain; charset=utf-8")),
        ({"label": "cat", "p": 0.9}, (b'{"label":"cat","p":0.9}', "application/json")),
        ([1, "é", None, True], ('[1,"é",null,true]'.encode(), "application/json")),
        (3, (b"3", "application/json")),
        (2.5, (b"2.5", "application/json")),
        (None, (b"null", "application/json")),
    ],
)
def test_encode_output(value: Any, expected: tuple[bytes, str]) -> None:
    body, content_type = encode_output(value)
    assert (body, content_type) == expected
    assert type(body) is bytes


def test_override_content_type_wins() -> None:
    assert encode_output("<b>hi</b>", "text/html") == (b"<b>hi</b>", "text/html")
    assert encode_output(b"\x89PNG", "image/png") == (b"\x89PNG", "image/png")
    assert encode_output({"a": 1}, "application/vnd.x+json") == (
        b'{"a":1}',
        "application/vnd.x+json",
    )


class Tensor:
    def tolist(self) -> list[int]:
        return [1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"scores": Tensor()},
            f"handler output contains a {__name__}.Tensor, which cannot be sent as JSON "
            "(convert it with .tolist() first); return bytes, str, or JSON values "
            "(dict, list, str, int, float, bool, None)",
        ),
        (
            {1, 2},
            "handler output contains a set, which cannot be sent as JSON; return bytes, str, "
            "or JSON values (dict, list, str, int, float, bool, None)",
        ),
        (
            {(1, 2): "x"},
            "handler output of type dict cannot be sent as JSON: keys must be str, int, float, "
            "bool or None, not tuple",
        ),
    ],
)
def test_unserialisable_output(value: Any, message: str) -> None:
    with pytest.raises(PayloadError) as caught:
        encode_output(value)
    assert str(caught.value) == message


def test_hooks_file_with_a_helper_class_loads_as_hooks(load: Loader, tmp_path: Path) -> None:
    model = write_model(
        tmp_path,
        {
            "hooks.py": """
                class Helper:
                    def initialize(self, ctx):
                        pass

                def preprocess(inputs):
                    return inputs
            """
        },
    )
    assert load("hooks", model).style == "hooks"
