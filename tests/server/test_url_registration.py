"""Registration by URL against a real HTTP server on 127.0.0.1 (the standard library's, in a
thread), and archives that are symlinks in the model store."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest

from server.config import load_config
from server.download import url_allowed
from server.errors import ConfigError
from tests.server.conftest import Server, wait_until

RELEASE_S = 30  # the longest a stalled or paused answer waits before it gives up by itself


@dataclass
class Route:
    """What the upstream answers on one path."""

    status: int = 200
    body: bytes = b""
    location: str | None = None
    announce_length: bool = True
    pause_after: int | None = None  # send this many bytes, then wait for ``release``
    trickle_s: float | None = None  # send one byte, then wait this long, until ``release``
    release: threading.Event = field(default_factory=threading.Event)
    hits: int = 0


class Upstream:
    """A threaded stdlib HTTP server; ``routes`` maps a path (query included) to its answer."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = upstream.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                route.hits += 1
                self.send_response(route.status)
                if route.location is not None:
                    self.send_header("Location", route.location)
                if route.announce_length:
                    self.send_header("Content-Length", str(len(route.body)))
                else:
                    self.send_header("Connection", "close")  # the body ends with the connection
                self.end_headers()
                if route.trickle_s is not None:
                    for i in range(len(route.body)):
                        if route.release.wait(route.trickle_s):
                            return
                        self.wfile.write(route.body[i : i + 1])
                        self.wfile.flush()
                    return
                cut = len(route.body) if route.pause_after is None else route.pause_after
                self.wfile.write(route.body[:cut])
                self.wfile.flush()
                if route.pause_after is not None:
                    route.release.wait(RELEASE_S)
                    self.wfile.write(route.body[cut:])
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        for route in self.routes.values():
            route.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
def echo_bytes(make_archive, tmp_path: Path) -> bytes:
    """A real echo archive, kept out of the model store (it is only reachable by URL)."""
    path = make_archive("echo_fn", "echo:handle", "echo")
    data = path.read_bytes()
    path.unlink()
    return data


def allowed_config(upstream: Upstream, **more: object) -> dict[str, object]:
    return {
        "allowed_urls": [f"http://127\\.0\\.0\\.1:{upstream.port}/ok/.*"],
        "download_timeout_s": 1,
        **more,
    }


def register(server: Server, url: str, extra: str = "") -> tuple[int, dict]:
    """POST /models with ``url`` percent-encoded (its own query stays its own)."""
    reply = server.manage("POST", f"/models?url={quote(url, safe=':/@')}{extra}")
    return reply.status, reply.json()


def log_text(server: Server) -> str:
    return (server.run_dir / "logs" / "mserve.log").read_text()


# --- downloads ----------------------------------------------------------------------------


def test_allowed_url_downloads_registers_and_predicts(upstream, echo_bytes, start_server) -> None:
    upstream.routes["/ok/echo.mar?sig=s3cret"] = Route(body=echo_bytes)
    server = start_server(config=allowed_config(upstream))
    url = upstream.url("/ok/echo.mar?sig=s3cret")
    status, body = register(server, url.replace("http://", "http://user:pw@"))
    assert (status, body) == (200, {"status": 'Model "echo" Version: 1.0 registered with 1 initial workers'})  # fmt: skip
    reply = server.predict("echo", "hello")
    assert reply.status == 200 and reply.body == b"hello"
    described = server.manage("GET", "/models/echo").json()[0]
    assert described["modelUrl"] == upstream.url("/ok/echo.mar")  # no credentials, no query
    text = log_text(server)
    assert f"downloaded {upstream.url('/ok/echo.mar')}: 0.0 MB in" in text
    assert f"sha256 {hashlib.sha256(echo_bytes).hexdigest()}" in text
    assert "s3cret" not in text and "user:pw" not in text
    downloads = list((server.run_dir / "downloads").rglob("*.archive"))
    assert [p.name for p in downloads] == [f"{hashlib.sha256(echo_bytes).hexdigest()}.archive"]
    assert not list((server.run_dir / "downloads").rglob(".download-*"))  # no temp file left
    assert server.manage("DELETE", "/models/echo").status == 200
    assert not list((server.run_dir / "downloads").rglob("*.archive"))  # unregistered: deleted


