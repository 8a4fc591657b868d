"""``archive_signatures`` at registration: an archive's signature checked before anything of
it is unpacked or imported (archiver/signing/ does the checking; docs/signing.md).

``off``: not checked. ``warn``: checked; a failure is logged, shown by describe, counted, and
the model loads. ``require``: a failure refuses the registration, saying why (unsigned, not
valid, signer not trusted, which file differs), before a byte is unpacked. The server sets the
policy for every model; a registration's ``archive_signatures`` parameter and the config's
``models`` entry (``archiveSignatures``) may only make it stricter, and a snapshot keeps a
model's. What the check reads: the manifest and the bundle, never a member's content; the
unpacking that follows compares each member's bytes with the signed digests as they stream (a
folder, used in place, is read once here instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from archiver.errors import ArchiverError, KeyUnusable, SignatureError, SignatureMismatch
from server.config import ServerConfig
from server.config.model_settings import SIGNATURE_POLICIES as POLICIES
from server.config.model_settings import ModelSettings
from server.errors import ArchiveSignatureRefused, BadRequest, ConfigError

if TYPE_CHECKING:
    from archiver import Archive
    from archiver.signing import TrustList

log = logging.getLogger(__name__)

SETTING = "archiveSignatures"  # a models entry's (and describe's, snapshots') name

# (reason, action) -> counted: mserve_archive_signature_failures (server/metrics/)
OnFailure = Callable[[str, str], None]


@dataclass(frozen=True)
class SignatureRecord:
    """What describe shows under ``signature``."""

    policy: str
    status: str  # verified, or the failure's reason: unsigned, invalid, untrusted, mismatch
    signer: str | None
    checked_at: float
    problem: str | None = None
    source: str = "server"  # where the policy came from: server, api or models

    def shown(self) -> dict[str, Any]:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.checked_at))
        return {
            "policy": self.policy,
            "status": self.status,
            "signer": self.signer,
            "verifiedAt": when if self.status == "verified" else None,
            "checkedAt": when,
            "problem": self.problem,
        }


def _shown_policy(record: SignatureRecord | None) -> tuple[str, str]:
    return (record.policy, record.source) if record is not None else ("off", "server")


class Signatures:
    """The server's policy and trusted signers, read at start (a bad entry stops the start,
    naming the file and the reason)."""

    def __init__(self, config: ServerConfig, on_failure: OnFailure | None = None) -> None:
        self.policy = config.archive_signatures
        self._config = config
        self._on_failure = on_failure
        # whether a ``models`` entry sets archiveSignatures: else a registration with nothing
        # stricter than off needs no check (and keeps the unpack cache's fast path)
        self._entries = any(e.get(SETTING) is not None for e in config.models)
        self.trust: TrustList | None = None
        if self.policy == "off" and not config.trusted_signers:
            return  # the signing modules (~0.5 s to import) are not needed: none imported
        from archiver.signing import TrustList

        try:
            self.trust = TrustList.load(config.trusted_signers, base=config.start_path)
        except KeyUnusable as exc:
            raise ConfigError(f"trusted_signers: {exc}") from None
        if self.policy != "off" and not self.trust:
            log.warning(
                "archive_signatures is %s but trusted_signers is empty: no signature can be"
                " trusted, so every archive %s",
                self.policy, "is refused" if self.policy == "require" else "gets a warning",
            )  # fmt: skip

    def _requested(self, requested: str | None, lenient: bool) -> tuple[str, str]:
        """(policy, source) from the server's and a registration's: an API parameter weaker
        than the server's is refused; a restored one (a snapshot recorded it) gives way."""
        if requested is None:
            return self.policy, "server"
        word = requested.strip().lower()
        if word not in POLICIES:
            raise BadRequest(
                f"archive_signatures should be one of {', '.join(POLICIES)}, found {requested!r}"
            )
        if POLICIES.index(word) < POLICIES.index(self.policy):
            if lenient:
                return self.policy, "server"
            raise BadRequest(
                f"archive_signatures={word} is weaker than the server's {self.policy}: a"
                " registration may only make it stricter"
            )
        return word, "api" if word != self.policy else "server"

    def applied(self, settings: ModelSettings, record: SignatureRecord | None) -> ModelSettings:
        """``settings`` with the policy the archive was checked under (describe's
        archiveSignatures, and what a snapshot records so that a restore keeps it)."""
        policy, source = _shown_policy(record)
        sources = {**settings.sources, "archive_signatures": source}
        return replace(settings, archive_signatures=policy, sources=sources)

    def checker(
        self, requested: str | None, name: str | None, url: str, lenient: bool = False
    ) -> Callable[[Archive], SignatureRecord | None] | None:
        """What store.unpack calls on the opened archive, before it unpacks: the strictest of
        the server's policy, the registration's and the config's ``models`` entry for the
        archive's name and version (known once the manifest is read). None: nothing can ask
        for a check. ``lenient``: a startup registration (snapshot), whose recorded policy may
        be weaker than the server's now."""
        policy, source = self._requested(requested, lenient)
        if policy == "off" and not self._entries:
            return None

        def check(archive: Archive) -> SignatureRecord | None:
            model = archive.manifest.model
            entry = self._config.model_entry(name or model.model_name, model.model_version)
            value = entry.get(SETTING) if entry is not None else None
            applied, where = policy, source
            if isinstance(value, str) and POLICIES.index(value) > POLICIES.index(policy):
                applied, where = value, "models"
            if applied == "off":
                return None
            return self._check(archive, applied, where, url)

        return check

    def _check(self, archive: Archive, policy: str, source: str, url: str) -> SignatureRecord:
        from archiver.signing import TrustList, check_signature

        if self.trust is None:  # off at the server, stricter for this registration
            self.trust = TrustList()
        try:
            found = check_signature(archive, self.trust)
            if archive.format == "folder":  # used in place, so its bytes are checked now
                report = archive.verify()
                if not report.ok:
                    raise SignatureMismatch(str(archive.path), found.signer, report.problems)
        except SignatureError as exc:
            action = "refused" if policy == "require" else "warned"
            if self._on_failure is not None:
                self._on_failure(exc.reason, action)
            if policy == "require":
                log.warning("refused archive %s (archive_signatures require): %s", url, exc)
                raise ArchiveSignatureRefused(f"cannot load archive {url}: {exc}") from None
            log.warning("archive %s: %s (archive_signatures is warn: loading it anyway)", url, exc)
            signer = getattr(exc, "signer", None)
            return SignatureRecord(policy, exc.reason, signer, time.time(), str(exc), source)
        except ArchiverError as exc:  # a folder's member that cannot be read
            raise ArchiveSignatureRefused(f"cannot load archive {url}: {exc}") from None
        log.info("archive %s: signed by %s, %d files verified", url, found.signer, found.files)
        return SignatureRecord(policy, "verified", found.signer, time.time(), None, source)
