"""BaseHandler and the built-in handlers in process: loading, per-request errors, options, and
the messages a model's author sees. Models are tiny and written to tmp_path; handlers load
through the real loader, as a worker loads them. End-to-end serving: test_builtin_handlers.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

from mserve_worker.context import Context
from mserve_worker.contract import LoadedHandler
from mserve_worker.loader import load_handler
from mserve_worker.sdk import vision
from mserve_worker.sdk.base_handler import BadInput, ModelLoadError, load_label_mapping
from mserve_worker.sdk.text_classifier import load_vocab

HANDLERS = Path(__file__).resolve().parent.parent / "handlers"
LINEAR = HANDLERS / "base_linear"
X = [1.0, -2.0, 0.5, 3.0]


class StoiVocab:
    """Stands in for a pickled torchtext vocab: get_stoi() and get_default_index()."""

    def get_stoi(self) -> dict[str, int]:
        return {"<unk>": 0, "hello": 1}

    def get_default_index(self) -> int:
        return 0


def make_context(model_dir: Path, manifest_model: dict[str, Any], **overrides: Any) -> Context:
    values: dict[str, Any] = {
        "model_name": "m",
        "model_dir": str(model_dir),
        "manifest": {"model": {"modelName": "m", **manifest_model}},
        "batch_size": 4,
        "gpu_id": None,
        "server_name": "mserve",
        "server_version": "test",
    }
    values.update(overrides)
    return Context(**values)


def start(context: Context, count: int, headers: list[list[str]] | None = None, op: str = ""):
    requests = [SimpleNamespace(request_id=f"r{i}", headers=headers or []) for i in range(count)]
    context.start_batch(requests, op)


Loader = Callable[..., tuple[LoadedHandler, Context]]


@pytest.fixture
def load(tmp_path: Path) -> Iterator[Loader]:
    """``load(handler, manifest_model, **context)``: tmp_path is the model folder, first on
    sys.path as in a worker; what it imported from there is forgotten afterwards."""
    saved_path, before = list(sys.path), set(sys.modules)

    def run(handler: str, manifest_model: dict[str, Any], **overrides: Any):
        sys.path.insert(0, str(tmp_path))
        context = make_context(tmp_path, manifest_model, **overrides)
        return load_handler(handler, str(tmp_path), context), context

    yield run
    sys.path[:] = saved_path
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None) or ""
        if os.path.realpath(where).startswith(str(tmp_path.resolve()) + os.sep):
            del sys.modules[name]


def linear_model_dir(folder: Path) -> torch.nn.Module:
    """model.py and explain_handler.py of tests/handlers/base_linear, seeded weights."""
    for name in ("model.py", "explain_handler.py"):
        shutil.copy(LINEAR / name, folder / name)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    torch.save({f"fc.{k}": v for k, v in model.state_dict().items()}, folder / "linear.pt")
    return model.eval()


EAGER = {"serializedFile": "linear.pt", "modelFile": "model.py"}


def png(size: tuple[int, int], colour: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


# BaseHandler: the default steps, per-request rejections, explanations.


def test_default_steps_answer_each_request_and_reject_bad_ones_alone(load, tmp_path) -> None:
    model = linear_model_dir(tmp_path)
    handler, ctx = load("explain_handler", EAGER)
    assert handler.style == "handler-class" and handler.instance.initialized
    assert str(handler.instance.device) == "cpu" and not handler.instance.model.training

    start(ctx, 3)
    out = handler.handle([{"body": X}, {"body": "not numbers"}, {"data": "[0, 0, 0, 1]"}], ctx)
    with torch.no_grad():
        expected = model(torch.tensor([X, [0, 0, 0, 1.0]])).tolist()
    assert out[0] == pytest.approx(expected[0]) and out[2] == pytest.approx(expected[1])
    message = "input must be a number or a nested list of numbers: not JSON (Expecting value: line 1 column 1 (char 0))"  # fmt: skip
    assert out[1] == {"code": 400, "type": "BadInput", "message": message}
    assert ctx.get_response_status(1) == (400, message)
    assert ctx.get_response_status(0) == (200, "")
    assert [m["name"] for m in ctx.metrics.drain()] == ["HandlerTime"]


def test_a_row_of_another_shape_is_rejected_alone(load, tmp_path) -> None:
    model = linear_model_dir(tmp_path)
    handler, ctx = load("explain_handler", EAGER)
    start(ctx, 3)
    out = handler.handle([{"body": X}, {"body": [1.0, 2.0]}, {"body": [0, 0, 0, 1]}], ctx)
    with torch.no_grad():
        expected = model(torch.tensor([X, [0, 0, 0, 1.0]])).tolist()
    assert out[0] == pytest.approx(expected[0]) and out[2] == pytest.approx(expected[1])
    message = "input has shape [2], but this batch's inputs have shape [4]"
    assert out[1] == {"code": 400, "type": "BadInput", "message": message}
    assert ctx.get_response_status(1) == (400, message)


def test_explain_header_alone_selects_explanations(load, tmp_path) -> None:
    model = linear_model_dir(tmp_path)
    handler, ctx = load("explain_handler", EAGER)
    start(ctx, 1, headers=[["Explain", "True"]])
    out = handler.handle([{"body": X, "target": "1"}], ctx)
    assert out[0] == pytest.approx((model.weight[1] * torch.tensor(X)).tolist())


def test_get_insights_must_be_written_for_explanations(load, tmp_path) -> None:
    linear_model_dir(tmp_path)
    (tmp_path / "plain.py").write_text(
        "from mserve_worker.sdk.base_handler import BaseHandler\n\n\n"
        "class Plain(BaseHandler):\n    pass\n"
    )
    handler, ctx = load("plain", EAGER)
    start(ctx, 1, op="explain")
    with pytest.raises(NotImplementedError) as info:
        handler.handle([{"body": X}], ctx)
    assert str(info.value) == (
        "Plain does not explain its predictions: /explanations needs a get_insights(self, "
        "tensor_data, raw_data, target) method returning one explanation per request"
    )


# Loading: what the manifest names and what the folder holds.


def test_missing_serialized_file_is_named(load, tmp_path) -> None:
    linear_model_dir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load("explain_handler", {"serializedFile": "gone.pt", "modelFile": "model.py"})
    assert str(info.value) == (
        f"the manifest's serializedFile 'gone.pt' is not in the model folder: "
        f"{tmp_path / 'gone.pt'} does not exist"
    )


def test_no_serialized_file_at_all(load, tmp_path) -> None:
    linear_model_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="GradientExplainer loads the manifest's serialized"):
        load("explain_handler", {})


def test_model_file_needs_exactly_one_module_class(load, tmp_path) -> None:
    linear_model_dir(tmp_path)
    (tmp_path / "model.py").write_text(
        "from torch import nn\nfrom torch.nn import Linear\n\n\n"
        "class A(nn.Module):\n    pass\n\n\nclass B(nn.Module):\n    pass\n"
    )
    with pytest.raises(ModelLoadError) as info:
        load("explain_handler", EAGER)
    assert "found 2: A, B" in str(info.value)  # the imported Linear does not count


def test_whole_pickled_model_is_refused_with_a_hint(load, tmp_path) -> None:
    linear_model_dir(tmp_path)
    sys.path.insert(0, str(tmp_path))
    import model as model_module  # the class must be importable to pickle it

    torch.save(model_module.Linear4(), tmp_path / "linear.pt")
    del sys.modules["model"]
    with pytest.raises(ModelLoadError, match=r"linear.pt is not a plain state dict .*save "
                       r"model.state_dict\(\) \(or safetensors\) as the serialized file"):  # fmt: skip
        load("explain_handler", EAGER)


def test_model_file_missing_from_folder(load, tmp_path) -> None:
    linear_model_dir(tmp_path)
    with pytest.raises(ModelLoadError, match=r"modelFile 'net\.py' is not in the model folder"):
        load("explain_handler", {"serializedFile": "linear.pt", "modelFile": "net.py"})


def test_label_mapping_forms(tmp_path) -> None:
    path = tmp_path / "index_to_name.json"
    assert load_label_mapping(str(path)) is None
    path.write_text('{"0": ["n01", "tench"], "1": "goldfish"}')
    assert load_label_mapping(str(path)) == {"0": "tench", "1": "goldfish"}
    path.write_text('["cat", "dog"]')
    assert load_label_mapping(str(path)) == {"0": "cat", "1": "dog"}
    path.write_text("7")
    with pytest.raises(ModelLoadError, match="must map class indexes to names"):
        load_label_mapping(str(path))


# Built-in handlers.


def cnn_torchscript(folder: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 2, 3, stride=8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(2, 6),
    )  # fmt: skip
    torch.jit.save(torch.jit.script(net.eval()), folder / "cnn.pt")


def test_image_classifier_options_from_the_model_config(load, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after
    cnn_torchscript(tmp_path)
    config = {"handler": {"topk": 2, "crop_size": 32, "resize_size": 40}}
    handler, ctx = load("image_classifier", {"serializedFile": "cnn.pt"},
                        model_yaml_config=config, limit_max_image_pixels=False)  # fmt: skip
    classifier = handler.instance
    assert type(classifier).__name__ == "ImageClassifier"
    assert (classifier.topk, classifier.crop_size, classifier.resize_size) == (2, 32, 40)
    assert Image.MAX_IMAGE_PIXELS is None  # limit_max_image_pixels: false lifts Pillow's limit
    assert classifier.preprocess([{"body": png((90, 60))}]).shape == (1, 3, 32, 32)
    start(ctx, 2)
    out = handler.handle([{"body": png((90, 60))}, {"body": b""}], ctx)
    assert len(out[0]) == 2 and sum(out[0].values()) < 1
    assert out[1]["message"] == "the request has no image: its body is empty"

    with pytest.raises(ModelLoadError) as info:
        load("image_classifier", {"serializedFile": "cnn.pt"},
             model_yaml_config={"handler": {"topk": "3"}})  # fmt: skip
    assert (
        str(info.value) == "model config handler.topk must be a int like the default 5, found '3'"
    )


def test_image_segmenter_gives_class_and_probability_per_pixel(load, tmp_path) -> None:
    """TorchServe's answer: after resize 256 / crop 224, a 224 x 224 grid of [class, prob]."""
    (tmp_path / "seg.py").write_text(
        "from torch import nn\n\n\nclass Seg(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.conv = nn.Conv2d(3, 4, 1)\n\n"
        "    def forward(self, x):\n        return {'out': self.conv(x)}\n"
    )
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 1)
    torch.save({f"conv.{k}": v for k, v in conv.state_dict().items()}, tmp_path / "seg.pt")
    handler, ctx = load("image_segmenter", {"serializedFile": "seg.pt", "modelFile": "seg.py"})
    start(ctx, 2)
    out = handler.handle([{"body": png((5, 3), (255, 0, 0))}, {"body": png((2, 4))}], ctx)
    assert [len(out[0]), len(out[0][0]), len(out[1]), len(out[1][0])] == [224, 224, 224, 224]
    red = torch.tensor([[[1.0]], [[0.0]], [[0.0]]])
    normalised = vision.normalize(red, vision.IMAGENET_MEAN, vision.IMAGENET_STD)
    with torch.no_grad():
        probs = torch.softmax(conv(normalised.unsqueeze(0)), dim=1)[0, :, 0, 0]
    pairs = {tuple(pair) for row in out[0] for pair in row}
    assert len(pairs) == 1
    (cls, prob), *_ = pairs
    assert cls == float(probs.argmax()) and prob == pytest.approx(probs.max().item(), abs=1e-6)


