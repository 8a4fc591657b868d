"""The kserve envelope inside one worker batch: requests that were batched together share one
handler call, one row per instance, and each gets its own slice of the outputs back; an instance
the handler failed fails its own request only. Runs the worker's batch code on a real frame
with a real handler (tests/handlers/envelope/rows.py), no server."""

from __future__ import annotations

import json
import sys
from typing import Any

from mserve_worker.context import Context
from mserve_worker.loader import load_handler
from mserve_worker.oip import serving
from mserve_worker.protocol import RequestItem
from mserve_worker.service import HandlerService
from tests.server.conftest import HANDLERS

FOLDER = HANDLERS / "envelope"


def _item(rid: str, doc: Any, api: str = "v1", op: str = "") -> RequestItem:
    return RequestItem(rid, "application/json", [], json.dumps(doc).encode(), op=op, api=api)


def _loaded(monkeypatch, envelope: str, entry: str = "rows:handle") -> HandlerService:
    monkeypatch.syspath_prepend(str(FOLDER))
    context = Context("rows", str(FOLDER), {}, 8, None, "mserve", "0")
    handler = load_handler(entry, str(FOLDER), context, None)
    sys.modules.pop("rows", None)
    serving.for_context(context, handler.style, envelope)  # as the worker does when it loads
    return HandlerService(handler, context)


def test_batched_requests_share_one_call_and_get_their_own_slices(monkeypatch) -> None:
    service = _loaded(monkeypatch, "kserve")
    items = [
        _item("a", {"instances": [1, 2]}),
        _item("b", {"instances": ["x", "bad", "y"]}),
        _item("c", {"instances": [3]}, api=""),  # /predictions, in the envelope's shape
        _item("d", {"plain": True}, api=""),  # /predictions, another body: no envelope
        _item("e", {"instances": []}),
    ]
    responses, _handler_ms, _metrics = service.serve(1, items)
    answers = [(r.status, json.loads(bytes(r.body))) for r in responses]
    # one call for the enveloped requests (e's empty instances never reach it), one for d
    rows = 2 + 3 + 1
    assert answers == [
        (200, {"predictions": [{"row": 1, "rows": rows, "explain": False},
                               {"row": 2, "rows": rows, "explain": False}]}),
        (422, {"error": "instance 3 is bad"}),  # its row's index in the call
        (200, {"predictions": [{"row": 3, "rows": rows, "explain": False}]}),
        (200, {"row": {"plain": True}, "rows": 1, "explain": False}),
        (400, {"error": "the request's 'instances' is empty: there is nothing to predict"}),
    ]  # fmt: skip


def test_body_envelope_hands_over_the_bodies_themselves(monkeypatch) -> None:
    """TorchServe's body envelope: a row is the body (its "data" or "body"), not {"body": ...}."""
    service = _loaded(monkeypatch, "body", "rows:as_given")
    items = [_item("a", [1, 2], api=""), _item("b", {"instances": [5]})]
    responses, _handler_ms, _metrics = service.serve(1, items)
    assert [json.loads(bytes(r.body)) for r in responses] == [
        [1, 2],
        {"predictions": {"instances": [5]}},
    ]
