"""``TextHandler``: the text clean-up steps TorchServe's text handlers share, for subclasses.

A handler that subclassed TorchServe's ``TextHandler`` keeps calling ``_remove_html_tags``,
``_expand_contractions``, ``_remove_accented_characters``, ``_remove_punctuation`` and
``_tokenize`` (torchtext's ``basic_english`` rules, without torchtext), and reads
``self.source_vocab`` (the archive's ``source_vocab.pt`` as ``torch.load`` returns it, or
``vocab.json``). Each step gives what TorchServe's gives for the same text. ``self.lig`` is captum's
``LayerIntegratedGradients`` over the model's ``embedding`` layer, as TorchServe's, made (and captum
imported) when first used.
"""

from __future__ import annotations

import os
import re
import string
import unicodedata
from typing import Any

from .base_handler import BaseHandler, ModelLoadError
from .insights import captum_attr

SOURCE_VOCAB = "source_vocab.pt"

# Tags and HTML entities (``&amp;``, ``&#39;``), removed outright.
_CLEANUP = re.compile(r"<.*?>|&([a-z0-9]+|#[0-9]{1,6}|#x[0-9a-f]{1,6});")
# torchtext's basic_english: what each character becomes before splitting on white space.
_BASIC_ENGLISH = [
    (re.compile(r"'"), " '  "),
    (re.compile(r'"'), ""),
    (re.compile(r"\."), " . "),
    (re.compile(r"<br \/>"), " "),
    (re.compile(r","), " , "),
    (re.compile(r"\("), " ( "),
    (re.compile(r"\)"), " ) "),
    (re.compile(r"!"), " ! "),
    (re.compile(r"\?"), " ? "),
    (re.compile(r";"), " "),
    (re.compile(r":"), " "),
    (re.compile(r"\s+"), " "),
]


def _contractions() -> dict[str, str]:
    """English contractions and their expansions, the set TorchServe's text handlers expand
    (its longer forms such as ``could've`` + ``n't`` never match before their prefix there)."""
    table = {
        "ain't": "is not", "can't": "cannot", "won't": "will not", "shan't": "shall not",
        "sha'n't": "shall not", "mayn't": "may not", "'cause": "because", "ma'am": "madam",
        "o'clock": "of the clock", "let's": "let us", "so's": "so as", "how'd": "how did",
        "where'd": "where did", "how'd'y": "how do you", "y'all": "you all",
        "i'm": "i am",
    }  # fmt: skip
    suffixes = {
        "n't": (" not", "are could did does do had has have is might must need ought should "
                        "was were would"),
        "'ll": (" will", "he how i it she they we what who you"),
        "'d": (" would", "he i it she that there they we you"),
        "'s": (" is", "he how it she that there what when where who why"),
        "'re": (" are", "they we what you"),
        "'ve": (" have", "could i might must should they we what when where who why will would "
                         "you so to"),
    }  # fmt: skip
    for suffix, (expansion, words) in suffixes.items():
        for word in words.split():
            table.setdefault(word + suffix, word + expansion)
    return table


class TextHandler(BaseHandler):
    """Loads the vocabulary next to the model; offers TorchServe's text clean-up steps."""

    source_vocab: Any = None
    _contraction_map: dict[str, str] | None = None
    _contraction_pattern: Any = None

    def initialize(self, context: Any) -> None:
        """Load the model, then ``source_vocab.pt`` (the manifest's ``sourceVocab`` when set)."""
        super().initialize(context)
        model_info = (self.manifest or {}).get("model", {})
        path = model_info.get("sourceVocab") or self.get_source_vocab_path(context)
        import torch

        self.source_vocab = torch.load(path, map_location="cpu", weights_only=False)

    @property
    def lig(self) -> Any:
        """captum's ``LayerIntegratedGradients`` over ``model.embedding``. TorchServe builds it in
        ``initialize``; here the first explanation does, so predictions never need captum. A
        subclass that sets its own keeps it."""
        lig = self.__dict__.get("lig")
        if lig is None:
            attr = captum_attr(type(self).__name__)
            layer = getattr(self.model, "embedding", None)
            if layer is None:
                raise NotImplementedError(
                    f"{type(self).__name__} explains through the model's embedding layer, "
                    f"model.embedding (as TorchServe's), and {type(self.model).__name__} has "
                    f"none: name that layer 'embedding', or override get_insights"
                )
            import torch

            if isinstance(self.model, torch.jit.ScriptModule):
                raise NotImplementedError(
                    f"{type(self).__name__} explains by hooking model.embedding, which a "
                    f"TorchScript model does not allow: archive the eager model (--model-file "
                    f"and its state dict as --serialized-file), or override get_insights"
                )
            lig = self.__dict__["lig"] = attr.LayerIntegratedGradients(self.model, layer)
        return lig

    @lig.setter
    def lig(self, value: Any) -> None:
        self.__dict__["lig"] = value

    def get_source_vocab_path(self, ctx: Any) -> str:
        path = os.path.join(ctx.system_properties.get("model_dir") or ".", SOURCE_VOCAB)
        if not os.path.isfile(path):
            raise ModelLoadError(
                f"{type(self).__name__} needs the vocabulary {SOURCE_VOCAB} in the archive "
                f"(--extra-files); {path} does not exist"
            )
        return path

    def _remove_html_tags(self, text: str) -> str:
        return _CLEANUP.sub("", text)

    def _expand_contractions(self, text: str) -> str:
        """``don't`` -> ``do not`` (any case; the first letter keeps its case), then drop the
        apostrophes left."""
        cls = type(self)
        if cls._contraction_pattern is None:
            cls._contraction_map = _contractions()
            alternatives = "|".join(re.escape(c) for c in cls._contraction_map)
            cls._contraction_pattern = re.compile(f"({alternatives})", re.IGNORECASE)
        table = cls._contraction_map or {}

        def expand(match: Any) -> str:
            found = match.group(0)
            return found[0] + table[found.lower()][1:]

        return cls._contraction_pattern.sub(expand, text).replace("'", "")

    def _remove_accented_characters(self, text: str) -> str:
        """Accents off, and every character that has no ASCII form dropped."""
        return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")

    def _remove_punctuation(self, text: str) -> str:
        return text.translate(str.maketrans("", "", string.punctuation))

    def _remove_puncutation(self, *args: Any, **kwargs: Any) -> str:
        """TorchServe's original, misspelled name."""
        return self._remove_punctuation(*args, **kwargs)

    def _tokenize(self, text: str) -> list[str]:
        """torchtext's ``basic_english``: lower case, punctuation split off, white space split."""
        text = text.lower()
        for pattern, replacement in _BASIC_ENGLISH:
            text = pattern.sub(replacement, text)
        return text.split()

    def get_word_token(self, input_tokens: list[str]) -> list[str]:
        """Tokens without the ``Ġ`` a BPE tokenizer marks spaces with."""
        return [token.replace("\u0120", "") for token in input_tokens]

    def summarize_attributions(self, attributions: Any) -> Any:
        """Softmax over the last dimension, scaled by the norm of its sums."""
        import torch

        attributions = torch.softmax(attributions, dim=-1)
        return attributions / torch.norm(attributions.sum(dim=-1))
