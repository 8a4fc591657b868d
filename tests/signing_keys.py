"""Keys, certificates and tampered archives for the signing tests (archiver and server).

Tampering re-records the manifest's digests, as an attacker who knows the format would: only
the signature can tell the archive from the one that was signed."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from archiver import MANIFEST_PATH

_NO_USAGE = dict.fromkeys(
    ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
     "encipher_only", "decipher_only"), False,
)  # fmt: skip


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path


def key_pair(folder: Path, name: str, kind: str = "ec") -> KeyPair:
    """A PEM key pair: ECDSA P-256 ("ec") or Ed25519 ("ed25519")."""
    key = (
        ec.generate_private_key(ec.SECP256R1())
        if kind == "ec"
        else ed25519.Ed25519PrivateKey.generate()
    )
    private, public = folder / f"{name}.key.pem", folder / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return KeyPair(private, public)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def ca_and_signer(folder: Path, ca_name: str, email: str) -> tuple[Path, KeyPair, Path]:
    """(CA certificate, the signer's key pair, the signer's certificate issued by that CA)."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name(ca_name)).issuer_name(_name(ca_name))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True,
                                     **_NO_USAGE), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    signer = key_pair(folder, f"{ca_name}-signer")
    key = serialization.load_pem_private_key(signer.private.read_bytes(), None)
    leaf = (
        x509.CertificateBuilder().subject_name(_name(email)).issuer_name(_name(ca_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())  # type: ignore[arg-type]
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=3))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     **_NO_USAGE), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(email)]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    ca_path, leaf_path = folder / f"{ca_name}.crt", folder / f"{ca_name}-signer.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    leaf_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    return ca_path, signer, leaf_path


def tamper(archive: Path, out: Path, how: str, member: str) -> Path:
    """A copy of a signed .mar with ``member`` changed by one byte ("byte"), added ("add") or
    removed ("remove"), the manifest's digests re-recorded to match, the signature kept."""
    with zipfile.ZipFile(archive) as zin:
        files = {info.filename: zin.read(info) for info in zin.infolist()}
    if how == "byte":
        data = bytearray(files[member])
        data[len(data) // 2] ^= 0x01
        files[member] = bytes(data)
    elif how == "add":
        files[member] = b"print('not what was signed')\n"
    else:
        del files[member]
    manifest = json.loads(files[MANIFEST_PATH])
    manifest["mserve"]["files"] = {
        name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        for name, data in sorted(files.items())
        if not name.startswith("MAR-INF/")
    }
    files[MANIFEST_PATH] = json.dumps(manifest, indent=2).encode()
    with zipfile.ZipFile(out, "w") as zout:
        for name, data in files.items():
            zout.writestr(name, data)
    return out
