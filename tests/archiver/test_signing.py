"""model-archiver --sign and --verify: real keys and certificates, real archives in every
format, tampered copies (their manifests re-recorded, as an attacker would), the model_signing
tool reading what we sign, and a keyless bundle from a private Sigstore made offline."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from archiver import open_archive
from archiver.signing import SIGNATURE_PATH, sign_function
from tests.conftest import ArchiverRunner
from tests.signing_keys import ca_and_signer, key_pair, tamper
from tests.sigstore_fixture import PrivateSigstore


def _build(archiver: ArchiverRunner, *extra: str) -> None:
    result = archiver(
        "--model-name", "m", "--handler", "handler.py", "--serialized-file", "weights.pt",
        "--extra-files", "labels.json", *extra,
    )  # fmt: skip
    assert result.exit_code == 0, result.output


@pytest.fixture
def signed(archiver: ArchiverRunner, model_inputs: Path) -> Path:
    keys = key_pair(model_inputs, "alice")
    _build(archiver, "--sign", str(keys.private))
    return model_inputs / "m.mar"


@pytest.mark.parametrize(("kind", "fmt", "out"), [
    ("ec", "default", "m.mar"), ("ed25519", "tgz", "m.tar.gz"), ("ec", "no-archive", "m"),
])  # fmt: skip
def test_sign_and_verify_round_trip(
    archiver: ArchiverRunner, model_inputs: Path, kind: str, fmt: str, out: str
) -> None:
    keys = key_pair(model_inputs, "alice", kind)
    _build(archiver, "--sign", str(keys.private), "--archive-format", fmt)
    with open_archive(model_inputs / out) as archive:
        assert archive.signature_bytes(1 << 20) is not None
        assert archive.verify().ok  # the signature is not a file the manifest lacks
    result = archiver("--verify", out, "--trust", str(keys.public))
    assert result.exit_code == 0, result.output
    assert f"signed by: the key {keys.public}" in result.output
    assert "verify:    OK, 4 files are what was signed" in result.output


def test_signer_not_trusted_and_unsigned(
    archiver: ArchiverRunner, model_inputs: Path, signed: Path
) -> None:
    other = key_pair(model_inputs, "mallory")
    result = archiver("--verify", str(signed), "--trust", str(other.public))
    assert result.exit_code == 9
    assert "is signed by the key sha256:" in result.output
    assert "which is not a trusted signer" in result.output
    _build(archiver, "-f")  # unsigned: still a valid archive
    assert archiver("--inspect", "m.mar").exit_code == 0
    result = archiver("--verify", "m.mar", "--trust", str(other.public))
    assert result.exit_code == 9
    assert "m.mar is not signed (no MAR-INF/signature.sigstore.json)" in result.output


@pytest.mark.parametrize(("how", "member", "words"), [
    ("byte", "weights.pt", "'weights.pt' differs from what was signed"),
    ("add", "extra.py", "'extra.py' was added after signing"),
    ("remove", "labels.json", "'labels.json' was signed but is missing"),
])  # fmt: skip
def test_tampered_archive_names_the_file(
    archiver: ArchiverRunner, model_inputs: Path, signed: Path, how: str, member: str, words: str
) -> None:
    bad = tamper(signed, model_inputs / "bad.mar", how, member)
    with open_archive(bad) as archive:
        assert archive.verify().ok  # the manifest was re-recorded: only the signature tells
    result = archiver("--verify", str(bad), "--trust", "alice.pub.pem")
    assert result.exit_code == 9
    assert "does not match its signature by the key alice.pub.pem" in result.output
    assert words in result.output
    assert "MANIFEST.json' differs from what was signed" in result.output


def test_certificate_signature_chains_to_a_trusted_ca(
    archiver: ArchiverRunner, model_inputs: Path
) -> None:
    ca, signer, cert = ca_and_signer(model_inputs, "Team CA", "alice@example.com")
    _build(archiver, "--sign", str(signer.private), "--sign-certificate", str(cert))
    result = archiver("--verify", "m.mar", "--trust", str(ca))
    assert result.exit_code == 0, result.output
    assert "signed by: the certificate alice@example.com (sha256:" in result.output
    other_ca, _, _ = ca_and_signer(model_inputs, "Other CA", "bob@example.com")
    result = archiver("--verify", "m.mar", "--trust", str(other_ca))
    assert result.exit_code == 9
    assert "is signed by the certificate alice@example.com" in result.output
    # a certificate that is not the key's is refused before anything is written
    result = archiver("--model-name", "n", "--handler", "handler.py", "--sign",
                      str(signer.private), "--sign-certificate", str(other_ca))  # fmt: skip
    assert result.exit_code == 3
    assert f"{other_ca}: its first certificate is not for the key" in result.output
    assert not (model_inputs / "n.mar").exists()


def test_bad_keys_bundles_and_trust_entries_are_named(
    archiver: ArchiverRunner, model_inputs: Path, signed: Path
) -> None:
    (model_inputs / "junk.pem").write_text("not a key\n")
    result = archiver("--model-name", "n", "--handler", "handler.py", "--sign", "junk.pem")
    assert result.exit_code == 3
    assert "junk.pem: not a PEM private key" in result.output
    assert not (model_inputs / "n.mar").exists()
    result = archiver("--verify", str(signed), "--trust", "missing.pem")
    assert result.exit_code == 3
    assert "missing.pem: no such file" in result.output
    result = archiver("--verify", str(signed), "--trust", "alice.key.pem")
    assert "alice.key.pem: holds a private key; trust its public key instead" in result.output
    result = archiver("--verify", str(signed), "--trust", "sigstore:alice@example.com")
    assert "a Sigstore identity is 'sigstore:IDENTITY ISSUER [TRUSTED_ROOT]'" in result.output
    with zipfile.ZipFile(signed) as zin, zipfile.ZipFile(model_inputs / "b.mar", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, b'{"mediaType": "nonsense"}' if info.filename == SIGNATURE_PATH
                          else data)  # fmt: skip
    result = archiver("--verify", "b.mar", "--trust", "alice.pub.pem")
    assert result.exit_code == 9
    assert "the signature of b.mar is not valid: the bundle does not parse" in result.output


def test_model_signing_verifies_an_unpacked_archive(model_inputs: Path, signed: Path) -> None:
    """Our format is the OpenSSF one: the model_signing library checks an unpacked archive."""
    import model_signing

    with open_archive(signed) as archive:
        folder = archive.extract(model_inputs / "unpacked")
    verifier = model_signing.verifying.Config().use_elliptic_key_verifier(
        public_key=model_inputs / "alice.pub.pem"
    )
    verifier.verify(folder, folder / SIGNATURE_PATH)
    (folder / "weights.pt").write_bytes(b"changed")
    # the library's message may hold its list of problems as a repr, quotes escaped (whether it
    # does depends on the digests' bytes)
    with pytest.raises(ValueError, match=r"Hash mismatch for \\*'weights\.pt"):
        verifier.verify(folder, folder / SIGNATURE_PATH)


def test_keyless_signature_verifies_offline_against_its_trusted_root(
    archiver: ArchiverRunner, model_inputs: Path
) -> None:
    """A Sigstore keyless bundle (certificate, SCT, log entry) from a private Sigstore made
    for the test, checked offline against its trusted root; never the network."""
    sigstore = PrivateSigstore("alice@example.com", "https://issuer.example.com")
    root = model_inputs / "trusted_root.json"
    root.write_text(sigstore.trusted_root())
    _build(archiver)
    with open_archive(model_inputs / "m.mar") as archive:
        manifest_bytes, files = archive.manifest_bytes, archive.manifest.files
    bundle = sign_function(sigstore, "m")(manifest_bytes, files)
    with zipfile.ZipFile(model_inputs / "m.mar", "a") as zf:
        zf.writestr(SIGNATURE_PATH, bundle)
    trusted = f"sigstore:alice@example.com https://issuer.example.com {root}"
    result = archiver("--verify", "m.mar", "--trust", trusted)
    assert result.exit_code == 0, result.output
    assert "signed by: alice@example.com (issuer https://issuer.example.com, Sigstore)" in (
        result.output
    )
    result = archiver("--verify", "m.mar", "--trust", trusted.replace("alice", "bob"))
    assert result.exit_code == 9
    assert "is signed by alice@example.com (Sigstore: Certificate's SANs do not match" in (
        result.output
    )
    other = PrivateSigstore("alice@example.com", "https://issuer.example.com")
    root.write_text(other.trusted_root())  # same identity, another Sigstore: not trusted
    result = archiver("--verify", "m.mar", "--trust", trusted)
    assert result.exit_code == 9
    assert "is signed by alice@example.com (Sigstore:" in result.output
    key = key_pair(model_inputs, "alice")
    result = archiver("--verify", "m.mar", "--trust", str(key.public))
    assert result.exit_code == 9
    assert "is signed by alice@example.com (Sigstore, keyless), which is not a trusted" in (
        result.output
    )
