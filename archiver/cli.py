"""``model-archiver``: torch-model-archiver's and MMS model-archiver's flags over our library.

A thin layer: it parses flags, resolves inputs into members and a manifest, and calls the writer.
Every ``ArchiverError`` becomes one line on stderr and the error's exit code; nothing a user can
get wrong prints a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from archiver import __version__
from archiver.checks import InputProblems, handler_problems, missing_inputs
from archiver.errors import (
    ArchiverError,
    DigestMismatch,
    ExportPathMissing,
    OutputExists,
    UsageError,
)
from archiver.handler_spec import BUILTIN_HANDLERS, HANDLER_STYLES, HandlerSpec, parse_handler
from archiver.manifest import (
    Manifest,
    ModelInfo,
    created_on,
    is_valid_model_name,
    model_name_pattern,
)
from archiver.members import MemberSet, split_list
from archiver.model_config import load_model_config
from archiver.reader import Archive, open_archive
from archiver.writer import ArchiveFormat, target_path, write_archive

PROGRESS_MIN_BYTES = 64 << 20  # smaller inputs archive too fast for a bar to help
ARCHIVER_VERSION = f"mserve-{__version__}"
WHEELHOUSE_DIR = "wheels"  # where --wheelhouse lands in the archive; named in the manifest


# the name TorchServe's archiver is installed as (mserve-torchserve installs ours under it)
TORCH_ARCHIVER = "torch-model-archiver"


def _prog() -> str:
    """The command's name as invoked: ``torch-model-archiver``, else ``model-archiver``."""
    ctx = click.get_current_context(silent=True)
    torch_archiver = ctx is not None and ctx.info_name == TORCH_ARCHIVER
    return TORCH_ARCHIVER if torch_archiver else "model-archiver"


def _warn(message: str) -> None:
    click.echo(f"{_prog()}: warning: {message}", err=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _resolve_handler_module(spec: HandlerSpec, members: MemberSet) -> None:
    """Find where a handler named by module lives; pack ``./h.py`` when that is what was meant."""
    if spec.source_file is not None or members.names() & set(spec.module_paths):
        return
    local = Path(spec.module_paths[0])
    if "." not in spec.module and local.is_file():
        members.add_file(local, "--handler")
        return
    if spec.module in BUILTIN_HANDLERS:
        return
    _warn(
        f"handler module '{spec.module}' is not in the archive (no {spec.module_paths[0]} in"
        " --extra-files or --model-path); it must be importable in the model's environment"
        " (installed from the requirements file or built in)"
    )


def build(
    *,
    model_name: str,
    handler: str,
    version: str,
    serialized_file: str | None,
    model_file: str | None,
    extra_files: tuple[str, ...],
    requirements_file: str | None,
    config_file: str | None,
    export_path: str,
    archive_format: str,
    runtime: str,
    force: bool,
    model_path: str | None,
    wheelhouse: str | None = None,
    handler_style: str = "auto",
    sign: str | None = None,
    sign_certificate: str | None = None,
) -> Path:
    """Validate every input first, then write; a mistake leaves nothing behind."""
    if not is_valid_model_name(model_name):
        raise UsageError(
            f"invalid --model-name {model_name!r}",
            hint="use letters, digits, '_', '-' and '.', starting with a letter or digit"
            f" (the pattern {model_name_pattern()} that TorchServe applies)",
        )
    if not version.strip():
        raise UsageError("--version is empty", hint="give a version such as 1.0, or leave it out")
    files = {
        "--serialized-file": serialized_file,
        "--model-file": model_file,
        "--requirements-file": requirements_file,
        "--config-file": config_file,
    }
    problems = missing_inputs(export_path, files, handler, model_path)
    if len(problems) > 1:  # all of them at once; one alone is raised where it is met below
        raise InputProblems(problems)
    export_dir = Path(export_path)
    if not export_dir.is_dir():
        raise ExportPathMissing(export_path)
    fmt = ArchiveFormat(archive_format)
    target = target_path(export_dir, model_name, fmt)
    if not force and (target.exists() or target.is_symlink()):
        raise OutputExists(str(target))

    signs = None
    if sign:  # the key is read before anything is written: a bad one leaves nothing behind
        from archiver.signing import load_signer, sign_function

        signs = sign_function(load_signer(sign, sign_certificate), model_name)
    elif sign_certificate:
        raise UsageError("--sign-certificate goes with --sign KEY (the certificate's key)")
    spec = parse_handler(handler)
    members = MemberSet()
    if model_path:
        members.add_model_path(Path(model_path))
    names: dict[str, str | None] = {}
    for flag, value in (
        ("--serialized-file", serialized_file),
        ("--model-file", model_file),
        ("--requirements-file", requirements_file),
        ("--config-file", config_file),
    ):
        names[flag] = members.add_file(Path(value), flag) if value else None
    if config_file:
        load_model_config(Path(config_file))
    if spec.source_file is not None:
        members.add_file(spec.source_file, "--handler")
    members.add_extra(split_list(extra_files))
    for problem in handler_problems(spec, handler, members.names()):
        raise problem
    _resolve_handler_module(spec, members)
    extra: dict[str, Any] = {}
    if wheelhouse:
        if not requirements_file:
            raise UsageError("--wheelhouse needs -r/--requirements-file: the wheels install it")
        members.add_folder(Path(wheelhouse), WHEELHOUSE_DIR, "--wheelhouse")
        extra.setdefault("mserve", {})["wheelhouse"] = WHEELHOUSE_DIR
    if handler_style != "auto":  # absent means: the worker detects the style
        extra.setdefault("mserve", {})["handlerStyle"] = handler_style

    manifest = Manifest(
        model=ModelInfo(
            model_name=model_name,
            handler=spec.manifest_value,
            model_version=version,
            serialized_file=names["--serialized-file"],
            model_file=names["--model-file"],
            requirements_file=names["--requirements-file"],
            config_file=names["--config-file"],
        ),
        runtime=runtime,
        created_on=created_on(),
        archiver_version=ARCHIVER_VERSION,
        extra=extra,
    )
    todo = members.members()
    total = sum(m.source.stat().st_size for m in todo)
    from rich.console import Console  # only the CLI draws progress

    console = Console(stderr=True)
    if total < PROGRESS_MIN_BYTES or not console.is_terminal:  # piped (CI, scripts): quiet
        return write_archive(manifest, todo, export_dir, fmt, force=force, sign=signs)
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"archiving {model_name}", total=total)
        return write_archive(
            manifest, todo, export_dir, fmt, force=force, sign=signs,
            progress=lambda done: bar.advance(task, done),
        )  # fmt: skip


