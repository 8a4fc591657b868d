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

The HTTP body form is in wire.py; reading values out of tensors in decode.py; tensors of a
handler's outputs, and the binary and JSON forms of values, in encode.py.

Every problem with a request raises :class:`OIPError` (status 400) with a message naming the
input, what was expected and what was found; a handler output that cannot be sent raises it with
status 500.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

HEADER_LENGTH = "Inference-Header-Content-Length"

# datatype -> (struct code, bytes per element); BYTES is variable (length-prefixed)
FORMATS = {
    "BOOL": ("?", 1), "UINT8": ("B", 1), "UINT16": ("H", 2), "UINT32": ("I", 4),
    "UINT64": ("Q", 8), "INT8": ("b", 1), "INT16": ("h", 2), "INT32": ("i", 4), "INT64": ("q", 8),
    "FP16": ("e", 2), "FP32": ("f", 4), "FP64": ("d", 8),
}  # fmt: skip
DATATYPES = (*FORMATS, "BYTES")
NUMPY_DTYPES = {
    "BOOL": "|b1", "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
    "INT8": "|i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "BYTES": "|O",
}  # fmt: skip
INT_RANGES = {
    f"{'U' if u else ''}INT{b}": ((0, 2**b - 1) if u else (-(2 ** (b - 1)), 2 ** (b - 1) - 1))
    for u in (True, False) for b in (8, 16, 32, 64)
}  # fmt: skip
LENGTH = struct.Struct("<I")


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


def shape_text(shape: Any) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
