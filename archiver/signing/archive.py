"""Sign an archive's content as it is written, and check an archive's signature before it is
unpacked: the signed digests against the manifest's and the members present, so that the
unpacking that follows (which compares each member's bytes with the manifest as they stream)
is what proves the bytes. Nothing here reads a member's content."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from archiver.errors import KeyUnusable, SignatureMismatch, Unsigned
from archiver.manifest import FileDigest
from archiver.signing import bundle as bundles
from archiver.signing.keys import load_certificates, load_private_key
from archiver.signing.payload import (
    MAX_BUNDLE_BYTES,
    SIGNATURE_PATH,
    content_digests,
    differences,
    statement,
)
from archiver.signing.trust import TrustList

if TYPE_CHECKING:
    from archiver.reader import Archive

KEYLESS = "sigstore"  # --sign sigstore: Sigstore's keyless flow
PASSWORD_ENV = "MSERVE_SIGNING_KEY_PASSWORD"

# what the writer calls once the digests are known: (manifest bytes, digests) -> bundle bytes
SignFunction = Callable[[bytes, Mapping[str, FileDigest]], bytes]


class Signer(Protocol):
    def sign(self, payload: bytes) -> bytes: ...


class KeySigner:
    """A private key (PEM), with the certificate chain that vouches for it when given."""

    def __init__(self, key: Path, certificate: Path | None, password: bytes | None) -> None:
        self._key = load_private_key(key, password)
        self._chain: list[bytes] = []
        if certificate is not None:
            from cryptography.hazmat.primitives.serialization import Encoding

            certs = load_certificates(certificate)
            if not certs:
                raise KeyUnusable(str(certificate), "holds no certificate")
            if certs[0].public_key() != self._key.public_key():
                raise KeyUnusable(
                    str(certificate), f"its first certificate is not for the key {key}"
                )
            self._chain = [c.public_bytes(Encoding.DER) for c in certs]

    def sign(self, payload: bytes) -> bytes:
        signature = bundles.sign_bytes(self._key, bundles.pae(payload))
        return bundles.write(payload, signature, key=self._key.public_key(), chain=self._chain)


def load_signer(
    spec: str, certificate: str | None = None, environ: Mapping[str, str] = os.environ
) -> Signer:
    """``--sign``: a private key file, or ``sigstore`` for the keyless flow."""
    if spec == KEYLESS:
        if certificate:
            raise KeyUnusable(certificate, "--sign sigstore gets its certificate from Fulcio")
        from archiver.signing.keyless import SigstoreSigner

        return SigstoreSigner(environ.get("SIGSTORE_ID_TOKEN"))
    password = environ.get(PASSWORD_ENV)
    return KeySigner(
        Path(spec).expanduser(),
        Path(certificate).expanduser() if certificate else None,
        password.encode() if password is not None else None,
    )


def sign_function(signer: Signer, model_name: str) -> SignFunction:
    def sign(manifest_bytes: bytes, files: Mapping[str, FileDigest]) -> bytes:
        return signer.sign(statement(model_name, content_digests(manifest_bytes, files)))

    return sign


@dataclass(frozen=True)
class SignatureCheck:
    """A signature that holds: who signed, and how many files it covers."""

    signer: str
    files: int


def check_signature(archive: Archive, trust: TrustList) -> SignatureCheck:
    """Raise Unsigned, SignatureInvalid, SignerNotTrusted or SignatureMismatch (naming each
    file that differs); reads the manifest and the bundle, no member's content."""
    where = str(archive.path)
    raw = archive.signature_bytes(MAX_BUNDLE_BYTES)
    if raw is None:
        raise Unsigned(where)
    verified = trust.verify(raw, where)
    signed = verified.content.digests
    problems = differences(signed, content_digests(archive.manifest_bytes, archive.manifest.files))
    present = {m.name for m in archive.members if not m.is_dir} - {SIGNATURE_PATH}
    for problem in differences(signed, {n: signed.get(n, "") for n in present}):
        if problem not in problems:
            problems.append(problem)
    if problems:
        raise SignatureMismatch(where, verified.signer, problems)
    return SignatureCheck(signer=verified.signer, files=len(signed))
