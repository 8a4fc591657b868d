"""``mserve replay`` (server/replay/, issue 46) against a real server: traffic captured by the
inference log of one version (files, and KServe's CloudEvents through a real receiver that
keeps them in the CloudEvents JSON format) replayed against versions that answer alike, change
a number slightly or change a label (tests/handlers/shadowed), with bad lines, another model's
records and a target that is down. One server for the module."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from cloudevents.core.bindings.http import HTTPMessage, from_http_event
from cloudevents.core.formats.json import JSONFormat

from archiver.cli import main as archiver_main
from server.replay.cli import replay_main
from tests.server.conftest import HANDLERS, MSERVE, Server, pid_alive, wait_until

CAPTURED = 24  # requests sent to version 1.0 while it logged them


class EventFolder:
    """A CloudEvents receiver that writes each event it parses to a folder, one file each, in
    the CloudEvents JSON format (what a capture service keeps)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.count = 0
        self.lock = threading.Lock()
        keeper = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                event = from_http_event(HTTPMessage(dict(self.headers.items()), body))
                with keeper.lock:
                    keeper.count += 1
                    path = keeper.folder / f"{keeper.count:05d}.json"
                path.write_bytes(JSONFormat().write(event))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/events"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, Path]]:
    """A server with versions 1.0 (logging every request to a file and to a receiver), 2.0
    (a score moved by 0.001) and 3.0 (another label); CAPTURED requests sent to 1.0. Yields
    the server, the log file and the events folder."""
    root = tmp_path_factory.mktemp("replay")
    store = root / "store"
    store.mkdir()
    for version in ("1.0", "2.0", "3.0"):
        args = ["--model-name", "shadowed", "--handler", "shadowed", "--model-path",
                str(HANDLERS / "shadowed"), "--export-path", str(root), "--version", version, "-f"]  # fmt: skip
        out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
        assert out.exit_code == 0, out.output
        (root / "shadowed.mar").rename(store / f"shadowed_{version}.mar")
    events = root / "events"
    events.mkdir()
    receiver = EventFolder(events)
    settings: dict[str, Any] = {f"{api}_address": "127.0.0.1:0" for api in
                ("inference", "management", "metrics", "grpc_inference", "grpc_management")}  # fmt: skip
    settings.update(model_store=str(store), disable_token_authorization=True,
                    enable_model_api=True, inference_log_flush_s=0.1)  # fmt: skip
    config = root / "mserve.yaml"
    config.write_text(yaml.safe_dump(settings))
    run_dir = root / "run"
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    started = subprocess.run(
        [MSERVE, "--start", *args], capture_output=True, text=True, timeout=300
    )
    assert started.returncode == 0, started.stdout + started.stderr
    server = Server(run_dir, json.loads((run_dir / "status.json").read_text()), args)
    try:
        from urllib.parse import quote

        log = f"inference_log=all&inference_log_url={quote(receiver.url, safe='')}"
        for version, extra in (("1.0", log), ("2.0", ""), ("3.0", "")):
            url = f"/models?url=shadowed_{version}.mar&initial_workers=1&synchronous=true&{extra}"
            reply = server.manage("POST", url)
            assert reply.status == 200, reply.body
        for i in range(CAPTURED):
            reply = server.predict("shadowed", {"x": i * 1.5}, version="1.0")
            assert reply.status == 200, reply.body
        log_file = run_dir / "inference_log" / "shadowed" / "1.0.jsonl"
        wait_until(lambda: log_file.exists() and len(log_file.read_text().splitlines()) == CAPTURED,
                   20, "the log's lines")  # fmt: skip
        wait_until(lambda: receiver.count == 2 * CAPTURED, 20, "the events")
        # the capture as it stands: a replay against 1.0 is logged too, and adds to the log
        kept = root / "captured"
        kept.mkdir()
        shutil.copy(log_file, kept / "1.0.jsonl")
        shutil.copytree(events, kept / "events")
        yield server, kept / "1.0.jsonl", kept / "events"
    finally:
        receiver.close()
        if pid_alive(server.pid):
            server.cli("--stop")


