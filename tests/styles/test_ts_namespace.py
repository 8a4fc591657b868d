"""Handlers written for TorchServe run unedited: module-level ``ts.*`` imports resolve to mserve's
namespace. Archives are made by the real torch-model-archiver 0.12 and served by a real mserve;
expected answers are computed here from the same seeded models.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from mserve_worker import compat
from mserve_worker.context import Context, Metrics
from mserve_worker.sdk.base_handler import BaseHandler, ModelLoadError
from mserve_worker.sdk.errors import PredictionException
from mserve_worker.sdk.text_handler import TextHandler
from tests.compat_tools import CompatTool
from tests.server import conftest as serving
from tests.server.conftest import concurrently, wait_until
from tests.styles.test_builtin_handlers import (
    CNN,
    HANDLERS,
    LINEAR,
    assert_ranking,
    cnn_names,
    imagenet_tensor,
    model_class,
    noise_png,
    post_image,
    seeded,
    store,  # noqa: F401  (fixture)
    topk,
)
from tests.wheels import make_wheel

start_server = serving.start_server  # the fixtures, for the tests here
make_archive = serving.make_archive

TS_STYLE = HANDLERS / "ts_style"
OUR_TS = str(Path("mserve_worker", "compat", "ts", "__init__.py"))


def tma_archive(tma: CompatTool, folder: Path, name: str, handler: Path, *flags: str) -> None:
    made = tma.run("--model-name", name, "--version", "1.0", "--handler", str(handler),
                   "--export-path", str(folder), "-f", *flags, cwd=folder)  # fmt: skip
    assert made.returncode == 0, made.stderr


def test_torchserve_handlers_run_unedited(start_server, tma, store, tmp_path) -> None:  # noqa: F811
    linear = seeded(model_class(LINEAR, "Linear4"))
    torch.save(linear.state_dict(), tmp_path / "linear.pt")
    cnn = seeded(model_class(CNN, "TinyCNN"))
    torch.save(cnn.state_dict(), tmp_path / "cnn.pt")
    (tmp_path / "profile.yaml").write_text("handler:\n  profile: true\n")
    (tmp_path / "pairs.yaml").write_text("batchSize: 2\nmaxBatchDelay: 20000\nbatchWait: fill\n")
    linear_files = ["--serialized-file", str(tmp_path / "linear.pt"), "--model-file",
                    str(LINEAR / "model.py"), "--extra-files", str(TS_STYLE / "index_to_name.json")]  # fmt: skip
    tma_archive(tma, store, "linear", TS_STYLE / "ts_base.py", *linear_files,
                "-c", str(tmp_path / "profile.yaml"))  # fmt: skip
    tma_archive(tma, store, "pairs", TS_STYLE / "ts_base.py", *linear_files,
                "-c", str(tmp_path / "pairs.yaml"))  # fmt: skip
    tma_archive(tma, store, "top3", TS_STYLE / "ts_classifier.py", "--serialized-file",
                str(tmp_path / "cnn.pt"), "--model-file", str(CNN / "model.py"),
                "--extra-files", str(CNN / "index_to_name.json"))  # fmt: skip
    server = start_server("linear=linear.mar", "pairs=pairs.mar", "top3=top3.mar")

    x = [1.0, -2.0, 0.5, 3.0]
    reply = server.predict("linear", {"x": x})
    assert reply.status == 200, reply.body
    with torch.no_grad():
        probs = torch.softmax(linear(torch.tensor([x])), dim=1)[0].tolist()
    answer = reply.json()
    assert answer.pop("labels") == dict(zip(["low", "mid", "high"], probs, strict=True))
    assert answer.pop("ts").endswith(OUR_TS)
    assert answer.pop("device") in ("cpu", "cuda:0")  # BaseHandler's choice, read back
    assert answer == {"context": True, "profile": True, "batch": 1}

    # PredictionException(message, code): that status and TorchServe's error body.
    failed = server.predict("linear", {"fail": "x must hold 4 numbers", "code": 422})
    assert failed.status == 422
    assert failed.json() == {"code": 422, "type": "InternalServerException",
                             "message": "x must hold 4 numbers"}  # fmt: skip
    odd = server.predict("linear", {"fail": "odd", "code": 999})
    assert odd.status == 500
    assert odd.json()["message"] == "odd (PredictionException code 999 is not an HTTP status)"
    # As in TorchServe, the exception answers every request of its batch (batches of 2 here).
    ok, bad = concurrently(lambda: server.predict("pairs", {"x": x}),
                           lambda: server.predict("pairs", {"fail": "no GPU left", "code": 507}))  # fmt: skip
    for reply in (ok, bad):
        assert (reply.status, reply.json()["message"]) == (507, "no GPU left")
    assert server.predict("linear", {"x": x}).status == 200  # the worker serves on

    png = noise_png(3)
    assert_ranking(post_image(server, "top3", png),
                   topk(cnn, imagenet_tensor(png), cnn_names(), k=3))  # fmt: skip


def test_installed_torchserve_is_shadowed_and_logged(make_archive, start_server, tmp_path) -> None:
    """A model whose requirements install a package named torchserve (a stand-in whose ``ts``
    marks itself) still gets mserve's ``ts``, and the worker logs the version it shadows."""
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "torchserve", "0.12.0", "INSTALLED_TORCHSERVE = True\n", package="ts")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("torchserve==0.12.0\n")
    make_archive("ts_style", "ts_installed:Which", "which", "-r", str(reqs),
                 "--wheelhouse", str(wheels))  # fmt: skip
    server = start_server("which=which.mar")

    reply = server.predict("which", {})
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["ts"].endswith(OUR_TS) and answer["installed_ts"] is False
    log = server.run_dir / "logs" / "mserve.log"
    line = "torchserve 0.12.0 is installed in this environment; handlers importing ts.* get " \
           "mserve's ts"  # fmt: skip
    wait_until(lambda: line in log.read_text(), 10, "the shadowed-torchserve log line")
    described = server.manage("GET", "/models/which").json()[0]
    assert json.dumps(described).count("environment") >= 1  # it ran in its own environment


