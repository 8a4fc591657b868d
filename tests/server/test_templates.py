"""Worker templates preload what their models import, learned from the workers and remembered
across starts; an echo model's workers never carry torch, even beside a torch model."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mserve_worker.imports import valid_names
from server.workers.preload import PRELOAD_FILE, PreloadMemory
from server.workers.prespawn import guess_archive_imports, guess_imports, local_archive
from tests.conftest import ARCHIVER_SCRIPT

REPO = Path(__file__).resolve().parent.parent.parent


def _maps_torch(pid: int) -> bool:
    """Whether torch's native library is mapped into the process: what carrying torch costs."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _template_of(pid: int) -> str:
    """The command line of the template a worker was forked from."""
    parent = psutil.Process(pid).parent()
    assert parent is not None
    cmdline = " ".join(parent.cmdline())
    assert "mserve_worker.template" in cmdline, cmdline
    return cmdline


def _started_at(pid: int) -> float:
    """When ``pid`` started, wall clock, to ~10 ms: psutil's create_time rests on the boot time
    in whole seconds (/proc/stat btime), too coarse here; /proc/uptime has hundredths."""
    start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    booted = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return booted + start_ticks / os.sysconf("SC_CLK_TCK")


def _template_started_before_listening(worker: int, run_dir: Path) -> bool:
    """Whether the template ``worker`` was forked from started before the server's (latest)
    start opened its first listener: while the server was still importing itself."""
    log = (run_dir / "logs" / "mserve.log").read_text()
    *_, listening = re.finditer(r"^(\S+ \S+),(\d+) INFO mserve: inference API listening", log, re.M)
    opened = time.mktime(time.strptime(listening[1], "%Y-%m-%d %H:%M:%S")) + int(listening[2]) / 1e3
    template = psutil.Process(worker).parent()
    assert template is not None
    return _started_at(template.pid) < opened


def test_echo_workers_carry_no_torch_and_the_next_start_preloads_what_was_learned(
    make_archive, start_server, tmp_path: Path
) -> None:
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("torch_import", "torchy:handle", "torchy")
    run_dir = tmp_path / "run"
    server = start_server("echo=echo.mar", "torchy=torchy.mar", run_dir=run_dir)
    assert server.predict("torchy", {}).status == 200
    assert not _maps_torch(server.worker_pids("echo")[0])
    assert _maps_torch(server.worker_pids("torchy")[0])
    # its first start: nothing learned yet, so its template preloads what its source imports,
    # read from the archive first thing, as at a later start (here each model has its own)
    assert "torch" in _template_of(server.worker_pids("torchy")[0]).partition("--preload")[2]
    assert _template_started_before_listening(server.worker_pids("torchy")[0], run_dir)
    assert _template_started_before_listening(server.worker_pids("echo")[0], run_dir)
    learned = json.loads((run_dir / "envs" / PRELOAD_FILE).read_text())["pythons"]
    (models,) = learned.values()
    assert models["echo"]["modules"] == []
    assert "torch" in models["torchy"]["modules"]
    server.cli("--stop")

    # the next start: each model's template preloads what its workers imported, from the
    # start on, so even the first scale-up right after the start forks every worker
    server = start_server(run_dir=run_dir)  # both restored from the snapshot
    assert server.manage("PUT", "/models/torchy?min_worker=3&synchronous=true").status == 200
    assert server.manage("PUT", "/models/echo?min_worker=2&synchronous=true").status == 200
    torchy, echo = server.worker_pids("torchy"), server.worker_pids("echo")
    assert len({psutil.Process(p).ppid() for p in torchy}) == 1
    assert "--preload" in _template_of(torchy[0]) and "torch" in _template_of(torchy[0])
    assert all(_maps_torch(p) for p in torchy)
    assert not any(_maps_torch(p) for p in echo)
    assert "torch" not in _template_of(echo[0]).partition("--preload")[2]
    assert server.predict("echo", "hi").body == b"hi"
    log = (run_dir / "logs" / "mserve.log").read_text()
    assert re.search(r"template for \S+ ready \(pid \d+, preloaded: [^)]*\btorch\b", log)
    # started before the server imported itself: before its first listener opened
    assert _template_started_before_listening(torchy[0], run_dir)


