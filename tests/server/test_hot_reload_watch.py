"""``mserve --watch`` (docs/hot-reload.md): a change to a folder model's handler file reloads it
on the live server, a broken one is logged and the old code serves on. One real server with
--watch, the model registered from a folder the test edits; waits are bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import wait_until
from tests.server.test_hot_reload import SOURCE, answers, edit, folder_model, start, stop

pytestmark = pytest.mark.timeout(120)


def test_a_changed_handler_file_is_reloaded_and_a_broken_one_is_not(tmp_path: Path) -> None:
    handler = folder_model(tmp_path, "hot") / "handler.py"
    server = start(tmp_path, ("--watch",))
    try:
        reply = server.manage("POST", "/models?url=hot&initial_workers=1&synchronous=true")
        assert reply.status == 200, reply.body
        assert {a["answer"] for a in answers(server, 2)} == {"v1"}
        edit(handler, "watched")
        wait_until(lambda: answers(server, 1)[0]["answer"] == "watched", 30, "the reload")
        assert answers(server, 2)[0]["loads"] == 1  # the same worker, the weights kept
        log = server.run_dir / "logs" / "mserve.log"
        wait_until(lambda: "handler code reloaded (watch) on 1 worker(s)" in log.read_text(), 10)
        assert f"model hot:1.0: {handler} changed; reloading its handler" in log.read_text()
        handler.write_text(SOURCE + "\ndef broken(:\n")
        wait_until(lambda: "hot reload (watch) failed, the old code serves on" in log.read_text(),
                   30, "the failed reload's log line")  # fmt: skip
        assert "SyntaxError: invalid syntax (handler.py, line " in log.read_text()
        assert {a["answer"] for a in answers(server, 2)} == {"watched"}
    finally:
        stop(server)
