"""The HTTP body of an inference request or response: a JSON object, then (the binary tensor
data extension) the binary tensors it announces, the JSON's length in the
``Inference-Header-Content-Length`` header."""

from __future__ import annotations

import json
from typing import Any

from .. import fastjson
from .decode import check_binary
from .encode import json_values, tensor_bytes
from .tensors import DATATYPES, HEADER_LENGTH, InferRequest, OIPError, RequestedOutput, Tensor


def parse_request(body: bytes | bytearray | memoryview, header_length: str | None) -> InferRequest:
    """An HTTP request body: the JSON object, then (with ``header_length``, the value of
    ``Inference-Header-Content-Length``) the binary tensors its inputs announce."""
    view = memoryview(body)
    if header_length is None:
        json_part, binary = view, view[len(view) :]
    else:
        try:
            length = int(header_length)
        except ValueError:
            length = -1
        if not 0 <= length <= len(view):
            raise OIPError(
                f"{HEADER_LENGTH} is {header_length!r}; it must be the length of the JSON part,"
                f" between 0 and the body's {len(view)} bytes"
            )
        json_part, binary = view[:length], view[length:]
    try:
        doc = fastjson.loads(json_part)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        where = "the JSON part of the body" if header_length is not None else "the body"
        raise OIPError(f"{where} is not valid JSON: {exc}") from None
    return request_from_json(doc, binary)


def request_from_json(doc: Any, binary: memoryview | bytes = b"") -> InferRequest:
    """The request a parsed JSON object describes; ``binary`` holds the inputs' binary data."""
    if not isinstance(doc, dict):
        raise OIPError(
            f'the inference request must be a JSON object {{"inputs": [...]}}, got {_kind(doc)}'
        )
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise OIPError(
            "the inference request needs 'inputs', a list of tensors "
            '{"name", "shape", "datatype", "data"}' + (f", got {_kind(inputs)}" if inputs else "")
        )
    tensors, seen, offset = [], set(), 0
    view = memoryview(binary)
    for i, entry in enumerate(inputs):
        tensor, offset = _input(entry, i, view, offset)
        if tensor.name in seen:
            raise OIPError(f"input {tensor.name!r} is given twice")
        seen.add(tensor.name)
        tensors.append(tensor)
    if offset != len(view):
        raise OIPError(
            f"the body holds {len(view)} bytes of binary data after the JSON, but the inputs'"
            f" binary_data_size add up to {offset}"
        )
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise OIPError(f"'id' must be a string, got {_kind(request_id)}")
    return InferRequest(
        request_id, tensors, _requested_outputs(doc.get("outputs")),
        _parameters(doc.get("parameters"), "the request's 'parameters'"),
    )  # fmt: skip


def _input(entry: Any, i: int, binary: memoryview, offset: int) -> tuple[Tensor, int]:
    if not isinstance(entry, dict):
        raise OIPError(f"inputs[{i}] must be an object with name, shape, datatype, data")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise OIPError(f"inputs[{i}] needs a 'name' (a non-empty string)")
    datatype = entry.get("datatype")
    if datatype not in DATATYPES:
        raise OIPError(
            f"input {name!r} has datatype {datatype!r}; expected one of {', '.join(DATATYPES)}"
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
        type(d) is int and d >= 0 for d in shape
    ):  # fmt: skip
        raise OIPError(
            f"input {name!r} has shape {shape!r}; expected a list of dimensions (integers >= 0)"
        )
    params = _parameters(entry.get("parameters"), f"input {name!r} 'parameters'")
    size = params.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:
            raise OIPError(
                f"input {name!r} has binary_data_size {size!r}; expected an integer >= 0"
            )
        if "data" in entry:
            raise OIPError(f"input {name!r} has both 'data' and binary_data_size; send one")
        if offset + size > len(binary):
            raise OIPError(
                f"input {name!r} announces {size} bytes of binary data, but only"
                f" {len(binary) - offset} remain after the JSON"
                + ("" if len(binary) else f" (send the {HEADER_LENGTH} header with binary data)")
            )
        tensor = Tensor(name, datatype, tuple(shape), binary[offset : offset + size], params)
        check_binary(tensor)
        return tensor, offset + size
    if "data" not in entry:
        raise OIPError(
            f"input {name!r} has no 'data' (nor binary_data_size with binary data after the JSON)"
        )
    if datatype == "FP16":
        raise OIPError(
            f"input {name!r} is FP16, which JSON cannot carry: send it as binary data"
            f" (binary_data_size and the {HEADER_LENGTH} header)"
        )
    data = entry["data"]
    data = data if isinstance(data, list) else [data]
    return Tensor(name, datatype, tuple(shape), data, params), offset