def test_object_detector_keeps_detections_above_threshold(load, tmp_path) -> None:
    (tmp_path / "det.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Det(nn.Module):\n"
        "    def forward(self, images):\n"
        "        return [{'boxes': torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 1.0]]),\n"
        "                 'labels': torch.tensor([1, 2]), 'scores': torch.tensor([0.9, 0.2])}\n"
        "                for _ in images]\n"
    )
    (tmp_path / "index_to_name.json").write_text('{"1": "cat", "2": "dog"}')
    handler, ctx = load("object_detector", {"modelFile": "det.py"},
                        model_yaml_config={"handler": {"threshold": 0.1}})  # fmt: skip
    start(ctx, 2)
    out = handler.handle([{"body": png((8, 8))}, {"body": png((6, 9))}], ctx)  # different sizes
    both = [{"cat": [1.0, 2.0, 3.0, 4.0], "score": pytest.approx(0.9)},
            {"dog": [0.0, 0.0, 1.0, 1.0], "score": pytest.approx(0.2)}]  # fmt: skip
    assert out == [both, both]
    handler.instance.threshold = 0.5
    assert handler.handle([{"body": png((8, 8))}], ctx) == [both[:1]]


def test_decode_image_errors() -> None:
    with pytest.raises(BadInput, match="the image sent as text is not valid base64"):
        vision.decode_image("not base64!")
    with pytest.raises(BadInput, match=r"expected an image \(file bytes or base64 text\), found dict"):  # fmt: skip
        vision.decode_image({"a": 1})
    truncated = png((20, 20))[:60]
    with pytest.raises(BadInput, match=r"cannot read the request's image \(60 bytes\)"):
        vision.decode_image(truncated)


