"""TLS for the listeners whose address is ``https://``: one server context from the PEM
certificate (chain) and private key files (TorchServe's ``certificate_file`` and
``private_key_file``).

Modern defaults: TLS 1.2 or newer; for TLS 1.2, forward-secret AEAD suites only (ECDHE or DHE
with AES-GCM or ChaCha20-Poly1305); TLS 1.3 suites are OpenSSL's, all strong. No compression,
no renegotiation. A file that is missing, unreadable, not PEM, or a key that does not match the
certificate stops the start with a message naming the file. A key OpenSSL finds too weak for
its security level (an RSA key under 2048 bits, at the default level 2) stops it too, naming
``tls_security_level``: 1 accepts such keys, as TorchServe does.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from server.errors import ConfigError

TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL:!eNULL:!MD5:!DSS"


def server_context(
    certificate_file: str, private_key_file: str, security_level: int | None = None
) -> ssl.SSLContext:
    cert, key = Path(certificate_file).expanduser(), Path(private_key_file).expanduser()
    for what, path in (("certificate_file", cert), ("private_key_file", key)):
        if not path.is_file():
            raise ConfigError(f"{what} {path} does not exist or is not a file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    level = "" if security_level is None else f":@SECLEVEL={security_level}"
    context.set_ciphers(TLS12_CIPHERS + level)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    if not _holds_certificate(cert):
        raise ConfigError(f"certificate_file {cert} holds no PEM certificate")
    try:
        # an encrypted key gets an empty password (and fails) rather than a terminal prompt
        context.load_cert_chain(str(cert), str(key), password=lambda: b"")
    except PermissionError as exc:
        raise ConfigError(f"cannot read {exc.filename or key}: permission denied") from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc).upper():
            raise ConfigError(
                f"private_key_file {key} does not belong to certificate_file {cert}"
            ) from None
        if exc.reason in ("EE_KEY_TOO_SMALL", "CA_KEY_TOO_SMALL", "CA_MD_TOO_WEAK"):
            raise ConfigError(
                f"certificate_file {cert}: its key or signature is too weak for OpenSSL's"
                f" security level ({exc.reason}; an RSA key under 2048 bits, at the usual"
                " level 2): make a 2048-bit or larger key, or set tls_security_level: 1 to"
                " accept it, as TorchServe does"
            ) from None
        raise ConfigError(
            f"private_key_file {key} is not a usable PEM private key ({exc.reason or exc});"
            " it must be unencrypted PEM"
        ) from None
    return context


def certificate_not_after(certificate_file: str) -> float | None:
    """The first certificate's notAfter in epoch seconds (``mserve_tls_certificate_expiry_
    timestamp_seconds``), None where it cannot be read: :func:`server_context` says why."""
    from cryptography import x509  # only servers with a certificate pay for the import

    try:
        data = Path(certificate_file).expanduser().read_bytes()
        return x509.load_pem_x509_certificate(data).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return None


def _holds_certificate(path: Path) -> bool:
    """Whether ``path`` starts with a PEM certificate (a chain may follow)."""
    try:
        text = path.read_text(errors="replace")
    except PermissionError:
        raise ConfigError(f"cannot read {path}: permission denied") from None
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    if begin not in text or end not in text:
        return False
    first = text[text.index(begin) : text.index(end) + len(end)]
    try:
        ssl.PEM_cert_to_DER_cert(first)
    except ValueError:
        return False
    return True
