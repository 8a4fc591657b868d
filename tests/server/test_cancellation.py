"""Cancellation and deadlines end to end: a client that goes away (REST chunked, gRPC stream)
or a request past its deadline (clientTimeoutInMills) stops, queued or generating, frees its
place at once, and is counted in mserve_requests_cancelled_total. The model is
tests/handlers/generator (continuous batching), which reports in every token which requests
shared the call."""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import pytest

from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc
from tests.server.conftest import HANDLERS, Reply, Server
from tests.server.test_continuous_batching import metric, reader, tokens, wait_for
from tests.server.test_streamed_responses import Incomplete, RawStream

GENERATOR = HANDLERS / "generator"


@pytest.fixture
def gen(make_archive, start_server) -> Server:
    config = str(GENERATOR / "model-config.yaml")
    make_archive("generator", "generator:Generator", "gen", "--config-file", config)
    return start_server("gen=gen.mar")


def test_a_queued_request_whose_client_leaves_never_reaches_the_handler(gen) -> None:
    a = RawStream(gen, "gen", {"name": "a", "tokens": 15})
    b = RawStream(gen, "gen", {"name": "b", "tokens": 25})
    a_thread, a_tokens = reader(a)
    b_thread, b_tokens = reader(b)
    wait_for(lambda: a_tokens and b_tokens, "both running")
    # batchSize 2 is full: this one waits in the queue, and its client leaves
    host, port = gen.status["inference"].rsplit(":", 1)
    body = json.dumps({"name": "left", "tokens": 3}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /predictions/gen HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.2)
    wait_for(
        lambda: metric(gen, "mserve_requests_cancelled_total", model="gen", reason="client"),
        "the cancellation counted",
    )
    late = RawStream(gen, "gen", {"name": "late", "tokens": 2})
    late_tokens = tokens(late)
    for t in (a_thread, b_thread):
        t.join(30)
    for s in (a, b, late):
        s.close()
    seen = {name for t in a_tokens + b_tokens + late_tokens for name in t["batch"]}
    assert seen == {"a", "b", "late"}  # "left" never ran
    assert [t["token"] for t in late_tokens] == ["late:0", "late:1"]


def test_a_grpc_stream_cancelled_by_its_client_frees_its_slot(gen) -> None:
    channel = grpc.insecure_channel(gen.status["grpc_inference"])
    try:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = ipb.PredictionsRequest(
            model_name="gen", input={"data": json.dumps({"name": "g", "tokens": 500}).encode()}
        )
        call = stub.StreamPredictions(request, timeout=30)
        first = json.loads(next(call).prediction)
        assert first["token"] == "g:0"
        call.cancel()
        wait_for(
            lambda: metric(gen, "mserve_requests_cancelled_total", model="gen", reason="client"),
            "the cancellation counted",
        )
        after = RawStream(gen, "gen", {"name": "after", "tokens": 2})
        got = tokens(after)
        after.close()
    finally:
        channel.close()
    assert got[-1]["batch"] == ["after"]  # the cancelled stream left the running set
    assert got[-1]["cache"] == ["after"]  # and its context.cache entry was cleaned


@pytest.fixture
def timed(make_archive, start_server) -> Server:
    config = str(GENERATOR / "deadline-config.yaml")
    make_archive("generator", "generator:Generator", "timed", "--config-file", config)
    return start_server("timed=timed.mar")


def test_requests_past_their_deadline_stop_queued_or_generating(timed) -> None:
    """clientTimeoutInMills=2000, batchSize 1. No step of it races a deadline: the stream's
    first token comes within one 50 ms step (2 s leaves room for a loaded machine), and the
    queued request waits behind one 4 s step, so its deadline passes while it is queued."""
    # generating: its 200 and first chunk went out; at its deadline the stream breaks off
    long = RawStream(timed, "timed", {"name": "long", "tokens": 400})
    try:
        assert long.status == 200
        assert long.next_chunk() is not None
        with pytest.raises(Incomplete):  # no terminating chunk: its client sees it is cut
            long.chunks()
    finally:
        long.close()
    # queued: behind a request whose one step outlasts its own deadline and the next one's
    pending = "mserve_requests_pending"  # queued, plus a worker in a step
    wait_for(lambda: metric(timed, pending, model="timed") == 0, "the stream's last step")
    replies: dict[str, Reply] = {}
    held = {"name": "blocker", "tokens": 1, "sleep": 4}
    thread = threading.Thread(target=lambda: replies.update(held=timed.predict("timed", held)))
    thread.start()
    wait_for(lambda: metric(timed, pending, model="timed") >= 1, "the blocker arrived")
    queued = timed.predict("timed", {"name": "queued", "tokens": 2})
    thread.join(30)
    for reply, name in ((queued, "queued"), (replies["held"], "blocker")):
        assert reply.status == 504, name
        message = reply.json()["message"]
        assert message.startswith("request ") and message.endswith(
            "to model timed:1.0 did not complete within clientTimeoutInMills=2000"
            " (queue time included); it was dropped"
        )
    wait_for(lambda: metric(timed, pending, model="timed") == 0, "the blocker's step ended")
    quick = timed.predict("timed", {"name": "quick", "tokens": 1, "sleep": 0})
    assert quick.status == 200
    assert json.loads(quick.body)["batch"] == ["quick"]
    assert metric(timed, "mserve_requests_cancelled_total", model="timed", reason="deadline") == 3
