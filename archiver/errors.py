"""The archiver's error tree.

Every failure a user can cause is an ``ArchiverError`` subclass that carries the facts as fields
and a stable ``code``; the CLI prints ``str(error)`` (one line with the fix) and exits with the
class's ``exit_code``, so no user mistake ever shows a traceback.
"""

from __future__ import annotations


class ArchiverError(Exception):
    """Base of every error the archiver raises on purpose."""

    code = "archiver_error"
    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class UsageError(ArchiverError):
    """A flag or argument is wrong: bad name, bad handler spec, conflicting options."""

    code = "usage_error"
    exit_code = 2


class InputNotFound(ArchiverError):
    """A file or folder named on the command line does not exist."""

    code = "input_not_found"
    exit_code = 3

    def __init__(self, what: str, path: str) -> None:
        super().__init__(f"{what} not found: {path}", hint="check the path")
        self.what = what
        self.path = path


class OutputExists(ArchiverError):
    """The target archive already exists and ``--force`` was not given."""

    code = "output_exists"
    exit_code = 4

    def __init__(self, path: str) -> None:
        super().__init__(
            f"output already exists: {path}", hint="use -f/--force to overwrite, or another name"
        )
        self.path = path


class ExportPathMissing(ArchiverError):
    """``--export-path`` names a folder that does not exist."""

    code = "export_path_missing"
    exit_code = 3

    def __init__(self, path: str) -> None:
        super().__init__(
            f"export path does not exist or is not a folder: {path}",
            hint="create it first with mkdir -p, or pass another --export-path",
        )
        self.path = path


class InvalidModelConfig(ArchiverError):
    """The model config YAML (``--config-file``) cannot be parsed or has a bad key or value."""

    code = "invalid_model_config"
    exit_code = 5

    def __init__(self, path: str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"invalid model config {path}: {problem}", hint=hint)
        self.path = path
        self.problem = problem


class InvalidManifest(ArchiverError):
    """``MAR-INF/MANIFEST.json`` is missing, not JSON, or breaks the schema."""

    code = "invalid_manifest"
    exit_code = 6

    def __init__(self, source: str, problem: str, *, field: str | None = None) -> None:
        where = f" field '{field}'" if field else ""
        super().__init__(f"invalid manifest in {source}:{where} {problem}")
        self.source = source
        self.problem = problem
        self.field = field


class BadArchive(ArchiverError):
    """The file is not an archive we can read (unknown format, corrupt zip or tar)."""

    code = "bad_archive"
    exit_code = 6

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"cannot read archive {path}: {problem}")
        self.path = path
        self.problem = problem


class UnsafeArchive(ArchiverError):
    """A member would escape the target folder or is not a plain file or folder."""

    code = "unsafe_archive"
    exit_code = 7

    def __init__(self, path: str, member: str, problem: str) -> None:
        super().__init__(f"refusing to extract {path}: member '{member}' {problem}")
        self.path = path
        self.member = member
        self.problem = problem


class LimitExceeded(ArchiverError):
    """An archive breaks a configured extraction limit (count, size, total, compression ratio)."""

    code = "limit_exceeded"
    exit_code = 7

    def __init__(self, path: str, limit: str, detail: str) -> None:
        super().__init__(
            f"refusing to extract {path}: {detail}",
            hint=f"raise the '{limit}' limit if the archive is trusted",
        )
        self.path = path
        self.limit = limit
        self.detail = detail


class DigestMismatch(ArchiverError):
    """A member's sha256 differs from the one recorded in the manifest."""

    code = "digest_mismatch"
    exit_code = 8

    def __init__(self, path: str, problems: list[str]) -> None:
        super().__init__(f"archive {path} failed verification: " + "; ".join(problems))
        self.path = path
        self.problems = problems


class KeyUnusable(ArchiverError):
    """A signing key, certificate or trust-list entry cannot be read or used (names the file)."""

    code = "unusable_key"
    exit_code = 3

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class SignatureError(ArchiverError):
    """An archive's signature does not establish who made it; ``reason`` says which way (the
    server counts refusals by it): unsigned, invalid, untrusted or mismatch."""

    code = "signature_error"
    exit_code = 9
    reason = "invalid"


class Unsigned(SignatureError):
    reason = "unsigned"

    def __init__(self, path: str) -> None:
        super().__init__(f"archive {path} is not signed (no MAR-INF/signature.sigstore.json)")
        self.path = path


class SignatureInvalid(SignatureError):
    """The bundle does not parse, or its signature is not valid for its payload."""

    reason = "invalid"

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"the signature of {where} is not valid: {problem}")
        self.where = where
        self.problem = problem


class SignerNotTrusted(SignatureError):
    reason = "untrusted"

    def __init__(self, where: str, signer: str) -> None:
        super().__init__(
            f"archive {where} is signed by {signer}, which is not a trusted signer",
            hint="add its public key, certificate or identity to the trusted signers",
        )
        self.where = where
        self.signer = signer


class SignatureMismatch(SignatureError):
    """A valid signature by a trusted signer over other content than the archive holds."""

    reason = "mismatch"

    def __init__(self, where: str, signer: str, problems: list[str]) -> None:
        super().__init__(
            f"archive {where} does not match its signature by {signer}: " + "; ".join(problems)
        )
        self.where = where
        self.signer = signer
        self.problems = problems
