"""``mserve top`` in a real terminal: tmux runs it against a server under load, and the test
reads the screen (``tmux capture-pane``) while pressing keys."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server.conftest import MSERVE, Server, wait_until


def test_top_says_when_no_server_runs(tmp_path: Path) -> None:
    out = subprocess.run([MSERVE, "top", "--run-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 3
    assert out.stderr.strip() == f"mserve: mserve is not running (run dir {tmp_path.resolve()})"


class Tmux:
    """One tmux server of the test's own (its socket in the test's folder)."""

    def __init__(self, folder: Path, command: list[str]) -> None:
        self.socket = str(folder / "tmux.sock")
        self._tmux("new-session", "-d", "-s", "top", "-x", "180", "-y", "45", *command)

    def _tmux(self, *args: str) -> str:
        # the terminal's own size, not one the test runner's environment may carry
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        out = subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True,
                             text=True, timeout=10, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def wait_for(self, check: Callable[[str], bool], what: str) -> str:
        seen: list[str] = [""]

        def ok() -> bool:
            seen[0] = self.screen()
            return check(seen[0])

        try:
            wait_until(ok, 20, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n{seen[0]}") from None
        return seen[0]

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=10)


def _row(screen: str, model: str) -> int:
    """The screen line of a model's row (-1: none)."""
    lines = screen.splitlines()
    return next((i for i, line in enumerate(lines) if line.strip().startswith(f"{model} ")), -1)


@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="needs tmux (scripts/test.sh installs it with apt-get)")  # fmt: skip
def test_top_shows_models_sorts_and_opens_one(
    tmp_path: Path, make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> None:
    make_archive("echo_fn", "echo", "alpha")
    make_archive("echo_fn", "echo", "busy")
    server = start_server("alpha=alpha.mar", "busy=busy.mar")
    stop = threading.Event()

    def load() -> None:  # busy gets the traffic; alpha one request
        server.predict("alpha", "a")
        while not stop.is_set():
            server.predict("busy", "b")

    loader = threading.Thread(target=load)
    loader.start()
    tmux = Tmux(tmp_path, [MSERVE, "top", "--run-dir", str(server.run_dir)])
    try:
        screen = tmux.wait_for(lambda s: _row(s, "alpha") >= 0 and _row(s, "busy") >= 0,
                               "both model rows")  # fmt: skip
        assert f"pid {server.pid}" in screen
        assert server.status["urls"]["inference"] in screen
        assert "MODEL ▼" in screen  # sorted by name at first: alpha above busy
        assert _row(screen, "alpha") < _row(screen, "busy")
        assert "ready" in screen.splitlines()[_row(screen, "busy")]
        # r: by requests per second, busiest first
        tmux.keys("r")
        screen = tmux.wait_for(
            lambda s: "REQ/S ▼" in s and 0 <= _row(s, "busy") < _row(s, "alpha"),
            "busy sorted above alpha by requests/s",
        )
        busy = screen.splitlines()[_row(screen, "busy")].split()
        assert float(busy[5]) > 1.0  # REQ/S under load
        # Enter opens the picked (top) row: its version and workers, with the worker's pid
        tmux.keys("Enter")
        pid = str(server.worker_pids("busy")[0])
        screen = tmux.wait_for(lambda s: "model busy:" in s and pid in s, "the busy model opened")
        assert "WORKER" in screen and "version 1.0: READY (loaded)" in screen
        tmux.keys("Escape")
        tmux.wait_for(lambda s: "REQ/S ▼" in s, "back to the table")
        tmux.keys("q")
        wait_until(lambda: subprocess.run(["tmux", "-S", tmux.socket, "has-session", "-t", "top"],
                                          capture_output=True, timeout=10).returncode != 0,
                   10, "mserve top to quit on q")  # fmt: skip
    finally:
        stop.set()
        loader.join(timeout=30)
        tmux.close()
