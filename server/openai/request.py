"""An OpenAI request, parsed at the edge: the body checked against a JSON Schema (jsonschema, as
the manifest is), the model's ``generative:`` declaration read, and the JSON each of the ``n``
jobs carries to the handler built.

What the handler receives (docs/generative.md): ``{"kind": "chat" | "completion" |
"embedding", "messages": [...], "prompt": "...", "max_tokens": N, "max_new_tokens": N,
"temperature", "top_p", "seed", "stop": [...], "stream": bool, "ignore_eos": bool}``: ``prompt``
is also set for a chat (the messages as ``role: content`` lines ending in ``assistant:``),
``max_new_tokens`` repeats ``max_tokens``, the names TorchServe's LLM examples read, and
``ignore_eos`` is vLLM's extension. With ``input: text`` the body
is the prompt alone, as plain text, for a TorchServe streaming handler that reads its prompt
from the body.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from archiver.jsonschema_import import import_jsonschema
from server.errors import MserveError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; a chat without one gets the context
MAX_N = 16  # choices per request: each one is a job on the model's queue
MAX_STOP = 4  # OpenAI's bound


# Asked for, they would change the answer's meaning: refused rather than ignored.
_UNSUPPORTED = (
    ("tools", "tools (function calling) are"),
    ("functions", "functions are"),
    ("logprobs", "log probabilities are"),
    ("response_format", "structured output is"),
)


class OpenAIError(MserveError):
    """A refusal in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``
    (server/http/answer.py writes it for every error on ``/openai/`` paths)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


_NUMBER_OR_NULL = {"type": ["number", "null"]}
_SAMPLING = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {**_NUMBER_OR_NULL, "minimum": 0, "maximum": 2},
    "top_p": {**_NUMBER_OR_NULL, "minimum": 0, "maximum": 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
    "seed": {"type": ["integer", "null"]},
    "stream": {"type": ["boolean", "null"]},
    "ignore_eos": {"type": ["boolean", "null"]},  # vLLM's extension (benchmarks send it)
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "stop": {
        "oneOf": [
            {"type": "null"},
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "maxItems": MAX_STOP,
            },
        ]
    },
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {"type": "null"},
                {"type": "array", "items": _TEXT_PART},
            ]
        },
        "name": {"type": "string"},
    },
    "required": ["role", "content"],
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "chat": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        },
        "required": ["model", "messages"],
    },
    "completion": {
        "type": "object",
        "properties": {
            **_SAMPLING,
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                ]
            },
        },
        "required": ["model", "prompt"],
    },
    "embedding": {
        "type": "object",
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                ]
            },
            "encoding_format": {"enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1},
        },
        "required": ["model", "input"],
    },
}


if TYPE_CHECKING:
    import jsonschema


@functools.cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    """Built at the first OpenAI request of its kind: importing jsonschema takes ~60 ms, which
    every server start (on the path to its first answer) would pay for an API most never use."""
    return import_jsonschema().Draft202012Validator(SCHEMAS[kind])


@dataclass(frozen=True)
class Generative:
    """A model's ``generative:`` section (its model config): how it takes OpenAI requests."""

    context_length: int | None  # tokens; max_tokens above it is refused
    input: str  # "json" (the handler gets the request as JSON) or "text" (the prompt alone)
    chat: bool  # answers /chat/completions and /completions
    embeddings: bool  # answers /embeddings


def generative(model_name: str, config: dict[str, Any]) -> Generative | None:
    """The model's declaration; None when it has none (it is not served under /openai/)."""
    section = config.get("generative")
    if section is None:
        return None
    where = f"model {model_name}: generative"
    if section is True:
        section = {}
    if not isinstance(section, dict):
        raise OpenAIError(500, f"{where} must be a mapping, found {section!r}")
    unknown = sorted(set(section) - {"context_length", "input", "chat", "embeddings"})
    if unknown:
        raise OpenAIError(500, f"{where}: unknown key(s) {', '.join(unknown)}")
    length = section.get("context_length")
    if length is not None and (type(length) is not int or length < 1):
        raise OpenAIError(
            500, f"{where}.context_length must be a positive integer, found {length!r}"
        )
    mode = section.get("input", "json")
    if mode not in ("json", "text"):
        raise OpenAIError(500, f"{where}.input must be 'json' or 'text', found {mode!r}")
    embeddings = section.get("embeddings", False)
    chat = section.get("chat", not embeddings)
    return Generative(length, mode, bool(chat), bool(embeddings))


