"""The ``torchserve`` command (compat/torchserve) run exactly as TorchServe's own launcher and
test utilities run TorchServe: ``torchserve --start ...`` in a working folder, its stdout read
line by line until ``Model server started.``, its files read from where TorchServe leaves them
(key_file.json there, logs/, logs/config/), ``torchserve --stop [--foreground]``.

Only the run dir (pid, status, unpack cache) is moved, to a folder of the test's own with
``MSERVE_RUN_DIR``, and listeners take free ports (port 0 in config.properties, the bound ones
read from the status file), so that tests do not share a machine-wide server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from archiver import __version__
from server.ts_config import parse_properties
from tests.server.conftest import Reply, http, pid_alive, wait_until

TORCHSERVE = str(Path(sys.executable).parent / "torchserve")
REPO = Path(__file__).resolve().parents[2]
PROPERTIES = """\
inference_address=http://127.0.0.1:0
management_address=http://127.0.0.1:0
metrics_address=http://127.0.0.1:0
grpc_inference_port=0
grpc_management_port=0
"""


class Console:
    """The launcher's stdout and stderr, read line by line by a thread as TorchServe's test
    utilities read them (the server keeps writing there after the launcher returns).

    ``launcher``: the ``torchserve --start`` process; its ``poll()`` is taken the moment
    ``Model server started`` is read, as TorchServe's ``ts_scripts/tsutils.py`` takes its
    verdict (``started_poll``)."""

    def __init__(self, stream: IO[str], launcher: subprocess.Popen[str] | None = None) -> None:
        self.lines: list[str] = []
        self.closed = threading.Event()
        self.launcher = launcher
        self.started_poll: int | None = None
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if self.launcher is not None and "Model server started" in line:
                self.started_poll = self.launcher.poll()
                self.launcher = None
            self.lines.append(line.rstrip("\n"))
        self.closed.set()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, proc: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
        """Until ``text`` is on the console; ``proc``, the launcher, failing ends the wait."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            code = proc.poll()
            assert code in (None, 0), f"torchserve --start exited with {code}:\n{self.text}"
            assert time.monotonic() < deadline, f"no {text!r} on the console:\n{self.text}"
            time.sleep(0.05)


class TorchServeDir:
    """A folder TorchServe is run from, and the ``torchserve`` command run in it."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.run_dir = Path(env["MSERVE_RUN_DIR"])
        self.consoles: list[Console] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> Console:
        proc = subprocess.Popen(
            [TORCHSERVE, "--start", *args], cwd=self.root, env={**self.env, **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        console = Console(proc.stdout, proc)
        self.consoles.append(console)
        console.wait_for("Model server started.", proc)
        # the launcher has exited 0 by the time the line is read: TorchServe's harness takes
        # poll() then as its verdict (None would be "TorchServe failed to start")
        assert console.started_poll == 0, console.text
        return console

    def command(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([TORCHSERVE, *args], cwd=self.root, env=self.env, text=True,
                              capture_output=True, timeout=120)  # fmt: skip

    @property
    def status(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "status.json").read_text())

    def key(self, kind: str) -> str:
        return json.loads((self.root / "key_file.json").read_text())[kind]["key"]

    def call(self, api: str, method: str, path: str, body: bytes | None = None) -> Reply:
        kind = "inference" if api == "inference" else "management"
        headers = {"Authorization": f"Bearer {self.key(kind)}"}
        if body:  # a body without a type is a form to TorchServe (urllib's default type)
            json_body = body.startswith(b"{")
            headers["Content-Type"] = (
                "application/json" if json_body else "application/octet-stream"
            )
        if body is None and method in ("POST", "PUT", "DELETE"):
            body = b""
        return http(method, f"{self.status['urls'][api]}{path}", body, headers)

    def workers(self, model: str) -> tuple[int, int, int]:
        """(minWorkers, maxWorkers, workers running) from describe."""
        described = self.call("management", "GET", f"/models/{model}").json()[0]
        return described["minWorkers"], described["maxWorkers"], len(described["workers"])

    def snapshots(self, log_dir: Path | None = None) -> list[str]:
        folder = (log_dir or self.root / "logs") / "config"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def torchserve_env(run_dir: Path) -> dict[str, str]:
    """The environment a test's ``torchserve`` runs in: this one without mserve's, TorchServe's
    and the log-location variables, no GPU, and a run dir of the test's own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MSERVE_", "TS_")) and k not in ("LOG_LOCATION", "METRICS_LOCATION")}  # fmt: skip
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["MSERVE_RUN_DIR"] = str(run_dir)
    return env