def _inspect(path: str, as_json: bool) -> int:
    with open_archive(path) as archive:
        report = archive.verify()
        if as_json:
            click.echo(
                json.dumps(_inspect_json(archive, report.problems, report.recorded), indent=2)
            )
        else:
            _print_inspect(archive)
            if not report.recorded:
                status = (
                    f"no digests recorded (written by {archive.manifest.writer});"
                    f" read all {report.checked} files cleanly"
                )
            else:
                status = f"{report.checked} files match their recorded sha256"
            if report.ok:
                click.echo(f"verify:   OK, {status}")
            else:
                click.echo("verify:   FAILED")
                for problem in report.problems:
                    click.echo(f"  - {problem}")
        return 0 if report.ok else 8


def _verify(path: str, trust: tuple[str, ...]) -> int:
    """Who signed the archive, and whether every byte is what they signed: the signature
    against the manifest's digests, then each member's bytes against those (one read)."""
    from archiver.signing import TrustList, check_signature

    trusted = TrustList.load(trust)
    with open_archive(path) as archive:
        check = check_signature(archive, trusted)
        report = archive.verify()
        click.echo(f"archive:   {archive.path}")
        click.echo(f"signed by: {check.signer}")
        if not report.ok:
            click.echo("verify:    FAILED, the content differs from what was signed")
            for problem in report.problems:
                click.echo(f"  - {problem}")
            return DigestMismatch.exit_code
        click.echo(f"verify:    OK, {check.files} files are what was signed")
    return 0


def _inspect_json(archive: Archive, problems: list[str], recorded: bool) -> dict[str, Any]:
    return {
        "archive": str(archive.path),
        "format": archive.format,
        "manifest": archive.manifest.to_json(),
        "members": [
            {"name": m.name, "size": m.size_bytes, "compressed": m.compressed_bytes}
            for m in archive.members
            if not m.is_dir
        ],
        "verify": {"ok": not problems, "digests_recorded": recorded, "problems": problems},
    }


def _print_inspect(archive: Archive) -> None:
    m = archive.manifest
    files = [x for x in archive.members if not x.is_dir]
    click.echo(
        f"archive:  {archive.path} ({archive.format}, {len(files)} files,"
        f" {_human(sum(x.size_bytes for x in files))})"
    )
    click.echo(f"written:  by {m.archiver_version or m.writer} on {m.created_on or 'unknown date'}")
    click.echo(
        f"model:    {m.model.model_name} version {m.model.model_version}, runtime {m.runtime}"
    )
    click.echo(f"handler:  {m.model.handler}")
    for key, value in m.referenced_files().items():
        click.echo(f"{key + ':':<17} {value}")
    shown = m.to_json()
    if "mserve" in shown:  # the digests are listed with the members below
        shown["mserve"]["files"] = f"<{len(m.files)} sha256 digests, listed under members>"
    click.echo("manifest:")
    for line in json.dumps(shown, indent=2).splitlines():
        click.echo(f"  {line}")
    click.echo("members:")
    for x in files:
        digest = m.files[x.name].sha256[:16] if x.name in m.files else "-"
        click.echo(f"  {x.size_bytes:>14,}  {digest:<16}  {x.name}")


