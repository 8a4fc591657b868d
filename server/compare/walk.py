"""The comparison itself: status, media type, bytes, then both JSON trees walked side by side
(the rules are in the package docstring, server/compare/__init__.py)."""

from __future__ import annotations

import json
import math
from typing import Any

from server.compare.answers import (
    KINDS,
    Answer,
    CompareOptions,
    Comparison,
    Difference,
    TopKAgreement,
)

# A value quoted in a Difference is cut to this many characters: a sample of differing pairs
# is kept in memory and shown by describe, so one long string must not fill it.
_QUOTE_CHARS = 120
# Bodies above this size are compared as bytes only: walking a 100 MB JSON answer would take
# the comparing process's CPU for seconds (the bytes comparison is still exact).
_MAX_PARSE_BYTES = 8 * 1024 * 1024


def compare(
    reference: Answer, candidate: Answer, options: CompareOptions | None = None
) -> Comparison:
    """Compare ``candidate`` with ``reference`` (see the module docstring for the rules)."""
    if (
        reference.body == candidate.body
        and reference.status == candidate.status
        and (
            reference.content_type == candidate.content_type
            or _media_type(reference.content_type) == _media_type(candidate.content_type)
        )
    ):
        return _IDENTICAL  # most pairs: nothing to build
    options = options or CompareOptions()
    walk = _Walk(options)
    if reference.status != candidate.status:
        walk.add("$", "status", reference.status, candidate.status)
        return walk.result(bytes_equal=False)
    ref_type = _media_type(reference.content_type)
    cand_type = _media_type(candidate.content_type)
    if ref_type != cand_type:
        walk.add("$", "content_type", ref_type, cand_type)
    if reference.body == candidate.body:
        return walk.result(bytes_equal=not walk.count)
    ref_json = _parse(reference.body, ref_type)
    cand_json = _parse(candidate.body, cand_type)
    if ref_json is _NOT_JSON or cand_json is _NOT_JSON:
        walk.add(
            "$",
            "bytes",
            f"{len(reference.body)} bytes",
            f"{len(candidate.body)} bytes",
            detail=f"bodies differ from byte {_first_difference(reference.body, candidate.body)}",
        )
    else:
        walk.walk(ref_json, cand_json)
    return walk.result(bytes_equal=False)


_NOT_JSON = object()
_IDENTICAL = Comparison(equal=True, bytes_equal=True)


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _parse(body: bytes, media_type: str) -> Any:
    textual = (
        not media_type
        or media_type.startswith("text/")
        or media_type.endswith("/json")
        or media_type.endswith("+json")
    )
    if not textual or len(body) > _MAX_PARSE_BYTES:
        return _NOT_JSON
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        # ValueError covers JSONDecodeError and UnicodeDecodeError
        return _NOT_JSON


def _first_difference(a: bytes, b: bytes) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


# what json.loads makes, by JSON type (bool is a type of its own: true is not a number)
_TYPE_NAMES = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}
_NUMBERS = frozenset((int, float))


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), "object")