def test_urls_outside_the_allow_list_are_refused(upstream, echo_bytes, start_server) -> None:
    upstream.routes["/other/echo.mar"] = Route(body=echo_bytes)
    server = start_server()  # no allowed_urls: the model store only
    url = upstream.url("/other/echo.mar")
    assert register(server, url + "?token=s3cret") == (403, {
        "code": 403, "type": "ArchiveNotAllowedException",
        "message": f"Given URL {url} does not match any allowed URL(s): allowed_urls is empty,"
                   " so only archives in the model store and allowed_paths can be registered"
                   " (TorchServe's default allows any URL: allowed_urls=file://.*|http(s)?://.*)",
    })  # fmt: skip
    server = start_server(config=allowed_config(upstream))
    status, body = register(server, url)
    assert (status, body["message"]) == (403, f"Given URL {url} does not match any allowed URL(s) (the allowed_urls patterns)")  # fmt: skip
    # the pattern must match the whole URL, as in TorchServe
    status, body = register(server, "http://evil.example/" + upstream.url("/ok/echo.mar"))
    assert status == 403
    assert upstream.routes["/other/echo.mar"].hits == 0  # refused before any request was made
    for url, message in [
        ("ftp://127.0.0.1/ok/echo.mar", "url 'ftp://127.0.0.1/ok/echo.mar': the scheme 'ftp' is not supported (http, https, file, or a name in the model store)"),
        ("file://host/x.mar", "url 'file://host/x.mar': a file URL must name a local path (file:///...)"),
        ("http:///x.mar", "url 'http:///x.mar' is not a valid URL: it names no host"),
        ("http://u:pw@127.0.0.1:99999/x.mar?sig=s3cret", "url 'http://127.0.0.1:99999/x.mar' is not a valid URL: Port out of range 0-65535"),
    ]:  # fmt: skip
        assert register(server, url) == (400, {"code": 400, "type": "BadRequestException", "message": message})  # fmt: skip


def test_a_missing_or_empty_url_answers_as_torchserve_does(start_server) -> None:
    """TorchServe: no ``url`` is a 400 BadRequestException, ``url=`` a 404 from the archive
    lookup (ModelNotFoundException "empty url"); clients branch on both."""
    server = start_server()
    for query, status, kind, message in [
        ("", 400, "BadRequestException", "Parameter url is required."),
        ("?model_name=m", 400, "BadRequestException", "Parameter url is required."),
        ("?url=", 404, "ModelNotFoundException", "empty url"),
        ("?url=&model_name=m", 404, "ModelNotFoundException", "empty url"),
    ]:
        reply = server.manage("POST", f"/models{query}")
        assert (reply.status, reply.json()) == (
            status, {"code": status, "type": kind, "message": message}
        ), query  # fmt: skip
    assert server.manage("GET", "/models").json() == {"models": []}


def test_redirects_are_followed_only_inside_the_allow_list(
    upstream, echo_bytes, start_server
) -> None:
    upstream.routes["/ok/latest.mar"] = Route(status=302, location="/ok/echo-v1.mar")
    upstream.routes["/ok/echo-v1.mar"] = Route(body=echo_bytes)
    upstream.routes["/ok/away.mar"] = Route(status=301, location=upstream.url("/cdn/echo.mar"))
    upstream.routes["/cdn/echo.mar"] = Route(body=echo_bytes)
    upstream.routes["/ok/loop.mar"] = Route(status=307, location="/ok/loop.mar")
    server = start_server(config=allowed_config(upstream))
    status, body = register(server, upstream.url("/ok/latest.mar"), "&initial_workers=0")
    assert status == 200, body
    described = server.manage("GET", "/models/echo").json()[0]
    assert described["modelUrl"] == upstream.url("/ok/latest.mar")  # the URL as registered
    assert f"{upstream.url('/ok/latest.mar')}: redirected to {upstream.url('/ok/echo-v1.mar')}" in log_text(server)  # fmt: skip
    away = upstream.url("/ok/away.mar")
    assert register(server, away, "&model_name=other") == (403, {
        "code": 403, "type": "ArchiveNotAllowedException",
        "message": f"{away} redirected to {upstream.url('/cdn/echo.mar')}, which does not match"
                   " any allowed URL(s) (the allowed_urls patterns)",
    })  # fmt: skip
    assert upstream.routes["/cdn/echo.mar"].hits == 0
    loop = upstream.url("/ok/loop.mar")
    assert register(server, loop) == (502, {
        "code": 502, "type": "DownloadArchiveException", "message": f"{loop}: more than 10 redirects",
    })  # fmt: skip