_FORMATS = [f.value for f in ArchiveFormat]


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Inspect an archive: model-archiver --inspect x.mar [--json]. See docs/archiver.md.",
)
@click.option("--model-name", help="Archive name; also the model's name when served.")
@click.option(
    "--handler", help="module, module:function, path/to/file.py[:function] or pkg.module:Callable."
)
@click.option("-v", "--version", "version", default="1.0", show_default=True, help="Model version.")
@click.option("--serialized-file", help="Weights file (state dict, TorchScript, ...).")
@click.option("--model-file", help="Python file defining the model class (eager mode).")
@click.option(
    "--extra-files",
    multiple=True,
    help="Comma-separated files, folders or globs; folders keep their name and structure.",
)
@click.option(
    "-r", "--requirements-file", help="requirements.txt installed into the model's own environment."
)
@click.option(
    "-c",
    "--config-file",
    help="Model config YAML (minWorkers, batchSize, ... and handler settings).",
)
@click.option(
    "--export-path",
    default=".",
    show_default="current folder",
    help="Existing folder to write into.",
)
@click.option(
    "--archive-format",
    type=click.Choice(_FORMATS),
    default="default",
    show_default=True,
    help="default: zip .mar; zip-store: uncompressed .mar; tgz: .tar.gz; no-archive: folder.",
)
@click.option(
    "--runtime", type=click.Choice(["python", "python3"]), default="python", show_default=True
)
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing archive.")
@click.option("--model-path", help="MMS style: pack this whole folder at the archive root.")
@click.option(
    "--wheelhouse",
    help="Folder of wheels for the requirements (pip download -d DIR -r"
    " requirements.txt): the server then installs offline, from the archive.",
)
@click.option(
    "--handler-style",
    type=click.Choice(["auto", *HANDLER_STYLES]),
    default="auto",
    show_default=True,
    help="How the server calls the handler; auto detects it from what the module defines."
    " Name it when detection would guess wrong.",
)
@click.option(
    "--inspect",
    "inspect_path",
    metavar="ARCHIVE",
    help="Print an archive's manifest and members and verify every digest.",
)
@click.option("--json", "as_json", is_flag=True, help="With --inspect: print JSON.")
@click.option(
    "--sign",
    metavar="KEY|sigstore",
    help="Sign the archive's content: a PEM private key (ECDSA or Ed25519), or 'sigstore' for"
    " Sigstore's keyless flow (needs the network). See docs/signing.md.",
)
@click.option(
    "--sign-certificate",
    metavar="PEM",
    help="With --sign KEY: the key's certificate (then its chain), carried in the signature.",
)
@click.option(
    "--verify",
    "verify_path",
    metavar="ARCHIVE",
    help="Check an archive's signature against --trust and every byte against it; print the"
    " signer.",
)
@click.option(
    "--trust",
    multiple=True,
    metavar="ENTRY",
    help="With --verify: a trusted public key or certificate file, or 'sigstore:IDENTITY"
    " ISSUER'; repeat for more.",
)
def main(
    inspect_path: str | None,
    as_json: bool,
    verify_path: str | None,
    trust: tuple[str, ...],
    **options: Any,
) -> None:
    """Pack a model into a .mar archive, compatible with torch-model-archiver and MMS."""
    try:
        if inspect_path:
            sys.exit(_inspect(inspect_path, as_json))
        if verify_path:
            sys.exit(_verify(verify_path, trust))
        if trust:
            raise UsageError("--trust goes with --verify ARCHIVE")
        for flag in ("model_name", "handler"):
            if not options[flag]:
                raise UsageError(
                    f"--{flag.replace('_', '-')} is required", hint=f"see {_prog()} -h"
                )
        started = time.perf_counter()
        out = build(**options)
        size = (
            sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            if out.is_dir()
            else out.stat().st_size
        )
        if _prog() != TORCH_ARCHIVER:  # which, as TorchServe's, says nothing on success
            click.echo(f"wrote {out} ({_human(size)}) in {time.perf_counter() - started:.2f} s")
    except ArchiverError as exc:
        click.echo(f"{_prog()}: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        click.echo(f"{_prog()}: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo(f"{_prog()}: interrupted; nothing was written", err=True)
        sys.exit(130)
