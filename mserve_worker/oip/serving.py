"""What a handler receives for a v2 (Open Inference Protocol) or v1 (KServe) request, and how
its results become the answer. Runs in the worker: standard library only, Python 3.8+, numpy
imported at the first tensor request when the model's environment has it.

Decoding happens here, in the worker, not in the server: the server process is shared by every
model and only routes bytes (the binary tensor data stays as sent, in the frame's payload, and
becomes a numpy array over that buffer without a copy); the worker runs in the model's own
environment, knows numpy, and pays for its own model's JSON.

v2 requests, by handler style:

- ``v2-model`` and ``hooks`` get decoded tensors; TorchServe's styles (module function, handler
  class, ``BaseHandler``) get them when the model config says ``kserveEnvelope: true``, else the
  body exactly as on ``/predictions``. Decoded, ``data[i]`` is ``{"body": {name: array}, "id",
  "parameters", "outputs"}`` (numpy arrays, or nested lists without numpy); a hooks pipeline sees
  ``{name: array}`` as its inputs and a v2 model class's ``predict`` gets ``{"id", "inputs":
  {name: array}, "parameters", "outputs"}``. What the handler returns for the request (an array,
  a list, a torch tensor, or a dict of name -> one of those) becomes the outputs, with the
  datatypes the signature declares.
- A JSON body that is not an OIP request (``inputs`` not a list of tensor objects, such as mlrun's
  ``{"inputs": [[1, 2]]}``) reaches the handler as on ``/predictions``, unless the model
  declares ``inputs`` (400).
- Kernels always get the body as on ``/predictions``.

v1 requests (``{"instances": [...]}``) go to the handler as on ``/predictions`` (a v2 model class
gets the instances as ``request["inputs"]``, a hooks pipeline as its input ``instances``); the
answer is ``{"predictions": ...}`` (``"explanations"`` for explain), unless the handler already
returned such an object.

The server-wide envelope (``service_envelope``, TorchServe's setting) changes that for
TorchServe's styles, unless the model config says ``kserveEnvelope: false``:

- ``kserve`` / ``json``: each instance of a v1 request is one row of the handler's batch (as
  TorchServe's envelopes hand them over), and the request's answer is ``{"predictions": [one
  output per instance]}``. On TorchServe's paths (``/predictions``, ``/explanations``) a JSON
  body with a list ``instances`` is read the same way; any other body is handed over as usual.
- ``kservev2``: v2 tensors are decoded as with ``kserveEnvelope: true``, and an OIP request
  sent to TorchServe's paths is read and answered as on ``/v2/models/{m}/infer``.
- ``body``: each row is the request's body itself (``data[i]`` is what ``data[i]["body"]``
  would be), except decoded v2 tensors; answers are unchanged.

Errors on either path are answered as ``{"error": "..."}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import fastjson
from ..payload import JSON, OCTET_STREAM, PayloadError, decode_request
from ..protocol import RequestItem, ResponseItem
from .decode import to_array, to_lists
from .encode import output_tensor
from .signature import ENVELOPE_KEY, Signature, SignatureError, check_output, parse_signature
from .tensors import HEADER_LENGTH, InferRequest, OIPError
from .wire import encode_response, parse_request, request_from_json

_TORCHSERVE_STYLES = ("module-function", "handler-class", "class-instance")
_NATIVE_STYLES = ("hooks", "v2-model")
DEFAULT_OUTPUT = "output_0"


@dataclass
class Prepared:
    """One request, read: the handler's ``data[i]``, the group it joins and what the answer
    needs (``request`` for v2 tensors)."""

    row: Any
    api: str  # "v2" (tensors), "v1", or "" (the body as on /predictions)
    request: InferRequest | None = None
    # Split by the kserve/json envelope: ``row`` is the list of instances, one batch row each.
    rows: int | None = None


class OipServing:
    """The v1/v2 reading and answering of one worker's model."""

    def __init__(
        self, config: dict[str, Any], style: str, model: str, version: str,
        service_envelope: str = "",
    ) -> None:  # fmt: skip
        self.signature: Signature = parse_signature(config)
        explicit = config.get(ENVELOPE_KEY)  # the model's own word wins over the server's
        if explicit is not None and not isinstance(explicit, bool):
            raise SignatureError(f"model config '{ENVELOPE_KEY}' should be true or false")
        self.style = style
        torchserve = style in _TORCHSERVE_STYLES and explicit is not False
        self.tensors = style in _NATIVE_STYLES or (
            torchserve and (explicit is True or service_envelope == "kservev2")
        )
        self.split = torchserve and service_envelope in ("kserve", "json")
        # whether TorchServe's paths are read through the envelope too
        self.enveloped = torchserve and service_envelope in ("kserve", "json", "kservev2")
        # "body": a row is the request's body itself (its "data" or "body"), not {"body": ...}
        self.bare = torchserve and service_envelope == "body"
        self.model = model
        self.version = version
        self._np: Any = None
        self._np_probed = False

    def numpy(self) -> Any:
        if not self._np_probed:
            self._np_probed = True
            try:
                import numpy
            except ImportError:
                numpy = None
            self._np = numpy
        return self._np

    # Requests.

    def prepare(self, item: RequestItem) -> Prepared:
        """Read one v1 or v2 request; raises OIPError (or PayloadError) for a bad one."""
        if item.api == "v1":
            return self._prepare_v1(item)
        if not self.tensors and self.signature.inputs is None:  # nothing to decode or check
            return Prepared(_as_on_predictions(item), "")
        header = _header(item.headers, HEADER_LENGTH)
        if header is not None:
            request = parse_request(item.body, header)
        else:
            doc = _json(item.body)
            if not _looks_oip(doc):
                if self.signature.inputs is not None:
                    request_from_json(doc)  # raises, saying what the body lacks
                return Prepared(self._plain_row(item, doc), "")
            request = request_from_json(doc)
        self.signature.check(request, self.model)
        if not self.tensors:  # checked against the signature, then handed over as it came
            if self.signature.inputs is not None:
                self._arrays(request)  # the data against the shapes
            return Prepared(self._plain_row(item, item.body if header is not None else doc), "")
        arrays = self._arrays(request)
        wanted = None if request.outputs is None else [o.name for o in request.outputs]
        row = {"body": arrays, "id": request.id, "parameters": request.parameters,
               "outputs": wanted}  # fmt: skip
        return Prepared(row, "v2", request)

    def _arrays(self, request: InferRequest) -> dict[str, Any]:
        np = self.numpy()
        if np is None:
            return {t.name: to_lists(t) for t in request.inputs}
        return {t.name: to_array(t, np) for t in request.inputs}

    def prepare_enveloped(self, item: RequestItem) -> Prepared:
        """A request on TorchServe's paths under the server's envelope: read as the envelope
        reads it when the body is in its shape, else handed over as on /predictions (api "")."""
        if self.split:  # TorchServe's envelope reads the row's "data" or "body" (gRPC's too)
            row = _as_on_predictions(item)
            doc = row.get("data") or row.get("body")
            if isinstance(doc, (bytes, bytearray)):
                doc = _json_or_none(doc)
            if isinstance(doc, dict) and isinstance(doc.get("instances"), list):
                return self._prepare_v1(item, doc)
            return Prepared(row, "")
        if _header(item.headers, HEADER_LENGTH) is not None or _looks_oip(_json_or_none(item.body)):
            return self.prepare(item)
        return Prepared(_as_on_predictions(item), "")

    def _prepare_v1(self, item: RequestItem, doc: Any = None) -> Prepared:
        if doc is None:
            doc = _json(item.body)
        instances = doc.get("instances", doc.get("inputs")) if isinstance(doc, dict) else None
        if not isinstance(instances, list):
            raise OIPError('a KServe v1 request is a JSON object {"instances": [...]}')
        if self.split:
            if not instances:
                raise OIPError("the request's 'instances' is empty: there is nothing to predict")
            return Prepared(instances, "v1", rows=len(instances))
        if self.style == "v2-model":
            return Prepared(self._plain_row(item, {"inputs": instances}), "v1")
        if self.style == "hooks":
            return Prepared(self._plain_row(item, {"instances": instances}), "v1")
        return Prepared(self._plain_row(item, doc), "v1")

    def _plain_row(self, item: RequestItem, body: Any) -> dict[str, Any]:
        """``data[i]`` as on /predictions, the body already parsed (or raw, for binary)."""
        if isinstance(body, (bytes, bytearray, memoryview)):
            return _as_on_predictions(item)
        row = {"body": body}
        for name, value in item.params.items():
            row.setdefault(name, value)
        return row

    # Answers.

    def answer(
        self, prepared: Prepared, output: Any, status: int, headers: list[list[str]], op: str
    ) -> ResponseItem:
        """The response to one request the handler answered with ``output``."""
        if status >= 400:
            return error_response(ResponseItem(status, _error_text(output), ""))
        if prepared.api == "v1":
            body = json.dumps(self._v1_body(output, op), default=_tolist).encode()
            return ResponseItem(status, body, JSON, headers)
        request = prepared.request
        assert request is not None
        if self.style == "v2-model" and isinstance(output, dict) and "outputs" in output:
            output = output["outputs"]
        np = self.numpy()
        tensors = [self._output(name, value, np) for name, value in self._named(output, request)]
        doc: dict[str, Any] = {"model_name": self.model, "model_version": self.version}
        if request.id is not None:
            doc["id"] = request.id
        parts, header = encode_response(
            doc, tensors, [request.binary_output(t.name) for t in tensors]
        )
        if header is None:
            return ResponseItem(status, parts[0], JSON, headers)
        headers = [*headers, [HEADER_LENGTH, str(header)]]
        return ResponseItem(status, b"".join(parts), OCTET_STREAM, headers)

    def _named(self, output: Any, request: InferRequest) -> list[tuple[str, Any]]:
        declared = self.signature.outputs
        if isinstance(output, dict):
            named = [(str(k), v) for k, v in output.items()]
        elif isinstance(output, tuple) and declared is not None and len(declared) > 1:
            if len(output) != len(declared):
                raise OIPError(
                    f"model {self.model} returned {len(output)} values for its"
                    f" {len(declared)} declared outputs", 500,
                )  # fmt: skip
            named = [(s.name, v) for s, v in zip(declared, output)]
        else:
            name = declared[0].name if declared else DEFAULT_OUTPUT
            if request.outputs and len(request.outputs) == 1 and not declared:
                name = request.outputs[0].name
            named = [(name, output)]
        if declared is not None:
            unknown = [n for n, _ in named if self.signature.output(n) is None]
            if unknown:
                raise OIPError(
                    f"model {self.model} returned output {unknown[0]!r}, which its signature does"
                    f" not declare (outputs: {', '.join(s.name for s in declared)})", 500,
                )  # fmt: skip
        if request.outputs is None:
            return named
        produced = dict(named)
        missing = [o.name for o in request.outputs if o.name not in produced]
        if missing:
            raise OIPError(
                f"model {self.model} produced no output {missing[0]!r}; it produced"
                f" {', '.join(produced)}"
            )
        return [(o.name, produced[o.name]) for o in request.outputs]

    def _output(self, name: str, value: Any, np: Any) -> Any:
        spec = self.signature.output(name)
        tensor = output_tensor(name, value, spec.datatype if spec else None, np)
        if spec is not None:
            check_output(tensor, spec, self.model)
        return tensor

    def _v1_body(self, output: Any, op: str) -> Any:
        key = "explanations" if op == "explain" else "predictions"
        if isinstance(output, (bytes, bytearray, str)):
            try:
                output = json.loads(output)
            except ValueError:
                output = output.decode("utf-8", "replace") if isinstance(output, bytes) else output
        if isinstance(output, dict):
            if "predictions" in output or "explanations" in output:
                return output
            if self.style == "v2-model" and "outputs" in output:
                output = output["outputs"]
            elif self.style == "hooks" and len(output) == 1:
                output = next(iter(output.values()))
        return {key: output}


