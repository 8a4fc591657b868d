"""model-archiver end to end: real inputs, real archives, every format and every user error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from archiver import open_archive
from tests.conftest import ARCHIVER_SCRIPT, ArchiverRunner

FORMAT_FILES = {"default": "m.mar", "zip-store": "m.mar", "tgz": "m.tar.gz", "no-archive": "m"}


def _full_args(fmt: str = "default") -> list[str]:
    return [
        "--model-name", "m", "--version", "2.5",
        "--serialized-file", "weights.pt", "--model-file", "model.py",
        "--handler", "handler.py:handle",
        "--extra-files", "src/mypkg,labels.json",
        "-r", "requirements.txt", "-c", "config.yaml",
        "--archive-format", fmt,
    ]  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMAT_FILES))
def test_round_trip_every_format(archiver: ArchiverRunner, model_inputs: Path, fmt: str) -> None:
    result = archiver(*_full_args(fmt))
    assert result.exit_code == 0, result.output
    out = model_inputs / FORMAT_FILES[fmt]
    with open_archive(out) as archive:
        model = archive.manifest.model
        assert (model.model_name, model.model_version) == ("m", "2.5")
        assert model.handler == "handler:handle"
        assert model.serialized_file == "weights.pt"
        assert model.requirements_file == "requirements.txt"
        assert model.config_file == "config.yaml"
        names = {m.name for m in archive.members if not m.is_dir}
        assert names == {
            "weights.pt", "model.py", "handler.py", "labels.json", "requirements.txt",
            "config.yaml", "mypkg/__init__.py", "mypkg/sub/vocab.txt", "MAR-INF/MANIFEST.json",
        }  # fmt: skip
        assert archive.verify().ok
        dest = archive.extract(model_inputs / "unpacked")
    for name in ("weights.pt", "model.py", "handler.py"):
        assert (dest / name).read_bytes() == (model_inputs / name).read_bytes()
    assert (dest / "mypkg/sub/vocab.txt").read_text() == "a\nb\n"


def test_zip_store_is_uncompressed_and_default_is_deflated(
    archiver: ArchiverRunner, model_inputs: Path
) -> None:
    for fmt, method in (("zip-store", zipfile.ZIP_STORED), ("default", zipfile.ZIP_DEFLATED)):
        assert archiver(*_full_args(fmt), "-f").exit_code == 0
        with zipfile.ZipFile(model_inputs / "m.mar") as zf:
            assert {i.compress_type for i in zf.infolist()} == {method}


def test_tgz_uses_torchserve_top_folder(archiver: ArchiverRunner, model_inputs: Path) -> None:
    assert archiver(*_full_args("tgz")).exit_code == 0
    with tarfile.open(model_inputs / "m.tar.gz") as tf:
        assert all(name.startswith("m/") for name in tf.getnames())
        assert "m/MAR-INF/MANIFEST.json" in tf.getnames()


def test_shortest_torchserve_form(archiver: ArchiverRunner, tmp_path: Path) -> None:
    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    result = archiver("--model-name", "x", "--handler", "h:handle")
    assert result.exit_code == 0, result.output
    with open_archive(tmp_path / "x.mar") as archive:
        assert archive.manifest.model.model_version == "1.0"
        assert archive.manifest.model.handler == "h:handle"
        assert [m.name for m in archive.members if not m.is_dir] == [
            "h.py",
            "MAR-INF/MANIFEST.json",
        ]


def test_mms_form_with_model_path(archiver: ArchiverRunner, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    (model_dir / "sub").mkdir(parents=True)
    (model_dir / "h.py").write_text("def handle(data, context):\n    return data\n")
    (model_dir / "sub" / "params.bin").write_bytes(b"\x01" * 100)
    (model_dir / ".git").mkdir()
    (model_dir / ".git" / "HEAD").write_text("ref")
    (tmp_path / "out").mkdir()
    result = archiver(
        "--model-name", "x", "--handler", "h:handle", "--model-path", "model",
        "--export-path", "out", "--runtime", "python3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    with open_archive(tmp_path / "out" / "x.mar") as archive:
        assert archive.manifest.runtime == "python3"
        names = {m.name for m in archive.members}
        assert names == {"h.py", "sub/params.bin", "MAR-INF/MANIFEST.json"}


def test_extra_folder_keeps_structure_so_packages_import(
    archiver: ArchiverRunner, model_inputs: Path
) -> None:
    assert archiver(*_full_args("no-archive")).exit_code == 0
    code = "import mypkg, pathlib; print(mypkg.VALUE)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=model_inputs / "m", capture_output=True, text=True
    )
    assert out.stdout.strip() == "1", out.stderr


def test_extra_files_glob_and_repeat(archiver: ArchiverRunner, model_inputs: Path) -> None:
    (model_inputs / "data").mkdir()
    for i in range(3):
        (model_inputs / "data" / f"t{i}.json").write_text("{}")
    result = archiver(
        "--model-name", "g", "--handler", "handler.py",
        "--extra-files", "data/*.json", "--extra-files", "labels.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    with open_archive(model_inputs / "g.mar") as archive:
        names = {m.name for m in archive.members}
    assert {"t0.json", "t1.json", "t2.json", "labels.json", "handler.py"} <= names


@pytest.mark.parametrize(
    ("spec", "stored"),
    [
        ("handler.py", "handler.py"),
        ("handler.py:handle", "handler:handle"),
        ("./handler.py:handle", "handler:handle"),
        ("handler", "handler"),
        ("mypkg.sub_mod:Handler", "mypkg.sub_mod:Handler"),
        ("image_classifier", "image_classifier"),
    ],
)
def test_handler_forms(
    archiver: ArchiverRunner, model_inputs: Path, spec: str, stored: str
) -> None:
    (model_inputs / "src" / "mypkg" / "sub_mod.py").write_text("class Handler: ...\n")
    result = archiver(
        "--model-name", "h", "--handler", spec, "--extra-files", "src/mypkg"
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    with open_archive(model_inputs / "h.mar") as archive:
        assert archive.manifest.model.handler == stored


def test_unresolvable_handler_module_warns(archiver: ArchiverRunner, tmp_path: Path) -> None:
    result = archiver("--model-name", "h", "--handler", "somepkg.handlers:Handler")
    assert result.exit_code == 0
    assert "handler module 'somepkg.handlers' is not in the archive" in result.output


# --- user errors: one line, the right exit code, nothing left behind -------------------------


def _assert_clean_failure(result, code: int, text: str, folder: Path, before: set[str]) -> None:
    assert result.exit_code == code, result.output
    assert text in result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("model-archiver: error: "), result.output
    assert {p.name for p in folder.iterdir()} == before, "partial output left behind"


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--model-name", "bad name!", "--handler", "handler.py"], 2, "invalid --model-name 'bad name!'"),
        (["--model-name", "-x", "--handler", "handler.py"], 2, "invalid --model-name '-x'"),
        (["--model-name", "abc\n", "--handler", "handler.py"], 2, "invalid --model-name 'abc\\n'"),
        (["--model-name", "m", "--handler", "handler.py", "--version", ""], 2, "--version is empty"),
        (["--model-name", "m", "--handler", "h.py:a:b"], 2, "more than one ':'"),
        (["--model-name", "m", "--handler", "handler.py:1x"], 2, "'1x' is not a valid Python name"),
        (["--model-name", "m", "--handler", "my-handler"], 2, "'my-handler' is not a module name"),
        (["--model-name", "m", "--handler", "nope.py"], 3, "handler file not found: nope.py"),
        (["--model-name", "m", "--handler", "handler.py", "--serialized-file", "nope.pt"], 3,
         "serialized file not found: nope.pt"),
        (["--model-name", "m", "--handler", "handler.py", "--model-file", "nope.py"], 3,
         "model file not found: nope.py"),
        (["--model-name", "m", "--handler", "handler.py", "--extra-files", "labels.json,nope.txt"],
         3, "extra file not found: nope.txt"),
        (["--model-name", "m", "--handler", "handler.py", "--extra-files", "*.nothing"], 3,
         "no match"),
        (["--model-name", "m", "--handler", "handler.py", "-r", "nope.txt"], 3,
         "requirements file not found: nope.txt"),
        (["--model-name", "m", "--handler", "handler.py", "--export-path", "nowhere"], 3,
         "export path does not exist or is not a folder: nowhere"),
        (["--model-name", "m", "--handler", "handler.py", "--model-path", "nowhere"], 3,
         "--model-path folder not found: nowhere"),
        (["--model-name", "m", "--handler", "handler.py", "--extra-files", "src/mypkg/sub/vocab.txt,"
          "labels.json,other/vocab.txt"], 2, "two files would be packed as 'vocab.txt'"),
        (["--handler", "handler.py"], 2, "--model-name is required"),
        (["--model-name", "m"], 2, "--handler is required"),
    ],
)  # fmt: skip
def test_user_errors(
    archiver: ArchiverRunner, model_inputs: Path, args: list[str], code: int, text: str
) -> None:
    (model_inputs / "other").mkdir()
    (model_inputs / "other" / "vocab.txt").write_text("z")
    before = {p.name for p in model_inputs.iterdir()}
    _assert_clean_failure(archiver(*args), code, text, model_inputs, before)


@pytest.mark.parametrize(
    ("config", "text"),
    [
        ("batchsize: 4\n", "unknown key 'batchsize'; did you mean 'batchSize'?"),
        ("minWorker: 1\n", "unknown key 'minWorker'; did you mean 'minWorkers'?"),
        ("batchSize: four\n", "'batchSize' should be integer, found 'four'"),
        ("batchSize: 0\n", "'batchSize' should be >= 1, found 0"),
        ("deviceIds: [0, gpu1]\n", "'deviceIds.1' should be integer, found 'gpu1'"),
        (
            "deviceType: tpu\n",
            "'deviceType' should be one of ['cpu', 'gpu', 'neuron'], found 'tpu'",
        ),
        ("minWorkers: 4\nmaxWorkers: 2\n", "minWorkers (4) is greater than maxWorkers (2)"),
        ("allowedEnvVars: HF_TOKEN\n", "'allowedEnvVars' should be array, found 'HF_TOKEN'"),
        ("allowedEnvVars: [HF_TOKEN, 3]\n", "'allowedEnvVars.1' should be string, found 3"),
        (
            "allowedEnvVar: [HF_TOKEN]\n",
            "unknown key 'allowedEnvVar'; did you mean 'allowedEnvVars'?",
        ),
        ("a: [\n", "YAML syntax error at line 2, column 1"),
        ("- 1\n- 2\n", "expected a mapping of keys, found list"),
    ],
)
def test_bad_model_config(
    archiver: ArchiverRunner, model_inputs: Path, config: str, text: str
) -> None:
    (model_inputs / "bad.yaml").write_text(config)
    before = {p.name for p in model_inputs.iterdir()}
    result = archiver("--model-name", "m", "--handler", "handler.py", "-c", "bad.yaml")
    _assert_clean_failure(result, 5, f"invalid model config bad.yaml: {text}", model_inputs, before)


def test_handler_settings_pass_through_config(archiver: ArchiverRunner, model_inputs: Path) -> None:
    (model_inputs / "c.yaml").write_text("batchSize: 2\nmy_handler_option: [1, 2]\n")
    assert archiver("--model-name", "m", "--handler", "handler.py", "-c", "c.yaml").exit_code == 0


@pytest.mark.parametrize("fmt", list(FORMAT_FILES))
def test_existing_output_needs_force(
    archiver: ArchiverRunner, model_inputs: Path, fmt: str
) -> None:
    assert archiver(*_full_args(fmt)).exit_code == 0
    out = model_inputs / FORMAT_FILES[fmt]
    before = {p.name for p in model_inputs.iterdir()}
    result = archiver(*_full_args(fmt))
    _assert_clean_failure(result, 4, f"output already exists: {out.name}", model_inputs, before)
    (model_inputs / "labels.json").write_text('{"0": "dog"}')
    assert archiver(*_full_args(fmt), "--force").exit_code == 0
    with open_archive(out) as archive:
        assert archive.verify().ok
        assert json.loads(archive.read_bytes("labels.json")) == {"0": "dog"}
    assert {p.name for p in model_inputs.iterdir()} == before, "temp files left behind"


@pytest.mark.parametrize("fmt", list(FORMAT_FILES))
def test_reproducible_with_source_date_epoch(
    archiver: ArchiverRunner, model_inputs: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    (model_inputs / "a").mkdir()
    (model_inputs / "b").mkdir()
    outs = []
    for export in ("a", "b"):
        os.utime(model_inputs / "weights.pt")  # mtimes must not leak into the archive
        assert archiver(*_full_args(fmt), "--export-path", export).exit_code == 0
        outs.append(model_inputs / export / FORMAT_FILES[fmt])
    if fmt == "no-archive":
        assert (outs[0] / "MAR-INF/MANIFEST.json").read_bytes() == (
            outs[1] / "MAR-INF/MANIFEST.json"
        ).read_bytes()
    else:
        assert outs[0].read_bytes() == outs[1].read_bytes()
    with open_archive(outs[0]) as archive:
        assert archive.manifest.created_on == "14/11/2023 22:13:20"


def test_concurrent_runs_never_clobber(model_inputs: Path) -> None:
    """Eight real processes race for one name: one wins, the rest say it exists, the file is whole."""
    big = model_inputs / "weights.pt"
    big.write_bytes(os.urandom(8 << 20))
    cmd = [ARCHIVER_SCRIPT, "--model-name", "race", "--handler", "handler.py",
           "--serialized-file", "weights.pt"]  # fmt: skip
    procs = [
        subprocess.Popen(cmd, cwd=model_inputs, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(8)
    ]
    results = [(p.wait(timeout=60), p.stderr.read().decode()) for p in procs]  # type: ignore[union-attr]
    assert sorted(code for code, _ in results) == [0] + [4] * 7, results
    with open_archive(model_inputs / "race.mar") as archive:
        assert archive.verify().ok
        assert archive.read_bytes("weights.pt", max_bytes=16 << 20) == big.read_bytes()
    assert sorted(p.name for p in model_inputs.iterdir() if p.name.startswith(".")) == []


def test_console_script_and_inspect(model_inputs: Path) -> None:
    """The installed entry point, as a user runs it, including --inspect in text and JSON."""
    made = subprocess.run(
        [ARCHIVER_SCRIPT, *_full_args()], cwd=model_inputs, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith("wrote m.mar")
    shown = subprocess.run(
        [ARCHIVER_SCRIPT, "--inspect", "m.mar"], cwd=model_inputs, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert "verify:   OK, 8 files match their recorded sha256" in shown.stdout
    assert "mypkg/sub/vocab.txt" in shown.stdout
    as_json = subprocess.run(
        [ARCHIVER_SCRIPT, "--inspect", "m.mar", "--json"],
        cwd=model_inputs, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads(as_json.stdout)
    assert report["verify"] == {"ok": True, "digests_recorded": True, "problems": []}
    assert report["manifest"]["model"]["modelName"] == "m"


def test_reading_an_archive_skips_jsonschemas_format_check_modules(model_inputs: Path) -> None:
    """Every model-archiver --inspect and server start validates manifests with jsonschema; the
    modules of its format checks (no schema of ours uses ``format``) cost 3-4 s of CPU
    (rfc3987_syntax's grammars) and ~0.08 s more (idna, webcolors, ...) when installed."""
    made = subprocess.run(
        [ARCHIVER_SCRIPT, *_full_args()], cwd=model_inputs, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    probe = (
        "import sys\n"
        "from archiver import open_archive\n"
        "with open_archive('m.mar') as archive:\n"
        "    assert archive.verify().ok\n"
        "print('jsonschema' in sys.modules)\n"
        "from archiver.jsonschema_import import _SLOW\n"
        "print(sorted(name for name in _SLOW if name in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=model_inputs, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True", "[]"]


def test_inspect_reports_tampering(archiver: ArchiverRunner, model_inputs: Path) -> None:
    assert archiver(*_full_args("no-archive")).exit_code == 0
    (model_inputs / "m" / "weights.pt").write_bytes(b"tampered")
    result = archiver("--inspect", "m")
    assert result.exit_code == 8
    assert "verify:   FAILED" in result.output
    assert "'weights.pt' sha256" in result.output


def test_inspect_errors_are_one_line(archiver: ArchiverRunner, tmp_path: Path) -> None:
    (tmp_path / "junk.mar").write_bytes(b"not an archive")
    result = archiver("--inspect", "junk.mar")
    assert result.exit_code == 6
    assert result.output.strip() == (
        "model-archiver: error: cannot read archive junk.mar: not a zip (.mar), a .tar.gz or a folder"
    )
    result = archiver("--inspect", "missing.mar")
    assert "cannot read archive missing.mar: no such file or folder" in result.output


def test_default_stores_incompressible_weights(archiver: ArchiverRunner, tmp_path: Path) -> None:
    """Random-looking weights are stored (deflate would crawl for ~7%); text still shrinks."""
    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    (tmp_path / "w.pt").write_bytes(os.urandom(3 << 20))
    (tmp_path / "vocab.txt").write_text("token\n" * 600_000)
    result = archiver(
        "--model-name", "s", "--handler", "h.py", "--serialized-file", "w.pt",
        "--extra-files", "vocab.txt",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    with zipfile.ZipFile(tmp_path / "s.mar") as zf:
        methods = {i.filename: i.compress_type for i in zf.infolist()}
    assert methods["w.pt"] == zipfile.ZIP_STORED
    assert methods["vocab.txt"] == zipfile.ZIP_DEFLATED
    assert methods["h.py"] == zipfile.ZIP_DEFLATED


@pytest.mark.slow
def test_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    """Big inputs draw a progress bar on a TTY; piped output (CI, scripts) stays quiet."""
    import fcntl
    import pty
    import struct
    import termios

    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    with open(tmp_path / "big.pt", "wb") as f:
        f.truncate(80 << 20)
    cmd = [ARCHIVER_SCRIPT, "--model-name", "p", "--handler", "h.py", "--serialized-file", "big.pt"]
    piped = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert piped.returncode == 0
    assert piped.stderr == ""

    main_fd, tty_fd = pty.openpty()
    # a real terminal has a size; a fresh pty is 0x0, where no bar fits
    fcntl.ioctl(tty_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([*cmd, "-f"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=tty_fd)
    os.close(tty_fd)
    seen = b""
    while True:
        try:
            data = os.read(main_fd, 4096)
        except OSError:  # the terminal closed: the process is done with it
            break
        if not data:
            break
        seen += data
    assert proc.wait(timeout=60) == 0
    os.close(main_fd)
    assert b"archiving p" in seen and b"/80.0 MiB" in seen, seen[-300:]


def test_wheelhouse_is_packed_and_named_in_the_manifest(
    archiver: ArchiverRunner, model_inputs: Path
) -> None:
    (model_inputs / "wh").mkdir()
    (model_inputs / "wh" / "pkg-1.0-py3-none-any.whl").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    base = ("--model-name", "w", "--handler", "handler.py")
    alone = archiver(*base, "--wheelhouse", "wh")
    assert alone.exit_code == 2
    assert "--wheelhouse needs -r/--requirements-file" in alone.output
    missing = archiver(*base, "-r", "requirements.txt", "--wheelhouse", "nope")
    assert missing.exit_code == 3 and "--wheelhouse folder not found: nope" in missing.output
    made = archiver(*base, "-r", "requirements.txt", "--wheelhouse", "wh")
    assert made.exit_code == 0, made.output
    with open_archive(model_inputs / "w.mar") as archive:
        assert "wheels/pkg-1.0-py3-none-any.whl" in {m.name for m in archive.members}
        assert archive.manifest.extra["mserve"]["wheelhouse"] == "wheels"
        assert archive.verify().ok


def test_handler_style_is_recorded_only_when_named(
    archiver: ArchiverRunner, tmp_path: Path
) -> None:
    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    assert archiver("--model-name", "auto", "--handler", "h").exit_code == 0
    named = archiver("--model-name", "named", "--handler", "h", "--handler-style", "hooks")
    assert named.exit_code == 0, named.output
    bad = archiver("--model-name", "bad", "--handler", "h", "--handler-style", "magic")
    assert bad.exit_code != 0 and "'magic' is not one of" in bad.output
    assert not (tmp_path / "bad.mar").exists()
    with open_archive(tmp_path / "auto.mar") as archive:
        assert "handlerStyle" not in archive.manifest.extra.get("mserve", {})
    with open_archive(tmp_path / "named.mar") as archive:
        raw = json.loads(archive.read_bytes("MAR-INF/MANIFEST.json"))
    assert raw["mserve"]["handlerStyle"] == "hooks"


def test_archiver_and_worker_agree_on_builtins_and_styles() -> None:
    """The archiver cannot import the server, so both keep a list; they must stay equal."""
    from archiver.handler_spec import BUILTIN_HANDLERS, HANDLER_STYLES
    from mserve_worker import contract, sdk

    assert set(BUILTIN_HANDLERS) == set(sdk.BUILTIN_HANDLERS)
    assert tuple(HANDLER_STYLES) == tuple(contract.STYLES)
