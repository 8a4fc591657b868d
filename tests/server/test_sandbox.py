"""Workers confined to their own model (server/workers/sandbox.py, mserve_worker/confine.py):
hostile handlers, each in its own archive, against real kernel rules (Landlock)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mserve_worker.confine import landlock_abi
from server.config import ServerConfig
from server.errors import ConfigError, InvalidModel
from server.workers.sandbox import Sandbox
from server.workers.sandbox_users import UidMap
from tests.conftest import REPO
from tests.server.conftest import Server, http

needs_landlock = pytest.mark.skipif(landlock_abi() < 4, reason="needs Landlock ABI 4+ (Linux)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a uid per model needs a root server")
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
    own_scratch = server.run_dir / "scratch" / "scratch-1.0"
    assert done["tmp"].startswith(str(own_scratch))
    # HOME and XDG_CACHE_HOME: a library caching in ~/.cache works unedited
    assert done["home"] == str(own_scratch) and (own_scratch / ".cache" / "hub").is_dir()
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
    uid = server.manage("GET", "/models/writer").json()[0]["sandbox"].get("uid")
    if uid is not None:  # a root server runs it as its own uid: the operator lets it write
        os.chown(tmp_path / "out", uid, uid)
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


def _uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("Uid:")).split()[1])


@needs_landlock
@needs_root
def test_each_model_runs_as_its_own_uid(make_archive, start_server, tmp_path: Path) -> None:
    make_archive("echo_fn", "echo", "victim")
    config = tmp_path / "m.yaml"
    programs = tmp_path / "programs"
    programs.mkdir()
    setuid_id = programs / "id"  # a setuid-root copy of id(1): it prints euid=0 when it works
    shutil.copy("/usr/bin/id", setuid_id)
    os.chmod(setuid_id, 0o4755)
    grants = {"bomb": "maxProcesses: 40", "setuid": f"readPaths: [{programs}]",
              "peek": "readPaths: [/proc]", "who": "maxOpenFiles: 1000"}  # fmt: skip
    entries = {"bomb": "spawn", "setuid": "run", "peek": "read_file", "who": "whoami"}
    for name, entry in entries.items():
        config.write_text(f"sandbox:\n  {grants[name]}\n")
        make_archive("hostile", f"hostile:{entry}", name, "--config-file", str(config))
    models = ["victim=victim.mar", *(f"{n}={n}.mar" for n in entries), "twin"]
    server = start_server(*models[:-1], config={"disable_token_authorization": False})
    # twin: the same archive bytes as victim, so the same unpacked folder, under another name
    twin = "/models?url=victim.mar&model_name=twin&initial_workers=1&synchronous=true"
    assert server.manage("POST", twin).status == 200
    described = {m.split("=")[0]: server.manage("GET", f"/models/{m.split('=')[0]}").json()[0]
                 for m in models}  # fmt: skip
    uids = {name: d["sandbox"]["uid"] for name, d in described.items()}
    assert len(set(uids.values())) == len(uids), uids  # one uid per model
    assert all(200000 <= uid <= 299999 for uid in uids.values())
    for name, d in described.items():
        worker = d["workers"][0]
        assert _uid_of(worker["pid"]) == uids[name], name
        assert f"uid={uids[name]}" in worker["sandbox"]["applied"]
    who = json.loads(server.predict("who", {}).body)
    assert who == {"uid": uids["who"], "euid": uids["who"], "gid": uids["who"], "groups": []}
    assert server.predict("twin", "same files").body == b"same files"  # reads victim's folder
    assert f"uid={uids['who']}" in server.cli("--status").stdout

    # RLIMIT_NPROC binds per uid: the fork bomb stops at its model's maxProcesses
    message = _failed(server, "bomb", {"count": 10_000})
    assert "[Errno 11] Resource temporarily unavailable" in message
    assert server.predict("bomb", {"count": 5}).body == b"spawned 5"

    # no_new_privs: the setuid binary, which makes anyone else root, gives the worker nothing
    nobody = {"user": 65534, "group": 65534, "extra_groups": []}
    as_nobody = subprocess.run([setuid_id], capture_output=True, text=True, **nobody)
    assert "euid=0(root)" in as_nobody.stdout, as_nobody
    ran = server.predict("setuid", {"argv": [str(setuid_id)]})
    assert ran.status == 200, ran.body
    assert ran.body.decode().startswith(f"uid={uids['setuid']} ") and b"euid" not in ran.body

    # granted all of /proc, a worker still cannot read another worker's or the server's secrets
    victim_pid = described["victim"]["workers"][0]["pid"]
    for pid in (victim_pid, server.pid):
        assert "Permission denied" in _failed(server, "peek", {"path": f"/proc/{pid}/environ"})
    # and the server and the other models keep serving, with the same workers
    assert server.predict("victim", "still here").body == b"still here"
    assert server.worker_pids("victim") == [victim_pid]
    # what the server keeps to itself stays its own
    assert (server.run_dir / "key_file.json").stat().st_mode & 0o077 == 0
    assert oct(server.run_dir.stat().st_mode & 0o777) == "0o711"  # searchable, not listable
    scratch = server.run_dir / "scratch" / "who-1.0"
    assert (scratch.stat().st_uid, scratch.stat().st_mode & 0o777) == (uids["who"], 0o700)


@needs_landlock
def test_a_worker_that_cannot_be_confined_does_not_load(
    make_archive, start_server, tmp_path: Path
) -> None:
    config = tmp_path / "tight.yaml"
    config.write_text("sandbox:\n  maxOpenFiles: 3\n")  # too few for Landlock's own ruleset
    make_archive("hostile", "hostile:whoami", "tight", "--config-file", str(config))
    make_archive("hostile", "hostile:whoami", "who")
    # every worker a fresh interpreter: under a root server, it starts as the model's uid
    server = start_server("who=who.mar", config={"fork_workers": False})
    failed = server.manage("POST", "/models?url=tight.mar&initial_workers=1&synchronous=true")
    assert failed.status >= 400
    assert (
        "cannot confine the worker: [Errno 24] landlock_create_ruleset: Too many open files"
        in failed.json()["message"]
    )
    who = json.loads(server.predict("who", {}).body)
    uid = server.manage("GET", "/models/who").json()[0]["sandbox"].get("uid")
    assert who["uid"] == who["euid"] == (os.getuid() if uid is None else uid)


def test_the_uid_range_setting_is_checked(tmp_path: Path) -> None:
    for value in ("200000", "9-3", "a-b", "0-10"):
        with pytest.raises(ConfigError) as err:
            _sandbox(tmp_path, sandbox_uid_range=value)
        assert (
            "sandbox_uid_range should be FIRST-LAST (uids, 1 to 4294967294, FIRST <= LAST)"
            f" or off, found {value!r}" in str(err.value)
        )
    assert _sandbox(tmp_path, sandbox_uid_range="off").uid_range is None


def test_uids_are_recorded_and_a_full_range_is_named(tmp_path: Path) -> None:
    uids = UidMap(tmp_path, (300000, 300001))
    assert [uids.uid("a"), uids.uid("b"), uids.uid("a")] == [300000, 300001, 300000]
    assert UidMap(tmp_path, (300000, 300001)).uid("b") == 300001  # kept across restarts
    assert (tmp_path / "sandbox_uids.json").stat().st_mode & 0o777 == 0o600
    with pytest.raises(InvalidModel) as err:
        uids.uid("c")
    assert "sandbox_uid_range 300000-300001 has no uid left for model c (2 models hold" in (
        err.value.message
    )


# A confined process that names a thread of its own through procfs, as CUDA's driver does while
# it initialises (cuInit fails with error 304 when it cannot), then tries a write the sandbox
# forbids. Landlock is for life: each case runs in a process of its own.
_THREAD_NAMING = """
import json, sys, threading
from mserve_worker import confine

