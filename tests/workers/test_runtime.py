"""The worker runtime driven directly over its socket, on this Python and on the oldest one a
model environment may use (3.8), from a plain copy of the child-side modules only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mserve_worker import protocol
from mserve_worker.protocol import Frame, Kind, RequestItem
from server.model_envs import copy_runtime

REPO = Path(__file__).resolve().parent.parent.parent
HANDLERS = REPO / "tests" / "handlers"


def _pythons() -> list[str]:
    found = [sys.executable]
    candidates = [os.environ.get("OLD_PYTHON_FOR_WORKER_TESTS"), *map(str, Path.home().glob(".pyenv/versions/3.8*/bin/python"))]  # fmt: skip
    for candidate in candidates:
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 8)"], capture_output=True).returncode == 0:  # fmt: skip
            found.append(candidate)
            break
    return found


def _plain_copy(tmp: Path) -> Path:
    """Only the child-side modules, as a model environment would see them: no server deps."""
    root = tmp / "lib"
    copy_runtime(root)
    return root


class Peer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = protocol.Decoder()
        self.frames: list[Frame] = []

    def send(self, frame: Frame) -> None:
        self.sock.sendall(protocol.encode_bytes(frame))

    def receive(self) -> Frame:
        while not self.frames:
            data = self.sock.recv(65536)
            assert data, "worker closed the channel"
            self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)


def _spawn(tmp_path: Path, python: str = sys.executable) -> tuple[subprocess.Popen, Peer]:
    """The runtime from a plain copy, on ``python``, with our end of its socket."""
    lib = _plain_copy(tmp_path)
    parent, child = socket.socketpair()
    # -I ignores PYTHONPATH and the cwd, so put the plain copy first on the path by hand
    boot = (
        "import sys, runpy; sys.path.insert(0, sys.argv.pop(1));"
        " runpy.run_module('mserve_worker.runtime', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [python, "-I", "-u", "-c", boot, str(lib), "--fd", str(child.fileno())],
        cwd=tmp_path, pass_fds=(child.fileno(),), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    child.close()
    return proc, Peer(parent)


PROBE_INIT = {"model_name": "probe", "model_dir": str(HANDLERS / "probe"), "handler": "probe:handle",
              "manifest": {"model": {"modelName": "probe"}}, "batch_size": 2, "gpu_id": None}  # fmt: skip


@pytest.mark.parametrize(
    "python", _pythons(), ids=lambda p: "this-python" if p == sys.executable else "python3.8"
)
def test_runtime_hello_load_batch_and_exit(tmp_path: Path, python: str) -> None:
    proc, peer = _spawn(tmp_path, python)
    parent = peer.sock
    try:
        hello = peer.receive()
        assert hello.kind == Kind.HELLO and hello.meta["pid"] == proc.pid
        peer.send(Frame(Kind.INIT, PROBE_INIT))
        ready = peer.receive()
        assert ready.kind == Kind.READY, ready.meta
        assert ready.meta["style"] == "module-function"
        items = [
            RequestItem("r1", "application/json", [["X-Test", "a"]], b'{"k": 1}'),
            RequestItem("r2", "text/plain", [], b"hi"),
        ]
        peer.send(protocol.batch_frame(7, items))
        batch_id, results = protocol.parse_result(peer.receive())
        assert batch_id == 7
        first, second = (json.loads(bytes(r.body)) for r in results)
        assert (first["body"], first["x_test"], first["batch_len"]) == ({"k": 1}, "a", 2)
        assert (second["body"], second["request_id"]) == ("hi", "r2")
        peer.send(
            protocol.batch_frame(
                8, [RequestItem("r3", "application/json", [], b'{"cmd": "raise"}')]
            )
        )
        failed = peer.receive()
        assert failed.kind == Kind.BATCH_FAILED and failed.meta["batch_id"] == 8
        assert "RuntimeError: probe was asked to fail" in failed.meta["error"]
    finally:
        parent.close()  # the worker must exit when its channel closes
    assert proc.wait(timeout=20) == 0
    assert b"probe was asked to fail" in proc.stderr.read()  # the traceback went to stderr


def test_async_batches_run_at_once_and_are_answered_in_order(tmp_path: Path) -> None:
    """asyncCommunication: the three batches await together (each waits until three calls
    have), the first ends last (it sleeps 0.3 s more), and the RESULTs still come in the order
    the batches were sent, which is what the server reads."""
    proc, peer = _spawn(tmp_path)
    try:
        assert peer.receive().kind == Kind.HELLO
        peer.send(Frame(Kind.INIT, {
            "model_name": "afn", "model_dir": str(HANDLERS / "async_handlers"),
            "handler": "async_fn:handle", "manifest": {"model": {"modelName": "afn"}},
            "batch_size": 1, "gpu_id": None,
            "model_yaml_config": {"asyncCommunication": True},
        }))  # fmt: skip
        ready = peer.receive()
        assert ready.kind == Kind.READY and ready.meta["concurrent"] is True, ready.meta
        bodies = [{"x": 0, "until": 3, "wait": 0.3}, {"x": 1, "until": 3}, {"x": 2, "until": 3}]
        for batch_id, body in enumerate(bodies):
            item = RequestItem(f"r{batch_id}", "application/json", [], json.dumps(body).encode())
            peer.send(protocol.batch_frame(batch_id, [item]))
        answers = [protocol.parse_result(peer.receive()) for _ in bodies]
        assert [batch_id for batch_id, _ in answers] == [0, 1, 2]
        got = [json.loads(bytes(results[0].body)) for _, results in answers]
        assert [(a["echo"], a["request_id"]) for a in got] == [(0, "r0"), (1, "r1"), (2, "r2")]
        assert min(a["most_awaiting"] for a in got) == 3
    finally:
        peer.sock.close()
    assert proc.wait(timeout=20) == 0


def _title(pid: int) -> tuple[bytes, str]:
    """(the command line as ps reads it, the command name as top shows it)."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    return cmdline.rstrip(b"\0"), Path(f"/proc/{pid}/comm").read_text().rstrip("\n")


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="process titles: Linux only")
@pytest.mark.parametrize(
    "python", _pythons(), ids=lambda p: "this-python" if p == sys.executable else "python3.8"
)
def test_the_worker_shows_its_model_version_and_id_in_ps(tmp_path: Path, python: str) -> None:
    """Without setproctitle (stdlib only): argv overwritten in place, and the 15-byte command
    name; a name too long for either is cut, never written past the original argv."""
    long_name = "a-model-with-a-long-name-" + "x" * 500
    for init, title, comm in (
        ({**PROBE_INIT, "model_version": "2.0", "worker_id": "9001"},
         b"mserve-worker probe:2.0 W-9001", "probe:2.0"),
        (PROBE_INIT, b"mserve-worker probe", "probe"),
        ({**PROBE_INIT, "model_name": long_name}, None, long_name[:15]),
    ):  # fmt: skip
        proc, peer = _spawn(tmp_path, python)
        try:
            assert peer.receive().kind == Kind.HELLO
            original = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            peer.send(Frame(Kind.INIT, init))
            assert peer.receive().kind == Kind.READY
            shown, name = _title(proc.pid)
            if title is None:  # as much of the title as the original argv area holds
                assert len(shown) == len(original) - 1
                assert shown == (b"mserve-worker " + long_name.encode())[: len(shown)]
            else:
                assert shown == title
            assert name == comm
        finally:
            peer.sock.close()
        assert proc.wait(timeout=20) == 0


