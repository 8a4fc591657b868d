"""Workers confined to their own model (server/workers/sandbox.py, mserve_worker/confine.py):
hostile handlers, each in its own archive, against real kernel rules (Landlock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mserve_worker.confine import landlock_abi
from server.config import ServerConfig
from server.errors import InvalidModel
from server.workers.sandbox import Sandbox
from tests.server.conftest import Server, http

needs_landlock = pytest.mark.skipif(landlock_abi() < 4, reason="needs Landlock ABI 4+ (Linux)")
DENIED = ("[Errno 13] Permission denied", "[Errno 1] Operation not permitted")

ATTACKS = {  # archive name -> entry point of tests/handlers/hostile/hostile.py
    "key": "read_file", "peer_read": "read_file", "peer_write": "write_file",
    "outside": "write_file", "mgmt": "connect", "infer": "connect", "bind": "bind",
    "files": "open_files", "scratch": "scratch",
}  # fmt: skip


def _failed(server: Server, model: str, target: dict) -> str:
    """The error of a request the sandbox must refuse (the handler's OS error)."""
    reply = server.predict(model, target)
    assert reply.status == 500, (model, reply.body)
    return reply.json()["message"]


def _port(server: Server, api: str) -> int:
    return int(server.url(api, "").rstrip("/").rpartition(":")[2])


@needs_landlock
def test_hostile_handlers_are_refused_and_everyone_keeps_serving(
    make_archive, start_server, tmp_path: Path
) -> None:
    make_archive("echo_fn", "echo", "victim")
    limits = tmp_path / "limits.yaml"
    limits.write_text("sandbox:\n  maxOpenFiles: 64\n")
    for name, entry in ATTACKS.items():
        extra = ("--config-file", str(limits)) if name == "files" else ()
        make_archive("hostile", f"hostile:{entry}", name, *extra)
    models = [f"{name}={name}.mar" for name in ["victim", *ATTACKS]]
    server = start_server(*models, config={"disable_token_authorization": False})
    victim_dir = next(p.parent for p in (server.run_dir / "unpacked").glob("*/echo.py"))
    victim_pid = server.worker_pids("victim")[0]

    assert "Permission denied" in _failed(
        server, "key", {"path": str(server.run_dir / "key_file.json")}
    )
    message = _failed(server, "peer_read", {"path": str(victim_dir / "echo.py")})
    assert "Permission denied" in message and "echo.py" in message
    assert "Permission denied" in _failed(server, "peer_write", {"path": str(victim_dir / "x.py")})
    assert "Permission denied" in _failed(server, "outside", {"path": str(tmp_path / "owned")})
    for environ in (f"/proc/{server.pid}/environ", f"/proc/{victim_pid}/environ"):
        assert any(d in _failed(server, "key", {"path": environ}) for d in DENIED), environ
    for model, api in (("mgmt", "management"), ("infer", "inference")):
        assert "Permission denied" in _failed(server, model, {"port": _port(server, api)})
    assert "Permission denied" in _failed(server, "bind", {"port": 0})
    assert "Too many open files" in _failed(server, "files", {"count": 1000})
    assert not (victim_dir / "x.py").exists() and not (tmp_path / "owned").exists()

    # what a model may do: its scratch folder is its TMPDIR; no_new_privs is set
    reply = server.predict("scratch", {})
    assert reply.status == 200, reply.body
    done = json.loads(reply.body)
    assert done["no_new_privs"] is True
    assert done["tmp"].startswith(str(server.run_dir / "scratch" / "scratch-1.0"))
    # the server and the other models keep serving, with the same workers
    assert server.predict("victim", "still here").body == b"still here"
    assert server.worker_pids("victim") == [victim_pid]
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert (
        f"PermissionError: [Errno 13] Permission denied: '{server.run_dir / 'key_file.json'}'"
        in log
    )

    described = server.manage("GET", "/models/key").json()[0]
    worker = described["workers"][0]["sandbox"]
    applied = set(worker["applied"])
    assert {"no_new_privs", "landlock-files", "landlock-tcp", "core=0"} <= applied
    assert any(item.startswith("nofile=") for item in applied)
    assert worker["connect"] == [] and worker["bind"] == []
    assert described["sandbox"]["scratch"] == str(server.run_dir / "scratch" / "key-1.0")
    metrics = http("GET", server.url("metrics", "/metrics"), headers=server.auth("management"))
    assert 'mserve_worker_confined{model="key",version="1.0",worker=' in metrics.body.decode()
    status = server.cli("--status").stdout
    assert f"sandbox    on: Landlock ABI {landlock_abi()} (files and TCP ports)" in status
    assert "W-" in status and ": confined: " in status


@needs_landlock
def test_a_model_config_grants_paths_and_ports(make_archive, start_server, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "vocab.txt").write_text("words")
    listener = __import__("socket").create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = tmp_path / "grants.yaml"
    config.write_text(
        f"sandbox:\n  readPaths: [{shared}]\n  writePaths: [{tmp_path / 'out'}]\n"
        f"  connectPorts: [{port}]\n"
    )
    (tmp_path / "out").mkdir()
    for name, entry in (("reader", "read_file"), ("writer", "write_file"), ("caller", "connect")):
        make_archive("hostile", f"hostile:{entry}", name, "--config-file", str(config))
    server = start_server("reader=reader.mar", "writer=writer.mar", "caller=caller.mar")
    with listener:
        assert server.predict("reader", {"path": str(shared / "vocab.txt")}).body == b"words"
        assert server.predict("writer", {"path": str(tmp_path / "out" / "f")}).status == 200
        assert server.predict("caller", {"port": port}).body == b"connected"
    assert "Permission denied" in _failed(server, "writer", {"path": str(shared / "f")})
    granted = server.manage("GET", "/models/caller").json()[0]["sandbox"]
    assert granted["read"] == [str(shared)] and granted["connect"] == [port]


def test_sandbox_off_leaves_workers_unconfined_and_says_so(make_archive, start_server) -> None:
    make_archive("hostile", "hostile:scratch", "scratch")
    server = start_server("scratch=scratch.mar", config={"sandbox": False})
    assert server.predict("scratch", {}).status == 200
    described = server.manage("GET", "/models/scratch").json()[0]
    assert described["sandbox"] is None and described["workers"][0]["sandbox"] is None
    status = server.cli("--status").stdout
    assert "sandbox    off (sandbox: false)" in status
    assert "scratch:1.0 W-" in status and "not confined (sandbox off)" in status
    metrics = http("GET", server.url("metrics", "/metrics")).body.decode()
    assert 'mserve_worker_confined{model="scratch",version="1.0",worker=' in metrics
    assert (
        metrics.split('mserve_worker_confined{model="scratch"')[1].split("\n")[0].endswith(" 0.0")
    )


def _sandbox(tmp_path: Path, **config) -> Sandbox:
    return Sandbox(ServerConfig(run_dir=str(tmp_path / "run"), **config), abi=7)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("nope", "model config of m:1: sandbox must be a mapping of readPaths, writePaths,"),
        ({"readpaths": []}, "model config of m:1: sandbox has unknown keys readpaths (known:"),
        (
            {"readPaths": "/data"},
            "model config of m:1: sandbox.readPaths must be a list, got '/data'",
        ),
        ({"writePaths": ["data"]}, "sandbox.writePaths must hold absolute paths, got 'data'"),
        (
            {"connectPorts": [70000]},
            "sandbox.connectPorts must hold TCP ports (1-65535), got 70000",
        ),
        ({"bindPorts": [8081]}, "sandbox.bindPorts names 8081, one of the server's own ports"),
        ({"maxProcesses": 0}, "sandbox.maxProcesses must be a positive integer, got 0"),
    ],
)
def test_bad_model_config_grants_are_named(tmp_path: Path, section, message: str) -> None:
    with pytest.raises(InvalidModel) as err:
        _sandbox(tmp_path).model("m", "1", tmp_path, {"sandbox": section})
    assert message in err.value.message


def test_no_model_is_granted_the_servers_own_files(tmp_path: Path) -> None:
    sandbox = _sandbox(tmp_path)
    for path in (tmp_path / "run", tmp_path / "run" / "key_file.json", tmp_path):
        with pytest.raises(InvalidModel) as err:
            sandbox.model("m", "1", tmp_path, {"sandbox": {"readPaths": [str(path)]}})
        assert (
            f"sandbox.readPaths names {path}, which holds or is inside the server's own files"
            in (err.value.message)
        )


def test_where_landlock_is_missing_one_loud_warning(tmp_path: Path) -> None:
    sandbox = Sandbox(ServerConfig(run_dir=str(tmp_path)), abi=0)
    assert sandbox.warning is not None
    assert sandbox.warning.startswith("sandbox: workers are NOT confined: this kernel offers no")
    assert "set sandbox: false to silence this warning" in sandbox.warning
    assert sandbox.summary().startswith("not applied: this kernel offers no Landlock")
    assert Sandbox(ServerConfig(run_dir=str(tmp_path), sandbox=False), abi=0).warning is None
