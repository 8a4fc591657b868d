"""Request bodies decoded through orjson give exactly what ``json.loads`` gives: the same values,
of the same types, and the same errors, whatever the body holds; answers encoded through orjson
are the very bytes the ``json`` encoder writes."""

from __future__ import annotations

import collections
import datetime
import enum
import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mserve_worker import fastjson
from mserve_worker.oip.serving import _json
from mserve_worker.payload import PayloadError, decode_request, encode_output

REPO = Path(__file__).resolve().parents[2]


def same(a: object, b: object) -> bool:
    """Equal values of equal types all the way down (1 is not 1.0 nor True; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and str(a) == str(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def decoded(body: bytes, content_type: str = "application/json") -> object:
    return decode_request(content_type, [], body, {})["body"]


def decoding(body: bytes, content_type: str) -> object:
    """The body's value, or its error's words."""
    try:
        return decoded(body, content_type)
    except PayloadError as exc:
        return str(exc)


def test_orjson_is_used_where_the_server_installed_it() -> None:
    # a dependency of the server: every default model environment sees it
    assert fastjson.AVAILABLE
    assert fastjson.decode(b'{"data": [0.5, 1, "x"]}') == {"data": [0.5, 1, "x"]}


@pytest.mark.parametrize(
    "body",
    [
        # integers past 64 bits stay exact integers (orjson would make them floats)
        b'{"id": 123456789012345678901234567890}',
        b"[-9223372036854775809, 18446744073709551616]",
        b'[9999999999999999999, "12345678901234567890123"]',
        # what json accepts and orjson refuses
        b"[NaN, Infinity, -Infinity]",
        b"[1e400, -1e400]",
        b'["\\ud800", "a\\udfffb"]',  # escaped lone surrogates
        b'["\xed\xa0\x80"]',  # a surrogate's UTF-8 bytes, as json reads them (surrogatepass)
        b"[" * 1500 + b"]" * 1500,  # deeper than orjson goes
        # both accept
        b'{"a": 1, "a": 2}',
        b"[4.9e-324, 2.2250738585072011e-308, 1.7976931348623157e308, -0.0, 0.1, 1E5, -0]",
        b'{"\xc3\xa9": ["\\u00e9", "\\ud83d\\ude00", "a\\/b"]}  \n',
    ],
)
def test_a_body_decodes_to_what_json_loads_gives(body: bytes) -> None:
    try:
        expected = json.loads(body)
    except RecursionError:
        with pytest.raises(RecursionError):
            decoded(body)
        return
    assert same(decoded(body), expected)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'{"a": 1} x', "Extra data: line 1 column 10 (char 9)"),
        (b"[1,]", "Expecting value: line 1 column 4 (char 3)"),
        (b'["\x01"]', "Invalid control character at: line 1 column 3 (char 2)"),
        (b"[01]", "Expecting ',' delimiter: line 1 column 3 (char 2)"),
    ],
)
def test_a_bad_body_gets_jsons_own_error(body: bytes, error: str) -> None:
    with pytest.raises(PayloadError) as caught:
        decoded(body)
    assert str(caught.value) == (
        f"request body is not valid JSON (Content-Type 'application/json'): {error}"
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text()
    | st.text(st.characters(categories=["Cs", "Cc", "Lo"])),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(json_values, max_size=8) | st.dictionaries(st.text(), json_values), st.booleans())
def test_any_json_body_decodes_as_json_loads_decodes_it(value: object, ascii_only: bool) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert same(decoded(body), json.loads(body))
    assert same(_json(memoryview(body)), json.loads(body))  # a v1/v2 request's body


number_texts = st.builds(
    lambda sign, whole, fraction, exponent: f"{sign}{whole}{fraction}{exponent}",
    st.sampled_from(["", "-"]),
    st.from_regex(r"\A(0|[1-9][0-9]{0,24})\Z"),
    st.sampled_from([""]) | st.from_regex(r"\A\.[0-9]{1,25}\Z"),
    st.sampled_from([""]) | st.from_regex(r"\A[eE][+-]?[0-9]{1,4}\Z"),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(number_texts, min_size=1, max_size=10))
def test_numbers_of_every_length_decode_to_the_same_value_and_type(texts: list[str]) -> None:
    body = f"[{', '.join(texts)}]".encode()
    assert same(decoded(body), json.loads(body))


@pytest.mark.parametrize("charset", ["utf-8", "UTF-8", "utf8"])
@pytest.mark.parametrize(
    "body",
    [
        b'{"data": [0.5, 1e-7, "\xc3\xa9"]}',
        b'["\xed\xa0\x80"]',  # a surrogate's bytes: strict UTF-8 refuses them
        b'\xef\xbb\xbf{"a": 1}',  # a BOM
        b'{\x00"\x00',  # UTF-16 bytes, named UTF-8
        b"[1e400, 123456789012345678901234567890]",
    ],
)
def test_a_body_named_utf8_decodes_as_before(charset: str, body: bytes) -> None:
    content_type = f"application/json; charset={charset}"
    real = fastjson._orjson_loads
    try:
        fastjson._orjson_loads = None
        before = decoding(body, content_type)
    finally:
        fastjson._orjson_loads = real
    after = decoding(body, content_type)
    assert type(after) is type(before) and (after == before or same(after, before))


def test_a_worker_without_orjson_decodes_with_json(tmp_path: Path) -> None:
    (tmp_path / "orjson.py").write_text("raise ImportError('not in this environment')\n")
    code = (
        "from mserve_worker import fastjson\n"
        "from mserve_worker.payload import decode_request\n"
        "assert not fastjson.AVAILABLE\n"
        "print(decode_request('application/json', [], b'{\"data\": [0.5, 12345678901234567890123]}', {}))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "{'body': {'data': [0.5, 12345678901234567890123]}}"


def outcome(value: object) -> bytes | tuple[str, str]:
    """The answer's bytes, or its error's type and words."""
    try:
        return encode_output(value)[0]
    except Exception as exc:  # compared, not handled
        return type(exc).__name__, str(exc)


def answer(value: object) -> bytes | tuple[str, str]:
    return outcome(value)


def json_answer(value: object) -> bytes | tuple[str, str]:
    """What the worker answered before orjson: the same call with it out of reach."""
    dumps = fastjson._orjson_dumps
    fastjson._orjson_dumps = None
    try:
        return outcome(value)
    finally:
        fastjson._orjson_dumps = dumps


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


def test_orjson_writes_answers_where_the_server_installed_it() -> None:
    assert fastjson.encode({"data": [0.5, 1, "é"]}) == '{"data":[0.5,1,"é"]}'.encode()


@pytest.mark.parametrize(
    "value",
    [
        [float("nan"), float("inf"), -float("inf")],  # orjson: null
        [1e-5, 8e-05, 8.966596414276016e-07, 0.0001, 5e-324],  # json: exponents
        [1e16, 1e20, 1.7976931348623157e308, -0.0, 0.0, 1.0, 123456.789],
        {"text": "one-shot 0.00001", "p": 0.25},  # spelled like a number json writes otherwise
        [2**64, -(2**63) - 1, 2**63],
        {1: "a", None: "b", 2.5: "c"},  # keys json turns into strings
        [Colour.RED, Name("n"), {Name("k"): 1}, collections.OrderedDict(a=1), (1, 2)],
        ["\ud800"],
        {"when": datetime.date(2026, 11, 27)},  # json refuses it in words
        [[[[[[[[[[1]]]]]]]]]] * 3,
        None,
        "x",
    ],
)
def test_an_answer_is_the_bytes_json_writes(value: object) -> None:
    if isinstance(value, str) and value == "x":
        value = {"s": '\u00e9\n\t"\\', "n": None}
    assert answer(value) == json_answer(value)


def test_deep_and_circular_answers_fail_as_before() -> None:
    deep: list[Any] = []
    for _ in range(400):  # past orjson's 254 levels, within json's recursion limit
        deep = [deep]
    assert answer(deep) == json_answer(deep)
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(PayloadError, match="Circular reference detected"):
        encode_output(loop)


def test_numpy_scalars_go_through_json() -> None:
    np = pytest.importorskip("numpy")
    assert encode_output([np.float64(0.5)])[0] == b"[0.5]"  # a float subclass: json's way
    with pytest.raises(PayloadError, match=r"numpy\.float32"):
        encode_output([np.float32(0.5)])


def test_an_enum_or_a_uuid_is_written_as_its_value_where_json_refused_it() -> None:
    class Mode(enum.Enum):
        FAST = "fast"

    value = {"mode": Mode.FAST, "id": uuid.UUID(int=1)}
    assert json_answer(value)[0] == "PayloadError"  # json refuses both
    assert answer(value) == b'{"mode":"fast","id":"00000000-0000-0000-0000-000000000001"}'


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_value_is_answered_with_the_bytes_json_writes(value: object) -> None:
    assert answer(value) == json_answer(value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats() | st.floats(min_value=-1e-3, max_value=1e-3), min_size=1))
def test_floats_of_every_size_are_written_as_json_writes_them(values: list[float]) -> None:
    assert answer(values) == json_answer(values)


def test_an_orjson_that_writes_numbers_otherwise_is_not_used_to_write(monkeypatch) -> None:
    real = fastjson._orjson_dumps
    assert fastjson._agrees() == (True, True)
    # as orjson before 3.11.9 wrote them: 1e16 where json writes 1e+16
    monkeypatch.setattr(fastjson, "_orjson_dumps", lambda v, option=0: real(v).replace(b"e+", b"e"))
    assert fastjson._agrees() == (True, False)