@dataclass(frozen=True)
class Completion:
    """A chat or completion request, checked."""

    kind: str  # "chat" or "completion"
    model: str
    messages: list[dict[str, Any]] | None
    prompt: str
    max_tokens: int
    temperature: float | None
    top_p: float | None
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False

    def handler_body(self, declared: Generative, choice: int) -> tuple[str, bytes]:
        """(content type, body) of choice ``choice``'s job. Choices differ by their seed, so
        that n > 1 with a seed is reproducible and gives n different answers."""
        if declared.input == "text":
            return "text/plain; charset=utf-8", self.prompt.encode()
        body = {
            "kind": self.kind,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": None if self.seed is None else self.seed + choice,
            "stop": list(self.stop),
            "stream": self.stream,
            "ignore_eos": self.ignore_eos,
        }
        if self.messages is not None:
            body["messages"] = self.messages
        return "application/json", json.dumps(body).encode()


@dataclass(frozen=True)
class Embedding:
    model: str
    inputs: list[str]
    base64: bool


def read_body(kind: str, raw: bytes) -> dict[str, Any]:
    """The body as JSON, checked against the schema of ``kind``; an OpenAI 400 naming the
    parameter otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    from jsonschema.exceptions import best_match  # once imported, a dictionary lookup

    error = best_match(_validator(kind).iter_errors(body))
    if error is not None:
        param = _param(error.absolute_path)
        raise OpenAIError(400, f"{param or 'body'}: {error.message}", param or None, None)
    return body


def completion(kind: str, body: dict[str, Any], declared: Generative) -> Completion:
    """A checked chat or completion request (``body`` passed :func:`read_body`)."""
    for param, what in _UNSUPPORTED:
        value = body.get(param)
        if value and not (param == "response_format" and value == {"type": "text"}):
            raise OpenAIError(400, f"{param}: {what} not supported by mserve's OpenAI API",
                              param, "unsupported_parameter")  # fmt: skip
    given = body.get("max_completion_tokens") or body.get("max_tokens")
    param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    limit = declared.context_length
    if given is not None and limit is not None and given > limit:
        raise OpenAIError(
            400,
            f"{param}={given} is more than the context length of model {body['model']!r}"
            f" ({limit} tokens)",
            param,
            "context_length_exceeded",
        )
    if given is None:
        given = limit if kind == "chat" and limit is not None else DEFAULT_MAX_TOKENS
    messages = body.get("messages")
    if kind == "chat":
        messages = [
            {"role": m["role"], "content": _content(m.get("content"))} for m in messages or ()
        ]
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    else:
        raw = body["prompt"]
        prompt = raw if isinstance(raw, str) else raw[0]
    stop = body.get("stop") or ()
    options = body.get("stream_options") or {}
    return Completion(
        kind=kind,
        model=body["model"],
        messages=messages,
        prompt=prompt,
        max_tokens=given,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        n=body.get("n") or 1,
        seed=body.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        ignore_eos=bool(body.get("ignore_eos")),
    )


def embedding(body: dict[str, Any]) -> Embedding:
    raw = body["input"]
    inputs = [raw] if isinstance(raw, str) else list(raw)
    return Embedding(body["model"], inputs, body.get("encoding_format") == "base64")


def _content(content: Any) -> str:
    """A message's text: a string, or the text parts of a list joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _param(path: Any) -> str:
    """jsonschema's path as OpenAI names a parameter: ``messages[0].role``."""
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out