@pytest.fixture
def ts_dir(tmp_path: Path, make_archive: Callable[..., Path]) -> Iterator[TorchServeDir]:
    root = tmp_path / "serve"
    root.mkdir()
    (root / "config.properties").write_text(PROPERTIES)
    env = torchserve_env(tmp_path / "run")
    make_archive("console_print", "printer:handle", "printer")
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("probe", "probe:handle", "probe")
    make_archive("bad_import", "broken", "broken")
    (root / "model_store").symlink_to(tmp_path / "store")
    served = TorchServeDir(root, env)
    yield served
    pid = _pid(served.run_dir)
    if pid is not None and pid_alive(pid):
        served.command("--stop", "--foreground")


def _pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "mserve.pid").read_text())
    except (OSError, ValueError):
        return None


def test_started_as_torchserve_is_its_files_console_and_stop(ts_dir: TorchServeDir) -> None:
    console = ts_dir.start("--ncs", "--model-store", "model_store", "--models",
                           "printer=printer.mar", "--ts-config", "config.properties")  # fmt: skip
    root = ts_dir.root
    # the worker's own output is on the console, as TorchServe's MODEL_LOG lines
    loaded = [line for line in console.lines if "printer handler loaded as printer" in line]
    assert loaded and "MODEL_LOG" in loaded[0] and "W-" in loaded[0], console.text
    assert console.lines.index(loaded[0]) < console.lines.index("Model server started.")

    # key_file.json where TorchServe writes it, mode 0600 still
    key_file = root / "key_file.json"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    keys = json.loads(key_file.read_text())
    assert {"inference", "management", "API"} <= set(keys)
    assert not (ts_dir.run_dir / "key_file.json").exists()
    reply = ts_dir.call("inference", "POST", "/predictions/printer", b"hello")
    assert (reply.status, reply.body) == (200, b"hello")
    bare = http("POST", f"{ts_dir.status['urls']['inference']}/predictions/printer", b"x")
    # keys are required, as in TorchServe 0.12, which refuses a call without one with a 400
    assert (bare.status, bare.json()["type"]) == (400, "InvalidKeyException")
    # the file the keys are in, in the folder the server was started from (the temp folder's
    # part of the path redacted, as server paths are in every answer)
    message = bare.json()["message"]
    assert message.startswith("token authorization is on: send the inference key as"), message
    in_tmp = key_file.relative_to(tempfile.gettempdir())
    assert message.endswith(f"(the keys are in <tmp>/{in_tmp})"), message

    refused = ts_dir.call("management", "POST", "/models?url=echo.mar")  # model API is off
    assert (refused.status, refused.json()) == (405, {
        "code": 405, "type": "MethodNotAllowedException",
        "message": "Requested method is not allowed, please refer to API document."})  # fmt: skip

    # TorchServe's log files under logs/, in its formats; metrics_mode log is its default
    logs = root / "logs"
    wait_until(lambda: '"POST /predictions/printer HTTP/1.1" 200' in _read(logs / "access_log.log"),
               10, "the request in access_log.log")  # fmt: skip
    wait_until(lambda: "printer got 1 request(s)" in _read(logs / "model_log.log"), 10,
               "the handler's print in model_log.log")  # fmt: skip
    wait_until(lambda: "Requests2XX.Count:1" in _read(logs / "ts_metrics.log"), 10,
               "Requests2XX in ts_metrics.log")  # fmt: skip
    assert "MODEL_LOG - printer got 1 request(s)" in _read(logs / "model_log.log")
    assert "inference API listening on" in _read(logs / "ts_log.log")
    assert (logs / "model_metrics.log").is_file()
    assert (
        not (ts_dir.run_dir / "logs").exists() and not (ts_dir.run_dir / "snapshot.json").exists()
    )
    assert ts_dir.snapshots() == []  # --ncs: no config snapshots

    again = ts_dir.command("--start", "--ncs", "--ts-config", "config.properties")
    assert again.returncode == 1
    assert "TorchServe is already running, please use torchserve --stop to stop TorchServe." in (
        again.stdout + again.stderr)  # fmt: skip

    pid = ts_dir.status["pid"]
    stopped = ts_dir.command("--stop", "--foreground")
    # with --foreground TorchServe's launcher says nothing once the server has stopped
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (0, "", "")
    assert not pid_alive(pid)  # every --stop waits until the server is gone
    assert console.closed.wait(10)  # and with it the console's last writer
    assert not key_file.exists()
    assert ts_dir.command("--stop").stdout.strip() == "TorchServe is not currently running."


