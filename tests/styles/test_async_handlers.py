"""``async def handle`` (TorchServe's async worker contract): archived, served by a real mserve,
queried over HTTP. Module functions and handler classes, their errors, and the model config's
``asyncCommunication``."""

from __future__ import annotations

from pathlib import Path

from tests.server import conftest as serving
from tests.server.conftest import concurrently

make_archive = serving.make_archive
start_server = serving.start_server


def test_async_handlers_are_awaited(make_archive, start_server, tmp_path: Path) -> None:
    config = tmp_path / "async.yaml"  # TorchServe's async test's model config
    config.write_text("minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\nasyncCommunication: true\n")
    make_archive("async_handlers", "async_fn:handle", "afn", "-c", str(config))
    make_archive("async_handlers", "async_cls:AsyncDoubler", "acls")
    server = start_server("afn=afn.mar", "acls=acls.mar")

    reply = server.predict("afn", {"x": 7}, headers={"X-Request-ID": "req-7"})
    assert reply.status == 200, reply.body
    assert reply.json() == {"echo": 7, "initialised": True, "on_loop": True,
                            "request_id": "req-7", "most_awaiting": 1}  # fmt: skip
    # an exception the coroutine raises is the handler's, as from a plain handle
    failed = server.predict("afn", {"fail": "no teapot here"})
    assert (failed.status, failed.json()["message"]) == (418, "no teapot here")
    assert server.predict("afn", {"x": 8}).json()["echo"] == 8  # the worker serves on

    # TorchServe's own async test handler, in shape: a BaseHandler subclass
    replies = concurrently(*(lambda i=i: server.predict("acls", str(i),
                                                        headers={"Content-Type": "application/json"})
                             for i in range(6)))  # fmt: skip
    assert [(r.status, r.json()) for r in replies] == [(200, 2 * i) for i in range(6)]