def replay(*args: str) -> tuple[int, dict[str, Any], str]:
    """The command in this process (its real click command): exit code, JSON report, output."""
    result = CliRunner().invoke(replay_main, [*args, "--json", "-", "--quiet"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    out = result.stdout
    report = json.loads(out[out.index("{") :]) if "{" in out else {}
    return result.exit_code, report, result.output + result.stderr


def base(server: Server) -> str:
    return server.status["urls"]["inference"]


def test_replay_against_the_same_version_matches(captured, tmp_path) -> None:
    server, log_file, _ = captured
    html = tmp_path / "report.html"
    code, report, _ = replay(str(log_file), "--against", base(server), "--version", "1.0",
                             "--html", str(html))  # fmt: skip
    assert code == 0, report
    counts = report["counts"]
    assert counts["sent"] == counts["answered"] == counts["equal"] == CAPTURED
    assert counts["bytes_equal"] == CAPTURED  # the log keeps a JSON answer's bytes as sent
    assert report["passed"] and report["by_field"] == {} and report["worst"] == []
    assert report["latency_ms"]["recorded"]["count"] == CAPTURED
    assert report["latency_ms"]["replayed"]["p99"] > 0
    assert "<svg" in html.read_text()


def test_a_changed_label_is_caught_with_the_field_named(captured, tmp_path) -> None:
    server, log_file, _ = captured
    html = tmp_path / "report.html"
    code, report, output = replay(str(log_file), "--against", base(server), "--version", "3.0",
                                  "--html", str(html))  # fmt: skip
    assert code == 1
    assert report["by_field"] == {"$.predictions[0].label": CAPTURED}
    assert report["by_kind"] == {"value": CAPTURED}
    worst = report["worst"][0]["comparison"]["differences"][0]
    assert (worst["path"], worst["reference"], worst["candidate"]) == (
        "$.predictions[0].label", "cat", "dog",
    )  # fmt: skip
    assert "100.00% of answers differ or failed, over the threshold 0.00%" in output
    # a threshold that allows them passes the gate
    code, report, _ = replay(str(log_file), "--against", base(server), "--version", "3.0",
                             "--max-differing", "1")  # fmt: skip
    assert code == 0 and report["counts"]["differing"] == CAPTURED


def test_numbers_within_tolerance_pass(captured) -> None:
    server, log_file, _ = captured
    code, report, _ = replay(str(log_file), "--against", base(server), "--version", "2.0")
    assert code == 1 and report["by_field"] == {"$.predictions[0].score": CAPTURED}
    assert report["max_abs_error"] == pytest.approx(0.001)
    code, report, _ = replay(str(log_file), "--against", base(server), "--version", "2.0",
                             "--abs-tol", "0.0011")  # fmt: skip
    assert code == 0 and report["counts"]["equal"] == CAPTURED


def test_a_cloudevents_capture_by_our_logger_replays(captured) -> None:
    server, _, events = captured
    code, report, _ = replay(str(events), "--against", base(server), "--version", "1.0")
    assert code == 0, report
    assert report["model"] == "shadowed"
    assert report["counts"]["equal"] == report["counts"]["bytes_equal"] == CAPTURED
    code, report, _ = replay(str(events), "--against", base(server), "--version", "3.0")
    assert code == 1 and report["by_field"] == {"$.predictions[0].label": CAPTURED}


def test_bad_lines_other_models_and_bodiless_records_are_counted(captured, tmp_path) -> None:
    server, log_file, _ = captured
    lines = log_file.read_text().splitlines()
    folder = tmp_path / "logs"
    folder.mkdir()
    # a rotated, gzipped older file with half the records, the live file with the rest
    with gzip.open(folder / "1.0.jsonl.1.gz", "wt") as f:
        f.write("\n".join(lines[: CAPTURED // 2]) + "\n")
    other = json.loads(lines[0]) | {"model": "other"}
    bodiless = {k: v for k, v in json.loads(lines[1]).items() if k != "request"}
    extra = ["not json at all", '{"a": 1}', json.dumps(other), json.dumps(bodiless), ""]
    (folder / "1.0.jsonl").write_text("\n".join(lines[CAPTURED // 2 :] + extra) + "\n")
    code, report, _ = replay(str(folder), "--against", base(server), "--version", "1.0",
                             "--limit", "20")  # fmt: skip
    assert code == 0, report
    counts = report["counts"]
    assert counts["equal"] == 20
    assert counts["skipped"] == {"not_a_record": 2, "other_model": 1, "no_request_body": 1,
                                 "over_limit": CAPTURED - 20}  # fmt: skip
    bad = [p for p in report["skipped_places"] if p["reason"] == "not_a_record"]
    first = CAPTURED - CAPTURED // 2 + 1  # the line after the live file's records
    assert bad[0]["where"].endswith(f"1.0.jsonl:{first}") and "not JSON" in bad[0]["detail"]
    assert bad[1]["where"].endswith(f"1.0.jsonl:{first + 1}")
    assert bad[1]["detail"] == "a JSON value without model, version, status"


def test_a_target_that_is_down_is_reported_with_exit_code_3(captured, tmp_path) -> None:
    _, log_file, _ = captured
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the installed command, as CI runs it: no traceback, a clean exit code
    out = subprocess.run(
        [shutil.which("mserve") or MSERVE, "replay", str(log_file), "--against",
         f"http://127.0.0.1:{port}", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 3, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "mserve replay: no answer from the target: {'unreachable': 24}" in out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["counts"]["failed"] == {"unreachable": CAPTURED}
    assert report["failures"][0]["kind"] == "unreachable"


def _browser() -> str | None:
    """Debian's chromium (scripts/test.sh installs it), else Playwright's own download."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_html_report_renders_in_a_real_browser(captured, tmp_path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    server, log_file, _ = captured
    html = tmp_path / "report.html"
    code, _, _ = replay(str(log_file), "--against", base(server), "--version", "3.0",
                        "--html", str(html))  # fmt: skip
    assert code == 1
    problems: list[str] = []
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=_browser())
        except sync_api.Error as exc:  # neither Debian's chromium nor Playwright's
            pytest.skip(f"no headless chromium here: {str(exc).splitlines()[0]}")
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith("file:") else problems.append(r.url))
        page.goto(html.as_uri())
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        assert page.title() == f"mserve replay: shadowed against {base(server)}"
        verdict = page.inner_text(".verdict")
        assert "100.00% of answers differ or failed" in verdict
        assert page.locator("svg").count() == 3  # latency, fields, kinds
        assert page.locator("svg rect").count() > 10
        assert "$.predictions[0].label" in page.inner_text("body")
        assert page.locator("table").nth(1).locator("tr").count() == 21  # the 20 worst pairs
        browser.close()
    assert problems == []  # no console error, no page error, nothing fetched
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_a_window_a_sample_and_the_recorded_pace(captured, tmp_path) -> None:
    server, log_file, _ = captured
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    middle = lines[CAPTURED // 2]["when"]
    code, report, _ = replay(str(log_file), "--against", base(server), "--version", "1.0",
                             "--since", middle, "--speed", "1000")  # fmt: skip
    assert code == 0
    after = sum(1 for line in lines if line["when"] >= middle)
    assert report["counts"]["equal"] == after
    assert report["counts"]["skipped"] == {"outside_window": CAPTURED - after}
    code, report, _ = replay(str(log_file), "--against", base(server), "--version", "1.0",
                             "--sample", "0.5", "--seed", "3")  # fmt: skip
    counts = report["counts"]
    assert code == 0 and 0 < counts["equal"] < CAPTURED
    assert counts["equal"] + counts["skipped"]["not_sampled"] == CAPTURED


def test_paths_for_each_api() -> None:
    from server.replay.records import Recorded
    from server.replay.target import Target

    def record(api: str, body: bytes, op: str = "predict") -> Recorded:
        return Recorded("id", "m", "1.0", api, op, 0.0, 0, body, "application/json", 200,
                        b"{}", "application/json", "f:1")  # fmt: skip

    base_url = "http://h:1"
    tensors = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}'
    assert Target(base_url).endpoint(record("torchserve", b"{}")) == "http://h:1/predictions/m"
    assert Target(base_url, version="2.0").endpoint(record("torchserve", b"{}", "explain")) == (
        "http://h:1/explanations/m/2.0"
    )
    assert Target(base_url, version="2").endpoint(record("", tensors)) == (
        "http://h:1/v2/models/m/versions/2/infer"
    )  # a CloudEvent's API guessed from its body
    assert Target(base_url, api="v1").endpoint(record("", b'{"instances": []}')) == (
        "http://h:1/v1/models/m:predict"
    )
    chat = record("", b'{"model": "a", "messages": []}')
    openai = Target(base_url, api="openai", model="b")
    assert openai.endpoint(chat) == "http://h:1/v1/chat/completions"
    assert json.loads(openai.body(chat))["model"] == "b"
    fixed = "http://h:1/predictions/other/3.0"
    assert Target(fixed).endpoint(record("v2", tensors)) == fixed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--against", "127.0.0.1:8080"], "'127.0.0.1:8080' is not an http:// or https:// URL"),
        (["--against", "http://h:1", "-H", "no colon"], "--header 'no colon' should be 'Name: value'"),
        (["--against", "http://h:1", "--since", "2026-01-01T00:00:00"],
         "'2026-01-01T00:00:00' has no time zone (add Z or +00:00)"),
        (["--against", "http://h:1", "--until", "yesterday"], "'yesterday' is not an ISO 8601 time"),
        (["--against", "http://h:1", "--top-k", "5000"], "top_k must be an integer from 0 to 1000"),
    ],
)  # fmt: skip
def test_usage_errors_name_the_flag(tmp_path, args: list[str], message: str) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    result = CliRunner().invoke(replay_main, [str(log), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_a_key_file_without_an_inference_key_is_named(tmp_path) -> None:
    log, key = tmp_path / "empty.jsonl", tmp_path / "key_file.json"
    log.write_text("")
    key.write_text("{}")
    result = CliRunner().invoke(replay_main, [str(log), "--against", "http://h:1",
                                              "--key-file", str(key)])  # fmt: skip
    assert result.exit_code == 2
    assert f"--key-file {key}: no inference key in it" in " ".join(result.output.split())


def test_nothing_to_replay_exits_4(tmp_path) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("garbage\n")
    code, report, output = replay(str(log), "--against", "http://127.0.0.1:9")
    assert code == 4 and report["counts"]["skipped"] == {"not_a_record": 1}
    assert "mserve replay: nothing to replay: no record of the log could be sent" in output


class _Other(BaseHTTPRequestHandler):
    """Another server's answers: HTTP/1.0 closing after each (``/close``), or HTTP/1.1 chunked
    (``/chunked``); both echo the request's x as TorchServe's version 1.0 answers it."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        x = float(body["x"])
        data = json.dumps({"predictions": [{"label": "cat", "score": x}], "x": x}).encode()
        if self.path == "/chunked":
            self.protocol_version = "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = len(data) // 2
            for part in (data[:half], data[half:], b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("path", ["/close", "/chunked"])
def test_another_server_closing_connections_or_chunking_answers(captured, path: str) -> None:
    _, log_file, _ = captured
    other = ThreadingHTTPServer(("127.0.0.1", 0), _Other)
    other.daemon_threads = True
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{other.server_address[1]}{path}"
        code, report, _ = replay(str(log_file), "--against", url, "-c", "4")
    finally:
        other.shutdown()
        other.server_close()
    assert code == 0, report
    assert report["counts"]["equal"] == CAPTURED and report["counts"]["failed"] == {}