def _raw(kind: int, meta: bytes = b"{}", payload: bytes = b"") -> bytes:
    return protocol.HEADER.pack(b"MS", protocol.PROTOCOL_VERSION, kind, 0, len(meta), len(payload)) + meta + payload  # fmt: skip


# (what the server sends, after INIT or instead of it; what the worker says on stderr)
GARBAGE = {
    "HTTP instead of INIT": (None, b"GET / HTTP/1.1\r\n\r\n", "bad frame magic b'GE', expected b'MS'"),
    "a BATCH instead of INIT": (None, protocol.encode_bytes(protocol.batch_frame(1, [])), "expected an INIT frame first, got BATCH"),
    "an INIT lacking model_dir": (None, protocol.encode_bytes(Frame(Kind.INIT, {"model_name": "m"})), "INIT lacks the required field 'model_dir'"),
    "an INIT with a string batch_size": (None, protocol.encode_bytes(Frame(Kind.INIT, {**PROBE_INIT, "batch_size": "2"})), "INIT batch_size must be an integer, got '2'"),
    "random bytes": (PROBE_INIT, bytes(range(7, 250, 3)), "bad frame magic b'\\x07\\n'"),
    "an unknown kind": (PROBE_INIT, _raw(42), "unknown frame kind 42"),
    "a version 2 frame": (PROBE_INIT, b"MS\x02" + _raw(5)[3:], "unsupported protocol version 2, this side speaks 6"),
    "meta not JSON": (PROBE_INIT, _raw(Kind.BATCH, b"{batch}"), "BATCH frame meta is not valid JSON"),
    "an oversized meta_len": (PROBE_INIT, protocol.HEADER.pack(b"MS", protocol.PROTOCOL_VERSION, 5, 0, 2**32 - 1, 0), "frame meta_len 4294967295 bytes exceeds the limit of 16777216 bytes"),
    "a BATCH whose sizes do not add up": (PROBE_INIT, _raw(Kind.BATCH, b'{"batch_id":1,"requests":[{"id":"r","size":5}]}', b"ab"), "BATCH 1: requests sizes add up to 5 bytes but the payload holds 2 bytes"),
    "a BATCH with a numeric request id": (PROBE_INIT, _raw(Kind.BATCH, b'{"batch_id":1,"requests":[{"id":7,"size":0}]}'), "BATCH requests[0].id must be a string, got int"),
    "a CANCEL with numeric ids": (PROBE_INIT, _raw(Kind.CANCEL, b'{"batch_id":1,"ids":[1]}'), "CANCEL ids[] must be a string, got int"),
    "a RESULT sent to the worker": (PROBE_INIT, protocol.encode_bytes(protocol.result_frame(1, [])), "unexpected RESULT frame after INIT"),
    "a RELOAD of no known step": (PROBE_INIT, _raw(Kind.RELOAD, b'{"reload_id":1,"step":"go"}'), "RELOAD step must be one of prepare, commit, abort, got 'go'"),
    "a second INIT": (PROBE_INIT, protocol.encode_bytes(Frame(Kind.INIT, PROBE_INIT)), "unexpected INIT frame after INIT"),
}  # fmt: skip


