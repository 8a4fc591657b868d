"""server/compare.py: the answer comparison shared by shadow diffs and replay (no server)."""

import json
import math

import pytest

from server.compare import Answer, CompareOptions, Comparison, compare


def js(value, status=200, content_type="application/json"):
    return Answer(status, json.dumps(value).encode(), content_type)


def test_identical_bytes_are_equal_at_once():
    result = compare(js({"a": 1}), js({"a": 1}))
    assert result.equal and result.bytes_equal
    assert result.kinds == () and result.difference_count == 0


def test_same_json_other_bytes_is_equal_but_not_bytes_equal():
    a = Answer(200, b'{"a": 1, "b": [1, 2]}', "application/json")
    b = Answer(200, b'{"b":[1,2],"a":1}', "application/json; charset=utf-8")
    result = compare(a, b)
    assert result.equal and not result.bytes_equal


def test_status_difference_stops_there():
    result = compare(js({"a": 1}), js({"error": "x"}, status=500))
    assert not result.equal
    assert result.kinds == ("status",)
    assert result.differences[0].reference == 200 and result.differences[0].candidate == 500


def test_content_type_difference():
    result = compare(Answer(200, b"x", "text/plain"), Answer(200, b"x", "application/octet-stream"))
    assert result.kinds == ("content_type",)
    assert not result.bytes_equal


def test_non_json_bodies_compare_as_bytes():
    a = Answer(200, b"\x89PNG\x00\x01", "image/png")
    b = Answer(200, b"\x89PNG\x00\x02", "image/png")
    result = compare(a, b)
    assert result.kinds == ("bytes",)
    assert result.differences[0].detail == "bodies differ from byte 5"
    # a JSON body is not parsed when the content type says it is an image
    result = compare(Answer(200, b"1", "image/png"), Answer(200, b"1.0", "image/png"))
    assert result.kinds == ("bytes",)


def test_one_changed_field_is_named_by_its_path():
    a = {"predictions": [{"label": "cat", "score": 0.9}, {"label": "dog", "score": 0.1}]}
    b = {"predictions": [{"label": "cat", "score": 0.9}, {"label": "dog", "score": 0.2}]}
    result = compare(js(a), js(b))
    assert not result.equal
    assert result.kinds == ("number",)
    assert result.fields == ("$.predictions[1].score",)
    d = result.differences[0]
    assert (d.reference, d.candidate) == (0.1, 0.2)
    assert d.abs_error == pytest.approx(0.1) and d.rel_error == pytest.approx(0.5)
    assert result.max_abs_error == pytest.approx(0.1)
    assert result.numbers_compared == 2


def test_structure_keys_types_and_lengths():
    a = {"a": 1, "b": "x", "c": [1, 2, 3], "weird key": True, "n": None}
    b = {"a": "1", "c": [1, 2], "weird key": False, "n": None, "extra": {}}
    result = compare(js(a), js(b))
    by_path = {d.path: d for d in result.differences}
    assert by_path["$.a"].kind == "type" and by_path["$.a"].detail == "number against string"
    assert by_path["$.b"].kind == "key" and by_path["$.b"].detail == "only in reference"
    assert by_path["$.extra"].kind == "key" and by_path["$.extra"].detail == "only in candidate"
    assert by_path["$.c"].kind == "length" and by_path["$.c"].detail == "3 items against 2"
    assert by_path['$["weird key"]'].kind == "value"
    assert result.kinds == ("key", "type", "length", "value")
    assert "$.n" not in by_path


def test_nested_lists():
    a = [[1, 2, [3, 4]], [5]]
    b = [[1, 2, [3, 40]], [5, 6]]
    result = compare(js(a), js(b))
    assert result.fields == ("$[0][2][1]", "$[1]")
    assert result.kinds == ("length", "number")


@pytest.mark.parametrize(
    ("a", "b", "options", "equal"),
    [
        (1.0, 1.25, CompareOptions(abs_tol=0.25), True),  # exactly at the tolerance: equal
        (1.0, 1.2500001, CompareOptions(abs_tol=0.25), False),
        (100.0, 101.0, CompareOptions(rel_tol=0.01), True),  # |d| = 0.01 * max: equal
        (100.0, 101.5, CompareOptions(rel_tol=0.01), False),
        (0.0, 1e-9, CompareOptions(rel_tol=0.5), False),  # relative to max: 1.0
        (0.0, 1e-9, CompareOptions(abs_tol=1e-8), True),
        (3, 3.0, CompareOptions(), True),  # an integer and a float of the same value
        (True, 1, CompareOptions(abs_tol=1), False),  # a boolean is not a number
    ],
)
def test_tolerance_edges(a, b, options, equal):
    assert compare(js({"x": a}), js({"x": b}), options).equal is equal


def test_within_tolerance_still_reports_the_error():
    result = compare(js([1.0, 2.0]), js([1.001, 2.0]), CompareOptions(abs_tol=0.01))
    assert result.equal and not result.bytes_equal
    assert result.max_abs_error == pytest.approx(0.001)
    assert result.max_rel_error == pytest.approx(0.001 / 1.001)


