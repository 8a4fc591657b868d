"""``async def handle`` (TorchServe's async worker contract): archived, served by a real mserve,
queried over HTTP. Module functions and handler classes, their errors, and the model config's
``asyncCommunication``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server import conftest as serving
from tests.server.conftest import concurrently, http, wait_until

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
                            "request_id": "req-7", "most_awaiting": 1, "cancelled": 0}  # fmt: skip
    # an exception the coroutine raises is the handler's, as from a plain handle
    failed = server.predict("afn", {"fail": "no teapot here"})
    assert (failed.status, failed.json()["message"]) == (418, "no teapot here")
    assert server.predict("afn", {"x": 8}).json()["echo"] == 8  # the worker serves on

    # asyncCommunication: batches of one worker run at once, as in TorchServe's async worker;
    # each waits until all six await together (so a worker running them one by one answers
    # 504 after 20 s), and a failing one fails alone
    bodies = [{"x": i, "until": 6} for i in range(6)] + [{"fail": "teapot", "wait": 0.2}]
    replies = concurrently(*(lambda b=b: server.predict("afn", b) for b in bodies))
    assert [r.status for r in replies] == [200] * 6 + [418], [r.body for r in replies]
    assert [r.json()["echo"] for r in replies[:6]] == list(range(6))
    assert max(r.json()["most_awaiting"] for r in replies[:6]) >= 6
    # a caller that leaves cancels its coroutine (the handler sees CancelledError), and the
    # worker serves on
    with pytest.raises(OSError):  # urllib's timeout: the client gives up and disconnects
        http("POST", server.url("inference", "/predictions/afn"), b'{"x": 5, "hang": 60}',
             {"Content-Type": "application/json"}, timeout=1)  # fmt: skip
    wait_until(lambda: server.predict("afn", {"x": 6}).json()["cancelled"] == 1, 20,
               "the handler to see its coroutine cancelled")  # fmt: skip
    # streams of batches running at once reach their own callers, whole and in order
    streams = concurrently(*(lambda i=i: server.predict("afn", {"x": i, "stream": 4})
                             for i in range(3)))  # fmt: skip
    assert [(r.status, r.body.decode()) for r in streams] == [
        (200, "".join(f"{i}.{k};" for k in range(4)) + f"{i}.end") for i in range(3)
    ]

    # TorchServe's own async test handler, in shape: a BaseHandler subclass
    replies = concurrently(*(lambda i=i: server.predict("acls", str(i),
                                                        headers={"Content-Type": "application/json"})
                             for i in range(6)))  # fmt: skip
    assert [(r.status, r.json()) for r in replies] == [(200, 2 * i) for i in range(6)]
