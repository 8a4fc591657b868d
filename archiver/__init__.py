"""Build, read, verify and safely extract model archives (``.mar``, ``.tar.gz``, folders).

This package never imports ``server``; the server reads archives only through the names below.
"""

from archiver.errors import (
    ArchiverError,
    BadArchive,
    DigestMismatch,
    InvalidManifest,
    LimitExceeded,
    UnsafeArchive,
)
from archiver.manifest import (
    MANIFEST_PATH,
    FileDigest,
    Manifest,
    ModelInfo,
    parse,
    schema_digest,
)
from archiver.reader import Archive, ExtractLimits, MemberInfo, VerifyReport, open_archive
from archiver.writer import ArchiveFormat, write_archive

__version__ = "0.1.0"

__all__ = [
    "MANIFEST_PATH",
    "Archive",
    "ArchiveFormat",
    "ArchiverError",
    "BadArchive",
    "DigestMismatch",
    "ExtractLimits",
    "FileDigest",
    "InvalidManifest",
    "LimitExceeded",
    "Manifest",
    "MemberInfo",
    "ModelInfo",
    "UnsafeArchive",
    "VerifyReport",
    "__version__",
    "open_archive",
    "parse",
    "schema_digest",
    "write_archive",
]
