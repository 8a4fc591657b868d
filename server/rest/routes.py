"""The inference paths, parsed in one place: TorchServe's, KServe v1's, the Open Inference
Protocol's (KServe v2) and the OpenAI-compatible API's (under ``/openai/v1/``, where KServe
serves it: ``/v1/models/...`` stays KServe v1's). Sans-IO: path segments and a method in, a
:class:`Route` out; the inference port's router (server/rest/inference.py) and the Ray Serve
ingress (server/rayserve/ingress.py) both act on it, so a path means the same on either engine.

Per request: one tuple, no dataclass ``__init__`` (this is on the frontend's hot path).
"""

from __future__ import annotations

from typing import NamedTuple

from server.errors import BadRequest

# What a route asks for (Route.kind)
INFER = "infer"  # a prediction, explanation or custom operation of one model
PING = "ping"  # TorchServe's health
MODELS = "models"  # TorchServe's model list on the inference port
V1_MODELS = "v1-models"  # KServe v1: the model names
V1_READY = "v1-ready"  # KServe v1: one model's readiness
V2_SERVER = "v2-server"  # OIP: the server's metadata
V2_LIVE = "v2-live"  # OIP: the server is live
V2_READY = "v2-ready"  # OIP: the server is ready
V2_MODEL = "v2-model"  # OIP: a model's metadata
V2_MODEL_READY = "v2-model-ready"  # OIP: a model's readiness
OPENAI = "openai"  # the OpenAI-compatible API (server/openai/): ``op`` says which call
WFPREDICT = "wfpredict"  # TorchServe's workflow prediction (server/rest/workflows.py)

# /openai/v1/<path> -> (Route.op, methods)
_OPENAI = {
    ("chat", "completions"): ("chat", ("POST",)),
    ("completions",): ("completion", ("POST",)),
    ("embeddings",): ("embedding", ("POST",)),
    ("models",): ("models", ("GET",)),
}

_GET = ("GET",)
_POST = ("POST",)


class Route(NamedTuple):
    kind: str
    methods: tuple[str, ...]  # what the path allows (HEAD counts as GET): else 405
    model: str | None = None
    version: str | None = None
    op: str = ""  # INFER: "" (predict), "explain", or a custom operation's name
    api: str = ""  # INFER: "" (TorchServe's body), "v1" or "v2" (the worker reads tensors)
    url_path: str | None = None  # INFER on TorchServe's paths: the ``url_path`` header's value

    @property
    def explain(self) -> bool:
        """The request carries TorchServe's ``explain: True`` header (handlers look at it)."""
        return self.op == "explain"


def match(parts: list[str], method: str) -> Route | None:
    """The route of a path split at ``/`` (empty segments dropped); None: no such path (404).
    ``method`` only tells a model's OIP readiness (GET) from a custom operation named ``ready``
    (POST). An operation that is not a name is a 400."""
    n = len(parts)
    head = parts[0] if n else ""
    if (head == "predictions" or head == "explanations") and n >= 2:
        # TorchServe 0.11+: the segment after the model is its version; the rest of the path
        # reaches the handler as the url_path header (empty without one)
        return Route(
            INFER, ("POST", "PUT"), parts[1], parts[2] if n >= 3 else None,
            "" if head == "predictions" else "explain", "", "/".join(parts[3:]),
        )  # fmt: skip
    if head == "v2":
        return _v2(parts[1:], method)
    if head == "openai":
        if n < 3 or parts[1] != "v1":
            return None
        if n == 4 and parts[2] == "models":  # one model (the client's models.retrieve)
            return Route(OPENAI, _GET, parts[3], None, "model")
        found = _OPENAI.get(tuple(parts[2:]))
        return None if found is None else Route(OPENAI, found[1], None, None, found[0])
    if head == "wfpredict" and n == 2:
        return Route(WFPREDICT, ("POST", "PUT"), parts[1])
    if n == 1:
        if head == "ping":
            return Route(PING, _GET)
        if head == "models":
            return Route(MODELS, _GET)
        return None
    if head == "v1" and parts[1] == "models":
        if n == 2:
            return Route(V1_MODELS, _GET)
        if n != 3:
            return None
        name, colon, verb = parts[2].rpartition(":")
        if not colon:
            return Route(V1_READY, _GET, parts[2])
        if verb == "predict":
            return Route(INFER, _POST, name, None, "", "v1")
        if verb == "explain":
            return Route(INFER, _POST, name, None, "explain", "v1")
    return None


def _v2(parts: list[str], method: str) -> Route | None:
    n = len(parts)
    if n == 0:
        return Route(V2_SERVER, _GET)
    if n == 2 and parts[0] == "health":
        if parts[1] == "live":
            return Route(V2_LIVE, _GET)
        if parts[1] == "ready":
            return Route(V2_READY, _GET)
        return None
    if n < 2 or parts[0] != "models":
        return None
    name, rest, version = parts[1], parts[2:], None
    if len(rest) >= 2 and rest[0] == "versions":
        version, rest = rest[1], rest[2:]
    if not rest:
        return Route(V2_MODEL, _GET, name, version)
    if len(rest) != 1:
        return None
    op = rest[0]
    if op == "ready" and method in ("GET", "HEAD"):
        return Route(V2_MODEL_READY, _GET, name, version)
    if op == "infer" or op == "predict":
        return Route(INFER, _POST, name, version, "", "v2")
    if op == "explain":
        return Route(INFER, _POST, name, version, "explain", "v2")
    if not op.isidentifier():
        raise BadRequest(f"operation {op!r} is not a valid name (letters, digits and '_')")
    return Route(INFER, _POST, name, version, op, "")  # a custom operation: its own body