def test_a_named_function_falls_back_to_the_one_class(make_archive, start_server) -> None:
    """TorchServe serves ``handler.py:handle`` over a file that defines only a handler class
    (``ts/model_loader.py``); so do we, and the worker says which class it took."""
    make_archive("cls_handler", f"{HANDLERS / 'cls_handler' / 'cls_handler.py'}:handle", "upper")
    make_archive("multi_cls", f"{HANDLERS / 'multi_cls' / 'multi.py'}:handle", "multi")
    server = start_server("upper=upper.mar")
    reply = server.predict("upper", "shout")
    assert (reply.status, reply.body) == (200, b"SHOUT")
    log = server.run_dir / "logs" / "mserve.log"
    line = "module 'cls_handler' has no 'handle'; using its one handler class UpperHandler " \
           "instead, as TorchServe does"  # fmt: skip
    wait_until(lambda: line in log.read_text(), 10, "the fallback log line")

    failed = server.manage("POST", "/models?url=multi.mar&synchronous=true")
    assert failed.status >= 400
    assert (
        "handler of multi:1.0 failed to load: module 'multi' has no attribute 'handle', and no "
        "single handler class to use in its place; it defines 2 handler classes "
        "(FirstHandler, SecondHandler)"
    ) in failed.json()["message"]


# In process: the ts modules as a worker imports them (compat folder on sys.path).


@pytest.fixture
def ts_path() -> Iterator[None]:
    """The compat folder on sys.path, as in a worker; the ts modules are forgotten after."""
    saved = list(sys.path)
    compat.install()
    yield
    sys.path[:] = saved
    for name in [n for n in sys.modules if n == "ts" or n.startswith("ts.")]:
        del sys.modules[name]


