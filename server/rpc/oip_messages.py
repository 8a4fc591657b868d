"""The Open Inference Protocol's gRPC messages to and from the bytes its REST form sends.

A ``ModelInferRequest`` becomes exactly the body a REST client sends with the binary tensor data
extension (a JSON header, then every input's binary data; ``Inference-Header-Content-Length``
says where the JSON ends), so the worker reads a gRPC request as it reads a REST one
(mserve_worker/oip/): the same checks against the model's signature, the same messages, the
same decoding into arrays. ``raw_input_contents`` already are that binary form and are joined
into the body as they are, never re-encoded. Typed ``contents`` are packed into it, once, after
their count and range are checked here (the worker cannot tell them from raw data): FP32 and
FP64 at the speed of a copy, since protobuf's own encoding of those fields is the binary form
(reading them one by one is slow in Python), the other types value by value.

Every output is asked for as binary data, and the worker's answer is cut back into
``raw_output_contents``, as Triton answers.
"""

from __future__ import annotations

from typing import Any

from mserve_worker.oip.decode import flat_values
from mserve_worker.oip.encode import tensor_bytes
from mserve_worker.oip.tensors import DATATYPES, RequestedOutput, Tensor, element_count
from mserve_worker.oip.wire import encode_request, parse_response
from server.errors import BadRequest
from server.rpc.protos import oip_pb2 as pb

# datatype -> the InferTensorContents field that carries it (FP16: raw only)
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}  # fmt: skip
# the types narrower than their field: the range the field's values must keep to
_NARROW = {
    "INT8": (-(2**7), 2**7 - 1), "INT16": (-(2**15), 2**15 - 1),
    "UINT8": (0, 2**8 - 1), "UINT16": (0, 2**16 - 1),
}  # fmt: skip


def parameters(params: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as the JSON object REST carries (unset values left
    out)."""
    out = {}
    for key, param in params.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out


def set_parameters(target: Any, values: dict[str, Any]) -> None:
    """Fill a ``map<string, InferParameter>`` from a JSON object (values other than bool,
    int, float and str are sent as their text)."""
    for key, value in values.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if value >= 2**63:
                param.uint64_param = value
            else:
                param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value if isinstance(value, str) else str(value)


def request_body(request: pb.ModelInferRequest) -> tuple[bytes, int | None]:
    """The REST form of ``request``: its body and the ``Inference-Header-Content-Length`` value
    (None when no input carries data). Raises BadRequest for contents that do not fit."""
    raw = request.raw_input_contents
    inputs = request.inputs
    if raw and len(raw) != len(inputs):
        raise BadRequest(
            f"the request has {len(inputs)} inputs but {len(raw)} raw_input_contents; send one"
            " entry per input, in the order of the inputs"
        )
    tensors = []
    for i, entry in enumerate(inputs):
        params = parameters(entry.parameters)
        if raw:
            if entry.HasField("contents"):
                raise BadRequest(
                    f"input {entry.name!r} has contents, but the request sends"
                    " raw_input_contents; send its data in one of them"
                )
            data: Any = raw[i]
        else:
            data = _typed(entry)
        tensors.append(Tensor(entry.name, entry.datatype, tuple(entry.shape), data, params))
    wanted = None
    if request.outputs:
        wanted = [RequestedOutput(o.name, True, parameters(o.parameters)) for o in request.outputs]
    params = parameters(request.parameters)
    if wanted is None:  # every output, as binary data (raw_output_contents)
        params["binary_data_output"] = True
    return encode_request(
        tensors, [True] * len(tensors), wanted, request.id or None, params
    )  # fmt: skip


def _typed(entry: Any) -> bytes:
    """An input's typed contents in the binary form, checked against its shape and datatype."""
    name, datatype = entry.name, entry.datatype
    if datatype not in DATATYPES:
        raise BadRequest(
            f"input {name!r} has datatype {datatype!r}; expected one of {', '.join(DATATYPES)}"
        )
    if not all(d >= 0 for d in entry.shape):
        raise BadRequest(
            f"input {name!r} has shape {list(entry.shape)}; expected a list of dimensions"
            " (integers >= 0)"
        )
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise BadRequest(
            f"input {name!r} is {datatype}, which typed contents cannot carry: send it in"
            " raw_input_contents"
        )
    contents = entry.contents
    for other in set(CONTENTS_FIELD.values()) - {field}:
        if len(getattr(contents, other)):
            raise BadRequest(
                f"input {name!r} is {datatype}, whose contents go in {field}; the request"
                f" fills {other}"
            )
    values = getattr(contents, field)
    count = element_count(tuple(entry.shape))
    if datatype in _FIXED_WIDTH:
        packed = _packed(contents, _FIXED_WIDTH[datatype] * count)
        if packed is not None:
            return packed
    if len(values) != count:
        raise BadRequest(
            f"input {name!r} has {len(values)} values in {field}; its shape"
            f" {list(entry.shape)} holds {count}"
        )
    span = _NARROW.get(datatype)
    if span is not None and values:
        low, high = min(values), max(values)
        if low < span[0] or high > span[1]:
            bad = low if low < span[0] else high
            raise BadRequest(f"input {name!r} is {datatype} but holds {bad!r}")
    return tensor_bytes(Tensor(name, datatype, tuple(entry.shape), list(values)))


# the packed repeated fields whose wire encoding is the binary form: bytes per element
_FIXED_WIDTH = {"FP32": 4, "FP64": 8}


def _packed(contents: Any, size: int) -> bytes | None:
    """The data of the one fixed-width field ``contents`` holds, taken from its wire encoding
    (field tag, length, then the little-endian values back to back); None when that encoding is
    not exactly that (unknown fields along), so the caller reads the values instead."""
    wire = contents.SerializeToString()
    if not wire:
        return b"" if size == 0 else None
    pos, length, shift = 1, 0, 0  # byte 0: the tag (field numbers under 16 take one byte)
    while pos < len(wire):
        byte = wire[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            break
        shift += 7
    if length != size or pos + length != len(wire):
        return None
    return wire[pos:]


def response(
    body: bytes | bytearray | memoryview, header_length: str | None
) -> pb.ModelInferResponse:
    """The worker's answer (the REST form) as a ``ModelInferResponse`` with every output in
    ``raw_output_contents``. Raises ValueError (KeyError, TypeError, ...) for a body that is
    not an OIP response."""
    doc, outputs = parse_response(body, header_length)
    if not isinstance(doc.get("outputs"), list):
        raise ValueError("it has no 'outputs' list")
    answer = pb.ModelInferResponse(
        model_name=str(doc.get("model_name", "")),
        model_version=str(doc.get("model_version", "")),
        id=str(doc.get("id") or ""),
    )
    set_parameters(answer.parameters, doc.get("parameters") or {})
    raw = []
    for tensor in outputs:
        answer.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        if tensor.binary:
            raw.append(bytes(tensor.data))
        else:  # a handler that wrote its own JSON answer
            flat = Tensor(tensor.name, tensor.datatype, tensor.shape, flat_values(tensor))
            raw.append(tensor_bytes(flat))
    answer.raw_output_contents.extend(raw)
    return answer
