"""The worker runtime driven directly over its socket, on this Python and on the oldest one a
model environment may use (3.8), from a plain copy of the child-side modules only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mserve_worker import protocol
from mserve_worker.protocol import Frame, Kind, RequestItem
from server.envs import copy_runtime

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


@pytest.mark.parametrize(
    "python", _pythons(), ids=lambda p: "this-python" if p == sys.executable else "python3.8"
)
def test_runtime_hello_load_batch_and_exit(tmp_path: Path, python: str) -> None:
    lib = _plain_copy(tmp_path)
    model = HANDLERS / "probe"
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
    peer = Peer(parent)
    try:
        hello = peer.receive()
        assert hello.kind == Kind.HELLO and hello.meta["pid"] == proc.pid
        init = {"model_name": "probe", "model_dir": str(model), "handler": "probe:handle",
                "manifest": {"model": {"modelName": "probe"}}, "batch_size": 2, "gpu_id": None}  # fmt: skip
        peer.send(Frame(Kind.INIT, init))
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
        import json

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
    from mserve_worker.runtime import Channel

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
    from mserve_worker.runtime import _serve_batch

    def loaded(folder: str, entry: str) -> tuple[object, Context]:
        model = HANDLERS / folder
        monkeypatch.syspath_prepend(str(model))
        context = Context(folder, str(model), {}, 2, None, "mserve", "0")
        handler = load_handler(entry, str(model), context, None)
        for name, module in list(sys.modules.items()):  # other tests load their own `echo`
            if str(getattr(module, "__file__", "")).startswith(str(HANDLERS)):
                del sys.modules[name]
        return handler, context

    handler, context = loaded("custom_metrics", "metrics_handler:handle")
    context.metrics.add_time("NotANumber", float("nan"))  # not JSON: dropped, batch unharmed
    body = b'{"color": "blue"}'
    frame = protocol.batch_frame(1, [RequestItem("r1", "application/json", [], body)])
    result = _serve_batch(frame, handler, context)  # type: ignore[arg-type]
    assert result.kind == Kind.RESULT
    handler_ms, entries = protocol.parse_result_metrics(result)
    assert handler_ms is not None and handler_ms >= 0
    by_name = {e.name: e for e in entries}
    assert "NotANumber" not in by_name
    assert by_name["ModelLoads"].request_id is None  # recorded while loading, sent now
    seen = by_name["ItemsSeen"]
    assert (seen.value, seen.kind, seen.request_id) == (1, "counter", "r1")
    assert seen.dimensions == [["Color", "blue"]]
    assert len(context.metrics) == 0  # drained: the next batch does not send them again

    handler, context = loaded("echo_fn", "echo:handle")
    result = _serve_batch(protocol.batch_frame(2, [RequestItem("r2", "", [], b"x")]), handler, context)  # type: ignore[arg-type]
    assert "metrics" not in result.meta and "handler_ms" in result.meta
