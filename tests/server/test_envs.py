"""Per-model environments: real uv builds from hand-made wheels, no index access."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mserve_worker.confine import landlock_abi
from server.config import DEFAULT_DENY
from server.model_envs import EnvBuildError, EnvCache, EnvRequest
from server.workers.build_sandbox import BUILD_TMP, BuildSandbox, url_ports
from tests.server.conftest import wait_until
from tests.wheels import make_wheel

PKG = "mservetestpkg"


def _wheelhouse(tmp_path: Path, version: str) -> Path:
    folder = tmp_path / f"wheels-{version}"
    make_wheel(folder, PKG, version, f"VERSION = {version!r}\n")
    return folder


def _archive(make_archive, tmp_path: Path, name: str, requirement: str, version: str, *extra):
    reqs = tmp_path / f"{name}-requirements.txt"
    reqs.write_text(requirement + "\n")
    wheels = _wheelhouse(tmp_path, version)
    return make_archive("versioned", "vhandler:handle", name, "-r", str(reqs),
                        "--wheelhouse", str(wheels), *extra)  # fmt: skip


def test_two_versions_side_by_side_and_reuse(make_archive, start_server, tmp_path: Path) -> None:
    _archive(make_archive, tmp_path, "old", f"{PKG}==1.0", "1.0")
    _archive(make_archive, tmp_path, "new", f"{PKG}==2.0", "2.0")
    _archive(make_archive, tmp_path, "again", f"# same set\n{PKG}==1.0", "1.0")
    server = start_server("old=old.mar", "new=new.mar")
    old, new = server.predict("old", {}).json(), server.predict("new", {}).json()
    assert (old["version"], new["version"]) == ("1.0", "2.0")
    assert old["python"] != new["python"] and old["python"] != sys.executable
    described = {n: server.manage("GET", f"/models/{n}").json()[0] for n in ("old", "new")}
    assert described["old"]["environment"] != described["new"]["environment"]

    # workers forked from the environment's own warm template see that environment too
    log = server.run_dir / "logs" / "mserve.log"
    wait_until(lambda: f"worker template for {old['python']} ready" in log.read_text(), 60,
               "the environment's worker template")  # fmt: skip
    assert server.manage("PUT", "/models/old?min_worker=3&synchronous=true").status == 200
    seen = {tuple(server.predict("old", {}).json().values()) for _ in range(20)}
    assert seen == {("1.0", old["python"])}

    assert server.manage("POST", "/models?url=again.mar").status == 200
    again = server.manage("GET", "/models/again").json()[0]
    assert again["environment"] == described["old"]["environment"]  # reused, nothing new
    listing = server.manage("GET", "/environments").json()
    assert len(listing["environments"]) == 2
    assert listing["totalBytes"] > 0
    assert all(e["inUse"] for e in listing["environments"])

    assert server.manage("DELETE", "/models/new").status == 200
    pruned = server.manage("DELETE", "/environments").json()
    assert pruned["removed"] == [described["new"]["environment"]]
    assert server.predict("old", {}).json()["version"] == "1.0"


def test_failed_install_is_a_clear_registration_error(make_archive, start_server, tmp_path) -> None:
    _archive(make_archive, tmp_path, "broken", f"{PKG}==9.9", "1.0")
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    reply = server.manage("POST", "/models?url=broken.mar")
    assert reply.status == 400
    message = reply.json()["message"]
    assert "installing requirements failed for broken:1.0" in message
    assert f"{PKG}==9.9" in message  # the installer's own words on what failed
    assert server.predict("probe", {}).status == 200
    envs = Path(server.run_dir) / "envs"
    assert not [p for p in envs.iterdir() if p.name.startswith(".tmp-") and p.is_dir()]


def test_layered_env_sees_server_packages_isolated_does_not(tmp_path: Path) -> None:
    cache = EnvCache(tmp_path / "envs")
    wheels = _wheelhouse(tmp_path, "1.0")
    probe = "import mserve_worker.runtime, mservetestpkg; import yaml"
    layered = cache.ensure(EnvRequest(f"{PKG}==1.0", "m:1", wheels))
    assert subprocess.run([layered, "-I", "-c", probe], capture_output=True).returncode == 0
    isolated = cache.ensure(EnvRequest(f"{PKG}==1.0", "m:1", wheels, isolated=True))
    assert isolated != layered
    out = subprocess.run([isolated, "-I", "-c", probe], capture_output=True, text=True)
    assert "No module named 'yaml'" in out.stderr  # runtime and its own package import, not ours


_PROBE = """
import os, sys
try:
    seen = open({secret!r}).read()
except OSError as exc:
    seen = f"refused {{exc.errno}}"
try:
    with open({outside!r}, "a") as f:
        f.write("written outside\\n")
except OSError:
    pass
with open(os.path.join(sys.prefix, "probe-ran.txt"), "a") as f:
    f.write(f"{{seen}} key={{os.environ.get('CLOUD_API_KEY')}}\\n")