def _as_on_predictions(item: RequestItem) -> dict[str, Any]:
    return decode_request(item.content_type, item.headers, item.body, item.params)


def _tolist(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _header(headers: list[Any], name: str) -> str | None:
    wanted = name.lower()
    for pair in headers:
        if pair[0].lower() == wanted:
            return str(pair[1])
    return None


def _json(body: Any) -> Any:
    try:
        return fastjson.loads(body)
    except ValueError as exc:
        raise OIPError(f"the body is not valid JSON: {exc}") from None


def bare_row(row: Any) -> Any:
    """TorchServe's body envelope: the row's ``data`` or ``body``, as its handlers read it."""
    if isinstance(row, dict):
        return row.get("data") or row.get("body")
    return row


def _json_or_none(body: Any) -> Any:
    """The JSON document of a body that may be another kind (an image): None if it is not."""
    first = bytes(body[:1])
    if first not in (b"{", b"[", b" ", b"\n", b"\r", b"\t"):
        return None  # not even JSON's first byte: spare the decoding of a large binary body
    try:
        return fastjson.loads(body)
    except ValueError:
        return None


def _looks_oip(doc: Any) -> bool:
    """An OIP request, as opposed to another JSON body sent to the same path: its ``inputs``
    is a list whose first entry is an object with a ``name``."""
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    return (
        isinstance(inputs, list)
        and bool(inputs)
        and isinstance(inputs[0], dict)
        and ("name" in inputs[0])
    )


def _error_text(body: Any) -> str:
    """The message of an error body: TorchServe's ``{"message"}``, OIP's ``{"error"}``, text."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        text = bytes(body).decode("utf-8", "replace")
        try:
            body = json.loads(text)
        except ValueError:
            return text
    if isinstance(body, dict):
        for key in ("error", "message"):
            if isinstance(body.get(key), str):
                return body[key]
    return body if isinstance(body, str) else json.dumps(body, default=str)


def error_response(response: ResponseItem) -> ResponseItem:
    """A failed answer to a v1/v2 request in OIP's shape, ``{"error": "..."}``."""
    body = json.dumps({"error": _error_text(response.body)}).encode()
    return ResponseItem(response.status, body, JSON, response.headers)


def for_context(context: Any, style: str, service_envelope: str = "") -> OipServing:
    """The worker's OipServing, made once (when the handler loads, with the server's
    ``service_envelope``) and kept on the context (raises SignatureError)."""
    oip = getattr(context, "_mserve_oip", None)
    if oip is None:
        oip = OipServing(
            context.model_yaml_config,
            style,
            context.model_name,
            context.model_version,
            service_envelope,
        )
        context._mserve_oip = oip
    return oip


__all__ = ["OipServing", "PayloadError", "Prepared", "error_response", "for_context"]
