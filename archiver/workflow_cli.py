"""``workflow-archiver`` (also installed as ``torch-workflow-archiver``): TorchServe's
torch-workflow-archiver flags over :func:`archiver.workflow.write_workflow_archive`.

Under TorchServe's name it prints nothing when the archive is written, as TorchServe's does;
``workflow-archiver`` says what it wrote. Errors are one line on stderr and the error's exit
code.
"""

from __future__ import annotations

from pathlib import Path

import click

from archiver.errors import ArchiverError
from archiver.members import split_list
from archiver.workflow import write_workflow_archive

TORCH_WORKFLOW_ARCHIVER = "torch-workflow-archiver"


def _prog() -> str:
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.info_name == TORCH_WORKFLOW_ARCHIVER:
        return TORCH_WORKFLOW_ARCHIVER
    return "workflow-archiver"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--workflow-name", required=True,
    help="The workflow's name: the archive is <export-path>/<workflow-name>.war.",
)  # fmt: skip
@click.option(
    "--spec-file", required=True,
    help="The workflow's YAML specification: its models and DAG.",
)  # fmt: skip
@click.option(
    "--handler", required=True,
    help="The Python file with the functions the DAG names (pre- and post-processing).",
)  # fmt: skip
@click.option(
    "--export-path", default=".", show_default=True, help="Folder the .war is written to."
)
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing .war of that name.")
@click.option("--extra-files", default=None, help="Comma-separated files to add beside them.")
def main(
    workflow_name: str,
    spec_file: str,
    handler: str,
    export_path: str,
    force: bool,
    extra_files: str | None,
) -> None:
    """Pack a workflow (spec, handler, extra files) into a .war, as torch-workflow-archiver."""
    try:
        target = write_workflow_archive(
            workflow_name,
            Path(spec_file),
            Path(handler),
            Path(export_path),
            tuple(Path(p) for p in split_list([extra_files] if extra_files else [])),
            force,
        )
    except ArchiverError as exc:
        click.echo(f"{_prog()}: error: {exc}", err=True)
        raise SystemExit(exc.exit_code) from None
    if _prog() != TORCH_WORKFLOW_ARCHIVER:
        click.echo(f"wrote {target} ({target.stat().st_size} bytes)")
