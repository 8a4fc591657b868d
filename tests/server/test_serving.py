"""End to end: real mserve daemons, real workers, real archives, real sockets."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil
import pytest
import requests

from tests.server.conftest import (
    MSERVE,
    concurrently,
    http,
    pid_alive,
    template_ready,
    wait_until,
)


def test_start_predict_status_stop(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    assert "model probe: ready" in server.start_output
    reply = server.predict("probe", {"hello": "world"}, headers={"X-Test": "42"})
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"] == "application/json"
    report = reply.json()
    assert report["body"] == {"hello": "world"}
    assert report["body_type"] == "dict"
    assert report["x_test"] == "42"
    assert report["init_calls"] == 1  # module:function got its one call with data=None
    assert report["server_name"] == "mserve"
    assert report["manifest_model"] == "probe"
    assert report["request_id"] == reply.headers["X-Request-Id"]
    assert Path(report["cwd"]) == Path(report["model_dir"])
    assert http("GET", server.url("inference", "/ping")).json() == {"status": "Healthy"}

    status = server.cli("--status")
    assert status.returncode == 0 and "model probe: ready" in status.stdout
    again = server.cli("--start", *server.cli_args)
    assert again.returncode == 1
    assert f"mserve is already running (pid {server.pid}" in again.stderr

    def starts_left() -> set[int]:  # `mserve --start` processes on this run dir
        found = set()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            line = proc.info["cmdline"] or []
            if "--start" in line and str(server.run_dir) in line:
                found.add(proc.info["pid"])
        return found

    # the daemon-to-be forked first thing (server/daemon.py) ends with the refused start
    wait_until(lambda: starts_left() <= {server.pid}, 10, "the refused start's fork to exit")
    workers = server.worker_pids("probe")
    stopped = server.cli("--stop")
    assert stopped.returncode == 0 and "mserve stopped" in stopped.stdout
    assert not pid_alive(server.pid)
    wait_until(lambda: not any(pid_alive(p) for p in workers), 10, "workers to exit")
    assert not (server.run_dir / "status.json").exists()
    nothing = server.cli("--stop")
    assert nothing.returncode == 1 and "mserve is not running" in nothing.stderr
    assert server.cli("--status").returncode == 3


def test_status_view_follows_the_registry(make_archive, start_server) -> None:
    """Models registered or removed through the API show in ``mserve --status`` at once; one
    that loads in the background turns ready there without another call."""
    make_archive("probe", "probe:handle", "probe")
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("bad_import", "broken", "broken")
    server = start_server("probe=probe.mar", "broken=broken.mar")

    def status() -> str:
        out = server.cli("--status")
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "model broken: failed:" in status()  # a startup failure stays listed
    assert server.manage("POST", "/models?url=echo.mar").status == 200
    shown = status()
    assert "model echo: ready" in shown and "model probe: ready" in shown
    assert server.manage("DELETE", "/models/probe").status == 200
    shown = status()
    assert "model probe" not in shown and "model echo: ready" in shown
    assert server.manage("POST", "/models?url=probe.mar&synchronous=false").status == 202
    wait_until(lambda: "model probe: ready" in status(), 30, "the status view to show it ready")
    assert server.manage("DELETE", "/models/echo").status == 200
    assert "model echo" not in status()


def test_request_bodies_reach_the_handler_as_torchserve_gives_them(make_archive, start_server):
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    text = server.predict("probe", "héllo").json()
    assert (text["body_type"], text["body"]) == ("str", "héllo")
    raw = server.predict("probe", b"\x00\x01\x02", headers={"Content-Type": "image/png"}).json()
    assert (raw["body_type"], raw["body"]) == ("bytes", {"bytes": 3})
    form = http(
        "POST", server.url("inference", "/predictions/probe?topk=3"), b"a=1&b=two",
        {"Content-Type": "application/x-www-form-urlencoded"},
    ).json()  # fmt: skip
    # the fields, as TorchServe gives them, and the bytes as sent (curl -d, urllib's default)
    assert form["keys"] == ["a", "b", "body", "topk"]
    binary = server.predict("probe", {"cmd": "bytes"})
    assert binary.body == bytes(range(256))
    assert binary.headers["Content-Type"] == "application/octet-stream"
    bad = server.predict("probe", b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status == 400
    # in the {"code", "type", "message"} envelope of every other error, not text/plain
    assert bad.headers["Content-Type"] == "application/json"
    assert bad.json()["code"] == 400 and bad.json()["type"] == "BadRequestException"
    assert bad.json()["message"].startswith(
        "request body is not valid JSON (Content-Type 'application/json'): Expecting property name"
    )


def test_json_bodies_come_back_as_json_reads_and_writes_them(make_archive, start_server) -> None:
    # the worker reads and writes JSON with orjson where it agrees with json (fastjson.py):
    # what it would do otherwise (big integers as floats, 8e-05 as 0.00008, NaN as null) must
    # never reach a client
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("echo_fn", "echo:shout", "shout")
    server = start_server("echo=echo.mar", "shout=shout.mar")
    json_type = {"Content-Type": "application/json"}
    bodies = [
        b'{"data": [0.5, 0.25, 1e+16, 123456.789, -0.0, 1, "\xc3\xa9"]}',
        b'{"id": 123456789012345678901234567890, "small": [8e-05, 8.9e-07, 0.0001]}',
        b"[NaN, Infinity, 1e400]",
    ]
    for body in bodies:
        reply = server.predict("echo", body, headers=json_type)
        assert reply.status == 200, reply.body
        expected = json.dumps(json.loads(body), ensure_ascii=False, separators=(",", ":"))
        assert reply.body == expected.encode()
    # a lone surrogate (a body's "\ud800") goes back as the escape it came as; as text, UTF-8
    # has no bytes for it: that request fails in words, and the worker goes on
    workers = server.worker_pids("shout")
    reply = server.predict("echo", b'["a\\ud800b"]', headers=json_type)
    assert (reply.status, reply.body) == (200, b'["a\\ud800b"]')
    reply = server.predict("shout", b'"a\\ud800b"', headers=json_type)
    assert reply.status == 500
    assert "holding '\\ud800' at index 1, a lone surrogate" in reply.body.decode()
    assert server.predict("shout", b'"ok"', headers=json_type).body == b"OK"
    assert server.worker_pids("shout") == workers


def test_form_fields_reach_the_handler_as_torchserve_gives_them(make_archive, start_server) -> None:
    """``curl -F data=@x.jpg -F other=value``: each field one input under its name, no ``body``;
    plain fields are bytes, files typed by their content type as TorchServe's worker types
    them (JSON parsed, text as str, bytes otherwise or when that fails)."""
    make_archive("form_fields", "form_fields", "fields")
    server = start_server("fields=fields.mar")
    url = server.url("inference", "/predictions/fields?topk=3")
    image = bytes(range(256))
    reply = requests.post(
        url,
        files={
            "data": ("x.jpg", image, "image/jpeg"),
            "untyped": ("blob.bin", b"\x00\x01"),  # requests sends no Content-Type for it
            "doc": ("doc.json", b'{"k": [1, "v"]}', "application/json"),
            "note": ("note.txt", "héllo".encode(), "text/plain; charset=utf-8"),
            "bad_json": ("x.json", b"{oops", "application/json"),
            "typed_field": (None, b'{"not": "parsed"}', "application/json"),  # no filename
        },
        data={"other": "value", "name": "café"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    got = reply.json()
    assert got["fields"] == {
        "data": ["bytes", image.decode("latin-1")],
        "untyped": ["bytes", "\x00\x01"],
        "doc": ["dict", {"k": [1, "v"]}],
        "note": ["str", "héllo"],
        "bad_json": ["bytes", "{oops"],
        "typed_field": ["bytes", '{"not": "parsed"}'],
        "other": ["bytes", "value"],
        "name": ["bytes", "café".encode().decode("latin-1")],
        "topk": ["str", "3"],
    }
    assert got["content_type"].startswith("multipart/form-data; boundary=")

    urlencoded = requests.post(url, data={"a": "1", "b": "two é"}, timeout=60).json()
    assert urlencoded["fields"] == {
        "a": ["bytes", "1"],
        "b": ["bytes", "two é".encode().decode("latin-1")],
        "body": ["bytes", "a=1&b=two+%C3%A9"],
        "topk": ["str", "3"],
    }
    # a field named like a query parameter wins, as TorchServe adds the fields after it
    clash = requests.post(url, files={"topk": (None, b"5")}, timeout=60).json()
    assert clash["fields"] == {"topk": ["bytes", "5"]}
    # a body that is not a form is still "body"
    plain = requests.post(url, json={"x": 1}, timeout=60).json()
    assert plain["fields"] == {"body": ["dict", {"x": 1}], "topk": ["str", "3"]}


def test_context_response_controls(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    teapot = server.predict("probe", {"cmd": "status"})
    assert teapot.status == 418
    custom = server.predict("probe", {"cmd": "header"})
    assert custom.status == 200
    assert custom.headers["X-Probe"] == "yes"
    assert custom.headers["Content-Type"] == "text/x-probe"
    assert custom.body == b"probe says hi"


def test_handler_failures_answer_5xx_and_the_worker_keeps_serving(make_archive, start_server):
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    pid = server.worker_pids("probe")[0]
    boom = server.predict("probe", {"cmd": "raise"})
    assert boom.status == 500
    assert boom.json()["type"] == "InternalServerException"
    assert "RuntimeError: probe was asked to fail" in boom.json()["message"]
    short = server.predict("probe", {"cmd": "wrong_length"})
    assert short.status == 500
    assert "one result per request: got 0 results for a batch of 1" in short.json()["message"]
    assert server.predict("probe", {"ok": 1}).status == 200
    assert server.worker_pids("probe") == [pid]
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "RuntimeError: probe was asked to fail" in log  # traceback re-logged under the model
    assert "Traceback" in log


def test_worker_crash_is_reported_and_replaced(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    old = server.worker_pids("probe")[0]
    crash = server.predict("probe", {"cmd": "exit"})
    assert crash.status == 500
    assert crash.json()["type"] == "InternalServerException"
    assert f"(pid {old}) exited with code 3" in crash.json()["message"]

    def replaced() -> bool:
        pids = server.worker_pids("probe")
        return bool(pids) and pids[0] != old and server.predict("probe", {}).status == 200

    wait_until(replaced, 30, "a replacement worker")


def test_errors_keep_torchserve_shape(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    missing = server.predict("nope", {})
    assert missing.status == 404
    assert missing.json() == {
        "code": 404,
        "type": "ModelNotFoundException",
        "message": "Model not found: nope",
    }
    version = server.predict("probe", {}, version="9.9")
    assert version.status == 404 and version.json()["type"] == "ModelVersionNotFoundException"
    nowhere = http("GET", server.url("inference", "/nowhere")).json()
    assert (nowhere["code"], nowhere["type"]) == (404, "ResourceNotFoundException")
    bad = server.manage("GET", "/models?next_page_token=x").json()
    assert (bad["code"], bad["type"]) == (400, "BadRequestException")
    assert server.manage("PUT", "/models/probe?min_worker=0&synchronous=true").status == 200
    idle = server.predict("probe", {}).json()
    assert (idle["code"], idle["type"]) == (503, "ServiceUnavailableException")


def test_handler_entry_styles(make_archive, start_server) -> None:
    make_archive("cls_handler", "cls_handler", "cls")
    make_archive("pkg_handler", "mypkg.service:Service", "dotted")
    make_archive("echo_fn", "echo:handle", "fn")
    server = start_server("cls=cls.mar", "dotted=dotted.mar", "fn=fn.mar")
    for name in ("cls", "dotted", "fn"):
        reply = server.predict(name, "abc")
        assert reply.status == 200, (name, reply.body)
    styles = {
        name: server.manage("GET", f"/models/{name}").json()[0]["status"]
        for name in ("cls", "dotted", "fn")
    }
    assert set(styles.values()) == {"READY"}


def test_load_failures_are_clear(make_archive, start_server) -> None:
    make_archive("bad_import", "broken", "broken")
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    broken = server.manage("POST", "/models?url=broken.mar")
    assert broken.status == 400, broken.body
    assert broken.json()["type"] == "InvalidModelException"
    assert "ModuleNotFoundError" in broken.json()["message"]
    assert "not found" not in broken.json()["message"].split("ModuleNotFoundError")[0]
    assert server.manage("GET", "/models").json()["models"] == [
        {"modelName": "probe", "modelUrl": "probe.mar", "loadState": "loaded"}
    ]
    assert server.predict("probe", {}).status == 200  # other models untouched


def test_a_startup_model_that_cannot_load_stays_registered_as_failed(
    make_archive, start_server
) -> None:
    """As docs/migration.md says (and TorchServe keeps such a model): requests get 503 naming
    the load error, describe shows it failed, /ping is Unhealthy, and unregistering removes it."""
    make_archive("bad_import", "broken", "broken")
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", "broken=broken.mar")
    assert "model broken: failed: handler of broken:1.0 failed to load" in server.start_output
    assert "1 startup model(s) failed" in server.start_output
    reply = server.predict("broken", {})
    assert reply.status == 503 and reply.json()["type"] == "ServiceUnavailableException"
    assert reply.json()["message"].startswith(
        "model broken:1.0 has failed: handler of broken:1.0 failed to load: ModuleNotFoundError:"
        " No module named 'mserve_test_missing_dependency'"
    ), reply.body
    described = server.manage("GET", "/models/broken").json()[0]
    assert described["status"] == "FAILED" and "ModuleNotFoundError" in described["failure"]
    assert [m["modelName"] for m in server.manage("GET", "/models").json()["models"]] == [
        "broken", "probe"]  # fmt: skip
    assert server.predict("probe", {}).status == 200  # the others serve
    assert http("GET", server.url("inference", "/ping")).status == 500
    assert server.manage("DELETE", "/models/broken").status == 200
    assert server.predict("broken", {}).status == 404
    assert http("GET", server.url("inference", "/ping")).status == 200


def test_model_shipping_server_and_archiver_modules_serves(make_archive, start_server) -> None:
    # TorchServe never reserved these names; archives made for it may well contain them.
    make_archive("own_server", "handler:handle", "own_server")
    server = start_server("own_server=own_server.mar")
    answer = server.predict("own_server", {})
    assert answer.status == 200, answer.body
    assert answer.body == b"from the model's own server package and its own archiver module"


def test_startup_model_failure_is_reported_not_fatal(make_archive, start_server) -> None:
    make_archive("bad_import", "broken", "broken")
    make_archive("probe", "probe:handle", "probe")
    server = start_server("broken=broken.mar", "probe=probe.mar")
    assert "model broken: failed:" in server.start_output
    assert "ModuleNotFoundError" in server.start_output
    assert server.predict("probe", {}).status == 200


def test_management_lifecycle(make_archive, start_server, tmp_path: Path) -> None:
    make_archive("probe", "probe:handle", "probe")
    (tmp_path / "v2.yaml").write_text("batchSize: 4\nmaxBatchDelay: 20\n")
    make_archive("probe", "probe:handle", "probe2", "-v", "2.0", "-c", str(tmp_path / "v2.yaml"))
    make_archive("echo_fn", "echo:handle", "echo")
    server = start_server()
    reg = server.manage("POST", "/models?url=probe.mar&initial_workers=1&synchronous=true")
    assert reg.status == 200
    assert reg.json()["status"] == 'Model "probe" Version: 1.0 registered with 1 initial workers'
    dup = server.manage("POST", "/models?url=probe.mar")
    assert dup.status == 409 and dup.json()["type"] == "ConflictStatusException"
    v2 = server.manage("POST", "/models?url=probe2.mar&model_name=probe&batch_size=2")
    assert v2.status == 200
    described = server.manage("GET", "/models/probe/2.0").json()[0]
    assert described["batchSize"] == 2 and described["settingSources"]["batch_size"] == "api"
    assert described["maxBatchDelay"] == 20
    assert described["settingSources"]["max_batch_delay_ms"] == "archive"
    assert (
        described["responseTimeout"] == 120
        and described["settingSources"]["response_timeout_s"] == "server"
    )
    # TorchServe's types: whole seconds are ints (typed clients refuse 120.0)
    assert type(described["responseTimeout"]) is int and type(described["startupTimeout"]) is int
    assert (described["deviceType"], described["parallelType"], described["parallelLevel"]) == (
        "cpu", "", 0,
    )  # fmt: skip
    assert described["jobQueueStatus"] == {"remainingCapacity": 100, "pendingRequests": 0}
    assert len(server.manage("GET", "/models/probe/all").json()) == 2
    assert len(server.manage("GET", "/models/probe/all/").json()) == 2  # TorchServe allows it
    assert server.predict("probe", {}, version="2.0").json()["batch_size"] == 2
    assert server.predict("probe", {}).json()["batch_size"] == 1  # default is the first version
    assert server.manage("PUT", "/models/probe/2.0/set-default").status == 200
    assert server.predict("probe", {}).json()["batch_size"] == 2
    assert server.manage("POST", "/models?url=echo.mar").status == 200
    page = server.manage("GET", "/models?limit=1").json()
    assert page == {
        "models": [{"modelName": "echo", "modelUrl": "echo.mar", "loadState": "loaded"}],
        "nextPageToken": "1",
    }
    page2 = server.manage("GET", "/models?limit=1&next_page_token=1").json()
    assert page2 == {  # the default version
        "models": [{"modelName": "probe", "modelUrl": "probe2.mar", "loadState": "loaded"}]
    }
    bad = server.manage("PUT", "/models/probe?min_worker=abc")
    assert bad.status == 400 and "'min_worker' should be an integer" in bad.json()["message"]
    scaled = server.manage("PUT", "/models/probe/2.0?min_worker=3&synchronous=true")
    assert scaled.status == 200
    assert len(server.worker_pids("probe")) == 3
    assert server.manage("PUT", "/models/probe/2.0?min_worker=1&synchronous=true").status == 200
    assert len(server.worker_pids("probe")) == 1
    gone = server.manage("DELETE", "/models/probe/1.0")
    assert gone.status == 200
    assert server.predict("probe", {}, version="1.0").status == 404
    assert server.manage("DELETE", "/models/probe").status == 200
    assert server.predict("probe", {}).status == 404
    outside = server.manage("POST", f"/models?url={tmp_path / 'store' / 'echo.mar'}x")
    assert outside.status in (403, 404)


def test_registration_parameters_take_effect(make_archive, start_server) -> None:
    """handler=, batch_size= and max_batch_delay= on POST /models: describe shows them and the
    workers run by them."""
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    reply = server.manage("POST", "/models?url=echo.mar&handler=echo:shout")
    assert reply.status == 200, reply.body
    described = server.manage("GET", "/models/echo").json()[0]
    assert described["handler"] == "echo:shout"
    assert server.predict("echo", "quiet please").body == b"QUIET PLEASE"  # shout, not handle

    path = "/models?url=probe.mar&batch_size=4&max_batch_delay=700&batch_wait=fill"
    reply = server.manage("POST", path)
    assert reply.status == 200, reply.body
    described = server.manage("GET", "/models/probe").json()[0]
    assert (described["batchSize"], described["maxBatchDelay"]) == (4, 700)
    assert described["batchWait"] == "fill"
    assert described["settingSources"]["max_batch_delay_ms"] == "api"
    assert described["settingSources"]["batch_wait"] == "api"
    started = time.monotonic()
    alone = server.predict("probe", {"n": 0}).json()
    assert time.monotonic() - started >= 0.6  # it waited for company, up to 700 ms
    assert alone["batch_len"] == 1
    together = concurrently(*(lambda i=i: server.predict("probe", {"n": i}) for i in range(3)))
    assert [r.json()["batch_len"] for r in together] == [3, 3, 3]  # one batch, in the delay


def test_a_batch_waits_for_company_only_while_its_worker_is_busy(
    make_archive, start_server, tmp_path: Path
) -> None:
    """By default (batch_wait busy) an idle worker gets a lone request at once, however long
    max_batch_delay is; batch_wait fill (TorchServe's way, here from the archive's model
    config) waits out the delay. Requests that arrive while the worker is busy still share a
    batch, sent when the worker is free."""
    make_archive("probe", "probe:handle", "probe")
    (tmp_path / "fill.yaml").write_text("batchWait: fill\n")
    make_archive("probe", "probe:handle", "filler", "-c", str(tmp_path / "fill.yaml"))
    server = start_server()
    for name in ("probe", "filler"):
        path = f"/models?url={name}.mar&batch_size=8&max_batch_delay=2000&initial_workers=1"
        assert server.manage("POST", path).status == 200
    described = server.manage("GET", "/models/probe").json()[0]
    assert (described["batchWait"], described["settingSources"]["batch_wait"]) == (
        "busy", "server"
    )  # fmt: skip
    described = server.manage("GET", "/models/filler").json()[0]
    assert (described["batchWait"], described["settingSources"]["batch_wait"]) == (
        "fill", "archive"
    )  # fmt: skip

    for _ in range(3):
        started = time.monotonic()
        alone = server.predict("probe", {})
        took = time.monotonic() - started
        assert alone.status == 200 and alone.json()["batch_len"] == 1
        assert took < 1.0, f"a lone request waited {took:.2f} s for company"
    started = time.monotonic()
    alone = server.predict("filler", {})
    assert alone.status == 200 and alone.json()["batch_len"] == 1
    assert time.monotonic() - started >= 1.9  # it waited out max_batch_delay

    # while the worker sleeps through one request, four more queue up: they go as one batch
    # when it is free (after ~0.7 s, not at the 2 s delay nor one by one)
    slow = threading.Thread(target=server.predict, args=("probe", {"cmd": "sleep", "s": 1.0}))
    slow.start()
    time.sleep(0.3)
    started = time.monotonic()
    together = concurrently(*(lambda i=i: server.predict("probe", {"n": i}) for i in range(4)))
    took = time.monotonic() - started
    slow.join(timeout=30)
    assert [r.json()["batch_len"] for r in together] == [4, 4, 4, 4]
    assert took < 1.6, f"the batch waited {took:.2f} s after its worker was free"

    bad = server.manage("POST", "/models?url=probe.mar&model_name=p2&batch_wait=sometimes")
    assert bad.status == 400
    assert bad.json()["message"] == (
        "parameter 'batch_wait' should be one of busy, fill, found 'sometimes'"
    )


def test_a_request_for_an_idle_worker_goes_from_the_call_that_queues_it(
    make_archive, start_server
) -> None:
    """A batching model (batch_wait busy) sends a request that finds its worker idle from the
    very call that queues it, as a model of batch size 1 does, not a loop turn later by waking
    its batch gatherer (what a lone request paid for a batch setting: docs/workers.md).
    Two requests written at once on one connection are queued by one read of the server: the
    first goes alone at once; the second finds the worker busy and goes when it is free, well
    before max_batch_delay (a gatherer woken a turn later found both: one batch of 2)."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    path = "/models?url=probe.mar&batch_size=8&max_batch_delay=2000&initial_workers=1"
    assert server.manage("POST", path).status == 200
    assert server.predict("probe", {}).status == 200  # the worker has served: it is idle now
    host, port = server.status["inference"].rsplit(":", 1)
    body = json.dumps({"n": 1}).encode()
    request = (
        b"POST /predictions/probe HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    started = time.monotonic()
    answers = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request * 2)
        received = b""
        while len(answers) < 2:
            head, found, rest = received.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", head) if found else None
            if length is None or len(rest) < int(length[1]):
                chunk = sock.recv(65536)
                assert chunk, f"the server closed the connection: {received!r}"
                received += chunk
                continue
            assert head.startswith(b"HTTP/1.1 200 "), head
            answers.append(json.loads(rest[: int(length[1])]))
            received = rest[int(length[1]) :]
    took = time.monotonic() - started
    assert [a["batch_len"] for a in answers] == [1, 1]
    assert took < 1.5, f"the second request waited {took:.2f} s for company"


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_ps_and_top_show_which_model_a_worker_serves(make_archive, start_server, fork) -> None:
    """Started fresh or forked from the template, a worker's command line and command name
    name its model, version and worker id, not the runtime's or the template's command."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"fork_workers": fork})
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    workers = server.manage("GET", "/models/probe").json()[0]["workers"]
    parents = {psutil.Process(w["pid"]).ppid() for w in workers}
    if fork:  # the first worker too: the template starts with the server's first worker
        assert len(parents) == 1 and server.pid not in parents
        assert "mserve_worker.template" in " ".join(psutil.Process(parents.pop()).cmdline())
    else:
        assert parents == {server.pid}
    for worker in workers:
        cmdline = Path(f"/proc/{worker['pid']}/cmdline").read_bytes().rstrip(b"\0")
        assert cmdline == f"mserve-worker probe:1.0 W-{worker['id']}".encode()
        assert Path(f"/proc/{worker['pid']}/comm").read_text() == "probe:1.0\n"
    assert server.predict("probe", {}).status == 200


def test_a_batch_size_whose_batch_is_more_than_a_frame_can_carry_still_serves(
    make_archive, start_server
) -> None:
    """batch_size x max_request_size_bytes over 4 GiB: the worker channel's limit was out of the
    codec's range, so the worker never started and the registration hung."""
    make_archive("echo_fn", "echo:handle", "echo")
    server = start_server()
    reply = server.manage(
        "POST", "/models?url=echo.mar&batch_size=1000&response_timeout=99999999999"
    )
    assert reply.status == 200, reply.body
    assert server.predict("echo", "big batches").body == b"big batches"


