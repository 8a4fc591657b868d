"""Where a recorded request goes: the URL of the same call on the target, for the API it was
recorded on or the one the target speaks (TorchServe's REST API, KServe v1, the Open Inference
Protocol over REST, or the OpenAI API)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from server.replay.records import Recorded

APIS = ("auto", "torchserve", "v1", "v2", "openai")


@dataclass(frozen=True)
class Target:
    """``url``: a base (``http://host:8080``), whose paths are made per API, or a full
    endpoint (``http://host:8080/predictions/m/2.0``) every request goes to. ``model`` and
    ``version``: the target's, when they differ from the recorded ones (a version on a
    running mserve: ``version="2.0"``)."""

    url: str
    api: str = "auto"
    model: str | None = None
    version: str | None = None

    @property
    def fixed(self) -> bool:
        return urlsplit(self.url).path.strip("/") != ""

    def endpoint(self, record: Recorded) -> str:
        if self.fixed:
            return self.url
        base = self.url.rstrip("/")
        model = quote(self.model or record.model, safe="")
        version = self.version
        api = self.api if self.api != "auto" else record.api or guess_api(record.request)
        if api == "v2":
            at = f"/versions/{quote(version, safe='')}" if version else ""
            op = "explain" if record.op == "explain" else "infer"
            return f"{base}/v2/models/{model}{at}/{op}"
        if api == "v1":
            return f"{base}/v1/models/{model}:{'explain' if record.op == 'explain' else 'predict'}"
        if api == "openai":
            chat = b'"messages"' in record.request
            return f"{base}/v1/{'chat/completions' if chat else 'completions'}"
        at = f"/{quote(version, safe='')}" if version else ""
        kind = "explanations" if record.op == "explain" else "predictions"
        return f"{base}/{kind}/{model}{at}"

    def body(self, record: Recorded) -> bytes:
        """The request's bytes; an OpenAI request names the target's model when one is set."""
        api = self.api if self.api != "auto" else record.api or guess_api(record.request)
        if api == "openai" and self.model:
            try:
                doc = json.loads(record.request)
            except ValueError:
                return record.request
            if isinstance(doc, dict):
                doc["model"] = self.model
                return json.dumps(doc).encode()
        return record.request


def guess_api(body: bytes) -> str:
    """The API a CloudEvent's request was sent to (the event does not say): OIP tensors,
    KServe v1 instances, an OpenAI chat or completion, else TorchServe's body as it is."""
    head = body[:4096]
    if not head.lstrip().startswith(b"{"):
        return "torchserve"
    try:
        doc = json.loads(body)
    except ValueError:
        return "torchserve"
    if not isinstance(doc, dict):
        return "torchserve"
    inputs = doc.get("inputs")
    if (
        isinstance(inputs, list)
        and inputs
        and all(isinstance(t, dict) and "datatype" in t for t in inputs)
    ):
        return "v2"
    if "instances" in doc:
        return "v1"
    if "model" in doc and ("messages" in doc or "prompt" in doc):
        return "openai"
    return "torchserve"


def headers_from(pairs: tuple[str, ...], key_file: Path | None) -> dict[str, str]:
    """Headers every replayed request carries: ``Name: value`` pairs, and the inference key of
    an mserve or TorchServe key file as ``Authorization``. ValueError names a bad one."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {pair!r} should be 'Name: value'")
        out[name.strip()] = value.strip()
    if key_file is not None:
        try:
            key = json.loads(key_file.read_text())["inference"]["key"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--key-file {key_file}: no inference key in it ({exc})") from None
        out["Authorization"] = f"Bearer {key}"
    return out
