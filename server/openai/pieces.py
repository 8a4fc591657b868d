"""What a generative handler sends back, read into text and token counts, with ``stop`` and
``max_tokens`` applied by the server so that every handler honours them.

A piece (one streamed chunk, or the whole answer of a handler that does not stream) is either
plain UTF-8 text, one token, or a JSON object (docs/generative.md):
``{"text": "...", "tokens": 1, "prompt_tokens": 12, "finish_reason": "stop"}``, every key
optional; ``ids`` (a list of token ids, as TorchServe's LLM examples send) counts as
``tokens`` when that is absent. An embedding model answers ``{"embedding": [...],
"prompt_tokens": N}`` or the list of floats alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from mserve_worker import fastjson
from server.openai.request import OpenAIError
from server.tenants.tokens import json_piece, piece_tokens


@dataclass
class Piece:
    text: str
    tokens: int
    prompt_tokens: int | None = None
    finish_reason: str | None = None


def read_piece(data: bytes) -> Piece:
    piece = json_piece(data)  # read as tenants' token quotas read it
    if piece is not None:
        fields, text = piece
        prompt = fields.get("prompt_tokens")
        reason = fields.get("finish_reason")
        return Piece(
            text,
            piece_tokens(fields, text),
            prompt if type(prompt) is int else None,
            reason if reason in ("stop", "length") else None,
        )
    text = data.decode("utf-8", "replace")
    return Piece(text, 1 if text else 0)


def read_embedding(data: bytes, model: str) -> tuple[list[float], int]:
    """(the vector, prompt tokens) of an embedding model's answer."""
    try:
        fields = fastjson.loads(data)
    except (ValueError, UnicodeDecodeError):
        fields = None
    prompt = 0
    if isinstance(fields, dict):
        prompt = fields.get("prompt_tokens") if type(fields.get("prompt_tokens")) is int else 0
        fields = fields.get("embedding")
    if not isinstance(fields, list) or not all(
        type(x) in (int, float) for x in fields
    ):  # fmt: skip
        raise OpenAIError(
            500,
            f"the handler of model {model!r} answered an embedding request with"
            f' {bytes(data[:80])!r}, not a list of numbers or {{"embedding": [...]}}',
        )
    return [float(x) for x in fields], prompt


class Choice:
    """One of the ``n`` answers: its text so far, its tokens, and whether it is finished,
    with ``stop`` strings cut out (text that may begin one is held back until it cannot)."""

    def __init__(self, index: int, stop: tuple[str, ...], max_tokens: int) -> None:
        self.index = index
        self.stop = stop
        self.max_tokens = max_tokens
        self.text: list[str] = []
        self.tokens = 0
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self._held = ""  # text not yet released: it may be the start of a stop string
        self._hold = max((len(s) for s in stop), default=1) - 1

    def add(self, piece: Piece) -> str:
        """Take a piece; return the text that may go to the client now. ``finish_reason`` is
        set once the choice is done (a stop string, ``max_tokens``, or the handler said so)."""
        if self.finish_reason is not None:
            return ""
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        self.tokens += piece.tokens
        out = self._scan(piece.text)
        if self.finish_reason is None:
            if piece.finish_reason is not None:
                self.finish_reason = piece.finish_reason
            elif self.tokens >= self.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                out += self._held
                self._held = ""
        self.text.append(out)
        return out

    def end(self) -> str:
        """The handler finished: release what was held back."""
        if self.finish_reason is not None:
            return ""
        out, self._held = self._held, ""
        self.finish_reason = "stop"
        self.text.append(out)
        return out

    def _scan(self, text: str) -> str:
        if not self.stop:
            return text
        held = self._held + text
        cut = min((i for i in (held.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.finish_reason = "stop"
            return held[:cut]
        keep = min(self._hold, len(held))
        # hold back only a tail that could still grow into a stop string
        while keep and not any(s.startswith(held[-keep:]) for s in self.stop):
            keep -= 1
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]

    @property
    def content(self) -> str:
        return "".join(self.text)


def usage(choices: list[Choice]) -> dict[str, int]:
    """OpenAI's usage: the prompt counted once, the completions of every choice."""
    prompt = max((c.prompt_tokens for c in choices), default=0)
    completion = sum(c.tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
