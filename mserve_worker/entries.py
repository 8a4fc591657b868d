"""What the BATCH, RESULT and STEP frames share: a frame's payload cut into its entries' bodies,
and the check of each field against what the wire carries, the error naming the bad field.
Standard library only, Python 3.8.
"""

from __future__ import annotations

from typing import Any

from .framing import (
    _BATCH,
    Frame,
    Kind,
    ProtocolError,
    _byte_view,
    _kind,
)

MIN_STATUS = 100
MAX_STATUS = 599


def _pairs_ok(value: object) -> bool:
    """Whether ``value`` is a list of [str, str] lists, the wire shape of headers. A plain
    loop: a generator under ``all()`` cost twice as much per request (timeit, 4 headers)."""
    if type(value) is not list:
        return False
    for p in value:
        if type(p) is not list or len(p) != 2 or type(p[0]) is not str or type(p[1]) is not str:
            return False
    return True


def _fast_split(
    frame: Frame, kind: Kind, key: str
) -> tuple[int, list[dict[str, Any]], list[memoryview]] | None:
    """``_split`` for well-formed frames, building no error text; None sends the caller to the
    checked path, which raises the precise error (or accepts an unusual but valid frame)."""
    if frame.kind is not kind:
        return None
    meta = frame.meta
    batch_id = meta.get("batch_id")
    entries = meta.get(key)
    payload = frame.payload
    if (
        type(batch_id) is not int
        or batch_id < 0
        or type(entries) is not list
        or type(payload) not in (bytes, bytearray)
    ):
        return None
    view = memoryview(payload)
    whole = len(view)
    bodies = []
    offset = 0
    for entry in entries:
        if type(entry) is dict:
            size = entry.get("size")
        elif type(entry) is list and len(entry) == 4 and kind is _BATCH:  # packed
            size = entry[2]
        else:
            return None
        if type(size) is not int or size < 0:
            return None
        # a lone body is the whole payload: the view itself, not a slice of it
        bodies.append(view if size == whole and not offset else view[offset : offset + size])
        offset += size
    if offset != whole:
        return None
    return batch_id, entries, bodies


def _split(
    frame: Frame, kind: Kind, key: str
) -> tuple[int, list[dict[str, Any]], list[memoryview]]:
    """Check the meta that batch and result frames share and cut the payload into bodies."""
    if frame.kind != kind:
        raise ProtocolError(f"expected a {kind.name} frame, got {_kind(frame.kind).name}")
    meta = frame.meta
    batch_id = _check_uint(
        _required(meta, "batch_id", f"{kind.name} meta"), f"{kind.name} batch_id"
    )
    entries = _required(meta, key, f"{kind.name} meta")
    packed = kind is Kind.BATCH  # its entries may be packed arrays (_entry)
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) or (packed and type(e) is list) for e in entries
    ):
        raise ProtocolError(
            f"{kind.name} meta {key!r} must be a list of objects"
            + (" or packed arrays" if packed else "")
        )
    sizes = []
    for i, entry in enumerate(entries):
        where = f"{kind.name} {key}[{i}]"
        if type(entry) is list:
            if len(entry) != 4:
                raise ProtocolError(
                    f"{where} is packed: [id, content_type, size, headers], 4 items,"
                    f" got {len(entry)}"
                )
            sizes.append(_check_uint(entry[2], f"{where}[2] (size)"))
        else:
            sizes.append(_check_uint(_required(entry, "size", where), f"{where}.size"))
    view = _byte_view(frame.payload, f"{kind.name} frame payload")
    if sum(sizes) != len(view):
        raise ProtocolError(
            f"{kind.name} {batch_id}: {key} sizes add up to {sum(sizes)} bytes but the payload "
            f"holds {len(view)} bytes"
        )
    bodies = []
    offset = 0
    for size in sizes:
        bodies.append(view[offset : offset + size])
        offset += size
    return batch_id, entries, bodies


def _required(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ProtocolError(f"{where} lacks the required field {key!r}")
    return obj[key]


def _check_uint(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def _check_bool(value: object, where: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{where} must be true or false, got {value!r}")
    return value


def _check_status(value: object, where: str) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not MIN_STATUS <= value <= MAX_STATUS
    ):
        raise ProtocolError(
            f"{where} must be an HTTP status in {MIN_STATUS}..{MAX_STATUS}, got {value!r}"
        )
    return value


def _check_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _check_pairs(value: object, where: str) -> list[list[str]]:
    if _pairs_ok(value):
        return value  # type: ignore[return-value]  # already exactly the wire shape
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{where} must be a list of [name, value] pairs")
    pairs = []
    for i, pair in enumerate(value):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(part, str) for part in pair)
        ):
            raise ProtocolError(
                f"{where}[{i}] must be a [name, value] pair of strings, got {pair!r}"
            )
        pairs.append([pair[0], pair[1]])
    return pairs


def _check_params(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ProtocolError(f"{where} must be an object mapping names to string values")
    return value
