"""Sigstore's keyless flow through ``sigstore`` (sigstore-python, imported only when used):
signing gets a short-lived certificate from Fulcio for an OpenID Connect identity and logs the
signature in Rekor (this needs the network); verification checks the certificate, the log entry
and the identity offline, against the trusted root ``sigstore`` ships and caches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from archiver.errors import KeyUnusable, SignatureInvalid, SignerNotTrusted

if TYPE_CHECKING:
    from archiver.signing.bundle import ParsedBundle


@dataclass(frozen=True)
class Identity:
    """A keyless signer: who Fulcio certified, and which OIDC issuer vouched for them."""

    identity: str
    issuer: str
    root: str | None = None  # a private Sigstore's trusted_root.json; None: the public one

    def __str__(self) -> str:
        return f"{self.identity} (issuer {self.issuer}, Sigstore)"


def _certified(parsed: ParsedBundle) -> str:
    """Who the bundle's certificate names (for an answer that says who signed)."""
    from sigstore.models import Bundle

    try:
        cert = Bundle.from_json(parsed.raw).signing_certificate
        from cryptography import x509

        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(v) for v in san.get_values_for_type(x509.RFC822Name)]
        names += [str(v) for v in san.get_values_for_type(x509.UniformResourceIdentifier)]
        return ", ".join(names) or "an unnamed identity"
    except Exception:  # only words for an error message: never fail on them
        return "an unreadable identity"


def verify_keyless(
    parsed: ParsedBundle, identities: Sequence[Identity], where: str
) -> tuple[str, str, bytes]:
    """(signer, payload type, payload) once the bundle verifies for one trusted identity,
    against the identity's trusted root (a private Sigstore's trusted_root.json) or the
    public instance's."""
    from sigstore.errors import Error as SigstoreError
    from sigstore.models import Bundle, InvalidBundle
    from sigstore.verify import Verifier
    from sigstore.verify.policy import Identity as IdentityPolicy

    if not identities:
        raise SignerNotTrusted(where, f"{_certified(parsed)} (Sigstore, keyless)")
    try:
        bundle = Bundle.from_json(parsed.raw)
    except (InvalidBundle, ValueError) as exc:
        raise SignatureInvalid(where, f"the Sigstore bundle does not parse ({exc})") from None
    from sigstore.models import TrustedRoot

    last: Exception | None = None
    for identity in identities:
        try:
            if identity.root is not None:
                verifier = Verifier(trusted_root=TrustedRoot.from_file(identity.root))
            else:
                verifier = Verifier.production(offline=True)
            payload_type, payload = verifier.verify_dsse(
                bundle, IdentityPolicy(identity=identity.identity, issuer=identity.issuer)
            )
            return str(identity), payload_type, payload
        except SigstoreError as exc:
            last = exc
    raise SignerNotTrusted(where, f"{_certified(parsed)} (Sigstore: {last})")


class SigstoreSigner:
    """Signs through Sigstore's public instance; the identity token comes from
    SIGSTORE_ID_TOKEN, the CI's ambient credential, or a browser sign-in."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def sign(self, payload: bytes) -> bytes:
        from sigstore import dsse, oidc
        from sigstore.errors import Error as SigstoreError
        from sigstore.models import ClientTrustConfig
        from sigstore.sign import SigningContext

        try:
            token = self._token or oidc.detect_credential()
            context = SigningContext.from_trust_config(ClientTrustConfig.production())
            if token is None:
                identity = oidc.Issuer.production().identity_token()
            else:
                identity = oidc.IdentityToken(token)
            with context.signer(identity) as signer:
                bundle = signer.sign_dsse(dsse.Statement(payload))
        except SigstoreError as exc:
            raise KeyUnusable("sigstore", f"keyless signing failed: {exc}") from None
        return bundle.to_json().encode("utf-8")