def test_decompression_bombs_stay_refused(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(BadInput, match=r"image refused: Image size .* exceeds limit"):
        vision.decode_image(png((30, 30)))


def test_transforms_follow_torchvision_sizes() -> None:
    image = Image.new("RGB", (300, 200))
    assert vision.resize_shorter_side(image, 256).size == (384, 256)
    assert vision.resize_shorter_side(Image.new("RGB", (240, 250)), 256).size == (256, 266)
    assert vision.center_crop(image, 100).size == (100, 100)
    tensor = vision.to_tensor(Image.new("RGB", (3, 2), (255, 0, 51)))
    assert tensor.shape == (3, 2, 3)
    assert tensor[:, 0, 0].tolist() == pytest.approx([1.0, 0.0, 0.2])


def test_vocabulary_forms(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="neither is in"):
        load_vocab(str(tmp_path))
    (tmp_path / "vocab.json").write_text('["<pad>", "<unk>", "hi"]')
    assert load_vocab(str(tmp_path)) == ({"<pad>": 0, "<unk>": 1, "hi": 2}, 1)
    (tmp_path / "vocab.json").write_text(json.dumps({"hi": "one"}))
    with pytest.raises(ModelLoadError, match="must map tokens"):
        load_vocab(str(tmp_path))
    torch.save({"a": 0, "b": 1}, tmp_path / "source_vocab.pt")  # preferred over vocab.json
    assert load_vocab(str(tmp_path)) == ({"a": 0, "b": 1}, None)
    torch.save(StoiVocab(), tmp_path / "source_vocab.pt")
    assert load_vocab(str(tmp_path)) == ({"<unk>": 0, "hello": 1}, 0)
