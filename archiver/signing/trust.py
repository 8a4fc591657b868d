"""Who may sign: a list of trusted signers, and the check of a bundle against it.

An entry is a PEM public key file (ECDSA or Ed25519: the key that signed), a PEM certificate
file (a CA: any signing certificate it issued; or one signer's own certificate), or a Sigstore
identity, ``sigstore:IDENTITY ISSUER`` (the e-mail or workflow URI Fulcio certified, and the
OpenID Connect issuer that vouched for it). A bundle passes when its signature is valid and its
signer is on the list; the answer names the signer either way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from archiver.errors import KeyUnusable, SignatureInvalid, SignerNotTrusted
from archiver.signing import bundle as bundles
from archiver.signing.bundle import ParsedBundle, PublicKey
from archiver.signing.keyless import Identity, verify_keyless
from archiver.signing.keys import load_trusted
from archiver.signing.payload import SignedContent, parse_statement

SIGSTORE_PREFIX = "sigstore:"


@dataclass(frozen=True)
class Verified:
    signer: str
    content: SignedContent


@dataclass
class TrustList:
    keys: dict[str, tuple[str, PublicKey]] = field(default_factory=dict)  # hint -> (file, key)
    certificates: list[tuple[str, x509.Certificate]] = field(default_factory=list)
    identities: list[Identity] = field(default_factory=list)

    @classmethod
    def load(cls, entries: Iterable[str], base: Path | None = None) -> TrustList:
        """Read every entry now: a missing or unreadable file fails here, naming it."""
        trust = cls()
        for entry in entries:
            if entry.startswith(SIGSTORE_PREFIX):
                parts = entry[len(SIGSTORE_PREFIX) :].split()
                if len(parts) not in (2, 3) or not parts[1].startswith(("https://", "http://")):
                    raise KeyUnusable(
                        entry,
                        "a Sigstore identity is 'sigstore:IDENTITY ISSUER [TRUSTED_ROOT]', e.g."
                        " 'sigstore:alice@example.com https://accounts.google.com'",
                    )
                root = None
                if len(parts) == 3:
                    root = str(_under(Path(parts[2]), base))
                    if not Path(root).is_file():
                        raise KeyUnusable(root, "no such file (the Sigstore trusted root)")
                trust.identities.append(Identity(parts[0], parts[1], root))
                continue
            path = _under(Path(entry), base)
            found = load_trusted(path)
            if isinstance(found, list):
                trust.certificates += [(str(path), cert) for cert in found]
            else:
                trust.keys[bundles.key_hint(found)] = (str(path), found)
        return trust

    def __bool__(self) -> bool:
        return bool(self.keys or self.certificates or self.identities)

    def verify(self, raw: bytes, where: str) -> Verified:
        """Check a bundle's signature and signer; its statement's digests when both hold."""
        parsed = bundles.parse(raw, where)
        if parsed.keyless:
            signer, payload_type, payload = verify_keyless(parsed, self.identities, where)
        elif parsed.chain:
            signer, key = self._certificate(parsed, where)
            self._check(key, parsed, where)
            payload_type, payload = parsed.payload_type, parsed.payload
        else:
            hint = parsed.key_hint or ""
            if hint not in self.keys:
                raise SignerNotTrusted(where, f"the key sha256:{hint[:16]}")
            path, key = self.keys[hint]
            self._check(key, parsed, where)
            signer = f"the key {path} (sha256:{hint[:16]})"
            payload_type, payload = parsed.payload_type, parsed.payload
        return Verified(signer, parse_statement(payload_type, payload, where))

    @staticmethod
    def _check(key: PublicKey, parsed: ParsedBundle, where: str) -> None:
        try:
            bundles.verify_bytes(key, parsed.signature, bundles.pae(parsed.payload))
        except (InvalidSignature, TypeError, ValueError):
            raise SignatureInvalid(where, "the signature does not verify with its key") from None

    def _certificate(self, parsed: ParsedBundle, where: str) -> tuple[str, PublicKey]:
        """The signing certificate's subject and key, once it chains to a trusted
        certificate; checked at the time it was issued, as no timestamp says when it signed."""
        from cryptography.x509.verification import (
            ExtensionPolicy,
            PolicyBuilder,
            Store,
            VerificationError,
        )

        try:
            chain = [x509.load_der_x509_certificate(der) for der in parsed.chain]
        except ValueError as exc:
            raise SignatureInvalid(where, f"its certificate does not parse ({exc})") from None
        leaf = chain[0]
        who = _subject(leaf)
        key = leaf.public_key()
        if any(cert == leaf for _, cert in self.certificates):
            return f"the certificate {who}", key  # type: ignore[return-value]
        anchors = [cert for _, cert in self.certificates]
        if not anchors:
            raise SignerNotTrusted(where, f"the certificate {who}")
        verifier = (
            PolicyBuilder()
            .store(Store(anchors))
            .time(leaf.not_valid_before_utc)
            .extension_policies(
                ca_policy=ExtensionPolicy.webpki_defaults_ca(),
                ee_policy=ExtensionPolicy.permit_all(),
            )
            .build_client_verifier()
        )
        try:
            verified = verifier.verify(leaf, chain[1:])
        except VerificationError as exc:
            raise SignerNotTrusted(where, f"the certificate {who} ({exc})") from None
        root = verified.chain[-1]
        path = next(p for p, cert in self.certificates if cert == root)
        return f"the certificate {who}, issued under {path}", key  # type: ignore[return-value]


def _under(path: Path, base: Path | None) -> Path:
    path = path.expanduser()
    return base / path if base is not None and not path.is_absolute() else path


def _subject(cert: x509.Certificate) -> str:
    """A certificate in words: its e-mail or URI, else its common name, and a fingerprint."""
    names: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(v) for v in san.get_values_for_type(x509.RFC822Name)]
        names += [str(v) for v in san.get_values_for_type(x509.UniformResourceIdentifier)]
    except x509.ExtensionNotFound:
        pass
    if not names:
        names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    fingerprint = hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()[:16]
    return f"{', '.join(names) or cert.subject.rfc4514_string()} (sha256:{fingerprint})"
