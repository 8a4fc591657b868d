"""captum explanations of the built-in handlers end to end: real archives, a real mserve, HTTP.

The expected attributions are computed here with captum itself, from the same seeded model and
the preprocessing TorchServe documents, so the tests check the served numbers and their meaning,
not only their shape. captum comes from the test environment (scripts/test.sh installs it):
an archive whose requirements.txt names captum gets a layered environment in which uv, which
does not see the server's torch, would also install torch and its CUDA wheels (GBs).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.server.conftest import Reply, http
from tests.styles import test_builtin_handlers as builtin
from tests.styles.test_builtin_handlers import (
    CNN,
    TEXT,
    archive,
    cnn_archive,
    imagenet_tensor,
    model_class,
    noise_png,
    seeded,
)

start_server, store = builtin.start_server, builtin.store  # the fixtures, for the tests here

PNG = {"Content-Type": "image/png"}
JSON = {"Content-Type": "application/json"}


def needs_captum() -> Any:
    return pytest.importorskip(
        "captum.attr", reason="captum is not in the test environment (scripts/test.sh installs it)"
    )


def explain(server: Any, model: str, body: bytes, headers: dict[str, str], query: str = ""):
    return http("POST", server.url("inference", f"/explanations/{model}{query}"), body, headers)


def nested_shape(value: Any) -> list[int]:
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        value = value[0]
    return shape


def flat(value: Any) -> list[float]:
    return torch.as_tensor(value).flatten().tolist()


def close(got: list[float], want: list[float]) -> bool:
    """Equal to float precision, relative to the attributions' size (they are ~1e-6 here)."""
    got_t, want_t = torch.tensor(got), torch.tensor(want)
    return got_t.shape == want_t.shape and bool(
        torch.norm(got_t - want_t) <= 1e-4 * torch.norm(want_t)
    )


def test_image_classifier_explains_with_integrated_gradients(start_server, store, tmp_path):
    attr = needs_captum()
    model = seeded(model_class(CNN, "TinyCNN"))
    cnn_archive(store, tmp_path, "cnn", "image_classifier")
    torch.jit.save(torch.jit.script(model), tmp_path / "cnn_ts.pt")
    archive(store, "cnn_ts", "image_classifier", "--serialized-file", str(tmp_path / "cnn_ts.pt"))
    props = tmp_path / "config.properties"
    props.write_text("service_envelope=kserve\n")  # KServe v1 bodies, as TorchServe's KServe setup
    server = start_server("cnn=cnn.mar", "cnn_ts=cnn_ts.mar", extra=("--ts-config", str(props)))
    png = noise_png(5)
    x = imagenet_tensor(png)[None]

    def expected(target: int) -> list[float]:
        ig = attr.IntegratedGradients(model)
        return flat(ig.attribute(x, target=target, n_steps=15)[0])  # TorchServe's 15 steps

    by_target = {}
    for query, target in (("", 0), ("?target=3", 3), ("?target=7", 7)):
        reply = explain(server, "cnn", png, PNG, query)
        assert reply.status == 200, reply.body
        attributions = reply.json()
        assert nested_shape(attributions) == [3, 224, 224]  # per pixel, as preprocessed
        values = flat(attributions)
        assert all(math.isfinite(v) for v in values) and len(set(values)) > 1000
        assert close(values, expected(target))
        by_target[target] = values
    assert not close(by_target[3], by_target[7])  # the target matters

    scripted = explain(server, "cnn_ts", png, PNG, "?target=3")
    assert close(flat(scripted.json()), by_target[3])

    # KServe v1: each instance {"data": base64, "target": k}, answered {"explanations": [...]}.
    body = {"instances": [{"data": base64.b64encode(png).decode(), "target": 7}]}
    url = server.url("inference", "/v1/models/cnn:explain")
    reply = http("POST", url, json.dumps(body).encode(), JSON)
    assert reply.status == 200, reply.body
    (v1,) = reply.json()["explanations"]
    assert close(flat(v1), by_target[7])

    # A target the model has no class for is the caller's mistake, said in words.
    for query, message in (
        ("?target=10", "target 10 is not a class of this model: it scores 10 classes (0 to 9)"),
        ("?target=cat", "target must be a class index (an integer from 0 to 9), found 'cat'"),
    ):
        reply = explain(server, "cnn", png, PNG, query)
        assert (reply.status, reply.json()["message"]) == (400, message)
    assert explain(server, "cnn", png, PNG).status == 200  # and the worker serves on


def text_ids(words: list[str]) -> torch.Tensor:
    """The built-in's tokens for lower-case words without punctuation: words, then bigrams,
    through vocab.json (<unk> for the unknown)."""
    vocab = json.loads((TEXT / "vocab.json").read_text())
    tokens = words + [f"{a} {b}" for a, b in itertools.pairwise(words)]
    return torch.tensor([vocab.get(t, vocab["<unk>"]) for t in tokens])


