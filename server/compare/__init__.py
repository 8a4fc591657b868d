"""Compare two answers to the same request: one module for shadow diffs and replay.

A shadow version's answer is compared with the primary's (server/rollouts/shadow.py), and a
replayed answer with the one the inference log recorded (``mserve replay``). Both ask the same
question, "did the answer change, where, and by how much?", so both call :func:`compare`; a
difference found by one is named the same way by the other.

The module is pure (no I/O, no server imports, standard library only) and sits in the leaf layer.

API
---
``compare(reference, candidate, options=CompareOptions()) -> Comparison``

- ``reference`` and ``candidate`` are :class:`Answer` (status, body bytes, content type). The
  reference is the answer trusted so far (the primary version's, the recorded one); the candidate
  is the one under test (the shadow's, the replayed one). Details say ``only in reference`` /
  ``only in candidate`` from that point of view.
- Steps: the status first (a different status is one ``status`` difference; the bodies of a
  200 and a 500 are not worth comparing, so the walk stops there). Then the media type
  (parameters such as ``charset`` ignored). Then the bytes: identical bytes are equal at once,
  the fast path for most pairs. Otherwise both bodies are parsed as JSON (unless a content
  type says neither JSON nor text); bodies that do not both parse are compared as bytes
  (one ``bytes`` difference). Parsed bodies are walked side by side.
- The walk names each difference by its path, JSONPath style: ``$``, ``$.predictions[0].score``,
  ``$["a key"]``. Kinds (:data:`KINDS`): ``status``, ``content_type``, ``bytes`` (bodies that are
  not JSON differ), ``key`` (a key on one side only), ``type`` (string against number, ...),
  ``length`` (lists of different lengths; the common prefix is still compared), ``value``
  (strings, booleans or null that differ), ``number`` (numbers beyond tolerance), ``top_k``
  (a classification's top k labels differ).
- Numbers (integers and floats alike; booleans are not numbers) are equal when
  ``|a - b| <= abs_tol`` or ``|a - b| <= rel_tol * max(|a|, |b|)``: a difference exactly at the
  tolerance is equal. The relative error is ``|a - b| / max(|a|, |b|)`` (0 when both are 0).
  NaN equals NaN (``nan_equal``, default on: a model that answered NaN before and NaN now has
  not changed); NaN against a number, or infinities of different signs, differ by an unbounded
  error. Python's parser reads ``NaN`` and ``Infinity`` in bodies, as json.dumps writes them.
- Top-k, when ``options.top_k > 0``: a node that is a ranking on both sides (a dict of
  label -> number, such as TorchServe's image classifier answer ``{"tabby": 0.41, ...}``, or a
  list of ``{"label": ..., "score": ...}`` dicts, as Hugging Face pipelines answer; lists of
  either, such as a batch or ``{"predictions": [...]}``, are walked to their rankings) is
  compared as a ranking: the sets of the k best labels must match (a ``top_k`` difference
  otherwise), the scores of labels present on both sides are compared as numbers, and labels
  outside both top k sets may come and go (a top-5 answer) without a ``key`` difference. Ties
  are ranked by label so that the order is stable. With ``top_k`` at 0 (the default) rankings
  are plain JSON.

The result, :class:`Comparison`, is frozen and serialisable: ``to_dict()`` gives plain JSON
values (non-finite errors become ``null``) and ``Comparison.from_dict`` reads it back. It says
``equal`` (no difference beyond tolerance), ``bytes_equal`` (status, media type and bytes all
identical), the sorted ``kinds``, the ``fields`` (paths) that differ, the first
``options.max_differences`` :class:`Difference` records and ``difference_count`` (all of them),
``max_abs_error`` / ``max_rel_error`` over every pair of numbers compared (within tolerance
too: how close the candidate came), ``numbers_compared``, and ``top_k``
(:class:`TopKAgreement`: rankings compared, how many agreed on the top k set, how many on the
first label) when rankings were compared.

Options come from operators (shadow settings over REST, the replay command line):
``CompareOptions.from_dict`` checks them and raises ``ValueError`` naming the field, which the
caller turns into its own 400 or usage error.
"""

from server.compare.answers import (
    KINDS,
    Answer,
    CompareOptions,
    Comparison,
    Difference,
    TopKAgreement,
)
from server.compare.walk import compare

__all__ = [
    "KINDS",
    "Answer",
    "CompareOptions",
    "Comparison",
    "Difference",
    "TopKAgreement",
    "compare",
]