def test_worker_counts_over_1024_are_refused(make_archive, start_server) -> None:
    """Each worker is a process: a count of a few zeros too many must not start them (the
    server tried to, and stopped answering)."""
    make_archive("echo_fn", "echo:handle", "echo")
    server = start_server("echo=echo.mar")
    for query in ("url=echo.mar&model_name=e2&initial_workers=1025",
                  "url=echo.mar&model_name=e3&initial_workers=100000000000000000000"):  # fmt: skip
        reply = server.manage("POST", f"/models?{query}")
        assert reply.status == 400
        assert reply.json()["message"].startswith(
            "parameter 'initial_workers' should be <= 1024, found 10"
        )
    for query, name in (("min_worker=5000", "min_worker"), ("min_worker=1&max_worker=1025", "max_worker")):  # fmt: skip
        reply = server.manage("PUT", f"/models/echo?{query}")
        assert reply.status == 400
        assert reply.json()["message"].startswith(f"parameter '{name}' should be <= 1024, found")
    assert len(server.manage("GET", "/models/echo").json()[0]["workers"]) == 1


def test_scale_and_describe_as_torchserve_clients_use_them(make_archive, start_server) -> None:
    """max_worker shows as maxWorkers; a scale without synchronous answers 202 and the workers
    come; PUT /predictions works as POST; startTime and memoryUsage are real."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    reply = server.manage("PUT", "/models/probe?min_worker=3&max_worker=5")
    assert reply.status == 202
    assert reply.json() == {"status": "Processing worker updates..."}

    def three_ready() -> bool:
        workers = server.manage("GET", "/models/probe").json()[0]["workers"]
        return len(workers) == 3 and all(w["status"] == "READY" for w in workers)

    wait_until(three_ready, 60, "three READY workers after an asynchronous scale")
    described = server.manage("GET", "/models/probe").json()[0]
    assert (described["minWorkers"], described["maxWorkers"]) == (3, 5)
    for worker in described["workers"]:
        started = datetime.strptime(worker["startTime"], "%Y-%m-%dT%H:%M:%S.%fZ")
        started = started.replace(tzinfo=timezone.utc)
        age_s = (datetime.now(timezone.utc) - started).total_seconds()
        assert 0 <= age_s < 120  # started during this test, in UTC
        assert type(worker["memoryUsage"]) is int
        assert 1 << 20 < worker["memoryUsage"] < 8 << 30  # an RSS in bytes: a Python process

    put = http("PUT", server.url("inference", "/predictions/probe"), b'{"via": "put"}',
               {"Content-Type": "application/json"})  # fmt: skip
    assert put.status == 200 and put.json()["body"] == {"via": "put"}
    put = http("PUT", server.url("inference", "/predictions/probe/1.0"), b'{"via": "put"}',
               {"Content-Type": "application/json"})  # fmt: skip
    assert put.status == 200 and put.json()["body"] == {"via": "put"}


def test_models_list_pages_as_torchserve_does(make_archive, start_server) -> None:
    """limit is 100 when missing, over 100 or negative; 0 is an empty page."""
    make_archive("echo_fn", "echo:handle", "echo")
    server = start_server()
    names = sorted(f"m{i:03d}" for i in range(102))
    for name in names:  # no workers: a registration is an unpacked archive and a name
        reply = server.manage("POST", f"/models?url=echo.mar&model_name={name}&initial_workers=0")
        assert reply.status == 200, reply.body
    for query in ("", "?limit=101", "?limit=5000", "?limit=-1"):
        page = server.manage("GET", f"/models{query}").json()
        assert [m["modelName"] for m in page["models"]] == names[:100], query
        assert page["nextPageToken"] == "100"
    rest = server.manage("GET", "/models?limit=100&next_page_token=100").json()
    assert rest == {
        "models": [
            {"modelName": n, "modelUrl": "echo.mar", "loadState": "unloaded"} for n in names[100:]
        ]
    }
    empty = server.manage("GET", "/models?limit=0&next_page_token=7")
    assert empty.status == 200 and empty.json() == {"models": [], "nextPageToken": "7"}
    first = server.manage("GET", "/models?limit=1&next_page_token=-3").json()
    assert first == {"models": [{"modelName": "m000", "modelUrl": "echo.mar", "loadState": "unloaded"}],
                     "nextPageToken": "1"}  # fmt: skip


def test_a_registration_url_no_file_system_can_name_is_refused(make_archive, start_server) -> None:
    """A NUL character, or a name too long for the file system, was a 500 (an OSError or a
    ValueError from the path calls; found by fuzzing the management API)."""
    server = start_server()
    for url, status, message in [
        ("%00echo.mar", 400, "url '\\x00echo.mar': a path cannot hold a NUL character"),
        # /tmp is a server folder: answers name it <tmp> (server/redaction.py)
            ("file:///tmp/%2500x.mar", 400, "url 'file://<tmp>/%00x.mar': a path cannot hold a NUL character"),
        ("a" * 300 + ".mar", 404, f"archive not found: {'a' * 300}.mar (File name too long)"),
    ]:  # fmt: skip
        reply = server.manage("POST", f"/models?url={url}")
        assert (reply.status, reply.json()["message"]) == (status, message)


def test_registration_url_must_stay_in_the_store(make_archive, start_server, tmp_path) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    elsewhere = tmp_path / "elsewhere.mar"
    elsewhere.write_bytes((tmp_path / "store" / "probe.mar").read_bytes())
    denied = server.manage("POST", f"/models?url={elsewhere}")
    assert denied.status == 403 and denied.json()["type"] == "ArchiveNotAllowedException"
    dots = server.manage("POST", "/models?url=../elsewhere.mar")
    assert dots.status == 403
    missing = server.manage("POST", "/models?url=nope.mar")
    assert missing.status == 404
    assert server.manage("POST", "/models").status == 400


def test_a_request_goes_to_an_idle_worker_not_behind_a_busy_ones_batch(
    make_archive, start_server
) -> None:
    """Workers hold several batches; a new request must still go to the idle worker, not queue
    behind the one running a long batch (it would wait for it to end)."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    slow = threading.Thread(target=server.predict, args=("probe", {"cmd": "sleep", "s": 4}))
    slow.start()
    time.sleep(0.5)  # one worker runs the slow request now
    # the other one answers this; it is then the worker that last took a request
    assert server.predict("probe", {}).status == 200
    started = time.monotonic()
    reply = server.predict("probe", {})
    took = time.monotonic() - started
    slow.join(timeout=30)
    assert reply.status == 200
    assert took < 2, f"waited {took:.1f} s behind the busy worker"


