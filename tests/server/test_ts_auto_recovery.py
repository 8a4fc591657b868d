"""Worker recovery as TorchServe's own tests read it from its console (test/pytest/
test_auto_recover.py, test_handler_traceback_logging.py): ``torchserve --start`` run as
TorchServe's test utilities run it (tests/server/test_torchserve_layout.py's harness), its
stdout read line by line.

- a worker that stops answering (a request past ``default_response_timeout``) or exits is
  killed, restarted after TorchServe's backoff and recovers, with TorchServe's lines at each
  step: ``Number or consecutive unsuccessful inference <n>``, ``<id> Worker disconnected``,
  ``Auto recovery start timestamp: <ms>``, ``Retry worker: <id> in <n> seconds.``, ``Auto
  recovery succeeded, reset recoveryStartTS``;
- a handler whose ``initialize`` fails is retried (1, 1, 2 seconds...) with its traceback on
  the console each time until ``maxRetryTimeoutInSec`` has passed, then the model is failed;
- those lines name the worker's thread as TorchServe's do (``W-9000-<model>_<version>``, and
  ``-stdout``/``-stderr`` after it for the worker's own output).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server.conftest import wait_until
from tests.server.test_torchserve_layout import Console, TorchServeDir
from tests.server.test_torchserve_layout import ts_dir as layout_ts_dir  # noqa: F401

TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}"
LOGGER = r"org\.pytorch\.serve\.wlm\.WorkerThread - "


@pytest.fixture
def ts_dir(layout_ts_dir: TorchServeDir) -> TorchServeDir:  # noqa: F811
    """The folder ``torchserve`` runs in, with its archives (the layout tests' fixture)."""
    return layout_ts_dir


def _after(console: Console, start: int, text: str, timeout_s: float = 30.0) -> int:
    """The index of the first console line from ``start`` on that holds ``text``."""
    found: list[int] = []

    def seen() -> bool:
        found[:] = [i for i in range(start, len(console.lines)) if text in console.lines[i]]
        return bool(found)

    wait_until(seen, timeout_s, f"{text!r} on the console:\n" + "\n".join(console.lines[start:]))
    return found[0]


def _line(console: Console, at: int, level: str, message: str, thread: str) -> None:
    """Line ``at`` is TorchServe's WorkerThread saying ``message`` on ``thread``."""
    pattern = rf"{TS} \[{level} *\] {re.escape(thread)} {LOGGER}{message}"
    assert re.fullmatch(pattern, console.lines[at]), console.lines[at]


def test_a_worker_that_stops_answering_or_exits_recovers_as_torchserves_does(
    ts_dir: TorchServeDir, make_archive: Callable[..., Path]
) -> None:
    make_archive("recovery", "crash_on:FailingModel", "tp_model")
    properties = ts_dir.root / "config.properties"
    properties.write_text(properties.read_text() + "default_response_timeout=2\n")
    console = ts_dir.start("--ncs", "--model-store", "model_store", "--enable-model-api",
                           "--ts-config", "config.properties")  # fmt: skip
    query = "url=tp_model.mar&initial_workers=1&synchronous=true&batch_size=1"
    assert ts_dir.call("management", "POST", f"/models?{query}").status == 200
    worker = ts_dir.call("management", "GET", "/models/tp_model").json()[0]["workers"][0]["id"]
    thread = f"W-{worker}-tp_model_1.0"  # TorchServe's WorkerThread's name
    loaded = _after(console, 0, "[xxx] Model initialization ... DONE")
    assert re.fullmatch(  # the worker's stdout, as TorchServe's reader thread logs it
        rf"{TS} \[INFO \] {thread}-stdout MODEL_LOG - \[xxx\] Model initialization \.\.\. DONE !!",
        console.lines[loaded],
    ), console.lines[loaded]

    # TorchServe's test_auto_recover: a request the worker does not answer in time
    start = len(console.lines)
    reply = ts_dir.call("inference", "POST", "/predictions/tp_model", b"42")
    assert reply.status == 500
    count = _after(console, start, "Number or consecutive unsuccessful inference")
    _line(console, count, "ERROR", "Number or consecutive unsuccessful inference 1", thread)
    assert "Backend worker error" in console.lines[count + 1]
    gone = _after(console, count, "Worker disconnected")
    _line(console, gone, "INFO", f"{worker} Worker disconnected. WORKER_MODEL_LOADED", thread)
    began = _after(console, gone, "Auto recovery start timestamp")
    _line(console, began, "INFO", r"Auto recovery start timestamp: \d{13}", thread)
    retry = _after(console, began, "Retry worker")
    _line(console, retry, "INFO", f"Retry worker: {worker} in 1 seconds.", thread)
    done = _after(console, retry, "Auto recovery succeeded, reset recoveryStartTS")
    assert any("Model initialization ... DONE" in line for line in console.lines[retry:done])
    assert not any("Auto recovery failed again" in line for line in console.lines[start:])
    # the restarted worker keeps its id and serves
    described = ts_dir.call("management", "GET", "/models/tp_model").json()[0]["workers"]
    assert [w["id"] for w in described] == [worker]
    ok = ts_dir.call("inference", "POST", "/predictions/tp_model", b"1")
    assert (ok.status, ok.body) == (200, b"sample output 0")

    # the count is of requests in a row without an answer: the answer above started it again
    start = len(console.lines)
    assert ts_dir.call("inference", "POST", "/predictions/tp_model", b"42").status == 500
    count = _after(console, start, "Number or consecutive unsuccessful inference")
    _line(console, count, "ERROR", "Number or consecutive unsuccessful inference 1", thread)
    _after(console, count, "Auto recovery succeeded, reset recoveryStartTS")
    assert ts_dir.call("inference", "POST", "/predictions/tp_model", b"42").status == 500
    count = _after(console, count + 1, "Number or consecutive unsuccessful inference")
    _line(console, count, "ERROR", "Number or consecutive unsuccessful inference 2", thread)
    _after(console, count, "Auto recovery succeeded, reset recoveryStartTS")

    # a worker whose process ends: the same recovery, without the unanswered count
    start = len(console.lines)
    assert ts_dir.call("inference", "POST", "/predictions/tp_model", b"exit").status == 500
    gone = _after(console, start, "Worker disconnected")
    _line(console, gone, "INFO", f"{worker} Worker disconnected. WORKER_MODEL_LOADED", thread)
    retry = _after(console, gone, "Retry worker")
    _line(console, retry, "INFO", f"Retry worker: {worker} in 1 seconds.", thread)
    _after(console, retry, "Auto recovery succeeded, reset recoveryStartTS")
    assert not any("unsuccessful inference" in line for line in console.lines[start:])
    assert ts_dir.call("inference", "POST", "/predictions/tp_model", b"1").status == 200


def test_a_handler_that_cannot_initialize_is_retried_with_its_traceback_each_time(
    ts_dir: TorchServeDir, make_archive: Callable[..., Path], tmp_path: Path
) -> None:
    """TorchServe's test_handler_traceback_logging (the first try and three retries, each with
    the handler's traceback), with maxRetryTimeoutInSec 4 instead of its 300, so that the
    model is failed after the fourth try: 503 naming the load error."""
    config = tmp_path / "model_config.yaml"
    config.write_text("maxRetryTimeoutInSec: 4\n")
    make_archive("recovery", "failing_init:FailingModel", "test_model", "-c", str(config))
    console = ts_dir.start("--ncs", "--model-store", "model_store", "--enable-model-api",
                           "--ts-config", "config.properties")  # fmt: skip
    query = "url=test_model.mar&initial_workers=1&synchronous=false&batch_size=1"
    assert ts_dir.call("management", "POST", f"/models?{query}").status == 202
    described = ts_dir.call("management", "GET", "/models/test_model").json()[0]
    assert described["maxRetryTimeoutInSec"] == 4
    worker = described["workers"][0]["id"]
    thread = f"W-{worker}-test_model_1.0"
    traceback = ["Traceback (most recent call last):", "in initialize", "self.call1()",
                 "in call1", "self.call2()", "in call4", "self.call5()", "in call5",
                 "assert False", "AssertionError"]  # fmt: skip
    at = 0
    for attempt in range(4):  # the first try, then three retries
        end = _after(console, at, "AssertionError")
        assert console.lines[end].endswith(f" {thread}-stderr MODEL_LOG - AssertionError")
        tried = console.lines[at : end + 1]
        for part in traceback:
            assert any(part in line for line in tried), (attempt, part, "\n".join(tried))
        at = end + 1
        if attempt < 3:
            gone = _after(console, at, "Worker disconnected")
            # TorchServe's test reads on to the next line naming the error: the next traceback's
            # own, not a line of ours repeating this one
            repeats = [line for line in console.lines[at:gone] if "AssertionError" in line]
            assert not repeats, repeats
            _line(console, gone, "INFO", f"{worker} Worker disconnected. WORKER_STARTED", thread)
            if attempt == 0:
                _line(console, gone + 1, "INFO", r"Auto recovery start timestamp: \d{13}", thread)
            else:
                _line(console, gone + 1, "WARN", "Auto recovery failed again", thread)
            delay = (1, 1, 2)[attempt]
            retry = _after(console, gone, "Retry worker")
            _line(console, retry, "INFO", f"Retry worker: {worker} in {delay} seconds.", thread)
            at = retry + 1
    # past maxRetryTimeoutInSec: no retry, the model is failed and says why
    failed = _after(console, at, "marked failed")
    assert not any("Retry worker" in line for line in console.lines[at:failed])
    reply = ts_dir.call("inference", "POST", "/predictions/test_model", b"1")
    assert reply.status == 503, reply.body
    message = reply.json()["message"]
    assert message.startswith(
        f"model test_model:1.0 has failed: worker {worker} was lost 4 times without loading"
        " again within maxRetryTimeoutInSec=4; last: handler of test_model:1.0 failed to"
        " load: AssertionError"
    ), message
    assert ts_dir.call("management", "GET", "/models/test_model").json()[0]["status"] == "FAILED"


def test_a_startup_model_that_cannot_load_is_retried_after_the_start(
    ts_dir: TorchServeDir, make_archive: Callable[..., Path], tmp_path: Path
) -> None:
    """A model given at start whose handler cannot load is retried as a lost worker is (not
    failed at its first failed load): ``torchserve --start`` returns once the first load has
    failed, requests wait in the model's queue meanwhile, and once maxRetryTimeoutInSec has
    passed the model is failed and the waiting request gets the 503 naming the load error."""
    config = tmp_path / "model_config.yaml"
    config.write_text("maxRetryTimeoutInSec: 4\n")
    make_archive("recovery", "failing_init:FailingModel", "test_model", "-c", str(config))
    console = ts_dir.start("--ncs", "--model-store", "model_store", "--models",
                           "test_model.mar", "--ts-config", "config.properties")  # fmt: skip
    started = console.lines.index("Model server started.")
    assert any("AssertionError" in line for line in console.lines[:started]), console.text
    described = ts_dir.call("management", "GET", "/models/test_model").json()[0]
    assert described["status"] != "FAILED", described
    worker = described["workers"][0]["id"]
    thread = f"W-{worker}-test_model_1.0"
    reply = ts_dir.call("inference", "POST", "/predictions/test_model", b"1")  # waits
    assert reply.status == 503, reply.body
    assert reply.json()["message"].startswith(
        f"model test_model:1.0 has failed: worker {worker} was lost 4 times without loading"
        " again within maxRetryTimeoutInSec=4; last: handler of test_model:1.0 failed to"
        " load: AssertionError"
    ), reply.body
    retry = _after(console, started, "Retry worker")
    _line(console, retry, "INFO", f"Retry worker: {worker} in 1 seconds.", thread)
    failed = _after(console, retry, "marked failed")
    assert sum("Retry worker" in line for line in console.lines[:failed]) == 3
    assert ts_dir.call("management", "GET", "/models/test_model").json()[0]["status"] == "FAILED"
