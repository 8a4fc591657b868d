"""Real mserve servers for end-to-end tests: daemon start, free ports, stop on teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from archiver import __version__  # noqa: F401  (the package under test is importable)
from tests.conftest import ARCHIVER_SCRIPT

HANDLERS = Path(__file__).resolve().parent.parent / "handlers"
MSERVE = str(Path(sys.executable).parent / "mserve")


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 60.0) -> Reply:  # fmt: skip
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, dict(exc.headers), exc.read())


@dataclass
class Server:
    run_dir: Path
    status: dict[str, Any]
    cli_args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return int(self.status["pid"])

    def url(self, api: str, path: str) -> str:
        return f"{self.status['urls'][api]}{path}"

    def key(self, kind: str) -> str:
        """A key from the server's key file ("management", "inference" or "API")."""
        return json.loads((self.run_dir / "key_file.json").read_text())[kind]["key"]

    def predict(self, model: str, body: bytes | dict[str, Any] | str, *, version: str | None = None,
                headers: dict[str, str] | None = None) -> Reply:  # fmt: skip
        path = f"/predictions/{model}" + (f"/{version}" if version else "")
        hdrs = dict(headers or {})
        if isinstance(body, dict):
            data, hdrs = json.dumps(body).encode(), {"Content-Type": "application/json", **hdrs}
        elif isinstance(body, str):
            data, hdrs = body.encode(), {"Content-Type": "text/plain", **hdrs}
        else:
            data = body
        return http("POST", self.url("inference", path), data, {**self.auth("inference"), **hdrs})

    def manage(self, method: str, path: str) -> Reply:
        return http(method, self.url("management", path), b"" if method != "GET" else None,
                    self.auth("management"))  # fmt: skip

    def auth(self, kind: str) -> dict[str, str]:
        """The Authorization header a client of this server sends for ``kind``'s API, read
        from the key file as a client script would (none when token authorization is off)."""
        if not self.status.get("token_authorization"):
            return {}
        return {"Authorization": f"Bearer {self.key(kind)}"}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [MSERVE, *args, "--run-dir", str(self.run_dir)], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip

    def worker_pids(self, model: str) -> list[int]:
        return [w["pid"] for w in self.manage("GET", f"/models/{model}").json()[0]["workers"]]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls at once, one thread each (a barrier lines them up so that they can share a
    batch); their results in order. Every call must return within two minutes."""
    results: list[Any] = [None] * len(calls)
    done = [False] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait(timeout=10)
        results[i] = calls[i]()
        done[i] = True

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(done), "a request got no reply"
    return results


def template_ready(server: Server) -> bool:
    """Whether the server's log says a warm worker template is ready to fork workers."""
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    return "worker template for" in log and "ready (pid" in log


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is as good as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def make_archive(tmp_path: Path) -> Callable[..., Path]:
    """Archive a fixture handler folder with the real model-archiver CLI."""
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)

    def make(folder: str, handler: str, name: str, *extra: str) -> Path:
        args = [
            ARCHIVER_SCRIPT, "--model-name", name, "--handler", handler,
            "--model-path", str(HANDLERS / folder), "--export-path", str(store), "-f", *extra,
        ]  # fmt: skip
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return store / f"{name}.mar"

    return make


def server_settings(store: Path, **overrides: Any) -> dict[str, Any]:
    """The settings test servers start from: every API on a free port of 127.0.0.1, the given
    model store, token authorization off (tests send no key) and the model API on;
    ``overrides`` add to them or replace them."""
    return {
        "inference_address": "127.0.0.1:0",
        "management_address": "127.0.0.1:0",
        "metrics_address": "127.0.0.1:0",
        "grpc_inference_address": "127.0.0.1:0",
        "grpc_management_address": "127.0.0.1:0",
        "model_store": str(store),
        "disable_token_authorization": True,
        "enable_model_api": True,
        **overrides,
    }


def start_daemon(config_file: Path, run_dir: Path, settings: dict[str, Any],
                 extra: tuple[str, ...] = (), timeout_s: float = 120) -> Server:  # fmt: skip
    """Write ``settings`` to ``config_file`` and start a daemon on it as an operator would
    (``mserve --start``), for module-scoped servers that outlive one test's ``start_server``;
    ``extra`` are more flags, kept out of the Server's ``cli_args`` (used again at a restart)."""
    config_file.write_text(yaml.safe_dump(settings))
    args = ["--config", str(config_file), "--run-dir", str(run_dir)]
    out = subprocess.run([MSERVE, "--start", *args, *extra], capture_output=True, text=True,
                         timeout=timeout_s)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return Server(run_dir, json.loads((run_dir / "status.json").read_text()), args)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*models: str, config: dict[str, Any] | None = None, expect_ok: bool = True,
              extra: tuple[str, ...] = (), run_dir: Path | None = None,
              env: dict[str, str | None] | None = None) -> Server:  # fmt: skip
        """``env`` adds to the server's environment (a name set to None is removed from it);
        CUDA_VISIBLE_DEVICES is unset unless it names it, so a developer's own setting cannot
        change which GPUs the tests see.

        Token authorization is off and the model API on unless ``config`` says otherwise: most
        tests are about serving, registering and scaling, and send no key;
        tests/server/test_auth.py starts servers with the secure defaults."""
        run_dir = run_dir or tmp_path / f"run{len(started)}"
        settings = server_settings(tmp_path / "store", **(config or {}))
        (tmp_path / "store").mkdir(exist_ok=True)
        cfg = tmp_path / f"mserve{len(started)}.yaml"
        cfg.write_text(yaml.safe_dump(settings))
        args = ["--start", "--config", str(cfg), "--run-dir", str(run_dir), *extra]
        if models:
            args += ["--models", *models]
        given = env or {}
        server_env = {k: v for k, v in os.environ.items()
                      if k != "CUDA_VISIBLE_DEVICES" and k not in given}  # fmt: skip
        server_env.update({k: v for k, v in given.items() if v is not None})  # None: unset it
        out = subprocess.run(
            [MSERVE, *args], capture_output=True, text=True, timeout=300, env=server_env
        )
        if expect_ok:
            assert out.returncode == 0, out.stdout + out.stderr
        status = json.loads((run_dir / "status.json").read_text())
        server = Server(run_dir, status, ["--config", str(cfg)])
        server.start_output = out.stdout + out.stderr  # type: ignore[attr-defined]
        started.append(server)
        return server

    yield start
    for server in started:
        if pid_alive(server.pid):
            server.cli("--stop")
        if pid_alive(server.pid):
            os.kill(server.pid, signal.SIGKILL)
