"""Continuous batching end to end (TorchServe's ``continuousBatching: true``): a real server and
worker run tests/handlers/generator, a TorchServe-style handler that emits one token per call
and keeps its state in ``context.cache``; several clients read their streams concurrently."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import pytest

from tests.server.conftest import HANDLERS, Server
from tests.server.test_streamed_responses import Incomplete, RawStream

CONFIG = str(HANDLERS / "generator" / "model-config.yaml")


@pytest.fixture
def gen(make_archive, start_server) -> Server:
    make_archive("generator", "generator:Generator", "gen", "--config-file", CONFIG)
    return start_server("gen=gen.mar")


def tokens(stream: RawStream) -> list[dict[str, Any]]:
    return [json.loads(line) for chunk in stream.chunks() for line in chunk.decode().splitlines()]


def test_each_step_is_one_chunk_and_the_stream_ends_when_the_criteria_say(gen) -> None:
    first = "mserve_time_to_first_token_seconds"

    def timed() -> list[float]:  # answers counted so far: all, within 0.1 s, within 0.5 s
        return [metric(gen, f"{first}_count", model="gen"),
                metric(gen, f"{first}_bucket", model="gen", le="0.1"),
                metric(gen, f"{first}_bucket", model="gen", le="0.5")]  # fmt: skip

    before = timed()
    stream = RawStream(gen, "gen", {"name": "a", "tokens": 3, "sleep": 0.2})
    try:
        assert stream.status == 200
        assert stream.headers["transfer-encoding"] == "chunked"
        assert "ts_stream_next" not in stream.headers  # between the worker and the server only
        got = tokens(stream)
    finally:
        stream.close()
    assert [t["token"] for t in got] == ["a:0", "a:1", "a:2"]
    assert all(t["batch"] == ["a"] for t in got)
    # its time to first token: one step (>= 0.2 s), not the three the whole answer took (0.6)
    assert [a - b for a, b in zip(timed(), before, strict=True)] == [1, 0, 1]


def test_a_one_step_request_gets_a_plain_answer(gen) -> None:
    reply = gen.predict("gen", {"name": "one", "tokens": 1})
    assert reply.status == 200
    assert json.loads(reply.body)["token"] == "one:0"


def read_while(stream: RawStream, out: list[dict[str, Any]]) -> None:
    """Read ``stream`` to its end in a thread, appending each token as it arrives."""
    while (chunk := stream.next_chunk()) is not None:
        out.extend(json.loads(line) for line in chunk.decode().splitlines())


def reader(stream: RawStream) -> tuple[threading.Thread, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    thread = threading.Thread(target=read_while, args=(stream, out), daemon=True)
    thread.start()
    return thread, out


def wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_retry_with_the_same_request_id_keeps_a_state_of_its_own(gen) -> None:
    """The handler keys its state by request id and the client names requests (X-Request-ID):
    a second request with the id of one still generating gets an id of its own."""
    same = {"X-Request-ID": "client-42"}
    first = RawStream(gen, "gen", {"name": "first", "tokens": 8}, headers=same)
    assert first.next_chunk() is not None  # generating
    first_thread, first_tokens = reader(first)
    again = RawStream(gen, "gen", {"name": "again", "tokens": 3}, headers=same)
    again_tokens = tokens(again)
    first_thread.join(30)
    first.close()
    again.close()
    assert [t["token"] for t in again_tokens] == ["again:0", "again:1", "again:2"]
    assert [t["token"] for t in first_tokens] == [f"first:{i}" for i in range(1, 8)]


def test_new_requests_join_while_others_run_up_to_batch_size(gen) -> None:
    long = RawStream(gen, "gen", {"name": "long", "tokens": 40})
    first = long.next_chunk()  # the long one is generating
    assert first is not None
    long_thread, long_tokens = reader(long)
    late = RawStream(gen, "gen", {"name": "late", "tokens": 3})
    third = RawStream(gen, "gen", {"name": "third", "tokens": 2})  # batchSize 2: it waits
    late_tokens, third_tokens = tokens(late), tokens(third)
    late_done = time.monotonic()
    long_thread.join(30)
    long_done = time.monotonic()
    for s in (long, late, third):
        s.close()
    assert len(long_tokens) == 39
    # the late request streamed and finished while the long one still ran
    assert [t["token"] for t in late_tokens] == ["late:0", "late:1", "late:2"]
    assert late_done < long_done
    assert late_tokens[0]["batch"] == ["long", "late"]
    # never more than batchSize in one call; the third got the slot the late one freed
    steps = [t["batch"] for t in long_tokens + late_tokens + third_tokens]
    assert max(len(b) for b in steps) == 2
    assert third_tokens[0]["batch"] == ["long", "third"]
    assert [t["token"] for t in third_tokens] == ["third:0", "third:1"]


def test_batch_wait_fill_gathers_an_idle_workers_first_step_as_torchserve_does(
    make_archive, start_server
) -> None:
    """``batchWait: fill`` (fill-config.yaml: batchSize 3, maxBatchDelay 1.5 s): an idle
    worker's first step waits for company up to the delay, as TorchServe's continuous batching
    does; once it generates, a newcomer joins the next step without waiting."""
    config = str(HANDLERS / "generator" / "fill-config.yaml")
    make_archive("generator", "generator:Generator", "gen", "--config-file", config)
    server = start_server("gen=gen.mar")
    lone = RawStream(server, "gen", {"name": "lone", "tokens": 1})  # returns at its head
    waited = lone.head_at - lone.sent_at
    lone.close()
    assert waited >= 1.4  # nobody came: it waited out the delay

    opened: dict[str, RawStream] = {}

    def start(name: str, n: int) -> threading.Thread:
        def run() -> None:
            opened[name] = RawStream(server, "gen", {"name": name, "tokens": n})

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    first = start("a", 30)
    time.sleep(0.3)  # well inside the delay
    second = start("b", 30)
    first.join(30)
    second.join(30)
    threads = {name: reader(opened[name]) for name in ("a", "b")}
    wait_for(lambda: len(threads["a"][1]) >= 2, "a's first tokens")
    late = RawStream(server, "gen", {"name": "late", "tokens": 2})  # it generates: no wait
    joined = late.head_at - late.sent_at
    late_tokens = tokens(late)
    for name, (thread, _) in threads.items():
        thread.join(30)
        opened[name].close()
    late.close()
    assert threads["a"][1][0]["batch"] == ["a", "b"]  # prefilled together
    assert late_tokens[0]["batch"] == ["a", "b", "late"]
    assert joined < 1.0  # the next step, not the delay


def metric(server: Server, name: str, **labels: str) -> float:
    from tests.server.conftest import http

    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_leaves_frees_its_slot_and_its_state_within_one_step(gen) -> None:
    gone = RawStream(gen, "gen", {"name": "gone", "tokens": 500})
    assert gone.next_chunk() is not None
    stay = RawStream(gen, "gen", {"name": "stay", "tokens": 30})
    stay_thread, stay_tokens = reader(stay)
    wait_for(lambda: len(stay_tokens) >= 2, "stay's first tokens")
    gone.close()
    # the next steps no longer include it, and its context.cache entry is gone
    wait_for(lambda: stay_tokens[-1]["batch"] == ["stay"], "a step without the gone request")
    cut = next(i for i, t in enumerate(stay_tokens) if t["batch"] == ["stay"])
    assert all(t["batch"] == ["stay"] for t in stay_tokens[cut:])
    # its slot goes to the next request at once, while "stay" still runs
    wait_for(lambda: len(stay_tokens) > cut + 1, "a further step")
    assert stay_tokens[-1]["cache"] == ["stay"]
    joined = RawStream(gen, "gen", {"name": "next", "tokens": 2})
    next_tokens = tokens(joined)
    joined.close()
    assert next_tokens[0]["batch"] == ["stay", "next"]
    stay_thread.join(30)
    stay.close()
    assert metric(gen, "mserve_requests_cancelled_total", model="gen", reason="client") == 1


def test_a_request_that_fails_mid_stream_breaks_only_its_own_stream(gen) -> None:
    bad = RawStream(gen, "gen", {"name": "bad", "tokens": 10, "fail_at": 3})
    good = RawStream(gen, "gen", {"name": "good", "tokens": 8})
    good_thread, good_tokens = reader(good)
    got = []
    with pytest.raises(Incomplete):  # closed without the terminating chunk
        while (chunk := bad.next_chunk()) is not None:
            got.append(json.loads(chunk))
    assert [t["token"] for t in got] == ["bad:0", "bad:1", "bad:2"]
    good_thread.join(30)
    assert [t["token"] for t in good_tokens] == [f"good:{i}" for i in range(8)]
    for s in (bad, good):
        s.close()


def test_a_handler_that_raises_fails_that_call_and_the_next_requests_are_served(gen) -> None:
    boom = RawStream(gen, "gen", {"name": "boom", "tokens": 10, "raise_at": 2})
    with pytest.raises(Incomplete):
        boom.chunks()
    boom.close()
    again = RawStream(gen, "gen", {"name": "again", "tokens": 2})
    assert [t["token"] for t in tokens(again)] == ["again:0", "again:1"]
    again.close()
    reply = gen.predict("gen", {"name": "raise", "tokens": 3, "raise_at": 0})
    assert reply.status == 500
    assert b"boom in raise" in reply.body


def test_a_worker_killed_mid_generation_breaks_its_streams_and_a_new_one_serves(gen) -> None:
    a = RawStream(gen, "gen", {"name": "a", "tokens": 500})
    assert a.next_chunk() is not None
    (pid,) = gen.worker_pids("gen")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Incomplete):  # its state died with the worker: the stream breaks off
        a.chunks()
    a.close()
    wait_for(lambda: gen.worker_pids("gen") not in ([], [pid]), "a replacement worker", 60)
    again = RawStream(gen, "gen", {"name": "again", "tokens": 2})
    assert [t["token"] for t in tokens(again)] == ["again:0", "again:1"]
    again.close()


def test_describe_shows_the_generative_settings(gen) -> None:
    (described,) = gen.manage("GET", "/models/gen").json()
    assert described["continuousBatching"] is True
    assert described["batchSize"] == 2
    assert described["sequenceBatching"] is False
    assert described["clientTimeoutInMills"] == 0


def test_the_inference_log_records_whole_answers_and_failed_calls(
    make_archive, start_server
) -> None:
    """Continuous batching feeds the model's inference log as the ordinary pump does: a request
    answered in its first step, a call that raised, and a streamed answer once it ends (its
    steps' pieces joined)."""
    make_archive("generator", "generator:Generator", "gen", "--config-file", CONFIG)
    server = start_server(config={"inference_log_flush_s": 0.05})
    params = "url=gen.mar&model_name=logged&initial_workers=1&inference_log=all"
    assert server.manage("POST", f"/models?{params}").status == 200
    one = server.predict("logged", {"name": "one", "tokens": 1})
    stream = RawStream(server, "logged", {"name": "streamed", "tokens": 3})
    try:
        assert len(tokens(stream)) == 3
    finally:
        stream.close()
    raised = server.predict("logged", {"name": "boom", "tokens": 3, "raise_at": 0})
    assert (one.status, raised.status) == (200, 500)
    gone = RawStream(server, "logged", {"name": "gone", "tokens": 200})
    try:
        assert gone.next_chunk()  # its first token, then the client leaves
    finally:
        gone.close()
    path = server.run_dir / "inference_log" / "logged" / "1.0.jsonl"

    def lines() -> list[dict[str, Any]]:
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    wait_for(lambda: len(lines()) >= 4, "four records")
    got = {line["request"]["name"]: line for line in lines()}
    assert sorted(got) == ["boom", "gone", "one", "streamed"]
    assert got["gone"]["status"] == 499 and "client went away" in got["gone"]["error"]
    assert "gone:0" in got["gone"]["resp"] and "gone:199" not in got["gone"]["resp"]
    assert got["streamed"]["status"] == 200
    pieces = [json.loads(x)["token"] for x in got["streamed"]["resp"].splitlines()]
    assert pieces == ["streamed:0", "streamed:1", "streamed:2"]
    assert got["one"]["request_id"] == one.headers["X-Request-Id"]
    assert got["one"]["status"] == 200 and "one:0" in str(got["one"]["resp"])
    assert got["boom"]["status"] == 500 and "boom in boom" in got["boom"]["error"]


def test_a_step_past_the_response_timeout_answers_504_and_a_new_worker_serves(
    make_archive, start_server
) -> None:
    """The worker runs the steps; one that takes longer than responseTimeout is a hung handler:
    its requests get a 504 that says so, the worker is replaced, the next request is served."""
    make_archive("generator", "generator:Generator", "gen", "--config-file", CONFIG)
    server = start_server()
    params = "url=gen.mar&model_name=slow&initial_workers=1&response_timeout=1"
    assert server.manage("POST", f"/models?{params}").status == 200
    (pid,) = server.worker_pids("slow")
    hung = server.predict("slow", {"name": "hung", "tokens": 3, "sleep": 4})
    assert hung.status == 504
    assert b"made no step within response_timeout_s=1" in hung.body
    wait_for(lambda: server.worker_pids("slow") not in ([], [pid]), "a replacement worker", 60)
    again = RawStream(server, "slow", {"name": "again", "tokens": 2})
    assert [t["token"] for t in tokens(again)] == ["again:0", "again:1"]
    again.close()


def test_intermediate_responses_inside_a_step_reach_the_stream_in_order(gen) -> None:
    """TorchServe's send_intermediate_predict_response works inside a step: each piece is a
    chunk of that request's stream, before the step's own result; the other requests of the
    step are not affected."""
    chatty = RawStream(gen, "gen", {"name": "chatty", "tokens": 3, "intermediate": True})
    quiet = RawStream(gen, "gen", {"name": "quiet", "tokens": 3})
    got = tokens(chatty)
    assert [t.get("partial") or t["token"] for t in got] == [
        "chatty:0", "chatty:0", "chatty:1", "chatty:1", "chatty:2", "chatty:2"
    ]  # fmt: skip
    assert [t["partial"] for t in got[::2]] == ["chatty:0", "chatty:1", "chatty:2"]
    assert [t["token"] for t in tokens(quiet)] == ["quiet:0", "quiet:1", "quiet:2"]
    for s in (chatty, quiet):
        s.close()


def test_scaling_to_zero_finishes_the_streams_and_what_is_queued(gen) -> None:
    """A worker retired while it generates (scaled to 0) finishes its streams and, being the
    model's last, what is still queued behind them, then stops: nothing accepted is dropped."""
    first = RawStream(gen, "gen", {"name": "first", "tokens": 12})
    second = RawStream(gen, "gen", {"name": "second", "tokens": 12})
    assert first.next_chunk() is not None and second.next_chunk() is not None
    queued = RawStream(gen, "gen", {"name": "queued", "tokens": 2})  # both slots are taken
    scaled = gen.manage("PUT", "/models/gen?min_worker=0&max_worker=0&synchronous=true")
    assert scaled.status == 200
    assert len(tokens(first)) == 11 and len(tokens(second)) == 11
    assert [t["token"] for t in tokens(queued)] == ["queued:0", "queued:1"]
    wait_for(lambda: gen.worker_pids("gen") == [], "the worker to stop")
    for s in (first, second, queued):
        s.close()
