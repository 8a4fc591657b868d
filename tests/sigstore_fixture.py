"""A private Sigstore made in memory for tests, offline: a Fulcio-like CA, a certificate
transparency log and a Rekor-like transparency log, each a fresh P-256 key. ``sign`` gives the
keyless bundle a Sigstore client would get for ``identity`` (a certificate with its SCT, a
DSSE log entry with its signed entry timestamp, inclusion proof and signed checkpoint);
``trusted_root`` the trusted_root.json that verifies it. Every signature is real; none of
Sigstore's services is involved (this machine has no network)."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import struct

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

SIGNED_AT = dt.datetime(2026, 1, 5, 12, 0, tzinfo=dt.timezone.utc)
_ISSUER_V1 = x509.ObjectIdentifier("1.3.6.1.4.1.57264.1.1")  # Fulcio's OIDC issuer (raw)
_ISSUER_V2 = x509.ObjectIdentifier("1.3.6.1.4.1.57264.1.8")  # the same, DER UTF8String
_LOG = "log.test.invalid"
_PAYLOAD_TYPE = "application/vnd.in-toto+json"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _spki(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _canonical(value: object) -> bytes:
    """RFC 8785 for what is signed here (ASCII strings, integers): sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _ecdsa(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


class PrivateSigstore:
    def __init__(self, identity: str, issuer: str) -> None:
        self.identity, self.issuer = identity, issuer
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ct_key = ec.generate_private_key(ec.SECP256R1())
        self._log_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test fulcio")])
        self._ca = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self._ca_key.public_key()).serial_number(1)
            .not_valid_before(SIGNED_AT - dt.timedelta(days=30))
            .not_valid_after(SIGNED_AT + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._ca_key.public_key()),
                           critical=False)
            .sign(self._ca_key, hashes.SHA256())
        )  # fmt: skip

    def _log_entry_key(self, key: ec.EllipticCurvePrivateKey) -> dict[str, object]:
        return {
            "baseUrl": f"https://{_LOG}",
            "hashAlgorithm": "SHA2_256",
            "logId": {"keyId": _b64(hashlib.sha256(_spki(key)).digest())},
            "publicKey": {
                "rawBytes": _b64(_spki(key)),
                "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                "validFor": {"start": "2025-01-01T00:00:00Z"},
            },
        }

    def trusted_root(self) -> str:
        return json.dumps({
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [self._log_entry_key(self._log_key)],
            "ctlogs": [self._log_entry_key(self._ct_key)],
            "certificateAuthorities": [{
                "subject": {"organization": "test", "commonName": "test fulcio"},
                "uri": "https://fulcio.test.invalid",
                "certChain": {"certificates": [
                    {"rawBytes": _b64(self._ca.public_bytes(serialization.Encoding.DER))}
                ]},
                "validFor": {"start": "2025-01-01T00:00:00Z"},
            }],
        })  # fmt: skip

    def _certificate(self, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
        """A Fulcio-style leaf for ``identity``, with an SCT from the CT log (RFC 6962)."""
        issuer_v2 = b"\x0c" + _der_length(len(self.issuer)) + self.issuer.encode()
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([]))
            .issuer_name(self._ca.subject).public_key(key.public_key()).serial_number(2)
            .not_valid_before(SIGNED_AT - dt.timedelta(minutes=1))
            .not_valid_after(SIGNED_AT + dt.timedelta(minutes=10))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False,
                                         False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(self.identity)]),
                           critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self._ca_key.public_key()), critical=False)
            .add_extension(x509.UnrecognizedExtension(_ISSUER_V1, self.issuer.encode()),
                           critical=False)
            .add_extension(x509.UnrecognizedExtension(_ISSUER_V2, issuer_v2), critical=False)
        )  # fmt: skip
        tbs = builder.sign(self._ca_key, hashes.SHA256()).tbs_certificate_bytes
        millis = int(SIGNED_AT.timestamp() * 1000)
        signed = (
            struct.pack(">BBQH", 0, 0, millis, 1)  # v1, certificate_timestamp, precert_entry
            + hashlib.sha256(_spki(self._ca_key)).digest()
            + len(tbs).to_bytes(3, "big") + tbs
            + struct.pack(">H", 0)  # no extensions
        )  # fmt: skip
        signature = _ecdsa(self._ct_key, signed)
        sct = (
            b"\x00" + hashlib.sha256(_spki(self._ct_key)).digest()
            + struct.pack(">QH", millis, 0)
            + struct.pack(">BBH", 4, 3, len(signature)) + signature  # sha256, ecdsa
        )  # fmt: skip
        listed = struct.pack(">H", len(sct)) + sct
        sct_list = struct.pack(">H", len(listed)) + listed
        octets = b"\x04" + _der_length(len(sct_list)) + sct_list
        cert = builder.add_extension(
            x509.UnrecognizedExtension(ExtensionOID.PRECERT_SIGNED_CERTIFICATE_TIMESTAMPS, octets),
            critical=False,
        ).sign(self._ca_key, hashes.SHA256())
        assert cert.tbs_precertificate_bytes == tbs
        return cert

    def sign(self, payload: bytes) -> bytes:
        """The keyless bundle (JSON) of a DSSE envelope over ``payload``."""
        key = ec.generate_private_key(ec.SECP256R1())  # ephemeral, as Sigstore's client's
        cert = self._certificate(key)
        pae = f"DSSEv1 {len(_PAYLOAD_TYPE)} {_PAYLOAD_TYPE} {len(payload)} ".encode() + payload
        signature = _ecdsa(key, pae)
        envelope = {"payload": _b64(payload), "payloadType": _PAYLOAD_TYPE,
                    "signatures": [{"sig": _b64(signature)}]}  # fmt: skip
        pem = cert.public_bytes(serialization.Encoding.PEM)
        body = _canonical({
            "apiVersion": "0.0.1",
            "kind": "dsse",
            "spec": {
                "envelopeHash": {"algorithm": "sha256",
                                 "value": hashlib.sha256(_canonical(envelope)).hexdigest()},
                "payloadHash": {"algorithm": "sha256",
                                "value": hashlib.sha256(payload).hexdigest()},
                "signatures": [{"signature": _b64(signature), "verifier": _b64(pem)}],
            },
        })  # fmt: skip
        log_id = hashlib.sha256(_spki(self._log_key)).digest()
        when = int(SIGNED_AT.timestamp())
        leaf = hashlib.sha256(b"\x00" + body).digest()  # a tree of one entry: its root
        note = f"{_LOG}\n1\n{_b64(leaf)}\n"
        signed_note = _b64(log_id[:4] + _ecdsa(self._log_key, note.encode()))
        promise = _canonical(
            {"body": _b64(body), "integratedTime": when, "logID": log_id.hex(), "logIndex": 0}
        )
        bundle = {
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": _b64(cert.public_bytes(serialization.Encoding.DER))},
                "tlogEntries": [{
                    "logIndex": "0",
                    "logId": {"keyId": _b64(log_id)},
                    "kindVersion": {"kind": "dsse", "version": "0.0.1"},
                    "integratedTime": str(when),
                    "inclusionPromise": {
                        "signedEntryTimestamp": _b64(_ecdsa(self._log_key, promise))
                    },
                    "inclusionProof": {
                        "logIndex": "0", "rootHash": _b64(leaf), "treeSize": "1", "hashes": [],
                        "checkpoint": {"envelope": f"{note}\n\u2014 {_LOG} {signed_note}\n"},
                    },
                    "canonicalizedBody": _b64(body),
                }],
            },
            "dsseEnvelope": envelope,
        }  # fmt: skip
        return json.dumps(bundle).encode()
