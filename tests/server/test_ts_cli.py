"""A TorchServe deployment started with ``mserve`` in place of ``torchserve``: its
config.properties, TS_ variables, start flags and config snapshot; registration parameters and
the ``url_path`` of paths after the version (real servers, real workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.conftest import MSERVE, Server, http, pid_alive

Started = Callable[..., tuple[Server | None, subprocess.CompletedProcess[str]]]

FREE_PORTS = (
    "inference_address=http://127.0.0.1:0\n"
    "management_address=http://127.0.0.1:0\n"
    "metrics_address=http://127.0.0.1:0\n"
    "grpc_inference_port=0\n"
    "grpc_management_port=0\n"
)


@pytest.fixture
def ts_start(tmp_path: Path) -> Iterator[Started]:
    """Start ``mserve`` with the given arguments only (no YAML config): what a TorchServe user's
    command line becomes. Stopped at teardown."""
    started: list[Server] = []

    def start(
        *args: str, env: dict[str, str] | None = None, run_dir: Path | None = None
    ) -> tuple[Server | None, ...]:
        run_dir = run_dir or tmp_path / f"run{len(started)}"
        server_env = {
            k: v
            for k, v in os.environ.items()
            if k != "CUDA_VISIBLE_DEVICES" and not k.startswith(("TS_", "MSERVE_"))
        }
        server_env.update(env or {})  # fmt: skip
        out = subprocess.run(
            [MSERVE, "--start", "--run-dir", str(run_dir), *args], capture_output=True,
            text=True, timeout=300, env=server_env, cwd=tmp_path,
        )  # fmt: skip
        if out.returncode != 0:
            return None, out
        server = Server(run_dir, json.loads((run_dir / "status.json").read_text()))
        started.append(server)
        return server, out

    yield start
    for server in started:
        if pid_alive(server.pid):
            server.cli("--stop")
        if pid_alive(server.pid):
            os.kill(server.pid, signal.SIGKILL)


@pytest.fixture
def free_ports(tmp_path: Path) -> tuple[str, str]:
    """``--config`` with a YAML of free ports, for tests that are not about the properties
    file."""
    path = tmp_path / "ports.yaml"
    path.write_text(
        "inference_address: 127.0.0.1:0\nmanagement_address: 127.0.0.1:0\n"
        "metrics_address: 127.0.0.1:0\n"
        + "grpc_inference_address: 127.0.0.1:0\ngrpc_management_address: 127.0.0.1:0\n"
    )
    return ("--config", str(path))


def describe(server: Server, model: str) -> dict:  # type: ignore[type-arg]
    reply = server.manage("GET", f"/models/{model}")
    assert reply.status == 200, reply.body
    return reply.json()[0]  # type: ignore[no-any-return]


def test_config_properties_drives_the_server(
    tmp_path: Path, make_archive: Callable[..., Path], ts_start: Started
) -> None:
    make_archive("url_path", "url_path", "paths")
    make_archive("echo_fn", "echo", "echo")
    (tmp_path / "config.properties").write_text(
        "# a TorchServe config, unchanged\n" + FREE_PORTS + "model_store=store\n"
        "load_models=paths.mar,echo.mar\n"
        "job_queue_size=7\n"
        "number_of_netty_threads=4\n"
        "vmargs=-Xmx4g -XX:+UseContainerSupport\n"
        "models={\\\n"
        '  "paths": {\\\n'
        '    "1.0": {"minWorkers": 2, "maxWorkers": 3, "batchSize": 4, "maxBatchDelay": 20,\\\n'
        '            "responseTimeout": 30}\\\n'
        "  }\\\n"
        "}\n"
    )
    server, out = ts_start("--ts-config", "config.properties")
    assert server is not None, out.stdout + out.stderr
    assert out.stderr.count("warning") == 1
    assert (
        "config.properties: these TorchServe keys have no effect on mserve (JVM, Netty, gRPC,"
        " plugins and other TorchServe-only parts; see docs/migration.md):"
        " number_of_netty_threads, vmargs"
    ) in out.stderr
    paths = describe(server, "paths")
    assert (paths["minWorkers"], paths["maxWorkers"], paths["batchSize"]) == (2, 3, 4)
    assert (paths["maxBatchDelay"], paths["responseTimeout"], paths["jobQueueSize"]) == (20, 30, 7)
    assert paths["settingSources"]["batch_size"] == "models"
    assert len(paths["workers"]) == 2
    echo = describe(server, "echo")  # no models entry: the server's defaults
    assert (echo["batchSize"], echo["minWorkers"]) == (1, 1)
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "these TorchServe keys have no effect on mserve" in log


def test_ts_variables_with_enable_envvars_config(
    tmp_path: Path, make_archive: Callable[..., Path], ts_start: Started
) -> None:
    make_archive("echo_fn", "echo", "echo")
    (tmp_path / "ts.properties").write_text(
        FREE_PORTS + "enable_envvars_config=true\nmodel_store=nowhere\njob_queue_size=3\n"
    )
    env = {
        "TS_CONFIG_FILE": str(tmp_path / "ts.properties"),
        "TS_MODEL_STORE": str(tmp_path / "store"),
        "TS_LOAD_MODELS": "echo.mar",
        "TS_JOB_QUEUE_SIZE": "9",
    }
    server, out = ts_start(env=env)
    assert server is not None, out.stdout + out.stderr
    assert describe(server, "echo")["jobQueueSize"] == 9


def test_torchserve_snapshot_brings_the_models_back(
    tmp_path: Path, make_archive: Callable[..., Path], ts_start: Started
) -> None:
    store = tmp_path / "store"
    make_archive("echo_fn", "echo", "echo").rename(store / "echo_v1.mar")
    make_archive("echo_fn", "echo", "echo", "--version", "2.0").rename(store / "echo_v2.mar")
    make_archive("url_path", "url_path", "paths")
    snapshots = tmp_path / "logs" / "config"
    snapshots.mkdir(parents=True)
    (snapshots / "20240101120000000-startup.cfg").write_text("model_snapshot={}\n")
    # As TorchServe's FSSnapshotSerializer writes it: java.util.Properties.store of the whole
    # config, the snapshot as pretty-printed JSON with its newlines and colons escaped.
    (snapshots / "20240301093015123-snapshot.cfg").write_text(
        "#Saving snapshot\n"
        "#Fri Mar 01 09:30:15 UTC 2024\n"
        "inference_address=http\\://127.0.0.1\\:0\n"
        "management_address=http\\://127.0.0.1\\:0\n"
        "metrics_address=http\\://127.0.0.1\\:0\n"
        "grpc_inference_port=0\ngrpc_management_port=0\n"
        "load_models=paths.mar\n"
        "model_snapshot={\\n"
        '  "name"\\: "20240301093015123-snapshot.cfg",\\n'
        '  "modelCount"\\: 2,\\n'
        '  "models"\\: {\\n'
        '    "echo"\\: {\\n'
        '      "1.0"\\: {\\n'
        '        "defaultVersion"\\: false,\\n'
        '        "marName"\\: "echo_v1.mar",\\n'
        '        "minWorkers"\\: 1,\\n'
        '        "maxWorkers"\\: 1,\\n'
        '        "batchSize"\\: 1,\\n'
        '        "maxBatchDelay"\\: 100,\\n'
        '        "responseTimeout"\\: 120,\\n'
        '        "runtimeType"\\: "python"\\n'
        "      },\\n"
        '      "2.0"\\: {\\n'
        '        "defaultVersion"\\: true,\\n'
        '        "marName"\\: "echo_v2.mar",\\n'
        '        "minWorkers"\\: 2,\\n'
        '        "maxWorkers"\\: 3,\\n'
        '        "batchSize"\\: 4,\\n'
        '        "maxBatchDelay"\\: 50,\\n'
        '        "responseTimeout"\\: 30,\\n'
        '        "runtimeType"\\: "python"\\n'
        "      }\\n"
        "    }\\n"
        "  }\\n"
        "}\n"
        f"model_store={store}\n"
        "tsConfigFile=config.properties\n"
        "python=/usr/bin/python3\n"
        "number_of_gpu=0\n"
        "NUM_WORKERS=1\n"
        f"workflow_store={store}\n"
        "version=0.12.0\n"
    )
    server, out = ts_start("--ts-config", "logs/config")  # a folder: its newest snapshot
    assert server is not None, out.stdout + out.stderr
    # no effect here (workflow_store has one: the workflow store); bookkeeping keys are quiet
    assert "TorchServe-only parts; see docs/migration.md): python\n" in out.stderr
    versions = {d["modelVersion"]: d for d in server.manage("GET", "/models/echo/all").json()}
    assert set(versions) == {"1.0", "2.0"}
    v2 = versions["2.0"]
    assert (v2["minWorkers"], v2["maxWorkers"], v2["batchSize"]) == (2, 3, 4)
    assert (v2["maxBatchDelay"], v2["responseTimeout"], len(v2["workers"])) == (50, 30, 2)
    assert v2["settingSources"]["batch_size"] == "api"  # recorded values win over the archive's
    assert describe(server, "echo")["modelVersion"] == "2.0"  # the default version
    assert server.predict("echo", "hi").body == b"hi"
    # with a snapshot, load_models is not used (TorchServe's rule)
    assert server.manage("GET", "/models/paths").status == 404

    # mserve's own snapshot takes over from there: a restart keeps a change made since
    assert server.manage("PUT", "/models/echo/2.0?min_worker=1&synchronous=true").status == 200
    server.cli("--stop")
    again, out = ts_start("--ts-config", "logs/config", run_dir=server.run_dir)
    assert again is not None, out.stdout + out.stderr
    assert describe(again, "echo")["minWorkers"] == 1


def test_url_path_reaches_the_handler(
    make_archive: Callable[..., Path], ts_start: Started, free_ports: tuple[str, str]
) -> None:
    make_archive("url_path", "url_path", "paths")
    server, out = ts_start("--models", "paths.mar", "--model-store", "store", *free_ports)
    assert server is not None, out.stdout + out.stderr

    def post(path: str, headers: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
        reply = http("POST", server.url("inference", path), b"hi",
                     {**server.auth("inference"), **(headers or {})})  # fmt: skip
        assert reply.status == 200, reply.body
        return reply.json()  # type: ignore[no-any-return]

    assert post("/predictions/paths/1.0/v1/chat/completions")["url_path"] == "v1/chat/completions"
    assert post("/predictions/paths/1.0/v1/models/")["url_path"] == "v1/models"
    assert post("/explanations/paths/1.0/a/b")["url_path"] == "a/b"
    assert post("/predictions/paths")["url_path"] == ""
    assert post("/predictions/paths/1.0", {"url_path": "forged"})["url_path"] == ""
    # as in TorchServe, the segment after the model is always its version
    reply = http("POST", server.url("inference", "/predictions/paths/v1/chat/completions"), b"x",
                 server.auth("inference"))  # fmt: skip
    assert reply.status == 404
    assert reply.json()["message"] == "Model version v1 does not exist for model paths"


def test_registration_startup_timeout_and_runtime(
    make_archive: Callable[..., Path], ts_start: Started, free_ports: tuple[str, str]
) -> None:
    make_archive("echo_fn", "echo", "echo")
    make_archive("slow_load", "slow:handle", "slow")
    server, out = ts_start("--model-store", "store", "--enable-model-api", *free_ports)
    assert server is not None, out.stdout + out.stderr
    reply = server.manage("POST", "/models?url=echo.mar&startup_timeout=33&runtime=python3")
    assert reply.status == 200, reply.body
    echo = describe(server, "echo")
    assert (echo["startupTimeout"], echo["runtime"]) == (33, "python3")
    assert echo["settingSources"]["startup_timeout_s"] == "api"

    reply = server.manage("POST", "/models?url=slow.mar&startup_timeout=1")
    assert reply.status == 400
    assert "did not load its handler within startup_timeout_s=1" in reply.json()["message"]

    for query, message in [
        ("runtime=java", "Invalid RuntimeType value: java (expected one of python, python2,"
                         " python3)"),
        ("runtime=LSP", "runtime LSP (TorchServe's C++ backend) is not supported by mserve"),
        ("startup_timeout=soon", "parameter 'startup_timeout' should be an integer, found 'soon'"),
        ("startup_timeout=0", "parameter 'startup_timeout' should be >= 1, found 0"),
    ]:  # fmt: skip
        reply = server.manage("POST", f"/models?url=echo.mar&model_name=e2&{query}")
        assert (reply.status, reply.json()["message"]) == (400, message)


def test_missing_model_store_is_an_error_at_start(tmp_path: Path, ts_start: Started) -> None:
    server, out = ts_start("--model-store", "nowhere")
    assert server is None and out.returncode == 1
    assert out.stderr.strip() == (
        f"mserve: model store nowhere does not exist ({tmp_path / 'nowhere'})"
    )
    (tmp_path / "afile").write_text("")
    (tmp_path / "c.properties").write_text("model_store=afile\n")
    server, out = ts_start("--ts-config", "c.properties")
    assert server is None
    assert out.stderr.strip() == f"mserve: model store afile is not a folder ({tmp_path / 'afile'})"
    # a log folder that cannot be made (mserve's layout; TorchServe's logs to its console
    # instead): a start error naming it and why, daemon or foreground, not a traceback
    logs = (tmp_path / "afile" / "logs").resolve()
    for foreground in ((), ("--foreground",)):
        server, out = ts_start("--model-store", ".", "--log-dir", "afile/logs", *foreground)
        assert server is None and out.returncode == 1
        assert out.stderr.strip() == (
            f"mserve: log folder {logs} cannot be used ({logs.parent} is a file, not a folder):"
            " set log_dir (--log-dir, MSERVE_LOG_DIR) to a folder the server can make and write"
            " in"
        )


def test_start_flag_errors_and_warnings(
    tmp_path: Path, ts_start: Started, free_ports: tuple[str, str]
) -> None:
    server, out = ts_start("--ts-config", "missing.properties")
    assert (server, out.stderr.strip()) == (
        None, "mserve: --ts-config file not found: missing.properties"
    )  # fmt: skip
    server, out = ts_start(env={"TS_CONFIG_FILE": "gone.properties"})
    assert out.stderr.strip() == "mserve: TS_CONFIG_FILE file not found: gone.properties"
    server, out = ts_start("--log-config", "log4j2.xml")
    assert out.stderr.strip() == "mserve: --log-config file not found: log4j2.xml"
    (tmp_path / "c.properties").write_text("inference_address=https://127.0.0.1:8443\n")
    server, out = ts_start("--ts-config", "c.properties")
    assert out.stderr.strip() == (
        "mserve: inference_address is https://127.0.0.1:8443: serving https needs"
        " certificate_file and private_key_file (PEM files)"
    ) and server is None  # fmt: skip

    server, out = ts_start("--workflow-store", "wf")  # TorchServe's launcher checks it too
    assert out.stderr.strip() == "mserve: --workflow-store directory not found: wf"
    (tmp_path / "wf").mkdir()  # where POST /workflows finds a .war by name (test_workflows.py)
    (tmp_path / "log4j2.xml").write_text("<Configuration/>")
    server, out = ts_start(
        "--log-config", "log4j2.xml", "--workflow-store", "wf", "--plugins-path", "plugins",
        "--disable-token-auth", "--enable-model-api", "--ncs", *free_ports,
    )  # fmt: skip
    assert server is not None, out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        "mserve: warning: --log-config log4j2.xml is not used: mserve logs with Python's logging"
        " (--log-dir)",
        "mserve: warning: --plugins-path plugins is not used: mserve loads no Java plugins",
    ]
    version = subprocess.run([MSERVE, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("mserve ")
