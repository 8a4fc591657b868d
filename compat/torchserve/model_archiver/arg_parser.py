"""``ArgParser``: torch-model-archiver's command line read into a ``ModelArchiverConfig``.

The command itself is ``archiver.cli`` (installed as ``torch-model-archiver``); this parser
serves ``generate_model_archive()`` called without a config, and TorchServe's tests, which
patch ``ArgParser.export_model_args_parser`` to hand their config in."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from model_archiver.manifest_components.manifest import RuntimeType
from model_archiver.model_archiver_config import ModelArchiverConfig

_FORMATS = ("default", "tgz", "no-archive", "zip-store")


class ArgParser:
    @staticmethod
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="torch-model-archiver", description="Pack a model into a .mar archive."
        )
        p.add_argument("--model-name", required=True, help="archive and model name")
        p.add_argument("--serialized-file", help="weights file")
        p.add_argument("--model-file", help="Python file defining the model class")
        p.add_argument("--handler", required=True, help="handler module, file or built-in name")
        p.add_argument("--extra-files", help="comma-separated extra files and folders")
        p.add_argument(
            "--runtime", default=RuntimeType.PYTHON.value, choices=[r.value for r in RuntimeType]
        )
        p.add_argument("--export-path", default=None, help="existing folder to write into")
        p.add_argument("--archive-format", default="default", choices=_FORMATS)
        p.add_argument("-f", "--force", action="store_true", help="overwrite an existing archive")
        p.add_argument("-v", "--version", required=True, help="model version")
        p.add_argument("-r", "--requirements-file", help="the model's requirements.txt")
        p.add_argument("-c", "--config-file", help="model config YAML")
        return p

    @staticmethod
    def export_model_args_parser(argv: Sequence[str] | None = None) -> ModelArchiverConfig:
        """The config for ``argv`` (default ``sys.argv[1:]``); exits 2 on bad flags, as
        argparse does."""
        args = ArgParser.parser().parse_args(argv)
        if args.export_path is None:
            args.export_path = os.getcwd()
        return ModelArchiverConfig.from_args(args)
