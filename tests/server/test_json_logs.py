"""log_format: json, X-Request-ID and the client's trace id with tracing off: a real server, a
real worker (tests/handlers/trace_echo)."""

from __future__ import annotations

import json

from tests.server.conftest import wait_until

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def _header(reply, name: str) -> str | None:
    return next((v for k, v in reply.headers.items() if k.lower() == name), None)


def test_json_logs_request_ids_and_the_clients_trace_id(make_archive, start_server) -> None:
    make_archive("trace_echo", "trace_echo:TraceEcho", "echo")
    server = start_server("echo=echo.mar", config={"log_format": "json"})

    # the client's id is taken, echoed and handed to the handler; its traceparent passes as sent
    reply = server.predict("echo", {}, headers={"X-Request-ID": "order-42:a/b",
                                                "traceparent": TRACEPARENT})  # fmt: skip
    assert reply.status == 200
    assert _header(reply, "x-request-id") == "order-42:a/b"
    seen = reply.json()
    assert seen["request_id"] == "order-42:a/b"
    assert seen["trace_context"] == {"traceparent": TRACEPARENT}

    # an id too long or with odd characters is replaced by one of ours
    for bad in ("x" * 129, "a b", "semi;colon"):
        reply = server.predict("echo", {}, headers={"X-Request-ID": bad})
        ours = _header(reply, "x-request-id")
        assert ours != bad and len(ours) == 32 and reply.json()["request_id"] == ours

    # an error answer names its request id too
    reply = server.predict("echo", {"fail": True}, headers={"X-Request-ID": "failing-1"})
    assert reply.status >= 500 and _header(reply, "x-request-id") == "failing-1"

    # access.log: one JSON object per line, with the ids, model, version, status and latency
    access = server.run_dir / "logs" / "access.log"
    wait_until(lambda: "failing-1" in access.read_text(), 10, "the access log lines")
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    line = next(x for x in lines if x.get("request_id") == "order-42:a/b")
    assert line["trace_id"] == TRACE_ID
    assert (line["model"], line["version"], line["status"]) == ("echo", "1.0", 200)
    assert line["method"] == "POST" and line["path"] == "/predictions/echo"
    assert line["worker"].isdigit() and line["latency_ms"] >= 0 and line["time"]
    failed = next(x for x in lines if x.get("request_id") == "failing-1")
    assert failed["status"] >= 500

    # mserve.log: every line a JSON object; a worker's output names its model and worker
    log = server.run_dir / "logs" / "mserve.log"
    wait_until(lambda: "trace_echo was asked to fail" in log.read_text(), 10, "the traceback")
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    worker_lines = [e for e in entries if e.get("model") == "echo"]
    assert worker_lines and all(e["worker"].isdigit() for e in worker_lines)
    assert any("trace_echo was asked to fail" in e["message"] for e in worker_lines)
    # and so do the server's lines about one worker
    ready = next(e for e in entries if " of echo:1.0 ready in " in e["message"])
    assert (ready["model"], ready["version"]) == ("echo", "1.0"), ready
    assert ready["message"].startswith(f"worker {ready['worker']} of echo:1.0 ready"), ready