@pytest.mark.parametrize(
    "python", _pythons(), ids=lambda p: "this-python" if p == sys.executable else "python3.8"
)
@pytest.mark.parametrize("case", list(GARBAGE))
def test_a_worker_fed_garbage_says_why_and_exits(tmp_path: Path, case: str, python: str) -> None:
    """Whatever bad bytes the server's end sends, at the start or after loading, the worker
    writes the protocol error to stderr, closes its end and exits with status 3; it never waits
    for more, and a batch queued behind the garbage is not run."""
    init, garbage, message = GARBAGE[case]
    proc, peer = _spawn(tmp_path, python)
    try:
        assert peer.receive().kind == Kind.HELLO
        if init is not None:
            peer.send(Frame(Kind.INIT, init))
            assert peer.receive().kind == Kind.READY
        touched = tmp_path / "ran"
        after = protocol.batch_frame(9, [RequestItem("r9", "application/json", [], json.dumps({"cmd": "touch", "path": str(touched)}).encode())])  # fmt: skip
        peer.sock.sendall(garbage + protocol.encode_bytes(after))
        peer.sock.settimeout(20)
        assert peer.sock.recv(1) == b"", "the worker answered after the garbage"
        assert proc.wait(timeout=20) == 3
    finally:
        peer.sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read().decode()
    assert f"mserve-worker: the server broke the protocol ({message}" in stderr, stderr
    assert "Traceback" not in stderr
    assert not touched.exists()


