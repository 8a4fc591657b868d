"""``ModelArchiver``: TorchServe's class form of ``generate_model_archive``."""

from __future__ import annotations

from pathlib import Path

from model_archiver.model_archiver_config import ModelArchiverConfig
from model_archiver.model_packaging import generate_model_archive


class ModelArchiver:
    @staticmethod
    def generate_model_archive(config: ModelArchiverConfig) -> Path:
        """Write the archive ``config`` describes and return its path."""
        return generate_model_archive(config)