def test_ts_names_are_mserves(ts_path, tmp_path) -> None:
    from ts.context import Context as TsContext
    from ts.metrics.metrics_store import MetricsStore
    from ts.torch_handler.base_handler import BaseHandler as TsBase
    from ts.torch_handler.image_segmenter import ImageSegmenter, ImangeSegmenter
    from ts.torch_handler.text_handler import TextHandler
    from ts.utils import util

    assert (TsContext, TsBase) == (Context, BaseHandler)
    # TorchServe's handler tests build their context's store as TorchServe does
    made = MetricsStore("a-request-id", "mnist")
    assert isinstance(made, Metrics) and made.model_name == "mnist"
    made.add_counter("Seen", 1, idx=0)
    assert made.drain()[0]["request_id"] == "a-request-id"
    assert ImangeSegmenter is ImageSegmenter
    assert util.PredictionException is PredictionException
    assert str(util.PredictionException("busy", 503)) == "busy : 503"
    assert util.map_class_to_label([[0.25, 0.75]], {"0": "a", "1": "b"}) == [{"a": 0.25, "b": 0.75}]
    assert util.check_valid_pt2_backend("inductor") and not util.check_valid_pt2_backend("x")
    module = sys.modules[TextHandler.__module__]
    assert util.list_classes_from_module(module) == [TextHandler]
    assert util.list_classes_from_module(module, BaseHandler) == [TextHandler]
    (tmp_path / "setup.yaml").write_text("handler:\n  max_length: 50\n")
    assert util.get_yaml_config(str(tmp_path / "setup.yaml")) == {"handler": {"max_length": 50}}


def test_text_handler_steps_are_torchserves(ts_path) -> None:
    from ts.torch_handler.text_handler import TextHandler

    h = TextHandler()
    assert h._remove_html_tags("a <b>bold</b> &amp; &#39;x&#39;") == "a bold  x"
    assert (
        h._expand_contractions("I'd say they won't, Don't") == "I would say they will not, Do not"
    )
    assert h._expand_contractions("how'd'y") == "how didy"  # the shorter form matches first
    assert h._remove_accented_characters("Café 日本") == "Cafe "
    assert h._remove_punctuation("a,b.c!¿") == "abc¿"
    assert h._tokenize("Hello, World. (x)!") == ["hello", ",", "world", ".", "(", "x", ")", "!"]
    assert h.get_word_token(["\u0120hi", "there"]) == ["hi", "there"]


def test_text_handler_without_vocabulary_fails_clearly(tmp_path) -> None:
    (tmp_path / "index_to_name.json").write_text("{}")
    context = Context("m", str(tmp_path), {"model": {}}, 1, None, "mserve", "test")
    with pytest.raises(ModelLoadError) as info:
        TextHandler().get_source_vocab_path(context)
    assert str(info.value) == (
        f"TextHandler needs the vocabulary source_vocab.pt in the archive (--extra-files); "
        f"{tmp_path / 'source_vocab.pt'} does not exist"
    )


def test_metrics_in_torchserves_forms(ts_path) -> None:
    from ts.metrics.dimension import Dimension
    from ts.metrics.metric_type_enum import MetricTypes

    context = Context("m", ".", {"model": {}}, 2, None, "mserve", "test")
    context.start_batch([SimpleNamespace(request_id=r, headers=[]) for r in ("r0", "r1")])
    m = context.metrics
    m.add_metric("Tokens", 7, "count", 1, [Dimension("Lang", "en")], MetricTypes.COUNTER)
    m.add_metric("Old", 1, 0, "ms")  # the pre-0.8 order
    m.add_time("T", 2.5, None, "ms", [Dimension("Step", "post")], MetricTypes.GAUGE)
    cached = m.add_metric_to_cache("Dist", "km", ["Region"], MetricTypes.GAUGE)
    assert m.get_metric("Dist", MetricTypes.GAUGE) is cached
    cached.add_or_update(3, ["eu"], "r1")
    cached.update(4, request_id="r0", dimensions=[Dimension("Region", "us")])
    entries = [(e["name"], e["value"], e["unit"], e["request_id"], e["dimensions"],
                e.get("type")) for e in m.drain()]  # fmt: skip
    assert entries == [  # the metric type travels to the server only when the handler gave one
        ("Tokens", 7, "count", "r1", [["Lang", "en"]], "counter"),
        ("Old", 1, "ms", "r0", [], None),
        ("T", 2.5, "ms", None, [["Step", "post"]], "gauge"),
        ("Dist", 3, "km", "r1", [["Region", "eu"]], "gauge"),
        ("Dist", 4, "km", "r0", [["Region", "us"]], "gauge"),
    ]
    with pytest.raises(ValueError) as bad_type:
        m.add_counter("Tokens", 1, metric_type="summary")
    assert str(bad_type.value) == (
        "metric 'Tokens': metric_type must be one of ('counter', 'gauge', 'histogram') "
        "(or TorchServe's MetricTypes), got 'summary'"
    )
    with pytest.raises(KeyError) as missing:
        m.get_metric("Dist")  # defined as a gauge, asked for as a counter
    assert missing.value.args[0] == (
        "metric 'Dist' of type counter is not defined; call add_metric_to_cache first "
        "(defined: Dist)"
    )
    with pytest.raises(ValueError) as wrong:
        cached.add_or_update(1, ["eu", "extra"])
    assert str(wrong.value) == (
        "metric 'Dist' has dimensions ['Region'], but 2 values were given: ['eu', 'extra']"
    )


