"""The manifest: typed model of ``MAR-INF/MANIFEST.json``, validated against the JSON Schema.

Manifests from three writers are read: torch-model-archiver 0.12, MMS model-archiver 1.0.3 and
mserve. Writing produces exactly torch-model-archiver's fields (so TorchServe loads our archives),
plus one ``mserve`` key with per-member digests that other readers ignore.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archiver.errors import InvalidManifest
from archiver.jsonschema_import import import_jsonschema

if TYPE_CHECKING:
    import jsonschema

MANIFEST_PATH = "MAR-INF/MANIFEST.json"
# An archive's signature (archiver/signing/): the one member its manifest does not record
SIGNATURE_PATH = "MAR-INF/signature.sigstore.json"
DEFAULT_MODEL_VERSION = "1.0"
DEFAULT_RUNTIME = "python"
MSERVE_KEY = "mserve"
FORMAT_VERSION = 1

# Keys each writer produces inside "model", in torch-model-archiver's order.
_MODEL_KEYS = (
    ("modelName", "model_name"),
    ("serializedFile", "serialized_file"),
    ("handler", "handler"),
    ("modelFile", "model_file"),
    ("modelVersion", "model_version"),
    ("requirementsFile", "requirements_file"),
    ("configFile", "config_file"),
    ("description", "description"),
)


@cache
def schema() -> dict[str, Any]:
    """The manifest JSON Schema, from the installed package or, in a source checkout, the root."""
    packaged = resources.files("archiver").joinpath("manifest_schema.json")
    if packaged.is_file():
        return json.loads(packaged.read_text(encoding="utf-8"))
    checkout = Path(__file__).resolve().parent.parent / "manifest_schema.json"
    return json.loads(checkout.read_text(encoding="utf-8"))


@cache
def schema_digest() -> str:
    """sha256 of the schema: what a check "this manifest is valid" was made against, for a
    caller that remembers such checks (the server's unpack cache)."""
    return hashlib.sha256(json.dumps(schema(), sort_keys=True).encode()).hexdigest()


@cache
def _validator() -> jsonschema.protocols.Validator:
    # here, not at module level: jsonschema is slow to import, and every server module
    # imports this package (for its version) while only reading an archive validates
    jsonschema = import_jsonschema()

    cls = jsonschema.validators.validator_for(schema())
    cls.check_schema(schema())
    return cls(schema())


def model_name_pattern() -> str:
    """The model-name rule, taken from the schema so the CLI and the reader cannot disagree."""
    return schema()["properties"]["model"]["properties"]["modelName"]["pattern"]


def is_valid_model_name(name: str) -> bool:
    """Full match: Python's ``$`` (used by JSON Schema ``pattern``) also matches before a final
    newline, which let torch-model-archiver write a file literally named ``abc\n.mar``."""
    return re.fullmatch(model_name_pattern(), name) is not None


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class ModelInfo:
    """The ``model`` object. Unknown keys from other writers are kept in ``extra``."""

    model_name: str
    handler: str
    model_version: str = DEFAULT_MODEL_VERSION
    serialized_file: str | None = None
    model_file: str | None = None
    requirements_file: str | None = None
    config_file: str | None = None
    description: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    model: ModelInfo
    runtime: str = DEFAULT_RUNTIME
    created_on: str | None = None
    archiver_version: str | None = None
    files: Mapping[str, FileDigest] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def writer(self) -> str:
        """Which tool wrote it: 'mserve', 'mms' or 'torch-model-archiver'."""
        if MSERVE_KEY in self.extra or self.files:
            return "mserve"
        if "specificationVersion" in self.extra or "modelServerVersion" in self.extra:
            return "mms"
        return "torch-model-archiver"

    def referenced_files(self) -> dict[str, str]:
        """Manifest field name -> archive path, for the members the manifest points at."""
        refs = {
            "serializedFile": self.model.serialized_file,
            "modelFile": self.model.model_file,
            "requirementsFile": self.model.requirements_file,
            "configFile": self.model.config_file,
        }
        return {k: v for k, v in refs.items() if v}

    def to_json(self) -> dict[str, Any]:
        """The manifest as torch-model-archiver lays it out, with ``mserve`` last."""
        model: dict[str, Any] = {}
        for json_key, attr in _MODEL_KEYS:
            value = getattr(self.model, attr)
            if value is not None:
                model[json_key] = value
        model.update(self.model.extra)
        out: dict[str, Any] = {}
        if self.created_on is not None:
            out["createdOn"] = self.created_on
        out["runtime"] = self.runtime
        out["model"] = model
        if self.archiver_version is not None:
            out["archiverVersion"] = self.archiver_version
        out.update({k: v for k, v in self.extra.items() if k != MSERVE_KEY})
        if self.files:
            out[MSERVE_KEY] = {
                **self.extra.get(MSERVE_KEY, {}),
                "formatVersion": FORMAT_VERSION,
                "files": {
                    name: {"sha256": d.sha256, "size": d.size_bytes}
                    for name, d in sorted(self.files.items())
                },
            }
        return out

    def to_bytes(self) -> bytes:
        """torch-model-archiver's exact layout: 2-space indent, ASCII escapes, no final newline."""
        return json.dumps(self.to_json(), indent=2).encode("utf-8")


def created_on(epoch_s: float | None = None) -> str:
    """Timestamp in torch-model-archiver's format; UTC when an epoch is given (reproducible)."""
    when = time.gmtime(epoch_s) if epoch_s is not None else time.localtime()
    return time.strftime("%d/%m/%Y %H:%M:%S", when)


def _field_of(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        parts.append(missing[0] if missing else "?")
    return ".".join(parts) or "(top level)"


def _problem_of(error: jsonschema.ValidationError) -> str:
    if error.validator == "required":
        return "is missing (required)"
    if error.validator == "pattern":
        return f"value {error.instance!r} does not match {error.validator_value!r}"
    if error.validator == "enum":
        return f"value {error.instance!r} is not one of {error.validator_value}"
    if error.validator == "type":
        return f"value {error.instance!r} should be of type {error.validator_value}"
    return error.message


def validate(data: Any, source: str) -> None:
    """Raise ``InvalidManifest`` naming the first field that breaks the schema."""
    if not isinstance(data, dict):
        raise InvalidManifest(source, f"expected a JSON object, found {type(data).__name__}")
    errors = sorted(_validator().iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        from jsonschema.exceptions import best_match  # imported by _validator() already

        error = best_match(errors)
        raise InvalidManifest(source, _problem_of(error), field=_field_of(error))


def parse(raw: bytes, source: str, schema_checked: bool = False) -> Manifest:
    """Parse and validate manifest bytes; missing optional fields get TorchServe's defaults.
    ``schema_checked``: these very bytes passed :func:`validate` before, against the schema of
    :func:`schema_digest` (the caller knows: the server's unpack cache), so it is not run again.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(source, f"not valid JSON: {exc}") from exc
    if not schema_checked:
        validate(data, source)
    if not is_valid_model_name(data["model"]["modelName"]):
        raise InvalidManifest(
            source,
            f"value {data['model']['modelName']!r} is not a valid model name",
            field="model.modelName",
        )
    model_data = dict(data["model"])
    known = {json_key: attr for json_key, attr in _MODEL_KEYS}
    kwargs = {known[k]: model_data.pop(k) for k in list(model_data) if k in known}
    model = ModelInfo(**kwargs, extra=model_data)
    top = {
        k: v
        for k, v in data.items()
        if k not in ("createdOn", "runtime", "model", "archiverVersion")
    }
    files: dict[str, FileDigest] = {}
    if MSERVE_KEY in top:
        for name, d in top[MSERVE_KEY]["files"].items():
            files[name] = FileDigest(sha256=d["sha256"], size_bytes=d["size"])
    return Manifest(
        model=model,
        runtime=data.get("runtime", DEFAULT_RUNTIME),
        created_on=data.get("createdOn"),
        archiver_version=data.get("archiverVersion"),
        files=files,
        extra=top,
    )