class ShortWrites:
    """Stands in for the channel's socket: each sendmsg takes at most ``limit`` bytes, as a
    blocking send interrupted by a signal does."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.calls = 0

    def sendmsg(self, buffers: list[bytes | memoryview]) -> int:
        self.calls += 1
        taken = b"".join(bytes(b) for b in buffers)[: self.limit]
        self.data += taken
        return len(taken)


FRAMES_TO_SEND = [
    Frame(Kind.READY, {"load_s": 0.1, "style": "module-function"}),
    protocol.result_frame(3, [protocol.ResponseItem(200, bytes(range(256)) * 3)]),
    Frame(Kind.RESULT, {"batch_id": 4, "responses": [{"size": 5}]}, memoryview(b"abcde")),
]


@pytest.mark.parametrize("frame", FRAMES_TO_SEND, ids=["no payload", "bytes", "memoryview"])
def test_channel_send_is_one_sendmsg_and_finishes_a_short_one(frame: Frame) -> None:
    from mserve_worker.channel import Channel

    whole = ShortWrites(limit=1 << 20)
    Channel(whole).send(frame)  # type: ignore[arg-type]
    assert (bytes(whole.data), whole.calls) == (protocol.encode_bytes(frame), 1)
    for limit in (1, 5, 16, 17, 100):
        short = ShortWrites(limit)
        Channel(short).send(frame)  # type: ignore[arg-type]
        assert bytes(short.data) == protocol.encode_bytes(frame), limit


def test_a_result_carries_the_handler_time_and_what_it_recorded(monkeypatch) -> None:
    from mserve_worker.context import Context
    from mserve_worker.loader import load_handler
    from mserve_worker.service import HandlerService

    def loaded(folder: str, entry: str) -> tuple[HandlerService, Context]:
        model = HANDLERS / folder
        monkeypatch.syspath_prepend(str(model))
        context = Context(folder, str(model), {}, 2, None, "mserve", "0")
        handler = load_handler(entry, str(model), context, None)
        for name, module in list(sys.modules.items()):  # other tests load their own `echo`
            if str(getattr(module, "__file__", "")).startswith(str(HANDLERS)):
                del sys.modules[name]
        return HandlerService(handler, context), context

    def result(service: HandlerService, batch_id: int, item: RequestItem) -> Frame:
        responses, handler_ms, metrics = service.serve(batch_id, [item])
        return protocol.result_frame(batch_id, responses, handler_ms=handler_ms, metrics=metrics)

    service, context = loaded("custom_metrics", "metrics_handler:handle")
    context.metrics.add_time("NotANumber", float("nan"))  # not JSON: dropped, batch unharmed
    body = b'{"color": "blue"}'
    handler_ms, entries = protocol.parse_result_metrics(
        result(service, 1, RequestItem("r1", "application/json", [], body))
    )
    assert handler_ms is not None and handler_ms >= 0
    by_name = {e.name: e for e in entries}
    assert "NotANumber" not in by_name
    assert by_name["ModelLoads"].request_id is None  # recorded while loading, sent now
    seen = by_name["ItemsSeen"]
    assert (seen.value, seen.kind, seen.request_id) == (1, "counter", "r1")
    assert seen.dimensions == [["Color", "blue"]]
    assert len(context.metrics) == 0  # drained: the next batch does not send them again

    service, context = loaded("echo_fn", "echo:handle")
    frame = result(service, 2, RequestItem("r2", "", [], b"x"))
    assert "metrics" not in frame.meta and "handler_ms" in frame.meta


def test_the_server_counts_as_gone_once_it_is_a_zombie_or_reaped() -> None:
    """What a worker asks before killing its process group on EOF: a live server is not gone (it
    stops its workers and kills their groups itself); an unreaped zombie and a reaped pid are."""
    from mserve_worker.runtime import _server_gone

    assert not _server_gone(os.getpid())
    assert not _server_gone(None)  # an older server that sent no pid
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _server_gone(proc.pid):  # a zombie, unreaped
        time.sleep(0.01)
    assert _server_gone(proc.pid)
    proc.wait()
    assert _server_gone(proc.pid)


def test_answers_encoded_as_json_are_flagged_only_for_a_logged_model(tmp_path: Path) -> None:
    """The server's inference log embeds a flagged body unchecked: the worker flags what its
    own JSON encoder wrote, never a handler's bytes, and only when INIT says the model is
    logged (other models' RESULTs stay as they were)."""
    for logged in (True, False):
        proc, peer = _spawn(tmp_path / str(logged))
        try:
            assert peer.receive().kind == Kind.HELLO
            peer.send(Frame(Kind.INIT, {**PROBE_INIT, "inference_log": logged}))
            assert peer.receive().kind == Kind.READY
            items = [
                RequestItem("r1", "application/json", [], b'{"k": 1}'),
                RequestItem("r2", "application/json", [], b'{"cmd": "bytes"}'),
            ]
            peer.send(protocol.batch_frame(1, items))
            _, results = protocol.parse_result(peer.receive())
            assert [r.json_body for r in results] == [logged, False]
            assert json.loads(bytes(results[0].body))["body"] == {"k": 1}
        finally:
            peer.sock.close()
        assert proc.wait(timeout=20) == 0
