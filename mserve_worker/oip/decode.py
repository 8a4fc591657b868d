"""A tensor's values as Python values or a numpy array, checked against its shape and datatype
(the inputs a handler receives)."""

from __future__ import annotations

import struct
from typing import Any

from .tensors import (
    FORMATS,
    INT_RANGES,
    LENGTH,
    NUMPY_DTYPES,
    OIPError,
    Tensor,
    element_count,
    shape_text,
)


def check_binary(tensor: Tensor) -> None:
    """The binary data's size against the shape and datatype."""
    count = tensor.count
    if tensor.datatype == "BYTES":
        split_bytes(tensor.data, count, tensor.name)
        return
    need = count * FORMATS[tensor.datatype][1]
    if len(tensor.data) != need:
        raise OIPError(
            f"input {tensor.name!r} of shape {shape_text(tensor.shape)} and datatype"
            f" {tensor.datatype} needs {need} bytes of binary data, got {len(tensor.data)}"
        )


def split_bytes(data: bytes | bytearray | memoryview, count: int, name: str) -> list[bytes]:
    """The elements of a binary BYTES tensor (each a 4-byte little-endian length, then bytes)."""
    view = memoryview(data)
    elements, pos, end = [], 0, len(view)
    while pos < end:
        if pos + 4 > end:
            raise OIPError(f"BYTES input {name!r} ends inside an element's 4-byte length")
        (n,) = LENGTH.unpack_from(view, pos)
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
        code = FORMATS[tensor.datatype][0]
        return list(struct.unpack(f"<{tensor.count}{code}", tensor.data))
    flat = _flatten(tensor.data, tensor.shape, tensor.name)
    return [checked_element(v, tensor.datatype, tensor.name) for v in flat]


def _flatten(data: list[Any], shape: tuple[int, ...], name: str) -> list[Any]:
    count = element_count(shape)
    if not any(isinstance(v, list) for v in data):
        if len(data) != count:
            raise OIPError(
                f"input {name!r} has {len(data)} values; its shape {shape_text(shape)} holds"
                f" {count}"
            )
        return data
    flat: list[Any] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, list):
                raise OIPError(
                    f"input {name!r}: data nests deeper than its shape {shape_text(shape)}"
                )
            flat.append(node)
            return
        if not isinstance(node, list) or len(node) != shape[depth]:
            found = f"{len(node)} values" if isinstance(node, list) else "a single value"
            raise OIPError(
                f"input {name!r}: data does not nest as its shape {shape_text(shape)}:"
                f" dimension {depth} should hold {shape[depth]} values, found {found}"
            )
        for value in node:
            walk(value, depth + 1)

    walk(data, 0)
    return flat


def checked_element(value: Any, datatype: str, name: str) -> Any:
    if datatype == "BOOL":
        if isinstance(value, bool):
            return value
    elif datatype == "BYTES":
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, (bytes, bytearray)):  # a handler's output, without numpy
            return bytes(value)
    elif datatype.startswith(("INT", "UINT")):
        low, high = INT_RANGES[datatype]
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
        low, high = INT_RANGES[tensor.datatype]
        if int(raw.min()) < low or int(raw.max()) > high:
            bad = raw.min() if int(raw.min()) < low else raw.max()
            raise OIPError(f"input {tensor.name!r} is {tensor.datatype} but holds {bad.item()!r}")
    return raw.astype(dtype, copy=False).reshape(shape)


def _element_ok(value: Any, datatype: str) -> bool:
    try:
        checked_element(value, datatype, "")
    except OIPError:
        return False
    return True


def to_lists(tensor: Tensor) -> Any:
    """The tensor as nested lists of its shape (for environments without numpy)."""
    flat = flat_values(tensor)
    for dim in reversed(tensor.shape[1:]):
        flat = [flat[i : i + dim] for i in range(0, len(flat), dim)]
    return flat if tensor.shape else flat[0]
