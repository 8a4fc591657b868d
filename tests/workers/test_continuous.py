"""The worker's side of continuous batching (mserve_worker/continuous.py) on a real Context:
which requests go on after a call, and the clean-up of those the server dropped; and a real
worker process running the steps itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mserve_worker import protocol
from mserve_worker.context import Context
from mserve_worker.protocol import Frame, Kind, RequestItem
from mserve_worker.steps import NEXT_HEADER, Steps
from tests.workers.test_runtime import HANDLERS, _spawn


def _context(*ids: str) -> Context:
    context = Context("gen", "/tmp", {}, 4, None, "mserve", "test")
    context.start_batch([RequestItem(i, "", [], b"") for i in ids])
    return context


class Criterion:
    def __init__(self, stop: bool | None) -> None:
        self.stop = stop
        self.cleaned = False

    def __call__(self, result: object) -> bool | None:
        return self.stop

    def clean_up(self) -> None:
        self.cleaned = True


def test_false_goes_on_true_is_the_last_chunk_none_a_whole_answer() -> None:
    context = _context("a", "b", "c", "d")
    context.stopping_criteria = [Criterion(False), Criterion(True), Criterion(None)]
    steps = Steps()
    steps.judge(context, ["x", "y", "z", "w"])
    # no criterion (3): done after one call
    assert steps.marks == {0: "true", 1: "false"}
    assert list(steps.running) == ["a"]
    steps.mark(context, everywhere=True)  # answers built from request processors (v1/v2)
    assert context.get_response_headers(0) == {NEXT_HEADER: "true"}
    assert context.get_response_headers(1) == {NEXT_HEADER: "false"}
    assert context.get_response_headers(2) == {}
    assert context.get_response_headers(3) == {}


def test_the_marks_go_through_the_context_where_the_handler_set_headers() -> None:
    """A handler that set headers itself (its own ts_stream_next too) gets its answers from
    its request processors: the criteria's verdict replaces its marker, its headers stay."""
    context = _context("a", "b")
    context.set_response_header(0, "X-Model", "gen")
    context.set_response_header(1, "TS_STREAM_NEXT", "true")
    context.stopping_criteria = [Criterion(False), Criterion(True)]
    steps = Steps()
    steps.judge(context, ["x", "y"])
    steps.mark(context, everywhere=False)
    assert context.get_response_headers(0) == {"X-Model": "gen", NEXT_HEADER: "true"}
    assert context.get_response_headers(1) == {NEXT_HEADER: "false"}
    assert steps.marks == {}


def test_untouched_answers_keep_their_marks_for_the_service() -> None:
    context = _context("a")
    context.stopping_criteria = [Criterion(False)]
    steps = Steps()
    steps.judge(context, ["x"])
    steps.mark(context, everywhere=False)
    assert context._touched(0) is None  # no request processor made for the marker
    assert steps.marks == {0: "true"}


def test_a_request_the_server_dropped_is_cleaned_up_at_the_next_call() -> None:
    context = _context("a", "b")
    with_clean_up = Criterion(False)
    context.stopping_criteria = [with_clean_up, lambda result: False]
    context.cache = {"a": "state of a", "b": "state of b"}
    steps = Steps()
    steps.judge(context, ["x", "y"])
    # the next call has neither: "a" has clean_up(), "b" only its context.cache entry
    steps.begin([RequestItem("c", "", [], b"")], set(), context)
    assert with_clean_up.cleaned
    assert context.cache == {"a": "state of a"}  # its clean_up() was its own business
    assert steps.running == {}


def test_a_request_that_goes_on_is_not_cleaned_up() -> None:
    context = _context("a")
    context.stopping_criteria = [Criterion(False)]
    context.cache = {"a": 1}
    steps = Steps()
    steps.judge(context, ["x"])
    steps.begin([RequestItem("a", "", [], b"", cached=True)], set(), context)
    assert context.cache == {"a": 1}
    assert list(steps.running) == ["a"]


def _step(peer) -> dict[tuple[int, int], tuple[str, bool]]:
    """The next STEP frame, as {(batch id, index): (token, goes on)}."""
    frame = peer.receive()
    assert frame.kind is Kind.STEP, frame.meta
    members, items = protocol.parse_step(frame)
    assert items is not None, frame.meta.get("error")
    return {
        m: (json.loads(bytes(r.body))["token"], [NEXT_HEADER, "true"] in r.headers)
        for m, r in zip(members, items, strict=True)
    }


def _request(name: str, tokens: int) -> RequestItem:
    return RequestItem(name, "application/json", [], json.dumps({"name": name, "tokens": tokens,
                                                                 "sleep": 0.01}).encode())  # fmt: skip


def test_the_worker_runs_steps_back_to_back_and_takes_joins_and_cancels_between_them(
    tmp_path: Path,
) -> None:
    """A real worker process with continuousBatching: once given requests it steps on its own
    (no frame from the server between steps), new requests join the next step, a cancelled one
    leaves it, and each step's answers name their BATCH frame and place."""
    proc, peer = _spawn(tmp_path)
    try:
        assert peer.receive().kind is Kind.HELLO
        peer.send(Frame(Kind.INIT, {
            "model_name": "gen", "model_dir": str(HANDLERS / "generator"),
            "handler": "generator:Generator", "manifest": {"model": {"modelName": "gen"}},
            "batch_size": 4, "gpu_id": None, "continuous_batching": True,
            "model_yaml_config": {"continuousBatching": True},
        }))  # fmt: skip
        assert peer.receive().kind is Kind.READY
        peer.send(protocol.batch_frame(1, [_request("a", 3), _request("b", 500)]))
        peer.sock.settimeout(20)
        first = _step(peer)
        assert first == {(1, 0): ("a:0", True), (1, 1): ("b:0", True)}
        second = _step(peer)  # nothing was sent: the worker went on by itself
        assert second == {(1, 0): ("a:1", True), (1, 1): ("b:1", True)}
        peer.send(protocol.batch_frame(2, [_request("c", 2)]))
        peer.send(protocol.cancel_frame(1, ["b"]))
        seen: list[dict[tuple[int, int], tuple[str, bool]]] = []
        finished: set[tuple[int, int]] = set()
        while finished != {(1, 0), (2, 0)}:
            seen.append(_step(peer))
            finished |= {m for m, (_, more) in seen[-1].items() if not more}
        joined = next(i for i, s in enumerate(seen) if (2, 0) in s)
        assert seen[joined][(2, 0)] == ("c:0", True)
        assert all((1, 1) not in s for s in seen[joined:])  # the cancel came before the join
        assert [s[(1, 0)] for s in seen if (1, 0) in s][-1] == ("a:2", False)
        assert [s[(2, 0)] for s in seen if (2, 0) in s] == [("c:0", True), ("c:1", False)]
        peer.sock.settimeout(0.5)  # everything finished: the worker waits, sending nothing
        with pytest.raises(TimeoutError):
            peer.receive()
    finally:
        peer.sock.close()
    assert proc.wait(timeout=20) == 0
    assert b"request b was dropped by the server" in proc.stderr.read()