def test_nan_and_infinity():
    nan = Answer(200, b'{"x": NaN, "y": Infinity}', "application/json")
    assert compare(nan, Answer(200, b'{"x":NaN,"y":Infinity}', "application/json")).equal
    strict = CompareOptions(nan_equal=False)
    assert not compare(nan, Answer(200, b'{"x":NaN,"y":Infinity}', ""), strict).equal
    result = compare(nan, Answer(200, b'{"x": 1.0, "y": -Infinity}', "application/json"))
    assert result.fields == ("$.x", "$.y")
    assert math.isinf(result.max_abs_error)
    as_json = json.loads(json.dumps(result.to_dict(), allow_nan=False))  # strict JSON
    assert as_json["max_abs_error"] is None
    assert as_json["differences"][0]["reference"] == "nan"
    assert as_json["differences"][0]["abs_error"] is None


def test_top_k_on_torchserve_classifier_answers():
    a = {"tabby": 0.5, "tiger_cat": 0.3, "Egyptian_cat": 0.1, "lynx": 0.05, "cougar": 0.01}
    b = {"tabby": 0.5, "tiger_cat": 0.3, "Egyptian_cat": 0.1, "lynx": 0.05, "jaguar": 0.02}
    options = CompareOptions(top_k=3)
    result = compare(js(a), js(b), options)
    assert result.equal  # the fifth label came and went, outside the top 3
    assert result.top_k.rankings == 1 and result.top_k.agreed == 1
    b2 = dict(a, lynx=0.2)
    result = compare(js(a), js(b2), CompareOptions(top_k=3, abs_tol=0.2))
    assert result.kinds == ("top_k",)
    d = result.differences[0]
    assert d.reference == "tabby, tiger_cat, Egyptian_cat"
    assert d.candidate == "tabby, tiger_cat, lynx"
    assert result.top_k.agreed == 0 and result.top_k.top1_agreed == 1
    # without top-k the same answers differ by their keys
    assert compare(js(a), js(b)).kinds == ("key",)


def test_top_k_on_lists_of_label_score_and_batches():
    a = {"predictions": [[{"label": "cat", "score": 0.9}, {"label": "dog", "score": 0.1}]] * 2}
    b = {
        "predictions": [
            [{"label": "cat", "score": 0.9}, {"label": "dog", "score": 0.1}],
            [{"label": "dog", "score": 0.6}, {"label": "cat", "score": 0.4}],
        ]
    }
    result = compare(js(a), js(b), CompareOptions(top_k=1))
    assert result.top_k.rankings == 2 and result.top_k.agreed == 1
    assert result.top_k.agreement == 0.5
    assert "$.predictions[1]" in result.fields
    assert '$.predictions[1][label="cat"].score' in result.fields
    assert result.to_dict()["top_k"]["agreement"] == 0.5


def test_differences_are_bounded_but_counted():
    result = compare(js(list(range(100))), js([x + 1 for x in range(100)]))
    assert result.difference_count == 100
    assert len(result.differences) == 20 and len(result.fields) == 20
    small = compare(js(list(range(100))), js([-1] * 100), CompareOptions(max_differences=3))
    assert len(small.differences) == 3 and small.difference_count == 100


def test_long_values_are_quoted_short():
    result = compare(js({"s": "a" * 1000}), js({"s": "b" * 1000}))
    assert len(result.differences[0].reference) == 120


def test_deep_nesting_does_not_recurse():
    deep_a = "[" * 900 + "1" + "]" * 900
    deep_b = "[" * 900 + "2" + "]" * 900
    result = compare(Answer(200, deep_a.encode()), Answer(200, deep_b.encode()))
    assert result.kinds == ("number",)


def test_round_trip_through_json():
    result = compare(
        js({"p": [{"a": 1.5}], "q": "x"}),
        js({"p": [{"a": 2.5}], "r": 1}),
        CompareOptions(top_k=2),
    )
    again = Comparison.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result


def test_options_from_dict_name_the_field():
    assert CompareOptions.from_dict({"abs_tol": 1, "top_k": 5}) == CompareOptions(
        abs_tol=1.0, top_k=5
    )
    cases = [
        ({"abs_tol": -1}, "shadow.abs_tol must be a finite number >= 0, got -1"),
        ({"rel_tol": "x"}, "shadow.rel_tol must be a finite number >= 0, got 'x'"),
        ({"top_k": 1.5}, "shadow.top_k must be an integer from 0 to 1000, got 1.5"),
        ({"nan_equal": 1}, "shadow.nan_equal must be true or false, got 1"),
        ({"tol": 1}, "unknown field shadow.tol: expected one of abs_tol, "),
    ]
    for data, message in cases:
        with pytest.raises(ValueError) as info:
            CompareOptions.from_dict(data, prefix="shadow.")
        assert str(info.value).startswith(message)
