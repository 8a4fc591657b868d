"""BaseHandler and the built-in handlers end to end: real archives, a real mserve, HTTP.

The models are tiny (seeded weights written to tmp_path by each test); every expected answer is
computed here from the same model with the preprocessing TorchServe documents, so the tests
check the served numbers, not only their shape.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import itertools
import json
import re
import string
import subprocess
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import ARCHIVER_SCRIPT
from tests.server import conftest as serving
from tests.server.conftest import Reply, http

start_server = serving.start_server  # the fixture, for the tests here

HANDLERS = Path(__file__).resolve().parent.parent / "handlers"
CNN, TEXT, LINEAR = HANDLERS / "base_cnn", HANDLERS / "base_text", HANDLERS / "base_linear"
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
JSON = {"Content-Type": "application/json"}
BATCH_CONFIG = "batchSize: 4\nmaxBatchDelay: 500\nbatchWait: fill\n"


def model_class(folder: Path, name: str) -> type:
    spec = importlib.util.spec_from_file_location(f"{folder.name}_model", folder / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def seeded(cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls().eval()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """The model store start_server serves from."""
    folder = tmp_path / "store"
    folder.mkdir(exist_ok=True)
    return folder


def archive(store: Path, name: str, handler: str, *flags: str) -> None:
    args = [ARCHIVER_SCRIPT, "--model-name", name, "--handler", handler,
            "--export-path", str(store), "-f", *flags]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def noise_png(seed: int, size: tuple[int, int] = (300, 260)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def striped_png(rgb: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    """A colour with stripes of its complement: colours this model tells apart."""
    pixels = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    pixels[:] = rgb
    pixels[::7] = 255 - np.array(rgb, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def imagenet_tensor(png: bytes, mirror: bool = False) -> torch.Tensor:
    """TorchServe's image_classifier preprocessing: resize 256, centre crop 224, normalise."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    if mirror:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    w, h = image.size
    size = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
    image = image.resize(size, Image.BILINEAR)
    w, h = image.size
    left, top = round((w - 224) / 2), round((h - 224) / 2)
    array = np.asarray(image.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255
    return torch.from_numpy(((array - MEAN) / STD).astype(np.float32).transpose(2, 0, 1))


def topk(model: torch.nn.Module, x: torch.Tensor, names: dict[str, str] | None, k: int = 5):
    with torch.no_grad():
        probs, classes = torch.softmax(model(x.unsqueeze(0)), dim=1).topk(k)
    pairs = zip(classes[0].tolist(), probs[0].tolist(), strict=True)
    return [((names or {}).get(str(c), str(c)), p) for c, p in pairs]


def assert_ranking(reply: Reply, expected: list[tuple[str, float]]) -> None:
    assert reply.status == 200, reply.body
    got = reply.json()
    assert list(got) == [label for label, _ in expected]
    assert list(got.values()) == pytest.approx([p for _, p in expected], abs=1e-5)


def cnn_names() -> dict[str, str]:
    return {k: v[-1] for k, v in json.loads((CNN / "index_to_name.json").read_text()).items()}


def post_image(server: Any, model: str, png: bytes) -> Reply:
    return server.predict(model, png, headers={"Content-Type": "image/png"})


def concurrently(calls: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def cnn_archive(store: Path, tmp_path: Path, name: str, handler: str, *flags: str) -> None:
    weights = tmp_path / "cnn.pt"
    torch.save(seeded(model_class(CNN, "TinyCNN")).state_dict(), weights)
    archive(store, name, handler, "--serialized-file", str(weights),
            "--model-file", str(CNN / "model.py"),
            "--extra-files", str(CNN / "index_to_name.json"), *flags)  # fmt: skip


def test_image_classifier_eager_and_torchscript(start_server, store, tmp_path) -> None:
    model = seeded(model_class(CNN, "TinyCNN"))
    cnn_archive(store, tmp_path, "cnn", "image_classifier")
    torch.jit.save(torch.jit.script(model), tmp_path / "cnn_ts.pt")
    archive(store, "cnn_ts", "image_classifier", "--serialized-file", str(tmp_path / "cnn_ts.pt"))
    server = start_server("cnn=cnn.mar", "cnn_ts=cnn_ts.mar")
    png = noise_png(1)

    assert_ranking(post_image(server, "cnn", png), topk(model, imagenet_tensor(png), cnn_names()))
    # TorchScript, no index_to_name.json: the labels are the class indexes.
    assert_ranking(post_image(server, "cnn_ts", png), topk(model, imagenet_tensor(png), None))
    # base64 text is decoded too (a text body, as some clients send images).
    encoded = server.predict("cnn", base64.b64encode(png).decode())
    assert_ranking(encoded, topk(model, imagenet_tensor(png), cnn_names()))

    bad = server.predict("cnn", b"GIF89a-not-really", headers={"Content-Type": "image/gif"})
    assert bad.status == 400
    assert bad.json()["message"] == (
        "cannot read the request's image: its 17 bytes (starting b'GIF89a-n') are not in an "
        "image format Pillow knows"
    )


def test_subclasses_override_one_step(start_server, store, tmp_path) -> None:
    model = seeded(model_class(CNN, "TinyCNN"))
    cnn_archive(store, tmp_path, "top1", str(CNN / "top1_handler.py"))
    cnn_archive(store, tmp_path, "mirror", str(CNN / "mirror_handler.py"))
    server = start_server("top1=top1.mar", "mirror=mirror.mar")
    png = noise_png(2)

    (label, prob), *_ = topk(model, imagenet_tensor(png), cnn_names())
    reply = post_image(server, "top1", png)
    assert reply.status == 200, reply.body
    assert reply.json() == {
        "label": label,
        "probability": pytest.approx(prob, abs=1e-5),
        "batch": 1,
    }
    mirrored = topk(model, imagenet_tensor(png, mirror=True), cnn_names())
    assert_ranking(post_image(server, "mirror", png), mirrored)
    assert mirrored != topk(model, imagenet_tensor(png), cnn_names())  # the override mattered


def test_image_batches_answer_each_caller_and_reject_bad_images_alone(start_server, store,
                                                                      tmp_path) -> None:  # fmt: skip
    model = seeded(model_class(CNN, "TinyCNN"))
    config = tmp_path / "batch.yaml"
    config.write_text(BATCH_CONFIG)
    cnn_archive(store, tmp_path, "cnn", "image_classifier", "-c", str(config))
    cnn_archive(store, tmp_path, "top1", str(CNN / "top1_handler.py"), "-c", str(config))
    server = start_server("cnn=cnn.mar", "top1=top1.mar")
    colours = [(255, 0, 0), (0, 255, 0), (255, 255, 255), (255, 255, 0)]
    pngs = [striped_png(rgb, (240 + 20 * i, 250)) for i, rgb in enumerate(colours)]

    replies = concurrently([lambda png=png: post_image(server, "cnn", png) for png in pngs])
    expected = [topk(model, imagenet_tensor(png), cnn_names()) for png in pngs]
    assert len({tuple(label for label, _ in e) for e in expected}) == 4  # distinct answers
    for reply, ranking in zip(replies, expected, strict=True):
        assert_ranking(reply, ranking)

    bodies = [pngs[0], pngs[1], b"\x89PNG\r\n\x1a\n truncated", pngs[2]]
    replies = concurrently([lambda body=body: post_image(server, "top1", body) for body in bodies])
    assert replies[2].status == 400
    assert replies[2].json()["type"] == "BadInput"
    assert "cannot read the request's image" in replies[2].json()["message"]
    good = [r.json() for i, r in enumerate(replies) if i != 2]
    assert all(r.status == 200 for i, r in enumerate(replies) if i != 2)
    assert [g["label"] for g in good] == [
        topk(model, imagenet_tensor(png), cnn_names())[0][0] for png in pngs[:3]
    ]
    assert max(g["batch"] for g in good) > 1  # they were served together


CONTRACTIONS = {"don't": "do not", "it's": "it is", "won't": "will not", "i'd": "i would"}


def text_reference(model: torch.nn.Module, text: str) -> dict[str, float]:
    """TorchServe's text_classifier steps: HTML tags and entities out, lower case, contractions
    expanded (those used here) and apostrophes dropped, ASCII only, ASCII punctuation out; words
    and bigrams; unknown tokens -> <unk>."""
    vocab = json.loads((TEXT / "vocab.json").read_text())
    names = json.loads((TEXT / "index_to_name.json").read_text())
    text = re.sub(r"<.*?>|&([a-z0-9]+|#[0-9]{1,6}|#x[0-9a-f]{1,6});", "", text).lower()
    for short, long in CONTRACTIONS.items():
        text = text.replace(short, long)
    text = unicodedata.normalize("NFKD", text.replace("'", "")).encode("ascii", "ignore").decode()
    words = text.translate(str.maketrans("", "", string.punctuation)).split()
    tokens = words + [f"{a} {b}" for a, b in itertools.pairwise(words)]
    ids = torch.tensor([vocab.get(t, vocab["<unk>"]) for t in tokens])
    with torch.no_grad():
        probs = torch.softmax(model(ids, torch.tensor([0])), dim=1)[0].tolist()
    return {names[str(i)]: p for i, p in enumerate(probs)}


def test_text_classifier_batch(start_server, store, tmp_path) -> None:
    model = seeded(model_class(TEXT, "TinyTextNet"))
    torch.save(model.state_dict(), tmp_path / "text.pt")
    config = tmp_path / "batch.yaml"
    config.write_text(BATCH_CONFIG)
    archive(store, "text", "text_classifier", "--serialized-file", str(tmp_path / "text.pt"),
            "--model-file", str(TEXT / "model.py"), "-c", str(config), "--extra-files",
            f"{TEXT / 'vocab.json'},{TEXT / 'index_to_name.json'}")  # fmt: skip
    server = start_server("text=text.mar")
    texts = ["A <b>good movie</b>, great FUN!", "Boring plot... I'd say bad, DON'T go &amp; \u00bfno?",
             "Café 日本 won't"]  # fmt: skip

    calls = [lambda text=text: server.predict("text", text) for text in texts]
    calls.append(lambda: server.predict("text", {"rating": 5}))
    replies = concurrently(calls)
    for reply, text in zip(replies[:3], texts, strict=True):
        assert reply.status == 200, reply.body
        assert reply.json() == pytest.approx(text_reference(model, text), abs=1e-5)
    assert replies[0].json() != replies[1].json()
    assert replies[3].status == 400
    assert replies[3].json()["message"] == (
        "expected text (a text body, or JSON {'text': ...}), found dict"
    )
    as_json = server.predict("text", {"text": texts[0]})
    assert as_json.json() == pytest.approx(text_reference(model, texts[0]), abs=1e-5)


SEGMENTER_PY = """from torch import nn


class Seg(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 1)

    def forward(self, x):
        return {"out": self.conv(x)}
"""

DETECTOR_PY = """import torch
from torch import nn


class Det(nn.Module):
    def forward(self, images):
        return [{"boxes": torch.tensor([[1.0, 2.0, 30.0, 40.0], [0.0, 0.0, 5.0, 5.0]]),
                 "labels": torch.tensor([1, 2]), "scores": torch.tensor([0.9, 0.3])}
                for _ in images]
"""


def test_segmenter_and_detector_answer_torchserves_shapes(start_server, store, tmp_path) -> None:
    """image_segmenter: resize 256, crop 224, normalise, then per pixel [class, probability]
    (224 x 224 x 2 whatever the photo's size); object_detector: [{label: box, "score": s}] for
    scores of at least 0.5, labels through index_to_name.json."""
    (tmp_path / "seg.py").write_text(SEGMENTER_PY)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 1).eval()
    torch.save({f"conv.{k}": v for k, v in conv.state_dict().items()}, tmp_path / "seg.pt")
    archive(store, "seg", "image_segmenter", "--serialized-file", str(tmp_path / "seg.pt"),
            "--model-file", str(tmp_path / "seg.py"))  # fmt: skip
    (tmp_path / "det.py").write_text(DETECTOR_PY)
    (tmp_path / "index_to_name.json").write_text('{"1": "cat", "2": "dog"}')
    archive(store, "det", "object_detector", "--model-file", str(tmp_path / "det.py"),
            "--extra-files", str(tmp_path / "index_to_name.json"))  # fmt: skip
    server = start_server("seg=seg.mar", "det=det.mar")
    png = noise_png(4, (640, 491))

    reply = post_image(server, "seg", png)
    assert reply.status == 200, reply.body
    grid = np.array(reply.json())
    assert grid.shape == (224, 224, 2)
    with torch.no_grad():
        best = torch.softmax(conv(imagenet_tensor(png).unsqueeze(0)), dim=1)[0].max(dim=0)
    assert (grid[:, :, 0] == best.indices.numpy()).mean() > 0.999  # ties at float precision
    assert grid[:, :, 1] == pytest.approx(best.values.numpy(), abs=1e-5)

    reply = post_image(server, "det", png)
    assert reply.status == 200, reply.body
    assert reply.json() == [{"cat": [1.0, 2.0, 30.0, 40.0], "score": pytest.approx(0.9)}]
    # Integrated gradients need class scores: these two say they do not explain, captum or not.
    for name, cls in (("seg", "ImageSegmenter"), ("det", "ObjectDetector")):
        explain = http("POST", server.url("inference", f"/explanations/{name}"), png,
                       {"Content-Type": "image/png"})  # fmt: skip
        assert explain.status == 500
        assert f"{cls} does not explain its predictions: /explanations needs a get_insights(" \
               "self, tensor_data, raw_data, target) method" in explain.json()["message"]  # fmt: skip


def test_explanations_call_get_insights(start_server, store, tmp_path) -> None:
    model = seeded(model_class(LINEAR, "Linear4"))
    torch.save(model.state_dict(), tmp_path / "linear.pt")
    torch.jit.save(torch.jit.script(model), tmp_path / "linear_ts.pt")
    archive(store, "explain", str(LINEAR / "explain_handler.py"), "--serialized-file",
            str(tmp_path / "linear.pt"), "--model-file", str(LINEAR / "model.py"))  # fmt: skip
    archive(store, "scratch", str(LINEAR / "scratch_handler.py"), "--serialized-file",
            str(tmp_path / "linear_ts.pt"))  # fmt: skip
    server = start_server("explain=explain.mar", "scratch=scratch.mar")
    x = [1.0, -2.0, 0.5, 3.0]
    with torch.no_grad():
        scores = model(torch.tensor([x]))[0].tolist()

    predicted = server.predict("explain", json.dumps(x).encode(), headers=JSON)
    assert predicted.json() == pytest.approx(scores, abs=1e-5)  # BaseHandler's defaults

    def explain(model_name: str, query: str = "") -> Reply:
        url = server.url("inference", f"/explanations/{model_name}{query}")
        return http("POST", url, json.dumps(x).encode(), JSON)

    weights = model.fc.weight.detach()
    for query, target in (("?target=2", 2), ("", 0)):
        reply = explain("explain", query)
        assert reply.status == 200, reply.body
        assert reply.json() == pytest.approx((weights[target] * torch.tensor(x)).tolist())
    v2 = http("POST", server.url("inference", "/v2/models/explain/explain?target=1"),
              json.dumps(x).encode(), JSON)  # fmt: skip
    assert v2.json() == pytest.approx((weights[1] * torch.tensor(x)).tolist())

    # The from-scratch form: its own __init__ and handle, branching on _is_explain().
    scratch = server.predict("scratch", json.dumps(x).encode(), headers=JSON)
    assert scratch.json() == {"scores": pytest.approx(scores, abs=1e-5)}
    assert explain("scratch", "?target=1").json() == {"target": 1, "input": x}


def test_model_file_errors_fail_registration_clearly(start_server, store, tmp_path) -> None:
    two = tmp_path / "two_models.py"
    two.write_text(
        "from torch import nn\n\n"
        "class Encoder(nn.Module):\n    pass\n\n"
        "class Decoder(nn.Module):\n    pass\n"
    )
    archive(store, "two", "image_classifier", "--model-file", str(two))
    weights = tmp_path / "text.pt"
    torch.save(seeded(model_class(TEXT, "TinyTextNet")).state_dict(), weights)
    archive(store, "novocab", "text_classifier", "--serialized-file", str(weights),
            "--model-file", str(TEXT / "model.py"))  # fmt: skip
    server = start_server()

    reply = server.manage("POST", "/models?url=two.mar")
    assert reply.status == 400, reply.body
    assert (
        "model file 'two_models.py' must define exactly one torch.nn.Module subclass (the model "
        "to build); found 2: Encoder, Decoder" in reply.json()["message"]
    )
    reply = server.manage("POST", "/models?url=novocab.mar")
    assert reply.status == 400, reply.body
    assert (
        "text_classifier needs a vocabulary in the archive (--extra-files): source_vocab.pt or "
        "vocab.json; neither is in" in reply.json()["message"]
    )
