"""Read signing keys, public keys and certificates from PEM files, with errors that name the
file and the reason. mserve signs with ECDSA (P-256, P-384, P-521: what Sigstore's key
signatures and ``model_signing`` use) and Ed25519 keys."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from archiver.errors import KeyUnusable
from archiver.signing.bundle import PrivateKey, PublicKey

_KINDS = "ECDSA (P-256, P-384, P-521) or Ed25519"
_CURVES = ("secp256r1", "secp384r1", "secp521r1")
MAX_PEM_BYTES = 1 << 20


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise KeyUnusable(str(path), "no such file") from None
    except OSError as exc:
        raise KeyUnusable(str(path), f"cannot be read ({exc.strerror})") from None
    if len(data) > MAX_PEM_BYTES:
        raise KeyUnusable(str(path), f"is larger than {MAX_PEM_BYTES} bytes; not a PEM key")
    return data


def _supported(key: object, path: Path) -> None:
    if isinstance(key, ed25519.Ed25519PublicKey | ed25519.Ed25519PrivateKey):
        return
    if isinstance(key, ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey):
        if key.curve.name in _CURVES:
            return
        raise KeyUnusable(str(path), f"an EC key on {key.curve.name}; use {_KINDS}")
    raise KeyUnusable(str(path), f"a {type(key).__name__.lstrip('_')}; use {_KINDS}")


def load_private_key(path: Path, password: bytes | None = None) -> PrivateKey:
    data = _read(path)
    try:
        key = serialization.load_pem_private_key(data, password)
    except TypeError:  # encrypted without a password, or a password for a plain key
        raise KeyUnusable(
            str(path),
            "the key is encrypted: set MSERVE_SIGNING_KEY_PASSWORD"
            if password is None
            else "the key is not encrypted: unset MSERVE_SIGNING_KEY_PASSWORD",
        ) from None
    except ValueError as exc:
        raise KeyUnusable(str(path), f"not a PEM private key ({exc})") from None
    _supported(key, path)
    return key  # type: ignore[return-value]


def load_certificates(path: Path) -> list[x509.Certificate]:
    data = _read(path)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise KeyUnusable(str(path), f"not a PEM certificate ({exc})") from None


def load_trusted(path: Path) -> PublicKey | list[x509.Certificate]:
    """A trust-list file: a PEM public key, or PEM certificates (a CA, or one signer's)."""
    data = _read(path)
    if b"-----BEGIN CERTIFICATE-----" in data:
        return load_certificates(path)
    if b"PRIVATE KEY-----" in data:
        raise KeyUnusable(
            str(path),
            "holds a private key; trust its public key instead (openssl pkey -pubout)",
        )
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise KeyUnusable(str(path), f"not a PEM public key or certificate ({exc})") from None
    _supported(key, path)
    return key  # type: ignore[return-value]