def test_log_and_metrics_locations(ts_dir: TorchServeDir, tmp_path: Path) -> None:
    logs, metrics = tmp_path / "var" / "log" / "ts", tmp_path / "var" / "metrics"
    ts_dir.start("--model-store", "model_store", "--models", "echo.mar", "--ts-config",
                 "config.properties", env={"LOG_LOCATION": str(logs),
                                           "METRICS_LOCATION": str(metrics)})  # fmt: skip
    assert ts_dir.call("inference", "POST", "/predictions/echo", b"x").status == 200
    wait_until(lambda: "Requests2XX" in _read(metrics / "ts_metrics.log"), 10, "ts_metrics.log")
    wait_until(lambda: "/predictions/echo" in _read(logs / "access_log.log"), 10, "access_log.log")
    assert (logs / "ts_log.log").is_file() and (metrics / "model_metrics.log").is_file()
    assert not (logs / "ts_metrics.log").exists() and not (ts_dir.root / "logs").exists()
    assert [n.endswith("-startup.cfg") for n in ts_dir.snapshots(logs)] == [True]
    assert ts_dir.command("--stop", "--foreground").returncode == 0
    assert [n.rsplit("-", 1)[1] for n in ts_dir.snapshots(logs)] == ["startup.cfg", "shutdown.cfg"]