def _quote(value: Any) -> Any:
    """A JSON-safe, short stand-in for a value in a Difference."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf', '-inf': strict JSON has no such numbers
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= _QUOTE_CHARS else value[: _QUOTE_CHARS - 1] + "…"
    if isinstance(value, list):
        return f"array({len(value)})"
    return f"object({len(value)} keys)"


def _key_path(path: str, key: str) -> str:
    if key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _ranking(value: Any) -> dict[str, float] | None:
    """Label -> score when ``value`` is classification-shaped, else None."""
    if isinstance(value, dict) and value:
        for score in value.values():
            if isinstance(score, bool) or not isinstance(score, int | float):
                return None
        return value
    if isinstance(value, list) and value:
        out: dict[str, float] = {}
        for item in value:
            if not isinstance(item, dict) or len(item) != 2:
                return None
            label, score = item.get("label"), item.get("score")
            if (
                not isinstance(label, str)
                or isinstance(score, bool)
                or not isinstance(score, int | float)
            ):
                return None
            out[label] = score
        return out
    return None


def _top(scores: dict[str, float], k: int) -> list[str]:
    def key(item: tuple[str, float]) -> tuple[float, str]:
        score = item[1]
        return (-score if not math.isnan(score) else math.inf, item[0])

    return [label for label, _ in sorted(scores.items(), key=key)[:k]]


class _Walk:
    """The state of one comparison: differences, counts and errors as the trees are walked."""

    def __init__(self, options: CompareOptions) -> None:
        self.options = options
        self.kept: list[Difference] = []
        self.count = 0
        self.kinds: set[str] = set()
        self.fields: dict[str, None] = {}
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.numbers = 0
        self.rankings = 0
        self.agreed = 0
        self.top1 = 0

    def add(
        self,
        path: str,
        kind: str,
        reference: Any,
        candidate: Any,
        abs_error: float | None = None,
        rel_error: float | None = None,
        detail: str = "",
    ) -> None:
        self.count += 1
        self.kinds.add(kind)
        if len(self.fields) < self.options.max_differences:
            self.fields[path] = None
        if len(self.kept) < self.options.max_differences:
            self.kept.append(
                Difference(
                    path, kind, _quote(reference), _quote(candidate), abs_error, rel_error, detail
                )
            )

    def result(self, bytes_equal: bool) -> Comparison:
        top = None
        if self.rankings:
            top = TopKAgreement(self.options.top_k, self.rankings, self.agreed, self.top1)
        return Comparison(
            equal=not self.count,
            bytes_equal=bytes_equal,
            kinds=tuple(k for k in KINDS if k in self.kinds),
            fields=tuple(self.fields),
            differences=tuple(self.kept),
            difference_count=self.count,
            max_abs_error=self.max_abs,
            max_rel_error=self.max_rel,
            numbers_compared=self.numbers,
            top_k=top,
        )

    def walk(self, reference: Any, candidate: Any) -> None:
        # An explicit stack, not recursion: a deeply nested body must not hit Python's limit.
        stack: list[tuple[str, Any, Any]] = [("$", reference, candidate)]
        while stack:
            path, a, b = stack.pop()
            children = self.node(path, a, b)
            stack.extend(reversed(children))

    def node(self, path: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
        type_a, type_b = type(a), type(b)
        if type_a in _NUMBERS and type_b in _NUMBERS:
            self.number(path, a, b)
            return []
        if type_a is not type_b:
            name_a, name_b = _type_name(a), _type_name(b)
            self.add(path, "type", a, b, detail=f"{name_a} against {name_b}")
            return []
        if type_a is not list and type_a is not dict:  # strings, booleans, null
            if a != b:
                self.add(path, "value", a, b)
            return []
        if self.options.top_k:
            ranking_a, ranking_b = _ranking(a), _ranking(b)
            if ranking_a is not None and ranking_b is not None:
                self.ranking(path, ranking_a, ranking_b, labelled=type_a is list)
                return []
        children: list[tuple[str, Any, Any]] = []
        if type_a is list:
            if len(a) != len(b):
                self.add(path, "length", a, b, detail=f"{len(a)} items against {len(b)}")
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                # numbers are compared here, without a path or a stack entry unless they differ:
                # a long list of floats (an embedding) is most of the work
                if type(x) in _NUMBERS and type(y) in _NUMBERS:
                    if x == y:
                        self.numbers += 1
                    elif (errors := self.beyond(x, y)) is not None:
                        self.add(f"{path}[{i}]", "number", x, y, *errors)
                else:
                    children.append((f"{path}[{i}]", x, y))
            return children
        for key, x in a.items():
            if key not in b:
                self.add(_key_path(path, key), "key", x, None, detail="only in reference")
                continue
            y = b[key]
            if type(x) in _NUMBERS and type(y) in _NUMBERS and x == y:
                self.numbers += 1
            else:
                children.append((_key_path(path, key), x, y))
        for key, y in b.items():
            if key not in a:
                self.add(_key_path(path, key), "key", None, y, detail="only in candidate")
        return children

    def number(self, path: str, a: float, b: float) -> None:
        errors = self.beyond(a, b)
        if errors is not None:
            self.add(path, "number", a, b, *errors)

    def beyond(self, a: float, b: float) -> tuple[float, float] | None:
        """Count a pair of numbers and its errors; (abs, rel error) when beyond tolerance."""
        self.numbers += 1
        if a == b:
            return None
        nan_a, nan_b = a != a, b != b  # NaN is the one value unequal to itself
        if nan_a and nan_b and self.options.nan_equal:
            return None
        if nan_a or nan_b or math.isinf(a) or math.isinf(b):
            abs_error = rel_error = math.inf
        else:
            try:
                abs_error = float(abs(a - b))
                rel_error = abs_error / max(abs(a), abs(b))
            except OverflowError:  # integers too large for a float
                abs_error = rel_error = math.inf
        if abs_error > self.max_abs:
            self.max_abs = abs_error
        if rel_error > self.max_rel:
            self.max_rel = rel_error
        if abs_error <= self.options.abs_tol or rel_error <= self.options.rel_tol:
            return None
        return abs_error, rel_error

    def ranking(self, path: str, a: dict[str, float], b: dict[str, float], labelled: bool) -> None:
        k = self.options.top_k
        top_a, top_b = _top(a, k), _top(b, k)
        self.rankings += 1
        if top_a[:1] == top_b[:1]:
            self.top1 += 1
        if set(top_a) == set(top_b):
            self.agreed += 1
        else:
            self.add(
                path,
                "top_k",
                ", ".join(top_a),
                ", ".join(top_b),
                detail=f"top {k} labels differ",
            )
        for label, score in a.items():
            if label not in b:
                continue
            errors = self.beyond(score, b[label])
            if errors is not None:
                where = (
                    f"{path}[label={json.dumps(label, ensure_ascii=False)}].score"
                    if labelled
                    else _key_path(path, label)
                )
                self.add(where, "number", score, b[label], *errors)