abi, devices, forbidden = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
libc = confine._libc()
assert libc.prctl(confine._PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
confine._landlock(libc, abi, {"read": [], "write": [], "devices": devices})
seen = {}

def name_myself():
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write("cuda-like")
        seen["named"] = True
    except OSError as exc:
        seen["named"] = exc.strerror

thread = threading.Thread(target=name_myself)
thread.start()
thread.join()
with open("/dev/null", "w") as null:  # a device every worker may use
    null.write("x")
try:
    open(forbidden, "a").close()
    seen["forbidden"] = "written"
except OSError as exc:
    seen["forbidden"] = exc.strerror
print(json.dumps(seen))
"""


@needs_landlock
def test_gpu_workers_can_start_cuda_on_every_landlock_abi(tmp_path: Path) -> None:
    """Checked on an H100 (scripts/check_gpu.py): CUDA's initialisation needs to name its
    threads, so a GPU worker may write its own /proc/self, a CPU worker may not; and a kernel
    with an older Landlock (no ioctl right before ABI 5) takes the same rules instead of refusing
    every worker's device rules (this kernel's ABI and every older one, as those kernels get)."""
    forbidden = tmp_path / "not-granted.txt"
    forbidden.write_text("")
    gpu = ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]  # those there, as the server says
    for abi in sorted({1, 2, 3, 4, 5, landlock_abi()} & set(range(1, landlock_abi() + 1))):
        for devices, named in ((gpu, True), ([], "Permission denied")):
            out = subprocess.run(
                [sys.executable, "-c", _THREAD_NAMING, str(abi), json.dumps(devices),
                 str(forbidden)],
                capture_output=True, text=True, timeout=60, cwd=REPO,
            )  # fmt: skip
            assert out.returncode == 0, (abi, devices, out.stderr)
            seen = json.loads(out.stdout)
            assert seen == {"named": named, "forbidden": "Permission denied"}, (abi, devices)