def _requested_outputs(outputs: Any) -> list[RequestedOutput] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise OIPError(f"'outputs' must be a list of {{\"name\"}} objects, got {_kind(outputs)}")
    wanted = []
    for i, entry in enumerate(outputs):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise OIPError(f"outputs[{i}] must be an object with a 'name'")
        params = _parameters(entry.get("parameters"), f"output {entry['name']!r} 'parameters'")
        binary = params.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise OIPError(f"output {entry['name']!r}: binary_data must be true or false")
        wanted.append(RequestedOutput(entry["name"], binary, params))
    return wanted


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OIPError(f"{where} must be an object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


def _entries(
    tensors: list[Tensor], binary: list[bool], with_parameters: bool
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The JSON entries of ``tensors`` and the binary data that follows the JSON, in order: a
    tensor goes as binary data when asked, and FP16 always (JSON cannot carry it).
    ``with_parameters``: a request's inputs keep their own parameters beside the size."""
    entries, blobs = [], []
    for tensor, as_binary in zip(tensors, binary):
        entry: dict[str, Any] = {
            "name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
        }  # fmt: skip
        if as_binary or tensor.datatype == "FP16":
            blob = tensor_bytes(tensor)
            own = tensor.parameters if with_parameters else {}
            entry["parameters"] = {**own, "binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = json_values(tensor)
        entries.append(entry)
    return entries, blobs


def encode_response(
    doc: dict[str, Any], outputs: list[Tensor], binary: list[bool]
) -> tuple[list[bytes], int | None]:
    """The response body as parts to write, and the JSON part's length when binary data
    follows it (the ``Inference-Header-Content-Length`` value), else None. ``doc`` holds the
    other fields (``model_name``, ``model_version``, ``id``, ``parameters``); FP16 outputs go as
    binary data whatever was asked, since JSON cannot carry them."""
    entries, blobs = _entries(outputs, binary, with_parameters=False)
    head = json.dumps({**doc, "outputs": entries}, separators=(",", ":")).encode()
    if not blobs:
        return [head], None
    return [head, *blobs], len(head)


def encode_request(
    inputs: list[Tensor], binary: list[bool], outputs: list[RequestedOutput] | None = None,
    request_id: str | None = None, parameters: dict[str, Any] | None = None,
) -> tuple[bytes, int | None]:  # fmt: skip
    """A request body (and its ``Inference-Header-Content-Length`` when binary data follows):
    what a client sends, or the gRPC front end forwarding a ModelInferRequest in HTTP's form
    (server/rpc/oip_messages.py). A binary tensor's ``bytes`` are joined into the body as they
    are, copied once."""
    doc: dict[str, Any] = {}
    if request_id is not None:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = parameters
    entries, blobs = _entries(inputs, binary, with_parameters=True)
    doc["inputs"] = entries
    if outputs is not None:
        doc["outputs"] = [
            {"name": o.name, "parameters": {**o.parameters, **(
                {} if o.binary is None else {"binary_data": o.binary})}}
            for o in outputs
        ]  # fmt: skip
    head = json.dumps(doc, separators=(",", ":")).encode()
    return b"".join([head, *blobs]), (len(head) if blobs else None)  # one copy of each blob


def parse_response(
    body: bytes | bytearray | memoryview, header_length: str | None
) -> tuple[dict[str, Any], list[Tensor]]:
    """A response body: its JSON object and its outputs as tensors (binary data sliced out)."""
    view = memoryview(body)
    length = len(view) if header_length is None else int(header_length)
    doc = json.loads(bytes(view[:length]))
    tensors, offset = [], length
    for entry in doc.get("outputs", []):
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is None:
            data = entry["data"]
        else:
            data, offset = view[offset : offset + size], offset + size
        tensors.append(Tensor(entry["name"], entry["datatype"], tuple(entry["shape"]), data))
    return doc, tensors