def test_download_failures_name_the_url_and_the_cause(upstream, echo_bytes, start_server) -> None:
    big = os.urandom(2000)
    digest = hashlib.sha256(echo_bytes).hexdigest()
    upstream.routes["/ok/echo.mar"] = Route(body=echo_bytes)
    upstream.routes["/ok/big.mar"] = Route(body=big)
    upstream.routes["/ok/big-unannounced.mar"] = Route(body=big, announce_length=False)
    upstream.routes["/ok/gone.mar"] = Route(status=500, body=b"oops")
    upstream.routes["/ok/corrupt.mar"] = Route(body=b"PK\x03\x04 this is no zip archive")
    upstream.routes["/ok/short.mar"] = Route(body=echo_bytes[:100], announce_length=False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    server = start_server(config={
        "allowed_urls": [f"http://127\\.0\\.0\\.1:({upstream.port}|{closed_port})/ok/.*"],
        "download_max_bytes": 1500,
    })  # fmt: skip
    u = upstream.url
    refused = f"http://127.0.0.1:{closed_port}/ok/echo.mar"
    cases = [
        (u("/ok/missing.mar"), 502, "DownloadArchiveException", f"{u('/ok/missing.mar')}: the server answered 404 Not Found"),
        (u("/ok/gone.mar"), 502, "DownloadArchiveException", f"{u('/ok/gone.mar')}: the server answered 500 Internal Server Error"),
        (refused, 502, "DownloadArchiveException", f"{refused}: download failed: [Errno 111] Connection refused"),
        (u("/ok/big.mar"), 413, "DownloadArchiveException", f"{u('/ok/big.mar')}: the archive is 2000 bytes, over download_max_bytes (1500)"),
        (u("/ok/big-unannounced.mar"), 413, "DownloadArchiveException", f"{u('/ok/big-unannounced.mar')}: the archive is over download_max_bytes (1500 bytes); stopped there"),
        (u("/ok/corrupt.mar"), 400, "InvalidModelException", f"cannot load archive {u('/ok/corrupt.mar')}: "),
        ((u("/ok/echo.mar"), "&sha256=" + "0" * 64), 400, "BadRequestException", f"{u('/ok/echo.mar')}: the downloaded archive's sha256 is {digest}, the sha256 parameter asks for {'0' * 64}"),
        ((u("/ok/echo.mar"), "&sha256=abc"), 400, "BadRequestException", "parameter 'sha256' should be 64 hex digits (a SHA-256 digest), found 'abc'"),
    ]  # fmt: skip
    for url, code, kind, message in cases:
        url, extra = url if isinstance(url, tuple) else (url, "")
        status, body = register(server, url, extra)
        assert (status, body["type"]) == (code, kind), (url, body)
        assert body["message"].startswith(message), (url, body["message"], message)
    assert register(server, u("/ok/short.mar"))[0] == 400  # a cut-off body is a bad archive
    # the size limit and the failures left nothing behind (the corrupt download is deleted),
    # and the server still registers
    assert not list((server.run_dir / "downloads").rglob(".download-*"))
    assert not list((server.run_dir / "downloads").rglob("*.archive"))
    status, body = register(
        server, u("/ok/echo.mar"), f"&sha256={digest.upper()}&initial_workers=0"
    )
    assert status == 200, body
    assert server.manage("GET", "/models").json()["models"] == [
        {"modelName": "echo", "modelUrl": u("/ok/echo.mar"), "loadState": "unloaded"}
    ]


def test_a_stalled_upstream_times_out_with_504(upstream, echo_bytes, start_server) -> None:
    upstream.routes["/ok/stall.mar"] = Route(body=echo_bytes, pause_after=10)
    upstream.routes["/ok/trickle.mar"] = Route(body=echo_bytes, trickle_s=0.2)
    config = allowed_config(upstream, download_total_timeout_s=2)  # download_timeout_s: 1
    server = start_server(config=config)
    url = upstream.url("/ok/stall.mar")
    started = time.monotonic()
    status, body = register(server, url)
    took = time.monotonic() - started
    assert (status, body) == (504, {
        "code": 504, "type": "DownloadArchiveException",
        "message": f"{url}: timed out waiting for data after 1 s (download_timeout_s)",
    })  # fmt: skip
    assert took < 8, f"the 1 s read timeout took {took:.1f} s"
    upstream.routes["/ok/stall.mar"].release.set()
    # a byte every 0.2 s never trips the read timeout; the whole download's deadline stops it
    url = upstream.url("/ok/trickle.mar")
    started = time.monotonic()
    status, body = register(server, url)
    took = time.monotonic() - started
    upstream.routes["/ok/trickle.mar"].release.set()
    assert (status, body["type"]) == (504, "DownloadArchiveException")
    assert body["message"].startswith(f"{url}: not finished after 2 s (download_total_timeout_s); 0.0 MB received")  # fmt: skip
    assert took < 10, f"the 2 s deadline took {took:.1f} s"


def test_other_models_serve_while_a_slow_download_shows_its_progress(
    upstream, echo_bytes, make_archive, start_server
) -> None:
    padded = echo_bytes  # the archive itself, announced and sent in two parts
    route = upstream.routes["/ok/slow.mar"] = Route(body=padded, pause_after=len(padded) // 2)
    make_archive("echo_fn", "echo:handle", "local")
    server = start_server("local=local.mar", config=allowed_config(upstream, download_timeout_s=60))
    result: list[tuple[int, dict]] = []
    url = upstream.url("/ok/slow.mar")
    thread = threading.Thread(
        target=lambda: result.append(register(server, url, "&model_name=slow&initial_workers=0"))
    )
    thread.start()
    try:
        half = len(padded) // 2

        def downloading() -> bool:
            reply = server.manage("GET", "/models/slow")
            return reply.status == 200 and reply.json()[0]["downloadedBytes"] == half

        wait_until(downloading, 30, "the download to show its progress")
        entry = server.manage("GET", "/models/slow").json()[0]
        total = f"{len(padded) / 1e6:.1f}"
        assert entry == {
            "modelName": "slow", "modelVersion": None, "modelUrl": url, "loadedAtStartup": False,
            "status": "LOADING", "stage": f"downloading {half / 1e6:.1f} of {total} MB",
            "downloadedBytes": half, "downloadTotalBytes": len(padded), "workers": [],
        }  # fmt: skip
        started = time.monotonic()
        for _ in range(5):
            reply = server.predict("local", "still here")
            assert reply.status == 200 and reply.body == b"still here"
        assert server.manage("GET", "/models/local").status == 200
        assert time.monotonic() - started < 5
        assert thread.is_alive()  # the download is still waiting for its second half
    finally:
        route.release.set()
        thread.join(timeout=30)
    assert result == [(200, {"status": 'Model "slow" Version: 1.0 registered with 0 initial'
                                       " workers. Use scale workers API to add workers for the"
                                       " model."})]  # fmt: skip
    assert f"downloading {url} ({total} MB)" in log_text(server)
    assert server.manage("GET", "/models/slow").json()[0]["modelVersion"] == "1.0"


def test_a_restart_restores_from_the_cached_download(upstream, echo_bytes, start_server) -> None:
    """The snapshot records the URL and the digest: the restored model is the same bytes, taken
    from the run dir's download cache without asking the upstream again."""
    route = upstream.routes["/ok/echo.mar"] = Route(body=echo_bytes)
    config = allowed_config(upstream)
    server = start_server(config=config)
    assert register(server, upstream.url("/ok/echo.mar"))[0] == 200
    assert server.cli("--stop").returncode == 0
    del upstream.routes["/ok/echo.mar"]  # the upstream no longer has it
    again = start_server(config=config, run_dir=server.run_dir)
    wait_until(lambda: again.predict("echo", "back").status == 200, 60, "the restored model")
    assert route.hits == 1
    assert again.manage("GET", "/models/echo").json()[0]["modelUrl"] == upstream.url("/ok/echo.mar")
    assert "using the cached download" in log_text(again)


def test_the_operator_may_name_any_http_url_on_the_command_line(
    upstream, echo_bytes, start_server
) -> None:
    """``--models name=URL`` is the operator's own choice, as with TorchServe: no allowed_urls
    needed (the API stays held to it)."""
    upstream.routes["/models/echo.mar"] = Route(body=echo_bytes)
    server = start_server(f"echo={upstream.url('/models/echo.mar')}")
    reply = server.predict("echo", "from the command line")
    assert reply.status == 200 and reply.body == b"from the command line"
    assert register(server, upstream.url("/models/echo.mar"), "&model_name=again")[0] == 403


def test_stopping_the_server_does_not_wait_for_a_stalled_download(
    upstream, echo_bytes, start_server
) -> None:
    upstream.routes["/ok/stall.mar"] = Route(body=echo_bytes, pause_after=10)
    server = start_server(config=allowed_config(upstream, download_timeout_s=120))
    thread = threading.Thread(target=register, args=(server, upstream.url("/ok/stall.mar")))
    thread.start()
    try:
        wait_until(lambda: server.manage("GET", "/models/stall").status == 200, 30, "the download")
        started = time.monotonic()
        assert server.cli("--stop").returncode == 0
        took = time.monotonic() - started
        assert took < 15, f"stopping took {took:.1f} s"
    finally:
        upstream.routes["/ok/stall.mar"].release.set()
        thread.join(timeout=30)


def test_allowed_urls_follow_torchserve_matching() -> None:
    """Whole-URL match, case ignored; the user name and password are not part of it."""
    patterns = (r"https://models\.example\.com/.*\.mar",)
    assert url_allowed("https://models.example.com/a/b.mar", patterns)
    assert url_allowed("HTTPS://MODELS.EXAMPLE.COM/a/b.MAR", patterns)
    assert url_allowed("https://user:pw@models.example.com/b.mar", patterns)
    assert not url_allowed("https://models.example.com/b.mar.exe", patterns)  # whole URL
    assert not url_allowed("https://models.example.com.evil/b.mar", patterns)
    assert not url_allowed("https://models.example.com@evil.test/x/b.mar", (r"https://models\.example\.com.*",))  # fmt: skip
    assert not url_allowed("https://models.example.com/b.mar", ())


def test_bad_download_settings_are_config_errors() -> None:
    for flags, message in [
        ({"allowed_urls": "https://ok/.*,https://(broken"}, "allowed_urls: 'https://(broken' is not a valid regular expression: missing ), unterminated subpattern at position 8"),
        ({"download_max_bytes": "0"}, "command line: 'download_max_bytes' should be a positive integer, found '0'"),
        ({"download_timeout_s": "-1"}, "command line: 'download_timeout_s' should be a positive finite number, found '-1'"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as caught:
            load_config(flags=flags, environ={})
        assert caught.value.message == message
    config = load_config(environ={})
    assert (config.allowed_urls, config.download_max_bytes, config.download_timeout_s,
            config.download_total_timeout_s) == ((), 8 * 1024**3, 30.0, 3600.0)  # fmt: skip


# --- symlinks in the model store ----------------------------------------------------------


@pytest.fixture
def linked_store(make_archive, tmp_path: Path) -> Callable[[], None]:
    """A store whose archive and archive folder are symlinks to files elsewhere (as Kubernetes
    volume mounts make them), plus an archive outside the store."""
    store = tmp_path / "store"
    shared = tmp_path / "shared"
    shared.mkdir()
    mar = make_archive("echo_fn", "echo:handle", "filelink")
    shutil.move(mar, shared / "filelink.mar")
    (store / "filelink.mar").symlink_to(shared / "filelink.mar")
    folder = make_archive("echo_fn", "echo:handle", "dirlink", "--archive-format", "no-archive")
    folder = folder.with_suffix("")
    shutil.move(folder, shared / "dirlink")
    (store / "dirlink").symlink_to(shared / "dirlink")
    (store / "sub").symlink_to(shared)
    (tmp_path / "outside.mar").write_bytes((shared / "filelink.mar").read_bytes())

    def check() -> None:
        assert (store / "filelink.mar").is_symlink() and (store / "dirlink").is_symlink()

    return check


def test_symlinked_archives_in_the_store_are_served_at_start(linked_store, start_server) -> None:
    linked_store()
    server = start_server("filelink=filelink.mar", "dirlink=dirlink")
    for name in ("filelink", "dirlink"):
        reply = server.predict(name, "linked")
        assert reply.status == 200 and reply.body == b"linked", name
    every = start_server("all")
    names = [m["modelName"] for m in every.manage("GET", "/models").json()["models"]]
    assert names == ["dirlink", "filelink"]


def test_symlinked_archives_register_through_the_api_and_escapes_are_refused(
    linked_store, start_server, tmp_path
) -> None:
    linked_store()
    elsewhere = tmp_path / "elsewhere.mar"  # outside the store, allowed by allowed_urls
    shutil.copy(tmp_path / "outside.mar", elsewhere)
    server = start_server(config={"allowed_urls": [re.escape(f"file://{elsewhere}")]})
    store = tmp_path / "store"
    for url, name in [("filelink.mar", "filelink"), ("dirlink", "dirlink"),
                      ("sub/filelink.mar", "viasub"), (f"{store}/filelink.mar", "absolute"),
                      (f"file://{store}/dirlink", "fileurl"),
                      (f"file://{elsewhere}", "allowedfile")]:  # fmt: skip
        status, body = register(server, url, f"&model_name={name}")
        assert status == 200, (url, body)
        reply = server.predict(name, "linked")
        assert reply.status == 200 and reply.body == b"linked", url
    outside = tmp_path / "outside.mar"

    def shown(text: str) -> str:  # answers name server folders, not their paths (redaction)
        return text.replace(str(store), "<model_store>").replace(tempfile.gettempdir(), "<tmp>")

    for url, message in [
        # TorchServe's words (mserve's own layout keeps the 403 of a refusal; TorchServe's is 404)
        ("../outside.mar", "Relative path is not allowed in url: ../outside.mar"),
        ("sub/../../outside.mar", "Relative path is not allowed in url: sub/../../outside.mar"),
        (f"{store}/sub/../../outside.mar", f"Relative path is not allowed in url: {store}/sub/../../outside.mar"),
        (f"file://{store}/sub/%2e%2e/%2e%2e/outside.mar", f"Relative path is not allowed in url: file://{store}/sub/%2e%2e/%2e%2e/outside.mar"),
        ("https://u:pw@example.com/a/../b.mar?sig=1", "Relative path is not allowed in url: https://example.com/a/../b.mar"),
        (str(outside), f"url '{outside}' is outside the model store and allowed_paths"),
        (f"file://{outside}", f"url 'file://{outside}' is outside the model store and allowed_paths"),
    ]:  # fmt: skip
        assert register(server, url, "&model_name=escape") == (403, {
            "code": 403, "type": "ArchiveNotAllowedException", "message": shown(message),
        }), url  # fmt: skip
    assert server.manage("GET", "/models/escape").status == 404


def test_a_store_archive_pinned_to_another_sha256_is_refused(make_archive, start_server) -> None:
    """sha256= pins local archives too: a store archive with another digest is refused naming
    both, the right one (any case) registers, and a folder cannot be pinned."""
    archive = make_archive("echo_fn", "echo:handle", "echo")
    make_archive("echo_fn", "echo:handle", "folder", "--archive-format", "no-archive")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    server = start_server(config={"disable_token_authorization": True, "enable_model_api": True})
    wrong = server.manage("POST", f"/models?url=echo.mar&sha256={'0' * 64}")
    assert wrong.status == 400 and wrong.json() == {
        "code": 400,
        "type": "BadRequestException",
        "message": f"archive echo.mar: its sha256 is {digest}, the sha256 parameter asks for"
        f" {'0' * 64}",
    }
    assert "echo" not in server.manage("GET", "/models").body.decode()
    folder = server.manage("POST", f"/models?url=folder&sha256={digest}")
    assert folder.status == 400 and folder.json()["message"] == (
        "url 'folder' is an archive folder: the sha256 parameter applies to archive files"
        " (.mar, .tar.gz)"
    )
    right = server.manage("POST", f"/models?url=echo.mar&sha256={digest.upper()}")
    assert right.status == 200, right.body