def test_timed_and_own_image_processing(ts_path, tmp_path) -> None:
    """``@timed`` records ``ts_handler_<step>`` only when the model config asks for profiling; a
    handler's own ``image_processing`` gets the image in its own mode (grayscale stays L)."""
    from ts.handler_utils.timer import timed
    from ts.torch_handler.vision_handler import VisionHandler

    seen = []

    class Gray(VisionHandler):
        image_processing = staticmethod(lambda image: seen.append(image.mode) or torch.zeros(1))

        @timed
        def preprocess(self, data):
            return super().preprocess(data)

    buffer = io.BytesIO()
    Image.new("L", (4, 3), 7).save(buffer, "PNG")
    for profile, expected in ((False, []), (True, ["ts_handler_preprocess"])):
        handler = Gray()
        handler.context = Context("m", ".", {"model": {}}, 1, None, "mserve", "test",
                                  model_yaml_config={"handler": {"profile": profile}})  # fmt: skip
        handler.context.start_batch([SimpleNamespace(request_id="r", headers=[])])
        assert handler.preprocess([{"body": buffer.getvalue()}]).shape == (1, 1)
        assert [e["name"] for e in handler.context.metrics.drain()] == expected
    assert seen == ["L", "L"]


def test_add_metric_argument_forms() -> None:
    context = Context("m", ".", {"model": {}}, 2, None, "mserve", "test")
    context.start_batch([SimpleNamespace(request_id=r, headers=[]) for r in ("r0", "r1")])
    m = context.metrics
    m.add_metric("A", 1, "ms", idx=1)  # 0.8: unit positional, idx by keyword
    m.add_metric("B", 2, 0, "count")  # 0.7: idx, unit
    m.add_metric(name="C", value=3, unit="km", idx=None, dimensions=[("K", "v")])
    m.add_metric("D", 4)
    assert [(e["name"], e["unit"], e["request_id"]) for e in m.drain()] == [
        ("A", "ms", "r1"), ("B", "count", "r0"), ("C", "km", None), ("D", "", None)
    ]  # fmt: skip
    with pytest.raises(TypeError) as info:
        m.add_metric("E", 1, "ms", 0, [], None, "extra")
    assert str(info.value) == (
        "metric 'E': add_metric takes at most 6 positional arguments (name, value, unit, idx, "
        "dimensions, metric_type), got 7"
    )


def test_custom_preprocess_calls_the_builtin_image_processing(ts_path) -> None:
    """TorchServe examples decode in their own preprocess and call ``self.image_processing``:
    on a built-in it is TorchServe's transform (here ImageClassifier's resize/crop/normalise)."""
    from ts.torch_handler.image_classifier import ImageClassifier

    class Custom(ImageClassifier):
        def preprocess(self, data):
            images = [Image.open(io.BytesIO(row.get("data") or row.get("body"))) for row in data]
            return torch.stack([self.image_processing(image) for image in images])

    png = noise_png(5)
    handler = Custom()
    assert torch.allclose(handler.preprocess([{"body": png}])[0], imagenet_tensor(png), atol=1e-5)
    handler.image_processing = lambda image: torch.zeros(2)  # an instance's own, as __init__ sets
    assert handler.preprocess([{"body": png}]).shape == (1, 2)
    assert Custom().image_processing.__name__ == "_builtin_processing"  # per instance
