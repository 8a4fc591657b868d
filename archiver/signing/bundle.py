"""Sigstore bundles (v0.3) holding a DSSE envelope: written for key and certificate signatures,
read for all, with ``sigstore-models`` (Sigstore's own schema of the bundle) doing the parsing.

Keyless (Fulcio and Rekor) bundles are written and checked by ``sigstore`` itself
(archiver/signing/keyless.py); key and certificate bundles carry no transparency log entry,
which ``sigstore``'s verifier requires, so their envelope signature is checked here with
``cryptography`` (DSSE: the pre-authentication encoding of the payload, signed as is).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from sigstore_models.bundle import v1 as bundle_v1
from sigstore_models.common import v1 as common_v1
from sigstore_models.intoto import Envelope
from sigstore_models.intoto import Signature as EnvelopeSignature

from archiver.errors import SignatureInvalid
from archiver.signing.payload import PAYLOAD_TYPE

MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey


@dataclass(frozen=True)
class ParsedBundle:
    raw: bytes
    bundle: bundle_v1.Bundle
    payload_type: str
    payload: bytes
    signature: bytes

    @property
    def key_hint(self) -> str | None:
        key = self.bundle.verification_material.public_key
        return key.hint if key is not None else None

    @property
    def chain(self) -> list[bytes]:
        """DER certificates, leaf first (a certificate signature's)."""
        chain = self.bundle.verification_material.x509_certificate_chain
        return [c.raw_bytes for c in chain.certificates] if chain is not None else []

    @property
    def keyless(self) -> bool:
        """Signed through Sigstore (Fulcio's certificate, a Rekor entry): sigstore checks it."""
        return bool(self.bundle.verification_material.tlog_entries)


def pae(payload: bytes, payload_type: str = PAYLOAD_TYPE) -> bytes:
    """DSSE's pre-authentication encoding: what the envelope's signature signs."""
    head = f"DSSEv1 {len(payload_type)} {payload_type} {len(payload)} "
    return head.encode("utf-8") + payload


def key_hint(key: PublicKey) -> str:
    """model_signing's key identifier: sha256 of the public key's PEM (SubjectPublicKeyInfo)."""
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(pem).hexdigest()


def _ec_hash(key: ec.EllipticCurvePublicKey) -> hashes.HashAlgorithm:
    return {256: hashes.SHA256(), 384: hashes.SHA384()}.get(key.curve.key_size, hashes.SHA512())


def sign_bytes(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(_ec_hash(key.public_key())))


def verify_bytes(key: PublicKey, signature: bytes, data: bytes) -> None:
    """Raise cryptography's InvalidSignature when ``signature`` is not ``key``'s over ``data``."""
    if isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(signature, data)
    else:
        key.verify(signature, data, ec.ECDSA(_ec_hash(key)))


def write(
    payload: bytes, signature: bytes, *, key: PublicKey | None = None, chain: list[bytes] = ()
) -> bytes:
    """A bundle naming its key by hint, or carrying its certificate chain (DER, leaf first)."""
    if chain:
        material = bundle_v1.VerificationMaterial(
            x509_certificate_chain=common_v1.X509CertificateChain(
                certificates=[
                    common_v1.X509Certificate(raw_bytes=base64.b64encode(c)) for c in chain
                ]
            ),
            tlog_entries=[],
        )
    else:
        assert key is not None
        material = bundle_v1.VerificationMaterial(
            public_key=common_v1.PublicKeyIdentifier(hint=key_hint(key)), tlog_entries=[]
        )
    envelope = Envelope(
        payload=base64.b64encode(payload),
        payload_type=PAYLOAD_TYPE,
        signatures=[EnvelopeSignature(sig=base64.b64encode(signature), keyid="")],
    )
    bundle = bundle_v1.Bundle(
        media_type=MEDIA_TYPE, verification_material=material, dsse_envelope=envelope
    )
    return bundle.to_json().encode("utf-8")


def parse(raw: bytes, where: str) -> ParsedBundle:
    """A bundle's parts, or SignatureInvalid saying why it does not parse."""
    try:
        bundle = bundle_v1.Bundle.from_json(raw)
    except ValueError as exc:  # pydantic's ValidationError (sigstore-models) is one
        first = str(exc).splitlines()
        reason = " ".join(first[:3]) if first else repr(exc)
        raise SignatureInvalid(where, f"the bundle does not parse ({reason})") from None
    envelope = bundle.dsse_envelope
    if envelope is None or len(envelope.signatures) != 1:
        raise SignatureInvalid(where, "the bundle holds no DSSE envelope with one signature")
    return ParsedBundle(
        raw=raw,
        bundle=bundle,
        payload_type=envelope.payload_type,
        payload=envelope.payload,
        signature=envelope.signatures[0].sig,
    )
