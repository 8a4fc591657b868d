"""``ModelArchiverConfig``: torch-model-archiver's arguments as a dataclass."""

from __future__ import annotations

import os
from argparse import Namespace
from dataclasses import dataclass, field, fields
from typing import Literal

from model_archiver.manifest_components.manifest import RuntimeType

ArchiveFormatName = Literal["default", "tgz", "no-archive", "zip-store"]


@dataclass
class ModelArchiverConfig:
    """One archive to build; each field is the flag of the same name (``--model-name``, ...).

    ``extra_files`` is one comma-separated string, as on the command line. ``export_path``
    defaults to the working folder when the config is made (TorchServe's: when the module was
    imported)."""

    model_name: str
    handler: str
    version: str
    serialized_file: str | None = None
    model_file: str | None = None
    extra_files: str | None = None
    runtime: str = RuntimeType.PYTHON.value
    export_path: str = field(default_factory=os.getcwd)
    archive_format: ArchiveFormatName = "default"
    force: bool = False
    requirements_file: str | None = None
    config_file: str | None = None

    @classmethod
    def from_args(cls, args: Namespace) -> ModelArchiverConfig:
        """The config for parsed arguments that carry every field as an attribute."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
