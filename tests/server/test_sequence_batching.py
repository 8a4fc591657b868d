"""Sequence batching end to end (TorchServe's ``sequenceBatching: true``): a real server with two
workers runs tests/handlers/stateful, a TorchServe-style handler that keeps a running sum per
sequence id in its worker; REST and gRPC clients."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import yaml

from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc
from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import HANDLERS, MSERVE, Server, pid_alive
from tests.server.test_continuous_batching import metric

CONFIG = str(HANDLERS / "stateful" / "model-config.yaml")
SEQ = "ts_request_sequence_id"


@pytest.fixture
def seq(make_archive, start_server) -> Server:
    make_archive("stateful", "stateful:Stateful", "seq", "--config-file", CONFIG)
    return start_server("seq=seq.mar")


def add(server: Server, n: int, sequence: str | None = None, sleep: float = 0.0):
    headers = {SEQ: sequence} if sequence else {}
    return server.predict("seq", {"add": n, "sleep": sleep}, headers=headers)


def test_a_request_without_a_sequence_id_opens_one_and_the_answer_names_it(seq) -> None:
    first = add(seq, 5)
    assert first.status == 200, first.body
    sequence = first.headers[SEQ]
    assert sequence.startswith("ts-seq-")
    assert first.json()["start"] is True  # the server added the start header
    second = add(seq, 2, sequence)
    assert second.headers[SEQ] == sequence
    assert second.json() == {**second.json(), "sum": 7, "seen": 2, "start": False}
    assert second.json()["pid"] == first.json()["pid"]


def test_requests_of_a_sequence_run_in_order_on_one_worker(seq) -> None:
    results: dict[str, list[tuple[int, dict[str, Any]]]] = {"s1": [], "s2": []}

    def send(sequence: str, i: int) -> None:
        reply = add(seq, 10**i, sequence, sleep=0.1)
        assert reply.status == 200, reply.body
        results[sequence].append((i, reply.json()))

    threads = []
    for i in range(4):  # sent while the earlier ones still run: they wait, in order
        for sequence in results:
            thread = threading.Thread(target=send, args=(sequence, i))
            thread.start()
            threads.append(thread)
        time.sleep(0.03)
    for thread in threads:
        thread.join(30)
    for sequence, answers in results.items():
        answers.sort(key=lambda a: a[1]["seen"])
        assert [a[0] for a in answers] == [0, 1, 2, 3], sequence  # run in arrival order
        assert [a[1]["sum"] for a in answers] == [1, 11, 111, 1111]
        assert len({a[1]["pid"] for a in answers}) == 1  # sticky
    # two sequences, two workers: each got its own
    assert results["s1"][0][1]["pid"] != results["s2"][0][1]["pid"]


def test_a_sequence_holds_at_most_max_sequence_job_queue_size_waiting(seq) -> None:
    running = threading.Thread(target=add, args=(seq, 1, "busy", 1.0))
    running.start()
    time.sleep(0.2)
    waiting = [threading.Thread(target=add, args=(seq, 1, "busy")) for _ in range(4)]
    for thread in waiting:
        thread.start()
    time.sleep(0.2)
    refused = add(seq, 1, "busy")
    assert refused.status == 429
    assert refused.json()["message"] == (
        "sequence busy of model seq:1.0 already has 4 request(s) waiting (maxSequenceJobQueueSize=4)"
    )
    for thread in [running, *waiting]:
        thread.join(30)


def test_idle_sequences_expire_and_free_their_place(seq) -> None:
    # batchSize 1 x 2 workers: two sequences open at once; a third waits for one to close
    assert add(seq, 1, "a").status == 200
    assert add(seq, 1, "b").status == 200
    opened = time.monotonic()
    third = add(seq, 1, "c")
    waited = time.monotonic() - opened
    assert third.status == 200
    assert waited >= 0.6  # sequenceMaxIdleMSec: 800, counted from a's and b's last answers
    # an expired sequence's id is refused (it does not open a new sequence)
    again = add(seq, 1, "a")
    assert again.status == 503


def test_grpc_sequence_ids_reach_the_handler(seq) -> None:
    channel = grpc.insecure_channel(seq.status["grpc_inference"])
    try:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        requests = [
            ipb.PredictionsRequest(
                model_name="seq", input={"data": json.dumps({"add": n}).encode()},
                sequenceId="g1",
            )
            for n in (1, 2, 3)
        ]  # fmt: skip
        answers = list(stub.StreamPredictions2(iter(requests), timeout=30))
    finally:
        channel.close()
    assert [a.sequenceId for a in answers] == ["g1"] * 3
    assert [json.loads(a.prediction)["sum"] for a in answers] == [1, 3, 6]


@pytest.fixture
def seq_gen(make_archive, start_server) -> Server:
    config = str(HANDLERS / "generator" / "sequence-config.yaml")
    make_archive("generator", "generator:Generator", "sgen", "--config-file", config)
    return start_server("sgen=sgen.mar")


def open_stream(server: Server, body: dict[str, Any], sequence: str) -> Any:
    host, port = server.status["inference"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(
        "POST", "/predictions/sgen", json.dumps(body),
        {"Content-Type": "application/json", SEQ: sequence},
    )  # fmt: skip
    return conn.getresponse()


def test_with_continuous_batching_a_sequence_goes_on_while_its_last_answer_streams(
    seq_gen,
) -> None:
    first = open_stream(seq_gen, {"name": "first", "tokens": 30}, "s")
    assert first.getheader(SEQ) == "s"
    assert json.loads(first.readline())["token"] == "first:0"
    second = open_stream(seq_gen, {"name": "second", "tokens": 2}, "s")
    assert second.getheader(SEQ) == "s"
    lines = [json.loads(line) for line in second.read().splitlines()]
    assert [t["token"] for t in lines] == ["second:0", "second:1"]
    assert lines[0]["batch"] == ["first", "second"]  # the same worker, the same call
    rest = [json.loads(line) for line in first.read().splitlines()]
    assert len(rest) == 29


def test_a_sequence_past_its_timeout_closes_and_its_waiting_requests_get_504(
    make_archive, start_server
) -> None:
    config = str(HANDLERS / "stateful" / "timeout-config.yaml")
    make_archive("stateful", "stateful:Stateful", "tseq", "--config-file", config)
    server = start_server("tseq=tseq.mar")
    first: list[Any] = []
    running = threading.Thread(
        target=lambda: first.append(
            server.predict("tseq", {"add": 1, "sleep": 1.5}, headers={SEQ: "t"})
        )
    )
    running.start()
    time.sleep(0.3)
    waiting = server.predict("tseq", {"add": 2}, headers={SEQ: "t"})
    running.join(30)
    assert waiting.status == 504
    assert (
        waiting.json()["message"]
        == "sequence t of model tseq:1.0 expired (sequenceTimeoutMSec=1000)"
    )
    assert first[0].status == 200  # the one under way when it expired finishes
    late = server.predict("tseq", {"add": 5}, headers={SEQ: "t"})
    assert late.status == 503  # it does not open again
    assert metric(server, "mserve_requests_cancelled_total", model="tseq", reason="deadline") == 1


# --- TorchServe's stateful example's limits (test_example_stateful_sequence_continuous_batching):
# tests/handlers/session on its contract (odd numbers stream, -1 cancels the sequence's stream,
# 0 ends the sequence), 2 workers, batchSize 1, maxNumSequence 2, sequenceMaxIdleMSec 1500,
# sequenceTimeoutMSec 3000; one server for these tests


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("session")
    store = root / "store"
    store.mkdir()
    for name, config in (("session", "model-config.yaml"), ("shared", "shared-config.yaml")):
        args = [ARCHIVER_SCRIPT, "--model-name", name, "--handler", "session:Session",
                "--model-path", str(HANDLERS / "session"), "--export-path", str(store),
                "-c", str(HANDLERS / "session" / config)]  # fmt: skip
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    settings = {f"{api}_address": "127.0.0.1:0" for api in
                ("inference", "management", "metrics", "grpc_inference", "grpc_management")}  # fmt: skip
    settings.update(model_store=str(store), disable_token_authorization=True)
    config = root / "mserve.yaml"
    config.write_text(yaml.safe_dump(settings))
    run_dir = root / "run"
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    models = ["session=session.mar", "shared=shared.mar"]
    started = subprocess.run([MSERVE, "--start", *args, "--models", *models],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    served = Server(run_dir, json.loads((run_dir / "status.json").read_text()), args)
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def send(server: Server, n: int, sequence: str | None = None, model: str = "session") -> Any:
    """POST ``n`` to ``model``; the response, open (a stream is read by the caller)."""
    host, port = server.status["inference"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", f"/predictions/{model}", str(n), {SEQ: sequence} if sequence else {})
    return conn.getresponse()


def test_a_later_request_of_the_sequence_cancels_its_stream_and_an_ended_one_frees_its_place(
    session,
) -> None:
    # three sequences one after the other, more than maxNumSequence: each one's end frees its
    # place at once (a new one would otherwise wait for an idle one to expire, 1.5 s)
    for _ in range(3):
        began = time.monotonic()
        opened = send(session, 2)
        assert (opened.status, opened.read()) == (200, b"2")
        assert time.monotonic() - began < 1.0
        sequence = opened.getheader(SEQ)
        stream = send(session, 3, sequence)
        assert stream.status == 200
        assert stream.getheader("Transfer-Encoding") == "chunked"
        assert stream.read1() == b"5"  # its first chunk; 10 more would follow, 0.2 s apart
        cancel = send(session, -1, sequence)  # joins the stream's worker while it streams
        assert (cancel.status, cancel.read()) == (200, b"-1")
        chunks = [b"5"]
        while chunk := stream.read1():
            chunks.append(chunk)
        assert 1 < len(chunks) < 5, chunks  # it stopped at its next step, not after 11
        end = send(session, 0, sequence)
        assert (end.status, end.read()) == (200, b"5")
        assert end.getheader("ts_request_sequence_end") == sequence


def test_an_idle_sequence_expires_and_its_next_request_is_refused(session) -> None:
    opened = send(session, 2)
    assert opened.status == 200
    sequence = opened.getheader(SEQ)
    opened.read()
    time.sleep(1.8)  # sequenceMaxIdleMSec: 1500
    late = send(session, 2, sequence)
    assert late.status == 503
    assert json.loads(late.read()) == {
        "code": 503,
        "type": "ServiceUnavailableException",
        "message": f"sequence {sequence} of model session:1.0 expired"
        " (sequenceMaxIdleMSec=1500); send the request without ts_request_sequence_id to start"
        " a new sequence",
    }
    fresh = send(session, 4)  # its place is free: a new sequence starts
    assert (fresh.status, fresh.read()) == (200, b"4")


def test_a_sequence_open_past_its_timeout_ends_and_its_next_request_is_refused(session) -> None:
    opened = send(session, 2)
    assert opened.status == 200
    sequence = opened.getheader(SEQ)
    opened.read()
    total, deadline = 2, time.monotonic() + 3.2  # sequenceTimeoutMSec: 3000
    while time.monotonic() < deadline:  # never idle, yet it ends
        reply = send(session, 2, sequence)
        if reply.status != 200:
            break
        total += 2
        assert reply.read() == str(total).encode()
        time.sleep(0.5)
    reply = send(session, 2, sequence)
    assert reply.status == 503
    assert json.loads(reply.read())["message"] == (
        f"sequence {sequence} of model session:1.0 expired (sequenceTimeoutMSec=3000); send the"
        " request without ts_request_sequence_id to start a new sequence"
    )
    assert total >= 8  # it served for the whole 3 s


def test_a_sequence_waiting_for_the_worker_another_streams_on_is_served_and_goes_on(
    session,
) -> None:
    # "shared": one worker, batchSize 1, maxNumSequence 2: both sequences are bound to it, and
    # one waits while the other's stream holds the worker
    first = send(session, 3, model="shared")
    assert first.read1() == b"3"
    second = send(session, 2, model="shared")  # waits for the stream's 4 more steps
    assert (second.status, second.read()) == (200, b"2")
    assert first.read() == b"3333"
    sequence = second.getheader(SEQ)
    for n, total in ((4, b"6"), (6, b"12")):  # the worker, idle again, takes them at once
        reply = send(session, n, sequence, model="shared")
        assert (reply.status, reply.read()) == (200, total)
