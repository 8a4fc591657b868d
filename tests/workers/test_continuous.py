"""The worker's side of continuous batching (mserve_worker/continuous.py) on a real Context:
which requests go on after a call, and the clean-up of those the server dropped."""

from __future__ import annotations

from mserve_worker.context import Context
from mserve_worker.continuous import NEXT_HEADER, Steps
from mserve_worker.protocol import RequestItem


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
    assert context.get_response_headers(0) == {NEXT_HEADER: "true"}
    assert context.get_response_headers(1) == {NEXT_HEADER: "false"}
    assert context.get_response_headers(2) == {}
    assert context.get_response_headers(3) == {}  # no criterion: done after one call
    assert list(steps.running) == ["a"]


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