def test_scale_under_traffic_loses_nothing(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    stop = threading.Event()
    results: list[int] = []

    def client() -> None:
        while not stop.is_set():
            results.append(server.predict("probe", {"n": 1}).status)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        for n in (3, 1, 4, 2, 1):
            reply = server.manage("PUT", f"/models/probe?min_worker={n}&synchronous=true")
            assert reply.status == 200, reply.body
            assert len(server.worker_pids("probe")) == n
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert len(results) > 50
    assert set(results) == {200}, {code: results.count(code) for code in set(results)}


def test_models_all_and_config_errors(make_archive, start_server, tmp_path: Path) -> None:
    make_archive("probe", "probe:handle", "one")
    make_archive("echo_fn", "echo:handle", "two")
    server = start_server("all")
    names = [m["modelName"] for m in server.manage("GET", "/models").json()["models"]]
    assert names == ["one", "two"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("job_queue: 5\n")
    out = subprocess.run(
        [MSERVE, "--start", "--config", str(bad), "--run-dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert f"config file {bad}: unknown key 'job_queue'" in out.stderr


def test_workers_exit_when_the_server_is_killed(make_archive, start_server) -> None:
    import os
    import signal

    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    server.manage("PUT", "/models/probe?min_worker=2&synchronous=true")
    workers = server.worker_pids("probe")
    os.kill(server.pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(p) for p in workers), 10, "orphaned workers to exit")


def test_metrics_endpoint(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    for _ in range(3):
        server.predict("probe", {})
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    assert 'mserve_requests_total{code="200",model="probe",version="1.0"} 3.0' in text
    assert 'mserve_workers_ready{model="probe",version="1.0"} 1.0' in text
    # the latency histogram: every answer counted once, cumulative buckets, a plausible sum
    latency = "mserve_request_latency_seconds"
    buckets = re.findall(latency + r'_bucket\{le="([^"]+)",model="probe"\} (\S+)', text)
    assert [le for le, _ in buckets][-1] == "+Inf" and len(buckets) == 15
    counts = [float(n) for _, n in buckets]
    assert counts == sorted(counts) and counts[-1] == 3.0
    assert f'{latency}_count{{model="probe"}} 3.0' in text
    total = float(re.search(latency + r'_sum\{model="probe"\} (\S+)', text).group(1))
    assert 0 < total < 60
    # TorchServe's ?name[]= filter picks our collected families as well
    query = f"/metrics?name[]={latency}_count&name[]=mserve_workers_ready"
    picked = http("GET", server.url("metrics", query)).body.decode()
    assert f'{latency}_count{{model="probe"}} 3.0' in picked and "mserve_workers_ready{" in picked
    assert "_bucket" not in picked and "mserve_requests_total" not in picked
    json.dumps(text)


def test_scaled_workers_fork_from_a_warm_template(make_archive, start_server) -> None:
    import psutil

    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"number_of_gpu": 2})
    wait_until(lambda: template_ready(server), 120, "the worker template")
    first = server.worker_pids("probe")[0]
    assert server.manage("PUT", "/models/probe?min_worker=3&synchronous=true").status == 200
    pids = server.worker_pids("probe")
    forked = [p for p in pids if p != first]
    parents = {psutil.Process(p).ppid() for p in forked}
    assert len(parents) == 1 and parents != {server.pid}  # children of the template
    template = parents.pop()
    assert "mserve_worker.template" in " ".join(psutil.Process(template).cmdline())
    gpus = sorted(w["gpuId"] for w in server.manage("GET", "/models/probe").json()[0]["workers"])
    assert gpus == [0, 0, 1]
    seen = set()
    for _ in range(30):
        report = server.predict("probe", {}).json()
        seen.add((report["pid"], report["cuda_visible_devices"], report["gpu_id"]))
    assert {(pid, gpu_id) for pid, _, gpu_id in seen} <= {(p, 0) for p in pids}
    assert {cvd for _, cvd, _ in seen} <= {"0", "1"}
    # a forked worker that dies is reported with its real exit code, then replaced
    for _ in range(50):
        crash = server.predict("probe", {"cmd": "exit"})
        assert crash.status == 500
        if any(f"(pid {p}) exited with code 3" in crash.json()["message"] for p in forked):
            break
    else:
        raise AssertionError("no forked worker took the crash request")
    wait_until(lambda: len(server.worker_pids("probe")) == 3 and server.predict("probe", {}).status == 200, 30, "recovery")  # fmt: skip
    workers = server.worker_pids("probe")
    server.cli("--stop")
    wait_until(lambda: not pid_alive(template) and not any(pid_alive(p) for p in workers), 10, "template and workers to exit")  # fmt: skip


def test_exec_only_when_fork_is_off(make_archive, start_server) -> None:
    import psutil

    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"fork_workers": False})
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    assert {psutil.Process(p).ppid() for p in server.worker_pids("probe")} == {server.pid}
    assert not template_ready(server)


