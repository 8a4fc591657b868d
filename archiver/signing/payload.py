"""What a signature covers: every file of an archive, named by its sha256, in the OpenSSF model
signing format (an in-toto statement, predicate ``https://model_signing/signature/v1.0``).

The digests are the ones the manifest records (``mserve.files``, computed while the archive was
written), plus the manifest's own sha256, so the statement covers every byte of the archive but
one member: the signature itself (``MAR-INF/signature.sigstore.json``), which cannot cover
itself. It is listed in the statement's ``ignore_paths``; a changed signature fails its own
check instead. An unpacked archive is a model folder the ``model_signing`` tool verifies as is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from archiver.errors import SignatureInvalid
from archiver.manifest import MANIFEST_PATH, SIGNATURE_PATH, FileDigest

__all__ = ["SIGNATURE_PATH"]  # re-exported: archiver.signing names it
MAX_BUNDLE_BYTES = 4 << 20  # a bundle is a few KiB; a certificate chain adds a few more
PAYLOAD_TYPE = "application/vnd.in-toto+json"
_STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
_PREDICATE_TYPE = "https://model_signing/signature/v1.0"


@dataclass(frozen=True)
class SignedContent:
    """What a verified statement says was signed: archive path -> sha256."""

    model_name: str
    digests: Mapping[str, str]


def content_digests(manifest_bytes: bytes, files: Mapping[str, FileDigest]) -> dict[str, str]:
    """The digests a signature covers: each recorded file and the manifest's own bytes."""
    out = {name: d.sha256 for name, d in files.items()}
    out[MANIFEST_PATH] = hashlib.sha256(manifest_bytes).hexdigest()
    return out


def _root(names: list[str], digests: Mapping[str, str]) -> str:
    """model_signing's subject digest: sha256 over the resources' raw digests, in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(digests[n]) for n in names)).hexdigest()


def statement(model_name: str, digests: Mapping[str, str]) -> bytes:
    """The in-toto statement to sign (the DSSE payload)."""
    names = sorted(digests)
    body = {
        "_type": _STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": _root(names, digests)}}],
        "predicateType": _PREDICATE_TYPE,
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": [SIGNATURE_PATH],
            },
            "resources": [{"name": n, "algorithm": "sha256", "digest": digests[n]} for n in names],
        },
    }
    return json.dumps(body, indent=None, separators=(",", ":")).encode("utf-8")


def parse_statement(payload_type: str, payload: bytes, where: str) -> SignedContent:
    """A signed payload's digests, once its shape and its subject digest are checked."""
    if payload_type != PAYLOAD_TYPE:
        raise SignatureInvalid(where, f"its payload is {payload_type!r}, not {PAYLOAD_TYPE!r}")
    try:
        body: Any = json.loads(payload)
        if body["_type"] != _STATEMENT_TYPE or body["predicateType"] != _PREDICATE_TYPE:
            raise SignatureInvalid(
                where,
                f"it signs a {body['predicateType']!r} statement, not a model signature"
                f" ({_PREDICATE_TYPE})",
            )
        serialization = body["predicate"]["serialization"]
        if serialization.get("method") != "files" or serialization.get("hash_type") != "sha256":
            raise SignatureInvalid(
                where,
                f"it signs digests made by {serialization.get('method')!r}/"
                f"{serialization.get('hash_type')!r}; mserve reads files/sha256",
            )
        digests: dict[str, str] = {}
        names: list[str] = []
        for item in body["predicate"]["resources"]:
            if item["algorithm"] != "sha256":
                raise SignatureInvalid(where, f"'{item['name']}' is signed as {item['algorithm']}")
            bytes.fromhex(item["digest"])
            digests[str(item["name"])] = str(item["digest"]).lower()
            names.append(str(item["name"]))
        (subject,) = body["subject"]
        if subject["digest"]["sha256"] != _root(names, digests):
            raise SignatureInvalid(where, "its subject digest does not match its resources")
        return SignedContent(model_name=str(subject["name"]), digests=digests)
    except (ValueError, KeyError, TypeError) as exc:  # json, fromhex, a missing key, 2 subjects
        raise SignatureInvalid(where, f"its statement is malformed ({exc!r})") from None


def differences(signed: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """Each file that differs from what was signed, in words naming it."""
    out = [f"'{n}' differs from what was signed" for n in sorted(signed) if n in actual
           and actual[n] != signed[n]]  # fmt: skip
    out += [f"'{n}' was added after signing" for n in sorted(actual) if n not in signed]
    out += [f"'{n}' was signed but is missing" for n in sorted(signed) if n not in actual]
    return out