"""


@pytest.mark.skipif(landlock_abi() <= 0, reason="needs Landlock (Linux 5.13+)")
def test_a_requirements_code_runs_confined_at_the_build(tmp_path: Path) -> None:
    """A requirement runs code at the build (a .pth file at each start of the new interpreter:
    the import probe, the SBOM; a source package's setup.py): confined as a worker is, it reads
    none of the server's files, writes nothing outside the environment, sees no secrets."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret, outside = run_dir / "key_file", run_dir / "written.txt"
    secret.write_text("the server's key")
    wheels = tmp_path / "wheels"
    probe = _PROBE.format(secret=str(secret), outside=str(outside))
    make_wheel(wheels, PKG, "1.0", "", extra={"zz_probe.pth": b"import mservetest_probe\n",
                                              "mservetest_probe.py": probe.encode()})  # fmt: skip
    environ = {**os.environ, "CLOUD_API_KEY": "s3cret"}
    sandbox = BuildSandbox(environ, DEFAULT_DENY)
    python = EnvCache(tmp_path / "envs", sandbox=sandbox).ensure(
        EnvRequest(f"{PKG}==1.0", "m:1", wheels)
    )
    ran = (Path(python).parent.parent / "probe-ran.txt").read_text().splitlines()
    assert ran and set(ran) == {"refused 13 key=None"}, ran  # the probe, and the SBOM if any
    assert not outside.exists()
    assert not (Path(python).parent.parent / BUILD_TMP).exists()  # its TMPDIR is gone


def test_an_index_and_a_proxy_named_anywhere_are_the_ports_a_build_reaches() -> None:
    texts = ["--index-url https://pypi.example:8443/simple\nrequests", "http://proxy:3128", ""]
    assert url_ports(texts) == [3128, 8443]


_BUILD = """
import sys
from pathlib import Path
from mserve_worker.confine import landlock_abi
from server.config import DEFAULT_DENY
from server.model_envs import EnvBuildError, EnvCache, EnvRequest
from server.workers.build_sandbox import BUILD_TMP, BuildSandbox, url_ports
cache = EnvCache(Path(sys.argv[1]), use_uv=sys.argv[3] == "uv")
print(cache.ensure(EnvRequest("mservetestpkg==1.0", "m:1", Path(sys.argv[2]))))
"""


def _builder(root: Path, wheels: Path, installer: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _BUILD, str(root), str(wheels), installer],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_concurrent_builds_of_one_key_end_in_one_env(tmp_path: Path) -> None:
    wheels = _wheelhouse(tmp_path, "1.0")
    procs = [_builder(tmp_path / "envs", wheels, "uv") for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({out.strip() for out, _ in outs}) == 1
    assert len(EnvCache(tmp_path / "envs").entries()) == 1


@pytest.mark.slow
def test_killed_build_is_never_used_and_is_swept(tmp_path: Path) -> None:
    wheels = _wheelhouse(tmp_path, "1.0")
    root = tmp_path / "envs"
    proc = _builder(root, wheels, "pip")  # venv + pip: slow enough to kill halfway
    wait_until(lambda: root.is_dir() and any(p.name.startswith(".tmp-") for p in root.iterdir()
                                             if not p.name.startswith(".tmp-runtime")), 60, "a build to start")  # fmt: skip
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    cache = EnvCache(root, use_uv=False)
    key = cache.key(EnvRequest(f"{PKG}==1.0", "m:1", wheels))
    assert not cache.ready(key) and not cache.path(key).exists()
    python = cache.ensure(EnvRequest(f"{PKG}==1.0", "m:1", wheels))
    assert cache.ready(key)
    assert subprocess.run([python, "-I", "-c", "import mservetestpkg"]).returncode == 0
    assert not [p for p in root.iterdir() if p.name.startswith(f".tmp-{key}")]


def test_pin_that_would_break_a_protected_base_package_is_refused(tmp_path: Path) -> None:
    """PyYAML stands in for torch here (torch is not installed in CI): protecting it makes a
    model's conflicting pin fail at install time, naming the conflict; other pins install."""
    from importlib import metadata

    wheels = _wheelhouse(tmp_path, "1.0")
    make_wheel(wheels, "PyYAML", "5.0", "")  # a version the server does not run
    cache = EnvCache(tmp_path / "envs", protected=("PyYAML",))

    with pytest.raises(EnvBuildError) as info:
        cache.ensure(EnvRequest(f"{PKG}==1.0\nPyYAML==5.0", "m:1", wheels))
    assert "installing requirements failed for m:1" in info.value.message
    assert "pyyaml" in info.value.message.lower()
    assert (
        f"PyYAML=={metadata.version('PyYAML')}" in info.value.message
        or "constraint" in info.value.message.lower()
        or "unsatisfiable" in info.value.message
    )
    ok = cache.ensure(EnvRequest(f"{PKG}==1.0", "m:1", wheels))
    assert subprocess.run([ok, "-I", "-c", "import mservetestpkg, yaml"]).returncode == 0


def test_unreadable_requirements_leave_nothing_registered(make_archive, start_server, tmp_path):
    reqs = tmp_path / "requirements.txt"
    reqs.write_bytes(b"\xff\xfe not utf-8")
    make_archive("versioned", "vhandler:handle", "garbled", "-r", str(reqs))
    server = start_server()
    reply = server.manage("POST", "/models?url=garbled.mar")
    assert reply.status == 400
    assert "cannot read requirements.txt from garbled.mar" in reply.json()["message"]
    assert server.manage("GET", "/models/garbled").status == 404
