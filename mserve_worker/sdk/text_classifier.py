"""Built-in ``text_classifier`` (``--handler text_classifier``): text in, class probabilities out.

For models in the shape of TorchServe's text classification example: an ``nn.EmbeddingBag`` model
called as ``model(token_ids, offsets)``, where ``token_ids`` is every request's ids end to end and
``offsets`` where each request starts. The text goes through TorchServe's steps (HTML tags and
entities removed, lower case, contractions expanded, accents and non-ASCII characters removed,
ASCII punctuation removed, torchtext's ``basic_english`` split), then n-grams up to ``ngrams`` (2,
as TorchServe's handler; model config ``handler: {ngrams: 1}`` to change) are added and mapped
through the archive's vocabulary: ``source_vocab.pt`` (a dict token -> index, or a torchtext-like
vocab with ``get_stoi()`` or ``stoi``) or ``vocab.json`` (a dict, or a list of tokens). Unknown
tokens take the index of ``<unk>`` when the vocabulary has one and are dropped otherwise. Each
request gets one ``{label: probability}`` object over all classes, named through
``index_to_name.json``. Unlike TorchServe's (which reads only the first request), it batches.
``/explanations`` answers captum's layer integrated gradients over ``model.embedding`` per request,
in TorchServe's shape (see ``get_insights``).
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

from .base_handler import (
    BadInput,
    BaseHandler,
    ModelLoadError,
    map_class_to_label,
    request_input,
)
from .insights import checked_target
from .text_handler import SOURCE_VOCAB, TextHandler

VOCAB_JSON = "vocab.json"
UNKNOWN = "<unk>"


class TextClassifier(TextHandler):
    """Clean up, tokenise, look up; ``model(token_ids, offsets)``; softmax over classes."""

    ngrams = 2
    handler_options = ("ngrams",)
    vocab: dict[str, int] | None = None
    unknown_index: int | None = None
    # The words of each request preprocess accepted, for the explanations' "words".
    words: list[list[str]] | None = None

    def initialize(self, context: Any) -> None:
        BaseHandler.initialize(self, context)
        self.vocab, self.unknown_index = load_vocab(context.system_properties["model_dir"])
        self.source_vocab = self.vocab

    def preprocess(self, data: list[Any]) -> Any:
        """Token ids of every accepted request, end to end, and the offset where each starts."""
        import torch

        ids: list[int] = []
        offsets: list[int] = []
        self.words = []
        for idx, row in enumerate(data):
            try:
                text = request_text(request_input(row))
            except BadInput as exc:
                self.reject(idx, str(exc))
                continue
            offsets.append(len(ids))
            text = self.normalize(text)
            self.words.append(self._tokenize(text))
            ids.extend(self.token_ids(self.tokenize(text)))
        if not offsets:
            return None
        as_long = {"dtype": torch.int64, "device": self.device}
        return torch.tensor(ids, **as_long), torch.tensor(offsets, **as_long)

    def normalize(self, text: str) -> str:
        """TorchServe's clean-up, in its order."""
        text = self._remove_html_tags(text).lower()
        text = self._expand_contractions(text)
        text = self._remove_accented_characters(text)
        return self._remove_punctuation(text)

    def tokenize(self, text: str) -> list[str]:
        """Words, then each run of 2 .. ``ngrams`` words joined by a space."""
        words = self._tokenize(text)
        tokens = list(words)
        for n in range(2, self.ngrams + 1):
            tokens += [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]
        return tokens

    def token_ids(self, tokens: list[str]) -> list[int]:
        vocab = self.vocab or {}
        ids = []
        for token in tokens:
            index = vocab.get(token, self.unknown_index)
            if index is not None:
                ids.append(index)
        return ids

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        token_ids, offsets = data
        return BaseHandler.inference(self, token_ids, offsets, *args, **kwargs)

    def postprocess(self, data: Any) -> list[Any]:
        import torch

        return map_class_to_label(torch.softmax(data, dim=1).tolist(), self.mapping, None)

    def get_insights(self, text_preprocess: Any, raw_data: Any, target: Any = 0) -> Any:
        """TorchServe's answer, for each request: ``{"importances": ..., "words": ...}``, the
        layer integrated gradients of the ``target`` class's score at the embedding layer's
        output (from an all-index-0 reference, as captum's ``TokenReferenceBase()``), through
        ``summarize_attributions``, and the request's words (without n-grams). An
        ``EmbeddingBag`` model's embedding output is one row per request, so its importances
        are ``[[one per embedding dimension]]``, as in TorchServe."""
        import torch

        token_ids, offsets = text_preprocess
        lig = self.lig
        bag = torch.zeros(1, dtype=torch.int64, device=self.device)  # each request alone
        starts = [*offsets.tolist(), len(token_ids)]
        words = self.words if self.words and len(self.words) == len(offsets) else None
        with torch.no_grad():
            scores = self.model(token_ids[: starts[1]], bag)
        target = checked_target(target, int(scores.shape[-1]))
        results = []
        for i in range(len(offsets)):
            ids = token_ids[starts[i] : starts[i + 1]]
            attributions = lig.attribute(
                ids, torch.zeros_like(ids), additional_forward_args=(bag,), target=target
            )
            results.append(
                {
                    "importances": self.summarize_attributions(attributions).tolist(),
                    "words": self.get_word_token(words[i]) if words else [],
                }
            )
        return results


def request_text(value: Any) -> str:
    """The text of one request: a text body, UTF-8 bytes, or a JSON object's ``text``."""
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"the text is not UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise BadInput(
        f"expected text (a text body, or JSON {{'text': ...}}), found {type(value).__name__}"
    )


def load_vocab(model_dir: str) -> tuple[dict[str, int], int | None]:
    """The archive's vocabulary as ``{token: index}`` and the index for unknown tokens."""
    pt_path = os.path.join(model_dir, SOURCE_VOCAB)
    json_path = os.path.join(model_dir, VOCAB_JSON)
    if os.path.isfile(pt_path):
        vocab, default = _vocab_object(pt_path)
    elif os.path.isfile(json_path):
        with open(json_path, encoding="utf-8") as f:
            vocab, default = json.load(f), None
        if isinstance(vocab, list):
            vocab = {token: i for i, token in enumerate(vocab)}
    else:
        raise ModelLoadError(
            f"text_classifier needs a vocabulary in the archive (--extra-files): {SOURCE_VOCAB} "
            f"or {VOCAB_JSON}; neither is in {model_dir}"
        )
    if not isinstance(vocab, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()
    ):
        raise ModelLoadError(
            "the vocabulary must map tokens (str) to indexes (int): a dict, a list of tokens "
            f"({VOCAB_JSON}), or an object with get_stoi() or stoi ({SOURCE_VOCAB}); "
            f"found {type(vocab).__name__}"
        )
    return vocab, default if default is not None else vocab.get(UNKNOWN)


def _vocab_object(path: str) -> tuple[Any, int | None]:
    """``source_vocab.pt``: a plain dict loads with weights_only; a vocab object (torchtext)
    needs full unpickling, which the archive's own code could do anyway."""
    import torch

    try:
        vocab = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        vocab = torch.load(path, map_location="cpu", weights_only=False)
    default = None
    if callable(getattr(vocab, "get_default_index", None)):
        default = vocab.get_default_index()
    if callable(getattr(vocab, "get_stoi", None)):
        vocab = vocab.get_stoi()
    elif hasattr(vocab, "stoi"):
        vocab = vocab.stoi
    return dict(vocab) if isinstance(vocab, dict) else vocab, default