def test_remembered_imports_survive_a_restart_and_bad_files_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    memory = PreloadMemory(tmp_path)
    assert memory.learn("/py", "mlp", ["numpy", "torch"], [])
    assert not memory.learn("/py", "mlp", ["numpy", "torch"], [])  # no news: no write
    memory.learn("/py", "echo", [], [])
    again = PreloadMemory(tmp_path)
    assert again.modules("/py", ["mlp", "echo"]) == ["numpy", "torch"]
    assert again.modules("/py", ["echo"]) == []
    assert again.pythons_for(["echo", "other"]) == {"/py": ["echo"]}
    # a worker forked with torch already imported does not report it: still needed
    again.learn("/py", "mlp", ["PIL"], ["numpy", "torch"])
    assert PreloadMemory(tmp_path).modules("/py", ["mlp"]) == ["PIL", "numpy", "torch"]
    # at a first start, what the source was guessed to import counts when the template had it
    assert not again.knows("/py", "new")
    again.learn("/py", "new", [], ["numpy", "torch", "tqdm"], assumed=["torch", "missing"])
    assert again.knows("/py", "new") and again.modules("/py", ["new"]) == ["torch"]

    (tmp_path / PRELOAD_FILE).write_text(json.dumps({"schema": 1, "pythons": {"/py": {
        "good": {"modules": ["yaml"], "seen": 1},
        "bad": {"modules": ["os; rm -rf /"], "seen": 1},
    }}}))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        kept = PreloadMemory(tmp_path)
    assert kept.modules("/py", ["good", "bad"]) == ["yaml"]
    assert "ignoring the entry of bad (not a module name: 'os; rm -rf /')" in caplog.text
    (tmp_path / PRELOAD_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert PreloadMemory(tmp_path).modules("/py", ["good"]) == []
    assert "templates learn their imports anew" in caplog.text


def test_a_first_start_guesses_from_the_model_source(tmp_path: Path) -> None:
    (tmp_path / "handler.py").write_text(
        "import json, os.path\nimport torch.nn as nn\nfrom helper import X\nfrom . import y\n"
        "try:\n    from PIL import Image\nexcept ImportError:\n    Image = None\n"
        "def handle(data, context):\n    import yaml  # only when called: not preloaded\n"
    )
    (tmp_path / "helper.py").write_text("import numpy\nX = 1\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    assert guess_imports(tmp_path) == ["PIL", "numpy", "torch"]


def _archive(source: Path, store: Path, *extra: str) -> Path:
    """``source`` archived by the real model-archiver CLI; the .mar, .tar.gz or folder."""
    store.mkdir()
    out = subprocess.run(
        [ARCHIVER_SCRIPT, "--model-name", "m", "--handler", "handler.py", "--model-path",
         str(source), "--export-path", str(store), "-f", *extra],
        capture_output=True, text=True, timeout=60, cwd=source,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return next(p for p in store.iterdir() if p.name.startswith("m"))


def test_a_fresh_run_dir_guesses_from_the_archive_before_unpacking(tmp_path: Path) -> None:
    """What a startup model imports is read from its .mar (or archive folder) itself, so that
    its template starts at once on a new machine; the same guess as from the unpacked model."""
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    (source / "handler.py").write_text("import torch\nimport helper\nimport pkg\n")
    (source / "helper.py").write_text("from PIL import Image\n")
    (source / "pkg" / "__init__.py").write_text("import yaml\n")  # not at the top: not read
    (source / "requirements.txt").write_text("pillow\n")
    mar = _archive(source, tmp_path / "zip")
    assert guess_archive_imports(mar, per_model_envs=False) == ["PIL", "torch"]
    assert guess_archive_imports(mar, True) == ["PIL", "torch"]  # names no requirements file
    assert guess_imports(source) == ["PIL", "torch"]
    folder = _archive(source, tmp_path / "folder", "--archive-format", "no-archive")
    assert guess_archive_imports(folder, per_model_envs=False) == ["PIL", "torch"]
    # its workers may run in an environment of their own, whose interpreter is not known yet
    own_env = _archive(source, tmp_path / "env", "--requirements-file",
                       str(source / "requirements.txt"))  # fmt: skip
    assert guess_archive_imports(own_env, per_model_envs=True) is None
    assert guess_archive_imports(own_env, per_model_envs=False) == ["PIL", "torch"]
    # guessed once unpacked: a .tar.gz (reading it means decompressing all of it), or no archive
    tgz = _archive(source, tmp_path / "tgz", "--archive-format", "tgz")
    assert guess_archive_imports(tgz, per_model_envs=False) is None
    (tmp_path / "junk.mar").write_bytes(b"not a zip")
    assert guess_archive_imports(tmp_path / "junk.mar", per_model_envs=False) is None
    assert guess_archive_imports(tmp_path / "missing.mar", per_model_envs=False) is None

    store = tmp_path / "store"
    assert local_archive("m.mar", store) == store / "m.mar"
    assert local_archive("/abs/m.mar", store) == Path("/abs/m.mar")
    assert local_archive("file:///abs/m%20x.mar", store) == Path("/abs/m x.mar")
    assert local_archive("file://localhost/abs/m.mar", None) == Path("/abs/m.mar")
    assert local_archive("https://example.com/m.mar", store) is None
    assert local_archive("m.mar", None) is None


def test_module_names_from_a_worker_are_checked() -> None:
    assert valid_names(["torch", "google.protobuf"]) == ["torch", "google.protobuf"]
    for bad, message in [
        ("torch", "expected a list of module names, got str"),
        (["torch", "../x"], "not a module name: '../x'"),
        ([1], "not a module name: 1"),
        (["m"] * 257, "257 module names, at most 256 allowed"),
    ]:
        with pytest.raises(ValueError) as info:
            valid_names(bad)
        assert str(info.value) == message


def test_a_worker_reports_installed_packages_only(tmp_path: Path) -> None:
    """What the handler imported from the environment counts; the standard library, the
    model's own modules and what was imported before the handler loaded do not."""
    (tmp_path / "own_helper.py").write_text("X = 1\n")
    script = (
        "import sys, json\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(tmp_path)!r}]\n"
        "from mserve_worker.imports import loaded_packages\n"
        "import click\n"
        "before = set(sys.modules)\n"
        "import yaml, own_helper, decimal, email.mime.text\n"
        f"print(json.dumps(loaded_packages([{str(tmp_path)!r}], before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert json.loads(out.stdout) == ["yaml"]


def test_a_template_that_cannot_import_a_remembered_module_still_forks(
    make_archive, start_server, tmp_path: Path
) -> None:
    """A remembered package that is gone from the environment is skipped, not fatal."""
    make_archive("echo_fn", "echo:handle", "echo")
    run_dir = tmp_path / "run"
    (run_dir / "envs").mkdir(parents=True)
    # the server's interpreter: its script's (python3 in a venv made by `python3 -m venv`)
    python = (Path(sys.executable).parent / "mserve").read_text().splitlines()[0][2:].strip()
    (run_dir / "envs" / PRELOAD_FILE).write_text(json.dumps({"schema": 1, "pythons": {
        python: {"echo": {"modules": ["no_such_package_here"], "seen": 1}},
    }}))  # fmt: skip
    server = start_server("echo=echo.mar", run_dir=run_dir)
    assert server.predict("echo", "hi").body == b"hi"
    assert "no_such_package_here" in _template_of(server.worker_pids("echo")[0])
    assert "ready (pid" in (log := (run_dir / "logs" / "mserve.log").read_text())
    assert "preloaded: nothing" in log
