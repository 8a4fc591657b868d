"""The Open Inference Protocol's tensors: requests and responses to and from tensors.

Sans-IO and independent of HTTP, standard library only (numpy where the caller passes it in),
Python 3.8+. A tensor is ``(name, datatype, shape, data)`` where ``data`` is one of

- a list, the JSON ``data`` as sent: flat, or nested as the shape (row-major);
- a bytes-like object: the binary form (little-endian, row-major, no padding; ``BOOL`` one byte
  per element; each ``BYTES`` element a 4-byte little-endian length, then its bytes);
- a numpy array (what a handler returned).

HTTP carries binary tensors after the JSON object of the request or response, the JSON's length
in the ``Inference-Header-Content-Length`` header and each tensor's size in its
``binary_data_size`` parameter (the binary tensor data extension). gRPC's ``raw_input_contents``
and ``raw_output_contents`` are the same binary form, so a gRPC front end builds :class:`Tensor`
objects from them and uses the same checks and conversions.

Every problem with a request raises :class:`OIPError` (status 400) with a message naming the
input, what was expected and what was found; a handler output that cannot be sent raises it with
status 500.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

HEADER_LENGTH = "Inference-Header-Content-Length"

# datatype -> (struct code, bytes per element); BYTES is variable (length-prefixed)
_FORMATS = {
    "BOOL": ("?", 1), "UINT8": ("B", 1), "UINT16": ("H", 2), "UINT32": ("I", 4),
    "UINT64": ("Q", 8), "INT8": ("b", 1), "INT16": ("h", 2), "INT32": ("i", 4), "INT64": ("q", 8),
    "FP16": ("e", 2), "FP32": ("f", 4), "FP64": ("d", 8),
}  # fmt: skip
DATATYPES = (*_FORMATS, "BYTES")
NUMPY_DTYPES = {
    "BOOL": "|b1", "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "|i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "BYTES": "|O",
}  # fmt: skip
_INT_RANGES = {
    f"{'U' if u else ''}INT{b}": ((0, 2**b - 1) if u else (-(2 ** (b - 1)), 2 ** (b - 1) - 1))
    for u in (True, False) for b in (8, 16, 32, 64)
}  # fmt: skip
_LENGTH = struct.Struct("<I")


class OIPError(ValueError):
    """A request that does not follow the protocol (400), or an output that cannot be sent (500).
    The message is what the client reads in ``{"error": ...}``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def binary(self) -> bool:
        return isinstance(self.data, (bytes, bytearray, memoryview))

    @property
    def count(self) -> int:
        return element_count(self.shape)


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None  # None: as the request's binary_data_output says
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None  # None: every output
    parameters: dict[str, Any] = field(default_factory=dict)

    def binary_output(self, name: str) -> bool:
        """Whether output ``name`` goes back as binary data (asked per output, or for all)."""
        for wanted in self.outputs or ():
            if wanted.name == name and wanted.binary is not None:
                return wanted.binary
        return self.parameters.get("binary_data_output") is True


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _shape_text(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# Requests.


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
        doc = json.loads(bytes(json_part))
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


def check_binary(tensor: Tensor) -> None:
    """The binary data's size against the shape and datatype."""
    count = tensor.count
    if tensor.datatype == "BYTES":
        split_bytes(tensor.data, count, tensor.name)
        return
    need = count * _FORMATS[tensor.datatype][1]
    if len(tensor.data) != need:
        raise OIPError(
            f"input {tensor.name!r} of shape {_shape_text(tensor.shape)} and datatype"
            f" {tensor.datatype} needs {need} bytes of binary data, got {len(tensor.data)}"
        )


def split_bytes(data: bytes | bytearray | memoryview, count: int, name: str) -> list[bytes]:
    """The elements of a binary BYTES tensor (each a 4-byte little-endian length, then bytes)."""
    view = memoryview(data)
    elements, pos, end = [], 0, len(view)
    while pos < end:
        if pos + 4 > end:
            raise OIPError(f"BYTES input {name!r} ends inside an element's 4-byte length")
        (n,) = _LENGTH.unpack_from(view, pos)
        if pos + 4 + n > end:
            raise OIPError(
                f"BYTES input {name!r}: element {len(elements)} says {n} bytes, only"
                f" {end - pos - 4} remain"
            )
        elements.append(bytes(view[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    if len(elements) != count:
        raise OIPError(
            f"BYTES input {name!r} holds {len(elements)} elements, its shape holds {count}"
        )
    return elements


def flat_values(tensor: Tensor) -> list[Any]:
    """The elements in row-major order, as Python values (``BYTES`` as ``bytes``), checked
    against the shape (count and nesting) and the datatype. Pure Python: for large tensors
    prefer :func:`to_array`."""
    if tensor.binary:
        if tensor.datatype == "BYTES":
            return split_bytes(tensor.data, tensor.count, tensor.name)
        code = _FORMATS[tensor.datatype][0]
        return list(struct.unpack(f"<{tensor.count}{code}", tensor.data))
    flat = _flatten(tensor.data, tensor.shape, tensor.name)
    return [_element(v, tensor.datatype, tensor.name) for v in flat]


def _flatten(data: list[Any], shape: tuple[int, ...], name: str) -> list[Any]:
    count = element_count(shape)
    if not any(isinstance(v, list) for v in data):
        if len(data) != count:
            raise OIPError(
                f"input {name!r} has {len(data)} values; its shape {_shape_text(shape)} holds"
                f" {count}"
            )
        return data
    flat: list[Any] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, list):
                raise OIPError(
                    f"input {name!r}: data nests deeper than its shape {_shape_text(shape)}"
                )
            flat.append(node)
            return
        if not isinstance(node, list) or len(node) != shape[depth]:
            found = f"{len(node)} values" if isinstance(node, list) else "a single value"
            raise OIPError(
                f"input {name!r}: data does not nest as its shape {_shape_text(shape)}:"
                f" dimension {depth} should hold {shape[depth]} values, found {found}"
            )
        for value in node:
            walk(value, depth + 1)

    walk(data, 0)
    return flat


def _element(value: Any, datatype: str, name: str) -> Any:
    if datatype == "BOOL":
        if isinstance(value, bool):
            return value
    elif datatype == "BYTES":
        if isinstance(value, str):
            return value.encode("utf-8")
    elif datatype.startswith(("INT", "UINT")):
        low, high = _INT_RANGES[datatype]
        if type(value) is int and low <= value <= high:
            return value
    elif type(value) in (int, float):
        return float(value)
    raise OIPError(f"input {name!r} is {datatype} but holds {value!r}")


def to_array(tensor: Tensor, np: Any) -> Any:
    """A numpy array of the tensor's dtype and shape (``BYTES``: an object array of ``bytes``).
    Binary data is not copied unless it is misaligned for its dtype."""
    shape = tensor.shape
    if tensor.datatype == "BYTES":
        values = flat_values(tensor)
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array.reshape(shape)
    dtype = np.dtype(NUMPY_DTYPES[tensor.datatype])
    if tensor.binary:
        array = np.frombuffer(tensor.data, dtype=dtype).reshape(shape)
        return array if array.flags.aligned else array.copy()
    try:
        raw = np.array(tensor.data)
    except ValueError:  # ragged nesting
        _flatten(tensor.data, shape, tensor.name)  # says where
        raise OIPError(f"input {tensor.name!r}: data is not a rectangular array") from None
    if raw.shape != shape and not (raw.ndim == 1 and raw.size == tensor.count):
        _flatten(tensor.data, shape, tensor.name)  # the precise message
        raise OIPError(
            f"input {tensor.name!r}: data of shape {list(raw.shape)} is not {list(shape)}"
        )
    kind = raw.dtype.kind
    wanted = dtype.kind
    if wanted in "iu" and kind in "fO":  # e.g. 2**64 - 1 does not fit numpy's int64 guess
        return np.array(flat_values(tensor), dtype=dtype).reshape(shape)
    ok = kind == "b" if wanted == "b" else kind in "iu" if wanted in "iu" else kind in "iuf"
    if not ok and raw.size:
        values = raw.ravel().tolist()
        sample = next((v for v in values if not _element_ok(v, tensor.datatype)), values[0])
        raise OIPError(f"input {tensor.name!r} is {tensor.datatype} but holds {sample!r}")
    if wanted in "iu" and raw.size:
        low, high = _INT_RANGES[tensor.datatype]
        if int(raw.min()) < low or int(raw.max()) > high:
            bad = raw.min() if int(raw.min()) < low else raw.max()
            raise OIPError(f"input {tensor.name!r} is {tensor.datatype} but holds {bad.item()!r}")
    return raw.astype(dtype, copy=False).reshape(shape)


def _element_ok(value: Any, datatype: str) -> bool:
    try:
        _element(value, datatype, "")
    except OIPError:
        return False
    return True


def to_lists(tensor: Tensor) -> Any:
    """The tensor as nested lists of its shape (for environments without numpy)."""
    flat = flat_values(tensor)
    for dim in reversed(tensor.shape[1:]):
        flat = [flat[i : i + dim] for i in range(0, len(flat), dim)]
    return flat if tensor.shape else flat[0]


# Outputs and responses.


def output_tensor(name: str, value: Any, datatype: str | None, np: Any) -> Tensor:
    """A handler's value for output ``name`` (numpy array, nested list, scalar, torch tensor)
    as a tensor; ``datatype`` is the declared one (the value is converted), else inferred."""
    value = _plain(value, np)
    if np is not None:
        if isinstance(value, np.ndarray) and value.dtype.kind not in "OUS":
            array = value
        elif datatype == "BYTES" or _holds_text(value):
            array = np.array(value, dtype=object)
            array = _bytes_array(array, name, np)
            datatype = "BYTES"
        else:
            array = np.asarray(value)
        if datatype is None:
            datatype = datatype_of(array.dtype, name)
        if datatype != "BYTES":
            try:
                array = array.astype(NUMPY_DTYPES[datatype], copy=False)
            except (TypeError, ValueError) as exc:
                raise OIPError(f"output {name!r} cannot be {datatype}: {exc}", 500) from None
        return Tensor(name, datatype, tuple(int(d) for d in array.shape), array)
    shape, flat = _shape_and_flat(value, name)
    if datatype is None:
        datatype = _infer(flat, name)
    try:
        flat = [_element(_text_bytes(v), datatype, name) for v in flat]
    except OIPError as exc:
        raise OIPError(exc.message.replace("input", "output", 1), 500) from None
    return Tensor(name, datatype, shape, flat)


def _plain(value: Any, np: Any) -> Any:
    """torch tensors and other array likes as numpy arrays (or lists without numpy)."""
    if np is not None and isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu()
        return value.numpy() if np is not None else value.tolist()
    if np is None and hasattr(value, "tolist"):
        return value.tolist()
    return value


def _holds_text(value: Any) -> bool:
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, (str, bytes))


def _text_bytes(value: Any) -> Any:
    return value.encode("utf-8") if isinstance(value, str) else value


def _bytes_array(array: Any, name: str, np: Any) -> Any:
    out = np.empty(array.shape, dtype=object)
    for index, value in np.ndenumerate(array):
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif not isinstance(value, (bytes, bytearray)):
            raise OIPError(f"output {name!r} is BYTES but holds {value!r}", 500)
        out[index] = bytes(value)
    return out


def datatype_of(dtype: Any, name: str) -> str:
    """The OIP datatype of a numpy dtype."""
    for datatype, text in NUMPY_DTYPES.items():
        if datatype != "BYTES" and dtype.kind == text[1] and dtype.itemsize == int(text[2:]):
            return datatype
    if dtype.kind in "OSU":
        return "BYTES"
    raise OIPError(f"output {name!r} has dtype {dtype}, which no OIP datatype carries", 500)


def _shape_and_flat(value: Any, name: str) -> tuple[tuple[int, ...], list[Any]]:
    shape: list[int] = []
    probe = value
    while isinstance(probe, (list, tuple)):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    flat: list[Any] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, (list, tuple)):
                raise OIPError(f"output {name!r} is not rectangular", 500)
            flat.append(node)
            return
        if not isinstance(node, (list, tuple)) or len(node) != shape[depth]:
            raise OIPError(f"output {name!r} is not rectangular", 500)
        for v in node:
            walk(v, depth + 1)

    walk(value, 0)
    return tuple(shape), flat


def _infer(flat: list[Any], name: str) -> str:
    first = flat[0] if flat else 0.0
    if isinstance(first, bool):
        return "BOOL"
    if isinstance(first, int):
        return "INT64"
    if isinstance(first, float):
        return "FP64"
    if isinstance(first, (str, bytes)):
        return "BYTES"
    raise OIPError(f"output {name!r} holds {type(first).__name__} values, not numbers or text", 500)


def tensor_bytes(tensor: Tensor, np: Any = None) -> bytes:
    """The binary form of a tensor (little-endian, row-major; BYTES length-prefixed)."""
    if tensor.binary:
        return tensor.data if type(tensor.data) is bytes else bytes(tensor.data)
    if tensor.datatype == "BYTES":
        values = tensor.data.ravel().tolist() if _is_array(tensor.data) else tensor.data
        return b"".join(_LENGTH.pack(len(v)) + v for v in (_text_bytes(x) for x in values))
    if _is_array(tensor.data):
        return tensor.data.astype(NUMPY_DTYPES[tensor.datatype], copy=False).tobytes()
    code = _FORMATS[tensor.datatype][0]
    return struct.pack(f"<{len(tensor.data)}{code}", *tensor.data)


def json_values(tensor: Tensor) -> list[Any]:
    """The flat JSON ``data`` of a tensor."""
    if tensor.datatype == "FP16":
        raise OIPError(f"output {tensor.name!r} is FP16, which JSON cannot carry", 500)
    if tensor.binary:
        values = flat_values(tensor)
    elif _is_array(tensor.data):
        values = tensor.data.ravel().tolist()
    else:
        values = tensor.data
    if tensor.datatype == "BYTES":
        try:
            return [v.decode("utf-8") if isinstance(v, (bytes, bytearray)) else v for v in values]
        except UnicodeDecodeError:
            raise OIPError(
                f"BYTES output {tensor.name!r} holds bytes that are not UTF-8 text, which JSON"
                f" cannot carry; ask for it as binary data (binary_data: true)",
                500,
            ) from None
    return values


def _is_array(value: Any) -> bool:
    return hasattr(value, "ravel") and hasattr(value, "dtype")


def encode_response(
    doc: dict[str, Any], outputs: list[Tensor], binary: list[bool]
) -> tuple[list[bytes], int | None]:
    """The response body as parts to write, and the JSON part's length when binary data
    follows it (the ``Inference-Header-Content-Length`` value), else None. ``doc`` holds the
    other fields (``model_name``, ``model_version``, ``id``, ``parameters``); FP16 outputs go as
    binary data whatever was asked, since JSON cannot carry them."""
    entries, blobs = [], []
    for tensor, as_binary in zip(outputs, binary):
        entry: dict[str, Any] = {
            "name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
        }  # fmt: skip
        if as_binary or tensor.datatype == "FP16":
            blob = tensor_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = json_values(tensor)
        entries.append(entry)
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
    entries, blobs = [], []
    for tensor, as_binary in zip(inputs, binary):
        entry: dict[str, Any] = {
            "name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
        }  # fmt: skip
        if as_binary or tensor.datatype == "FP16":
            blob = tensor_bytes(tensor)
            entry["parameters"] = {**tensor.parameters, "binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = json_values(tensor)
        entries.append(entry)
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