def test_a_log_location_that_cannot_be_made_leaves_the_console_only(
    ts_dir: TorchServeDir, tmp_path: Path
) -> None:
    """TorchServe starts when LOG_LOCATION cannot be written (log4j only complains): so does
    the ``torchserve`` command, logging to the console only, with one warning naming the
    folder; the config snapshots it cannot write are warned about, and it serves and stops."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # under a file: no folder, whoever runs the test
    logs = blocker / "logs"
    console = ts_dir.start("--model-store", "model_store", "--models", "echo.mar",
                           "--enable-model-api", "--ts-config", "config.properties",
                           env={"LOG_LOCATION": str(logs)})  # fmt: skip
    assert not any("Traceback" in line for line in console.lines), console.text
    warned = [line for line in console.lines if f"log folder {logs} cannot be used" in line]
    assert len(warned) == 1 and "[WARN ]" in warned[0], console.text
    assert "logging to the console only" in warned[0], warned[0]
    assert ts_dir.call("inference", "POST", "/predictions/echo", b"x").body == b"x"
    # a change would write a config snapshot: it cannot, which is said, and the call succeeds
    start = len(console.lines)
    scaled = ts_dir.call("management", "PUT", "/models/echo?min_worker=2&synchronous=true")
    assert scaled.status == 200, scaled.body
    wait_until(lambda: any("config snapshot" in line for line in console.lines[start:]), 10,
               "a line about the snapshot not written")  # fmt: skip
    assert ts_dir.command("--stop", "--foreground").returncode == 0
    assert blocker.read_text() == "not a folder"
    assert not any("Traceback" in line for line in console.lines), console.text
    # the next start looks for a snapshot to restore there: none, and it starts
    console = ts_dir.start("--model-store", "model_store", env={"LOG_LOCATION": str(logs)})
    assert not any("Traceback" in line for line in console.lines), console.text
    assert ts_dir.command("--stop", "--foreground").returncode == 0


def test_snapshots_restore_models_and_workers_across_a_stop_and_start(
    ts_dir: TorchServeDir,
) -> None:
    ts_dir.start("--model-store", "model_store", "--models", "printer=printer.mar",
                 "--enable-model-api", "--ts-config", "config.properties")  # fmt: skip
    first = ts_dir.snapshots()
    assert len(first) == 1 and first[0].endswith("-startup.cfg")

    # no initial_workers and none in the archive: 0 workers, as TorchServe registers it
    reply = ts_dir.call("management", "POST", "/models?url=echo.mar&model_name=zero")
    assert reply.json() == {
        "status": 'Model "zero" Version: 1.0 registered with 0 initial'
        " workers. Use scale workers API to add workers for the model."
    }
    assert ts_dir.workers("zero") == (0, 0, 0)
    reply = ts_dir.call("inference", "POST", "/predictions/zero", b"x")
    assert reply.status == 503 and reply.json()["message"] == (
        'Model "zero" has no worker to serve inference request. Please use scale workers API'
        " to add workers.")  # fmt: skip
    reply = ts_dir.call(
        "management",
        "POST",
        "/models?url=echo.mar&model_name=two&initial_workers=2&synchronous=true",
    )
    assert reply.status == 200 and ts_dir.workers("two") == (2, 2, 2)
    assert (
        ts_dir.call("management", "PUT", "/models/printer?min_worker=3&synchronous=true").status
        == 200
    )
    # every change is one more -snapshot.cfg, as TorchServe writes them
    assert [n.rsplit("-", 1)[1] for n in ts_dir.snapshots()] == [
        "startup.cfg", "snapshot.cfg", "snapshot.cfg", "snapshot.cfg"]  # fmt: skip

    # TorchServe's answers in its layout
    broken = ts_dir.call("management", "POST", "/models?url=broken.mar&initial_workers=1")
    assert broken.status == 500 and broken.json()["type"] == "InternalServerException"
    assert "No module named" in broken.json()["message"]
    ts_dir.call(
        "management",
        "POST",
        "/models?url=probe.mar&initial_workers=1&response_timeout=1&synchronous=true",
    )
    slow = ts_dir.call(
        "inference",
        "POST",
        "/predictions/probe",
        json.dumps({"cmd": "sleep", "s": 5}).encode(),
    )
    assert slow.status == 500 and slow.json()["type"] == "InternalServerException", slow.body
    assert ts_dir.call("management", "DELETE", "/models/probe").json() == {
        "status": 'Model "probe" unregistered'}  # fmt: skip

    # a stop that does not wait, then a start with no models named: the newest snapshot
    assert ts_dir.command("--stop").stdout.strip() == "TorchServe has stopped."
    ts_dir.start("--model-store", "model_store")
    assert ts_dir.snapshots()[-2].endswith("-shutdown.cfg")
    assert ts_dir.snapshots()[-1].endswith("-startup.cfg")
    assert ts_dir.workers("printer") == (3, 3, 3)
    assert ts_dir.workers("two") == (2, 2, 2)
    assert ts_dir.workers("zero") == (0, 0, 0)
    assert "probe" not in {
        m["modelName"] for m in ts_dir.call("management", "GET", "/models").json()["models"]
    }
    assert ts_dir.call("inference", "POST", "/predictions/two", b"back").body == b"back"
    # the config.properties keys rode along in the snapshot: the same (free) addresses again
    newest = ts_dir.root / "logs" / "config" / ts_dir.snapshots()[-1]
    props = {k: p.value for k, p in parse_properties(newest.read_text(), newest).items()}
    assert (
        props["grpc_inference_port"] == "0" and props["inference_address"] == "http://127.0.0.1:0"
    )


# TorchServe 0.12's own snapshot of a server with one model (store and ports adapted), as its
# FSSnapshotSerializer writes it: java.util.Properties with the JSON escaped
TORCHSERVE_SNAPSHOT = r"""#Saving snapshot
#Fri Mar 01 09:30:15 UTC 2024
inference_address=http\://127.0.0.1\:0
load_models=echo.mar
model_store={store}
management_address=http\://127.0.0.1\:0
grpc_inference_port=0
grpc_management_port=0
tsConfigFile=logs/config/20240301092950000-startup.cfg
metrics_address=http\://127.0.0.1\:0
number_of_netty_threads=32
NUM_WORKERS=1
job_queue_size=1000
model_snapshot={{\n  "name"\: "20240301093015123-snapshot.cfg",\n  "modelCount"\: 1,\n  "created"\: 1709285415123,\n  "models"\: {{\n    "echo"\: {{\n      "1.0"\: {{\n        "defaultVersion"\: true,\n        "marName"\: "echo.mar",\n        "minWorkers"\: 2,\n        "maxWorkers"\: 2,\n        "batchSize"\: 1,\n        "maxBatchDelay"\: 100,\n        "responseTimeout"\: 120,\n        "runtimeType"\: "python"\n      }}\n    }}\n  }}\n}}
version=0.12.0
"""


def test_a_torchserve_snapshot_starts_mserve_and_mserves_starts_it_again(
    ts_dir: TorchServeDir,
) -> None:
    config = ts_dir.root / "logs" / "config"
    config.mkdir(parents=True)
    store = (ts_dir.root / "model_store").resolve()
    (config / "20240301093015123-snapshot.cfg").write_text(TORCHSERVE_SNAPSHOT.format(store=store))
    ts_dir.start()  # no flags at all: TorchServe restores its newest snapshot
    assert ts_dir.workers("echo") == (2, 2, 2)
    assert ts_dir.call("inference", "POST", "/predictions/echo", b"hi").body == b"hi"
    assert ts_dir.command("--stop", "--foreground").returncode == 0

    # the snapshot mserve wrote at stop holds what TorchServe reads back, and restores
    shutdown = config / ts_dir.snapshots()[-1]
    assert shutdown.name.endswith("-shutdown.cfg")
    props = {k: p.value for k, p in parse_properties(shutdown.read_text(), shutdown).items()}
    state = json.loads(props["model_snapshot"])
    assert state["modelCount"] == 1 and state["name"] == shutdown.name
    mserve_only = {"startupTimeout": None, "batchWait": None, "weightsScan": None,
                   "archiveSignatures": None}  # fmt: skip
    assert state["models"]["echo"]["1.0"] | mserve_only == {
        "defaultVersion": True, "marName": "echo.mar", "minWorkers": 2, "maxWorkers": 2,
        "batchSize": 1, "maxBatchDelay": 100, "responseTimeout": 120, "runtimeType": "python",
        **mserve_only,
    }  # fmt: skip
    assert props["job_queue_size"] == "1000" and props["model_store"] == str(store)
    ts_dir.start()
    assert ts_dir.workers("echo") == (2, 2, 2)
    assert ts_dir.call("management", "GET", "/models/echo").json()[0]["jobQueueStatus"][
        "remainingCapacity"] == 1000  # fmt: skip


def test_the_commands_package_is_mserves_version() -> None:
    text = (REPO / "compat" / "torchserve" / "pyproject.toml").read_text()
    assert f'version = "{__version__}"' in text and f'"mserve=={__version__}"' in text
    out = subprocess.run([str(Path(sys.executable).parent / "torch-model-archiver"), "--help"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "--serialized-file" in out.stdout


def test_the_console_speaks_as_torchserve(
    ts_dir: TorchServeDir, make_archive: Callable[..., Path]
) -> None:
    make_archive("slow_load", "slow:handle", "slow")
    console = ts_dir.start("--ncs", "--model-store", "model_store", "--models", "echo.mar",
                           "--enable-model-api", "--ts-config", "config.properties")  # fmt: skip
    lines, urls = console.lines, ts_dir.status["urls"]
    # TorchServe's start-up banner: its log line, then one "Name: value" line per setting
    head = next(i for i, line in enumerate(lines) if line.endswith(
        "[INFO ] main org.pytorch.serve.ModelServer - "))  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} \[INFO \] main"
                        r" org\.pytorch\.serve\.ModelServer - ", lines[head])  # fmt: skip
    banner = dict(line.split(": ", 1) for line in lines[head + 1 : head + 36])
    assert list(banner)[:3] == ["Torchserve version", "TS Home", "Current directory"]
    assert banner["Torchserve version"] == f"{__version__} (mserve)"
    assert banner["Current directory"] == str(ts_dir.root.resolve())
    assert banner["Config file"] == "config.properties"
    assert banner["Inference address"] == urls["inference"]
    assert banner["Management address"] == urls["management"]
    assert banner["Model Store"] == str((ts_dir.root / "model_store").resolve())
    assert banner["Initial Models"] == "echo.mar"
    assert banner["Log dir"] == str(ts_dir.root.resolve() / "logs")
    assert banner["Number of CPUs"] == str(len(os.sched_getaffinity(0)))
    assert banner["Max heap size"] == "N/A (no JVM)"
    assert banner["Python executable"] == sys.executable
    assert banner["Model API enabled"] == "true"
    assert list(banner)[-1] == "Model API enabled" and len(banner) == 35
    # the lifecycle lines under TorchServe's logger names
    assert any(" main org.pytorch.serve.ModelServer - mserve " in line for line in lines)
    assert any(" org.pytorch.serve.wlm.ModelManager - " in line for line in lines)

    # a handler that does not load within startup_timeout: TorchServe's two lines
    query = "url=slow.mar&startup_timeout=1&initial_workers=1&synchronous=true"
    reply = ts_dir.call("management", "POST", f"/models?{query}")
    assert reply.status == 500, reply.body
    wait_until(lambda: any("Backend worker error" in line for line in console.lines), 10,
               "Backend worker error on the console")  # fmt: skip
    at = next(i for i, line in enumerate(console.lines) if "Backend worker error" in line)
    assert console.lines[at].endswith(" org.pytorch.serve.wlm.WorkerThread - Backend worker error")
    assert console.lines[at + 1] == ("org.pytorch.serve.wlm.WorkerInitializationException:"
                                     " Backend worker did not respond in given time")  # fmt: skip


def test_torch_model_archiver_speaks_as_itself(tmp_path: Path) -> None:
    """TorchServe's archiver prints nothing when it wrote the archive, and errors under its own
    name; mserve's ``model-archiver`` keeps its ``wrote ...`` line."""
    bin_dir = Path(sys.executable).parent
    handler = REPO / "tests" / "handlers" / "echo_fn" / "echo.py"

    def archive(command: str, *more: str) -> subprocess.CompletedProcess[str]:
        args = ["--model-name", "echo", "--handler", str(handler), "--export-path", str(tmp_path)]
        return subprocess.run([str(bin_dir / command), *args, *more], capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    done = archive("torch-model-archiver")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert (tmp_path / "echo.mar").is_file()
    again = archive("torch-model-archiver")
    assert again.returncode != 0 and again.stderr.startswith("torch-model-archiver: error: ")
    ours = archive("model-archiver", "--force")
    assert ours.returncode == 0 and ours.stdout.startswith(f"wrote {tmp_path / 'echo.mar'} (")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_a_start_that_fails_exits_non_zero_without_the_started_line(
    ts_dir: TorchServeDir,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = PROPERTIES.replace(":0\n", f":{port}\n", 1)  # the inference address
        (ts_dir.root / "busy.properties").write_text(busy)
        proc = subprocess.run(
            [TORCHSERVE, "--start", "--ncs", "--ts-config", "busy.properties"], cwd=ts_dir.root,
            env=ts_dir.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode != 0
    assert "address already in use" in proc.stderr, proc.stdout + proc.stderr
    assert "Model server started." not in proc.stdout + proc.stderr


def test_stop_returns_once_stopped_and_a_second_stop_waits_for_the_first(
    ts_dir: TorchServeDir,
) -> None:
    ts_dir.start("--model-store", "model_store", "--models", "probe=probe.mar",
                 "--ts-config", "config.properties")  # fmt: skip
    pid, key_file = ts_dir.status["pid"], ts_dir.root / "key_file.json"
    slow: list[Reply] = []
    request = threading.Thread(target=lambda: slow.append(ts_dir.call(
        "inference", "POST", "/predictions/probe", b'{"cmd": "sleep", "s": 2}')))  # fmt: skip
    request.start()
    wait_until(lambda: ts_dir.call("management", "GET", "/models/probe").json()[0]["workers"][0]
               ["state"] == "BUSY", 10, "a busy worker")  # fmt: skip
    first = subprocess.Popen([TORCHSERVE, "--stop"], cwd=ts_dir.root, env=ts_dir.env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    wait_until(lambda: ts_dir.status["state"] == "stopping", 10, "the server stopping")
    second = ts_dir.command("--stop")  # while the first waits for the in-flight request
    assert (second.returncode, second.stdout.strip()) == (0, "TorchServe has stopped.")
    assert not pid_alive(pid)  # "stopped" means stopped
    out, _ = first.communicate(timeout=60)
    assert (first.returncode, out.strip()) == (0, "TorchServe has stopped.")
    request.join(timeout=30)
    # one signal only: the server drained (the request answered), removed its keys and wrote
    # its shutdown snapshot, as after a single stop
    assert [r.status for r in slow] == [200], "the in-flight request was cut off"
    assert not key_file.exists()
    assert ts_dir.snapshots()[-1].endswith("-shutdown.cfg")
    assert ts_dir.command("--stop").stdout.strip() == "TorchServe is not currently running."


def test_a_forced_exit_leaves_no_keys_behind(ts_dir: TorchServeDir) -> None:
    ts_dir.start("--ncs", "--model-store", "model_store", "--models", "probe=probe.mar",
                 "--ts-config", "config.properties")  # fmt: skip
    key_file = ts_dir.root / "key_file.json"
    request = threading.Thread(target=lambda: _quietly(lambda: ts_dir.call(
        "inference", "POST", "/predictions/probe", b'{"cmd": "sleep", "s": 5}')))  # fmt: skip
    request.start()
    wait_until(lambda: ts_dir.call("management", "GET", "/models/probe").json()[0]["workers"][0]
               ["state"] == "BUSY", 10, "a busy worker")  # fmt: skip
    pid = ts_dir.status["pid"]
    os.kill(pid, signal.SIGTERM)  # drains: would wait for the 5 s request
    wait_until(lambda: ts_dir.status["state"] == "stopping", 10, "the server stopping")
    os.kill(pid, signal.SIGTERM)  # a second signal forces the exit
    wait_until(lambda: not pid_alive(pid), 5, "the forced exit")
    assert not key_file.exists()
    request.join(timeout=30)

    # SIGKILL leaves its key file; the next start, without keys, removes it
    ts_dir.start("--ncs", "--ts-config", "config.properties")
    os.kill(ts_dir.status["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(ts_dir.status["pid"]), 5, "the killed server gone")
    assert key_file.exists()
    ts_dir.start("--ncs", "--disable-token-auth", "--ts-config", "config.properties")
    assert not key_file.exists()


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(OSError):  # the forced exit drops the connection: expected
        call()
