"""``generate_model_archive``: build one archive from a ``ModelArchiverConfig``.

The archive is the one our ``torch-model-archiver`` command writes for the same arguments: the
config goes to the same ``archiver.cli.build`` (inputs checked before anything is written, the
archive written beside its target and renamed into place). Our archiver's errors are translated
here, once, into ``ModelArchiverError`` with the same message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import archiver
from archiver.cli import build
from archiver.errors import ArchiverError
from archiver.writer import ArchiveFormat
from model_archiver.arg_parser import ArgParser
from model_archiver.manifest_components.manifest import RuntimeType
from model_archiver.model_archiver_config import ModelArchiverConfig
from model_archiver.model_archiver_error import ModelArchiverError

logger = logging.getLogger(__name__)

_FORMATS = tuple(f.value for f in ArchiveFormat)
_RUNTIMES = tuple(r.value for r in RuntimeType)


@contextlib.contextmanager
def our_archiver() -> Iterator[None]:
    """Make ``import archiver`` mean mserve's archiver for the duration of a build.

    TorchServe's test fixture (test/pytest/conftest.py) loads its own ``model_packaging.py``
    under the module name ``archiver`` and puts it in ``sys.modules`` for the whole test module,
    then deletes it; our archiver looks itself up by that name (its packaged schema, through
    ``importlib.resources``). The package imported with this module is put back while we build
    and whatever was there is restored after, so their fixture keeps its module."""
    current = sys.modules.get("archiver")
    if current is archiver:
        yield
        return
    sys.modules["archiver"] = archiver
    try:
        yield
    finally:
        if current is None:
            sys.modules.pop("archiver", None)
        else:
            sys.modules["archiver"] = current


def _path(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


def _check(config: ModelArchiverConfig) -> None:
    """What the command line's parser guarantees and a hand-made config may lack."""
    for name in ("model_name", "handler", "version"):
        value = getattr(config, name)
        if not isinstance(value, str) or not value.strip():
            raise ModelArchiverError(
                f"ModelArchiverConfig.{name} must be a non-empty string, got {value!r}"
            )
    if config.archive_format not in _FORMATS:
        raise ModelArchiverError(
            f"ModelArchiverConfig.archive_format must be one of {', '.join(_FORMATS)},"
            f" got {config.archive_format!r}"
        )
    if config.runtime not in _RUNTIMES:
        raise ModelArchiverError(
            f"ModelArchiverConfig.runtime must be one of {', '.join(_RUNTIMES)},"
            f" got {config.runtime!r}"
        )


def build_archive(config: ModelArchiverConfig) -> Path:
    """Write the archive ``config`` describes; return its path (``.mar``, ``.tar.gz`` or the
    folder for ``no-archive``). Raises ``ModelArchiverError``; an ``OSError`` while writing
    (disk full, permissions) propagates as it does from TorchServe's."""
    _check(config)
    extra_files = _path(config.extra_files)
    with our_archiver(), _translated():
        return build(
            model_name=config.model_name,
            handler=config.handler,
            version=config.version,
            serialized_file=_path(config.serialized_file),
            model_file=_path(config.model_file),
            extra_files=(extra_files,) if extra_files else (),
            requirements_file=_path(config.requirements_file),
            config_file=_path(config.config_file),
            export_path=_path(config.export_path) or os.getcwd(),
            archive_format=config.archive_format,
            runtime=config.runtime,
            force=bool(config.force),
            model_path=None,
        )


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """Our archiver's errors as ``ModelArchiverError``, same message, translated once here."""
    try:
        yield
    except ArchiverError as exc:
        raise ModelArchiverError(str(exc), exc.code) from exc


def generate_model_archive(config: ModelArchiverConfig | None = None) -> Path:
    """Build the archive ``config`` describes, or, without one, what ``sys.argv`` asks for
    (torch-model-archiver's flags). Returns the path written (TorchServe's returns None)."""
    if config is None:
        config = ArgParser.export_model_args_parser()
    out = build_archive(config)
    logger.info("Successfully exported model %s to file %s", config.model_name, out)
    return out
