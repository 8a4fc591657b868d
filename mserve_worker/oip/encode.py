"""A handler's outputs as tensors, and a tensor's values in the binary form and as JSON data."""

from __future__ import annotations

import struct
from typing import Any

from .decode import checked_element, flat_values
from .tensors import FORMATS, LENGTH, NUMPY_DTYPES, OIPError, Tensor


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
        flat = [checked_element(v, datatype, name) for v in flat]
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
        return b"".join(LENGTH.pack(len(v)) + v for v in (_text_bytes(x) for x in values))
    if _is_array(tensor.data):
        return tensor.data.astype(NUMPY_DTYPES[tensor.datatype], copy=False).tobytes()
    code = FORMATS[tensor.datatype][0]
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
