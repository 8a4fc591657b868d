"""Inference logging on real servers: KServe's CloudEvents to a real HTTP receiver that parses
them with the ``cloudevents`` SDK (REST, gRPC and OIP requests, paired by id), the JSON-lines
files and their rotation, sampling and batching, a v2 model class's ``logged_results`` and
``set_metric``, redaction, and a receiver that refuses, answers 500 or is slow."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.client import IncompleteRead
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_http_event

from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc
from tests.server.conftest import HANDLERS, Server, http, wait_until

REQUEST = "org.kubeflow.serving.inference.request"
RESPONSE = "org.kubeflow.serving.inference.response"
JSON = {"Content-Type": "application/json"}


class Receiver:
    """A CloudEvents receiver on 127.0.0.1: keeps what it parsed; ``fail`` answers the next N
    posts 500, ``delay_s`` holds each answer that long."""

    def __init__(self, port: int = 0) -> None:
        self.events: list[Any] = []
        self.posts = 0
        self.fail = 0
        self.delay_s = 0.0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    receiver.posts += 1
                    failing = receiver.fail > 0
                    receiver.fail -= 1 if failing else 0
                    delay = receiver.delay_s
                time.sleep(delay)
                if not failing:
                    event = from_http_event(HTTPMessage(dict(self.headers.items()), body))
                    with receiver.lock:
                        receiver.events.append(event)
                self.send_response(500 if failing else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/events"

    def by_id(self) -> dict[str, dict[str, Any]]:
        """Events grouped by id, each group by type."""
        out: dict[str, dict[str, Any]] = {}
        with self.lock:
            for event in self.events:
                out.setdefault(event.get_id(), {})[event.get_type()] = event
        return out

    def wait_for(self, count: int, timeout_s: float = 20.0) -> None:
        wait_until(lambda: len(self.events) >= count, timeout_s, f"{count} events")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _data(event: Any) -> Any:
    data = event.get_data()
    if isinstance(data, (bytes, str)):
        try:
            return json.loads(data)
        except ValueError:
            return data
    return data


def _counts(server: Server) -> dict[tuple[str, str, str], float]:
    """mserve_inference_log_records_total by (model, sink, outcome)."""
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    out = {}
    pattern = r"^mserve_inference_log_records_total\{([^}]*)\} (\S+)$"
    for labels, value in re.findall(pattern, text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(got["model"], got["sink"], got["outcome"])] = float(value)
    return out


def _lines(path: Path, missing_ok: bool = False) -> list[dict[str, Any]]:
    """``missing_ok``: a file being rotated is missing for a moment (renamed before the next
    batch makes it again): none yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        if not missing_ok:
            raise
        return []
    return [json.loads(line) for line in text.splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_request_and_response_events_for_rest_grpc_oip_and_a_v2_model(
    make_archive, start_server, receiver
) -> None:
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("oip_models", "echo_tensors", "plain")
    make_archive("v2_logged", "scorer", "scorer")
    server = start_server(
        "echo=echo.mar", "plain=plain.mar", "scorer=scorer.mar",
        config={"inference_log": "all", "inference_log_url": receiver.url,
                "inference_log_flush_s": 0.1, "inference_log_redact": ["ssn", "/card/number"]},
    )  # fmt: skip
    secret = "Bearer sekrit-key-123"
    # REST: KServe's id is the client's ce-id header, else the request id we answer with
    rest = server.predict("echo", {"a": 1, "ssn": "123-45-6789", "card": {"number": "4111"}},
                          headers={"ce-id": "client-1", "Authorization": secret})  # fmt: skip
    assert rest.status == 200
    plain = server.predict("echo", {"b": 2})
    # gRPC (TorchServe's Predictions)
    with grpc.insecure_channel(server.status["grpc_inference"]) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        reply = stub.Predictions(
            ipb.PredictionsRequest(model_name="echo", input={"body": b'{"g": 3}'}), timeout=30
        )
    assert json.loads(reply.prediction) == {"g": 3}
    # the Open Inference Protocol
    tensor = {"name": "x", "shape": [1], "datatype": "INT32", "data": [7]}
    oip = http("POST", server.url("inference", "/v2/models/plain/infer"),
               json.dumps({"inputs": [tensor]}).encode(), JSON)  # fmt: skip
    assert oip.status == 200, oip.body
    # a v2 model class: logged_results, set_metric, a request logged as it is, an error
    scored = server.predict("scorer", {"inputs": [1, 2, 3]})
    as_is = server.predict("scorer", {"inputs": [5], "plain": True})
    failed = server.predict("scorer", {"inputs": ["boom"]})
    assert (scored.status, as_is.status, failed.status) == (200, 200, 500)
    receiver.wait_for(13)  # 6 pairs, and the failed request's request event alone
    events = receiver.by_id()

    pair = events["client-1"]
    assert set(pair) == {REQUEST, RESPONSE}
    request = pair[REQUEST]
    assert request.get_source().startswith("http://localhost")
    assert request.get_datacontenttype() == "application/json"
    for name, value in (("inferenceservicename", "echo"), ("namespace", ""),
                        ("component", "predictor"), ("endpoint", "1.0")):  # fmt: skip
        assert request.get_extension(name) == value, name
    redacted = {"a": 1, "ssn": "[redacted]", "card": {"number": "[redacted]"}}
    assert _data(request) == redacted
    assert _data(pair[RESPONSE]) == redacted
    assert _data(events[plain.headers["X-Request-Id"]][RESPONSE]) == {"b": 2}
    # a gRPC input map reaches the model as a form: logged as it reached it
    grpc_pairs = [p for p in events.values() if '{"g": 3}' in str(p[REQUEST].get_data())]
    assert len(grpc_pairs) == 1
    assert grpc_pairs[0][REQUEST].get_datacontenttype().startswith("multipart/form-data")
    assert _data(grpc_pairs[0][RESPONSE]) == {"g": 3}
    oip_pair = events[oip.headers["X-Request-Id"]]
    assert _data(oip_pair[REQUEST])["inputs"][0]["data"] == [7]
    assert _data(oip_pair[RESPONSE]) == json.loads(oip.body)
    assert oip_pair[REQUEST].get_extension("inferenceservicename") == "plain"

    logged = events[scored.headers["X-Request-Id"]]
    assert _data(logged[REQUEST])["inputs"] == [3]  # logged_results: the row count
    assert _data(logged[RESPONSE]) == {"outputs": [12]}  # and the outputs' sum
    assert json.loads(logged[REQUEST].get_extension("metrics")) == {"rows": 3}
    whole = events[as_is.headers["X-Request-Id"]]
    assert _data(whole[REQUEST]) == {"inputs": [5], "plain": True}
    assert _data(whole[RESPONSE])["outputs"] == [10]
    assert set(events[failed.headers["X-Request-Id"]]) == {REQUEST}  # KServe: 200s only

    # the files: one per model version, errors with their message; the key is never logged
    folder = server.run_dir / "inference_log"
    wait_until(lambda: len(_lines(folder / "scorer" / "1.0.jsonl")) == 3, 10, "scorer lines")
    scorer = {line["request_id"]: line for line in _lines(folder / "scorer" / "1.0.jsonl")}
    error = scorer[failed.headers["X-Request-Id"]]
    assert error["status"] == 500 and "boom is not a number" in error["error"]
    assert error["class"] == "Scorer" and error["op"] == "infer"
    line = scorer[scored.headers["X-Request-Id"]]
    assert (line["request"]["inputs"], line["resp"], line["metrics"]) == (
        [3],
        {"outputs": [12]},
        {"rows": 3},
    )
    assert line["microsec"] > 0 and line["when"].endswith("+00:00")
    echo_lines = _lines(folder / "echo" / "1.0.jsonl")
    assert echo_lines[0]["id"] == "client-1" and echo_lines[0]["request"] == redacted
    everything = "".join(p.read_text() for p in folder.rglob("*.jsonl"))
    everything += "".join(json.dumps(_data(e), default=str) for e in receiver.events)
    assert "sekrit" not in everything and "123-45-6789" not in everything
    # counted once the receiver's answers are read, a moment after it got the events
    wait_until(lambda: _counts(server).get(("echo", "cloudevents", "sent")) == 3, 10, "counts")
    counts = _counts(server)
    assert counts[("scorer", "file", "sent")] == 3
    assert counts.get(("echo", "cloudevents", "dropped"), 0) == 0


def test_sampling_batching_and_registration_parameters(
    make_archive, start_server, receiver
) -> None:
    make_archive("echo_fn", "echo:handle", "echo")
    server = start_server("echo=echo.mar", config={"inference_log_flush_s": 60})
    params = (f"url=echo.mar&model_name=sampled&initial_workers=1&inference_log=all"
              f"&inference_log_sample=3&inference_log_batch=2&inference_log_file=false"
              f"&inference_log_url={quote(receiver.url, safe='')}")  # fmt: skip
    assert server.manage("POST", f"/models?{params}").status == 200
    described = server.manage("GET", "/models/sampled").json()[0]
    assert (described["inferenceLogSample"], described["inferenceLogBatch"]) == (3, 2)
    assert described["settingSources"]["inference_log_sample"] == "api"
    ids = [server.predict("sampled", {"n": n}).headers["X-Request-Id"] for n in range(9)]
    receiver.wait_for(4)  # every 3rd request: 3rd and 6th, sent as one batch of two
    assert set(receiver.by_id()) == {ids[2], ids[5]}
    time.sleep(1.0)  # the 9th waits for a second record to fill its batch (or 60 s)
    assert len(receiver.events) == 4
    assert server.predict("echo", {"off": True}).status == 200  # off by default
    assert not (server.run_dir / "inference_log" / "echo").exists()
    assert not (server.run_dir / "inference_log" / "sampled").exists()  # files turned off

    # the snapshot keeps what the registration set
    assert server.cli("--stop").returncode == 0
    server = start_server(config={"inference_log_flush_s": 60}, run_dir=server.run_dir)
    described = server.manage("GET", "/models/sampled").json()[0]
    assert (described["inferenceLog"], described["inferenceLogSample"]) == ("all", 3)
    assert described["settingSources"]["inference_log_sample"] == "api"

    bad = server.manage("POST", "/models?url=echo.mar&model_name=bad&inference_log=everything")
    assert bad.status == 400
    assert bad.json()["message"] == (
        "model bad:1.0: inferenceLog should be one of off, request, response, all,"
        " found 'everything' (from the api)"
    )
    bad = server.manage("POST", "/models?url=echo.mar&model_name=bad&inference_log=all"
                        "&inference_log_url=ftp://x")  # fmt: skip
    assert bad.json()["message"] == (
        "model bad:1.0: inferenceLogUrl should be an http:// or https:// URL, found 'ftp://x'"
        " (from the api)"
    )


def test_files_rotate_by_size_and_keep_a_bounded_count(
    make_archive, start_server, tmp_path
) -> None:
    config = tmp_path / "model-config.yaml"  # the archive's model config turns it on
    config.write_text("inferenceLog: request\ninferenceLogBatch: 2\n")
    make_archive("echo_fn", "echo:handle", "echo", "--config-file", str(config))
    server = start_server("echo=echo.mar", config={
        "inference_log_flush_s": 30, "inference_log_file_max_bytes": 800,
        "inference_log_file_count": 2,
    })  # fmt: skip
    described = server.manage("GET", "/models/echo").json()[0]
    assert described["settingSources"]["inference_log"] == "archive"
    for n in range(12):
        assert server.predict("echo", {"n": n, "pad": "x" * 100}).status == 200
    folder = server.run_dir / "inference_log" / "echo"
    wait_until(lambda: any(line["request"]["n"] == 11 for line in _lines(folder / "1.0.jsonl",
                                                                          missing_ok=True)),
               10, "the last record")  # fmt: skip
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["1.0.jsonl", "1.0.jsonl.1", "1.0.jsonl.2"]
    for path in folder.iterdir():
        lines = _lines(path)
        assert len(lines) == 2 and path.stat().st_size <= 800  # one batch each
        assert all("resp" not in line for line in lines)  # mode request: no responses
    newest = [line["request"]["n"] for line in _lines(folder / "1.0.jsonl")]
    older = [line["request"]["n"] for line in _lines(folder / "1.0.jsonl.1")]
    assert max(older) < min(newest)


def test_a_receiver_that_is_down_failing_or_slow_never_holds_requests(
    make_archive, start_server
) -> None:
    make_archive("echo_fn", "echo:handle", "echo")
    port = _free_port()  # nothing listens there yet: connections are refused
    server = start_server("echo=echo.mar", config={
        "inference_log": "all", "inference_log_url": f"http://127.0.0.1:{port}/",
        "inference_log_file": False, "inference_log_flush_s": 0.05,
        "inference_log_queue_size": 5, "inference_log_retries": 2,
        "inference_log_timeout_s": 0.5,
    })  # fmt: skip

    def answered_in(n: int, tag: str) -> float:
        started = time.monotonic()
        for i in range(n):
            assert server.predict("echo", {"i": i}, headers={"ce-id": f"{tag}-{i}"}).status == 200
        return time.monotonic() - started

    assert answered_in(60, "refused") < 15  # while every send fails: answered at once
    wait_until(lambda: _counts(server).get(("echo", "cloudevents", "failed"), 0) > 0, 15,
               "failed records")  # fmt: skip
    counts = _counts(server)
    assert counts[("echo", "cloudevents", "dropped")] > 0

    receiver = Receiver(port)  # the receiver comes up, answering 500 twice first
    try:
        receiver.fail = 2
        wait_until(lambda: server.predict("echo", {"x": 1}, headers={"ce-id": "back"})
                   and "back" in receiver.by_id(), 20, "delivery resumed")  # fmt: skip
        assert receiver.posts > len(receiver.events)  # the 500s were retried

        receiver.delay_s = 2.0  # slower than inference_log_timeout_s
        failed = _counts(server).get(("echo", "cloudevents", "failed"), 0)
        assert answered_in(20, "slow") < 5
        wait_until(lambda: _counts(server)[("echo", "cloudevents", "failed")] > failed, 20,
                   "timed-out records")  # fmt: skip
        receiver.delay_s = 0.0
        # the pair's two events may arrive on two connections, one after the other
        wait_until(lambda: server.predict("echo", {"x": 2}, headers={"ce-id": "fast"})
                   and set(receiver.by_id().get("fast", ())) == {REQUEST, RESPONSE}, 30,
                   "delivery resumed")  # fmt: skip
    finally:
        receiver.close()


def test_v2_model_base_class_logs_everything_by_default() -> None:
    """mlrun's hook: the base class's logged_results keeps the request and response."""
    from mserve_worker.sdk.v2_model import V2ModelServer

    assert V2ModelServer().logged_results({"inputs": [1]}, {"outputs": [2]}, "infer") == (
        None,
        None,
    )
    assert (HANDLERS / "v2_logged" / "scorer.py").exists()


def test_a_file_is_rotated_once_it_is_old(tmp_path) -> None:
    """The age limit, on the file sink itself (a server would need minutes of traffic)."""
    import asyncio

    from server.inference_log.records import Encoder, Record
    from server.inference_log.sinks import FileSink

    path = tmp_path / "m" / "1.jsonl"
    sink = FileSink(path, Encoder("m", "1", (), "http://localhost/", ""), 10**6, 0.2, 1)

    def record(n: int) -> Record:
        body = json.dumps({"n": n}).encode()
        return Record(f"r{n}", f"r{n}", "", "", time.time(), 1, "application/json", body,
                      200, "application/json", body, None, None)  # fmt: skip

    async def write() -> None:
        assert await sink.send([record(1)]) == []
        assert await sink.send([record(2)]) == []  # young: the same file
        await asyncio.sleep(0.3)
        assert await sink.send([record(3)]) == []  # old: rotated first
        await asyncio.sleep(0.3)
        assert await sink.send([record(4)]) == []  # again; only one rotated file is kept

    asyncio.run(write())
    assert [line["request"]["n"] for line in _lines(path)] == [4]
    assert [line["request"]["n"] for line in _lines(path.with_name("1.jsonl.1"))] == [3]
    assert sorted(p.name for p in path.parent.iterdir()) == ["1.jsonl", "1.jsonl.1"]


@pytest.mark.parametrize(
    ("request_id", "metrics", "namespace"),
    [
        ("abc-123", None, "default"),
        ('id with space/%"é', {"accuracy": 0.5, "note": "a b"}, "team ns"),
    ],
)
def test_events_match_the_cloudevents_sdk_byte_for_byte(request_id, metrics, namespace) -> None:
    """The events are built without the SDK on the request path: each must be what the SDK's
    ``to_binary_event`` makes of the same attributes, header for header, in the same order."""
    from datetime import datetime

    from cloudevents.core.bindings.http import to_binary_event
    from cloudevents.core.v1.event import CloudEvent

    from server.inference_log.records import RESPONSE_EVENT, Encoder, Record

    encoder = Encoder("my model", "2.0", [], "http://localhost:8080/", namespace)
    body = b'{"data": [1, 2]}'
    logged = {"metrics": metrics} if metrics else None
    record = Record(request_id, request_id, "", "", time.time(), 10, "application/json", body,
                    200, "application/json", body, None, logged)  # fmt: skip
    ours = encoder.events(record, True, True)
    assert len(ours) == 2
    for message in ours:
        when = datetime.fromisoformat(message.headers["ce-time"].replace("Z", "+00:00"))
        attributes = {
            "id": request_id, "type": message.headers["ce-type"],
            "source": "http://localhost:8080/", "datacontenttype": "application/json",
            "time": when, "inferenceservicename": "my model", "namespace": namespace,
            "component": "predictor", "endpoint": "2.0", "metadata": "{}",
        }  # fmt: skip
        if metrics:
            attributes["metrics"] = json.dumps(metrics)
        theirs = to_binary_event(CloudEvent(attributes, message.body))
        assert list(message.headers.items()) == list(theirs.headers.items())
        assert message.body == theirs.body
    assert ours[1].headers["ce-type"] == RESPONSE_EVENT


def test_a_handler_content_type_cannot_break_the_events_headers() -> None:
    """A content type the handler set with a line break would end the event's headers early
    (and let the handler write headers of its own): it is sent as octet-stream instead."""
    from server.inference_log.records import Encoder, Record

    encoder = Encoder("m", "1.0", [], "http://localhost:8080/", "default")
    evil = "text/plain\r\nce-type: forged"
    record = Record("r1", "r1", "", "", time.time(), 10, "application/json", b"{}",
                    200, evil, b"ok", None, None)  # fmt: skip
    response = encoder.events(record, False, True)[0]
    assert response.headers["content-type"] == "application/octet-stream"
    assert "forged" not in str(list(response.headers.items()))


def test_streamed_answers_are_logged_when_they_end(make_archive, start_server) -> None:
    """A streamed answer's record is made when its stream ends: its chunks joined, or a broken
    stream's error and what it had sent (continuous batching's streams:
    tests/server/test_continuous_batching.py)."""
    make_archive("streaming", "gen_stream:handle", "gen")
    server = start_server(config={"inference_log_flush_s": 0.2})
    params = "url=gen.mar&initial_workers=1&synchronous=true&inference_log=all"
    assert server.manage("POST", f"/models?{params}").status == 200

    whole = server.predict("gen", {"name": "a", "parts": 3})
    with pytest.raises(IncompleteRead):  # the answer breaks off, as it should
        server.predict("gen", {"name": "b", "parts": 3, "fail_after": 1},
                       headers={"X-Request-ID": "broken-1"})  # fmt: skip
    assert whole.status == 200

    def records(model: str, count: int) -> list[dict[str, Any]]:
        path = server.run_dir / "inference_log" / model / "1.0.jsonl"
        wait_until(lambda: len(_lines(path, missing_ok=True)) >= count, 10, f"{model}'s records")
        return _lines(path)

    by_id = {line["request_id"]: line for line in records("gen", 2)}
    record = by_id[whole.headers["X-Request-Id"]]
    assert (record["status"], record["request"]) == (200, {"name": "a", "parts": 3})
    assert record["resp"] == whole.body.decode() == "a:0;a:1;a:2;"
    record = by_id["broken-1"]
    assert record["status"] == 500 and "b failed after 1 parts" in record["error"]
    assert record["resp"] == "b:0;"  # what the client got before it broke