def text_archive(folder: Path, name: str, weights: Path, *flags: str) -> None:
    archive(folder, name, "text_classifier", "--serialized-file", str(weights), "--extra-files",
            f"{TEXT / 'vocab.json'},{TEXT / 'index_to_name.json'}", *flags)  # fmt: skip


NO_EMBEDDING_PY = """from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(16, 8, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, text, offsets):
        return self.fc(self.emb(text, offsets))
"""


def test_text_classifier_explains_word_importances(start_server, store, tmp_path) -> None:
    attr = needs_captum()
    model = seeded(model_class(TEXT, "TinyTextNet"))
    torch.save(model.state_dict(), tmp_path / "text.pt")
    config = tmp_path / "batch.yaml"
    config.write_text("batchSize: 4\nmaxBatchDelay: 300\n")
    text_archive(store, "text", tmp_path / "text.pt", "--model-file",
                 str(TEXT / "model.py"), "-c", str(config))  # fmt: skip
    torch.jit.save(torch.jit.script(model), tmp_path / "text_ts.pt")
    text_archive(store, "text_ts", tmp_path / "text_ts.pt")
    (tmp_path / "noemb.py").write_text(NO_EMBEDDING_PY)
    torch.save({k.replace("embedding", "emb"): v for k, v in model.state_dict().items()},
               tmp_path / "noemb.pt")  # fmt: skip
    text_archive(store, "noemb", tmp_path / "noemb.pt", "--model-file",
                 str(tmp_path / "noemb.py"))  # fmt: skip
    server = start_server("text=text.mar", "text_ts=text_ts.mar", "noemb=noemb.mar")
    text, words = "A good movie, great FUN!", ["a", "good", "movie", "great", "fun"]

    def expected(target: int) -> list[list[float]]:
        """TorchServe's recipe: LayerIntegratedGradients over the embedding from index-0
        tokens, softmax over the last dimension, divided by the norm of its sums."""
        lig = attr.LayerIntegratedGradients(model, model.embedding)
        ids = text_ids(words)
        found = lig.attribute(ids, torch.zeros_like(ids), additional_forward_args=(torch.tensor([0]),),
                              target=target)  # fmt: skip
        found = torch.softmax(found, dim=-1)
        return (found / torch.norm(found.sum(dim=-1))).tolist()

    answers = {}
    for target in (0, 2):
        reply = explain(server, "text", text.encode(), {}, f"?target={target}")
        assert reply.status == 200, reply.body
        answer = reply.json()
        assert answer["words"] == words  # the request's words, without the bigrams
        # An EmbeddingBag's output is one row per request: one importance per dimension.
        assert nested_shape(answer["importances"]) == [1, 8]
        assert close(flat(answer["importances"]), flat(expected(target)))
        answers[target] = flat(answer["importances"])
    assert not close(answers[0], answers[2])

    # A JSON body names its target; its text is explained on its own.
    body = json.dumps({"text": "boring plot", "target": 1}).encode()
    reply = explain(server, "text", body, JSON)
    assert reply.status == 200, reply.body
    assert reply.json()["words"] == ["boring", "plot"]

    reply = explain(server, "text_ts", text.encode(), {})
    assert reply.status == 500
    assert (
        "TextClassifier explains by hooking model.embedding, which a TorchScript model does not "
        "allow: archive the eager model (--model-file and its state dict as --serialized-file), "
        "or override get_insights" in reply.json()["message"]
    )
    reply = explain(server, "noemb", text.encode(), {})
    assert reply.status == 500
    assert (
        "TextClassifier explains through the model's embedding layer, model.embedding (as "
        "TorchServe's), and Net has none: name that layer 'embedding', or override get_insights"
        in reply.json()["message"]
    )
    assert server.predict("noemb", text).status == 200  # predictions never needed it


def test_without_captum_and_with_own_insights(start_server, store, tmp_path) -> None:
    cnn_archive(store, tmp_path, "nocaptum", str(CNN / "no_captum_handler.py"))
    cnn_archive(store, tmp_path, "own", str(CNN / "own_insights_handler.py"))
    server = start_server("nocaptum=nocaptum.mar", "own=own.mar")
    png = noise_png(6)

    assert server.predict("nocaptum", png, headers=PNG).status == 200
    reply: Reply = explain(server, "nocaptum", png, PNG)
    assert reply.status == 500
    message = reply.json()["message"]
    assert (
        "NoCaptumClassifier explains its predictions with captum, which this model's environment "
        "cannot import (No module named 'captum'): install captum in the "
        "model's environment (requirements.txt), or pip install captum next to the server's "
        "torch" in message
    )
    assert "Traceback" not in message

    # A subclass's own get_insights is what /explanations calls.
    reply = explain(server, "own", png, PNG, "?target=4")
    assert reply.status == 200, reply.body
    assert reply.json() == {"own": True, "target": 4, "shape": [3, 224, 224]}
