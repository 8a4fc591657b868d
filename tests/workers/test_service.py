"""The worker's service without its socket, as a Ray Serve replica uses it: load a real handler
from INIT's fields, serve request items, get response items (no frames). Each scenario runs in
a fresh interpreter, since loading makes that process the model's (working directory,
``sys.path``, the ``ts`` namespace)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mserve_worker.protocol import ProtocolError, ResponseItem, checked_response
from tests.server.conftest import HANDLERS

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = """
import json, sys
from mserve_worker.protocol import RequestItem
from mserve_worker.service import BatchFailed, HandlerService, LoadFailed

init = json.loads(sys.argv[1])
try:
    service = HandlerService.load(init)
except LoadFailed as exc:
    print(json.dumps({"load_failed": exc.error, "traceback": exc.traceback}))
    sys.exit(0)
out = {"style": service.style, "load_s": service.load_s, "batches": []}
for batch_id, (bodies, cancelled) in enumerate(json.loads(sys.argv[2]), 1):
    items = [RequestItem(f"r{i}", "application/json", [], json.dumps(b).encode())
             for i, b in enumerate(bodies)]
    try:
        responses, handler_ms, metrics = service.serve(batch_id, items, set(cancelled))
    except BatchFailed as exc:
        out["batches"].append({"failed": exc.error, "traceback": exc.traceback})
        continue
    out["batches"].append({"handler_ms": handler_ms, "responses": [
        [r.status, bytes(r.body).decode("latin-1"), r.content_type, r.headers]
        for r in responses]})
service.shutdown()
print(json.dumps(out))
"""


def _run(init: dict, batches: list) -> dict:
    done = subprocess.run(
        [sys.executable, "-I", "-c", SCENARIO, json.dumps(init), json.dumps(batches)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _init(**extra: object) -> dict:
    return {"model_name": "probe", "model_dir": str(HANDLERS / "probe"),
            "handler": "probe:handle", "manifest": {"model": {"modelName": "probe"}},
            "batch_size": 4, **extra}  # fmt: skip


def test_service_answers_items_with_items_and_skips_cancelled_ones() -> None:
    out = _run(_init(), [[[{"k": 1}, {"cmd": "status"}, {"k": 3}], ["r2"]]])
    assert out["style"] == "module-function" and out["load_s"] > 0
    (batch,) = out["batches"]
    assert batch["handler_ms"] >= 0
    first, teapot, gone = batch["responses"]
    report = json.loads(first[1])
    # the cancelled request never reached the handler: it saw a batch of two
    assert (first[0], report["body"], report["batch_len"]) == (200, {"k": 1}, 2)
    assert report["cwd"] == str(HANDLERS / "probe")  # loading made the process the model's
    assert teapot[0] == 418
    assert gone == [499, "", "", []]


def test_service_limits_the_answer_size_it_was_loaded_with() -> None:
    out = _run(_init(max_response_bytes=100), [[[{"cmd": "big", "n": 101}, {"cmd": "big", "n": 100}], []]])  # fmt: skip
    too_big, fits = out["batches"][0]["responses"]
    assert too_big == [413, "", "", [["x-mserve-response-too-large", "101"]]]
    assert (fits[0], len(fits[1])) == (200, 100)


def test_a_batch_the_handler_fails_raises_batch_failed_with_its_traceback() -> None:
    out = _run(_init(), [[[{"cmd": "raise"}], []], [[{"k": 2}], []]])
    failed, after = out["batches"]
    assert failed["failed"] == "RuntimeError: probe was asked to fail"
    assert "Traceback" in failed["traceback"] and "probe.py" in failed["traceback"]
    assert after["responses"][0][0] == 200  # the service serves on


def test_wrong_number_of_results_fails_the_batch_in_words() -> None:
    out = _run(_init(), [[[{"k": 1}, {"cmd": "wrong_length"}], []]])
    assert out["batches"][0] == {
        "failed": "handler must return a list with one result per request: got 1 results"
        " for a batch of 2",
        "traceback": "",
    }


def test_a_handler_that_does_not_load_raises_load_failed() -> None:
    out = _run(_init(handler="nope:handle"), [])
    assert out["load_failed"].startswith(
        f"handler module 'nope' not found in {HANDLERS / 'probe'}; it has: "
    )
    assert out["traceback"] == ""  # our message, not the user's traceback
    out = _run(_init(model_dir=str(HANDLERS / "bad_import"), handler="broken:handle"), [])
    assert out["load_failed"].startswith("ModuleNotFoundError: ")
    assert "Traceback" in out["traceback"]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (ResponseItem(700, b""), "responses[0].status must be an HTTP status in 100..599, got 700"),
        (ResponseItem(200, "text"), "responses[0].body must be bytes-like, got str"),  # type: ignore[arg-type]
        (ResponseItem(200, b"", "", [["X-A", 1]]), "responses[0].headers"),  # type: ignore[list-item]
    ],
    ids=["status", "body", "header"],
)
def test_an_answer_the_wire_cannot_carry_is_refused_by_name(
    item: ResponseItem, message: str
) -> None:
    """What an in-process caller (the Ray replica) checks before handing answers on."""
    with pytest.raises(ProtocolError) as caught:
        checked_response(item, "responses[0]")
    assert str(caught.value).startswith(message)
    entry, body = checked_response(ResponseItem(200, bytearray(b"ok"), "text/plain"), "r")
    assert (entry["status"], entry["size"], bytes(body)) == (200, 2, b"ok")