def test_port_in_use_is_reported_plainly(start_server, tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "busy.yaml"
        cfg.write_text(f"inference_address: 127.0.0.1:{port}\nmanagement_address: 127.0.0.1:0\n"
                       "metrics_address: 127.0.0.1:0\ngrpc_inference_address: 127.0.0.1:0\ngrpc_management_address: 127.0.0.1:0\n")  # fmt: skip
        out = subprocess.run(
            [MSERVE, "--start", "--config", str(cfg), "--run-dir", str(tmp_path / "r")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} for the inference API" in out.stderr
    assert "Traceback" not in out.stderr


def test_grpc_port_in_use_fails_the_start_while_models_load(make_archive, tmp_path: Path) -> None:
    """The gRPC listeners open while the startup models' workers load (the first answer does
    not wait for gRPC's import): one that cannot bind still fails the start plainly, and the
    worker loading meanwhile and its template do not outlive the server."""
    import re
    import socket

    make_archive("slow_load", "slow:handle", "slow")  # its worker loads for ten minutes
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "busy.yaml"
        cfg.write_text("inference_address: 127.0.0.1:0\nmanagement_address: 127.0.0.1:0\n"
                       f"metrics_address: 127.0.0.1:0\nmodel_store: {tmp_path / 'store'}\n"
                       f"grpc_inference_address: 127.0.0.1:{port}\n"
                       "grpc_management_address: 127.0.0.1:0\n")  # fmt: skip
        out = subprocess.run(
            [MSERVE, "--start", "--config", str(cfg), "--run-dir", str(tmp_path / "r"),
             "--models", "slow=slow.mar"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} for the gRPC inference API" in out.stderr
    assert "Traceback" not in out.stderr
    log = (tmp_path / "r" / "logs" / "mserve.log").read_text()
    started = re.findall(r"worker \S+ of slow:1.0 started, pid (\d+)", log)
    assert started, "the gRPC listener was to fail while the model's worker loaded:\n" + log
    pids = [int(p) for p in started + re.findall(r"worker template for .* ready \(pid (\d+)", log)]
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "the worker and template to exit")


def test_async_registration_retries_instead_of_failing(make_archive, start_server) -> None:
    make_archive("bad_import", "broken", "broken")
    server = start_server()
    reply = server.manage("POST", "/models?url=broken.mar&synchronous=false")
    assert reply.status == 202
    wait_until(
        lambda: server.manage("GET", "/models/broken").json()[0]["status"] == "FAILED",
        60, "the model to be marked failed after repeated load failures",
    )  # fmt: skip
    described = server.manage("GET", "/models/broken").json()[0]
    # about six tries: mserve's maxRetryTimeoutInSec (TorchServe's 300 in its layout)
    assert "without loading again within maxRetryTimeoutInSec=10;" in described["failure"]
    assert any("ModuleNotFoundError" in line for line in described["lastOutput"])
    assert http("GET", server.url("inference", "/ping")).status == 500


def test_access_log_is_written_while_running_and_at_stop(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    access = server.run_dir / "logs" / "access.log"
    assert server.predict("probe", {"n": 1}).status == 200
    # buffered, but never for long: the server flushes it every second
    wait_until(
        lambda: access.exists() and '"POST /predictions/probe HTTP/1.1" 200' in access.read_text(),
        5, "the access log line",
    )  # fmt: skip
    for i in range(3):
        assert server.predict("probe", {"n": i}).status == 200
    assert server.cli("--stop").returncode == 0
    assert access.read_text().count('"POST /predictions/probe HTTP/1.1" 200') == 4
