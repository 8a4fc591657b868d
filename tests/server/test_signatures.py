"""archive_signatures at registration (docs/signing.md), on one real server with
``archive_signatures: warn`` trusting alice's key: registrations that ask for ``require``
(stricter, as a registration may) are refused, the others load with a warning. Real signed
archives, tampered copies whose manifests were re-recorded (only the signature tells), real
workers, the metrics port; and the start errors a bad trust list gives."""

from __future__ import annotations

import functools
import http.server
import json
import re
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
import yaml

from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import HANDLERS, MSERVE, Server, pid_alive
from tests.signing_keys import KeyPair, key_pair, tamper

pytestmark = pytest.mark.timeout(180)


def _config(root: Path, **extra: Any) -> Path:
    config = {
        "inference_address": "127.0.0.1:0",
        "management_address": "127.0.0.1:0",
        "metrics_address": "127.0.0.1:0",
        "grpc": False,
        "model_store": str(root / "store"),
        "disable_token_authorization": True,
        "enable_model_api": True,
        **extra,
    }
    (root / "store").mkdir(exist_ok=True)
    path = root / "mserve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _archive(root: Path, name: str, *extra: str, fmt: str = "default") -> Path:
    weights, labels = root / "weights.bin", root / "labels.txt"
    if not weights.exists():
        weights.write_bytes(bytes(range(256)) * 64)
        labels.write_text("cat\ndog\n")
    out = subprocess.run(
        [ARCHIVER_SCRIPT, "--model-name", name, "--handler", "echo:handle", "--model-path",
         str(HANDLERS / "echo_fn"), "--serialized-file", str(weights), "--extra-files", str(labels), "--export-path",
         str(root / "store"), "--archive-format", fmt, "-f", *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return root / "store" / (name if fmt == "no-archive" else f"{name}.mar")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, KeyPair]]:
    root = tmp_path_factory.mktemp("signatures")
    alice = key_pair(root, "alice")
    cfg = _config(root, archive_signatures="warn", trusted_signers=[str(alice.public)],
                  allowed_urls=[r"http://127\.0\.0\.1:[0-9]+/.*"],
                  models={"strict": {"1.0": {"archiveSignatures": "require"}}})  # fmt: skip
    args = ["--config", str(cfg), "--run-dir", str(root / "run")]
    out = subprocess.run([MSERVE, "--start", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    server = Server(root / "run", json.loads((root / "run" / "status.json").read_text()), args)
    # the store over HTTP, for registrations by URL (the download folder's part)
    files = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root / "store"))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), files)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    server.web_port = web.server_address[1]  # type: ignore[attr-defined]
    try:
        yield server, root, alice
    finally:
        web.shutdown()
        web.server_close()
        if pid_alive(server.pid):
            server.cli("--stop")


def _on_disk(root: Path) -> set[str]:
    """What the run dir's unpack cache and download folder hold (the cache's top level, every
    file of the downloads)."""
    run = root / "run"
    found = set()
    if (run / "unpacked").exists():
        found |= {str(p.relative_to(run)) for p in (run / "unpacked").iterdir()}
    if (run / "downloads").exists():
        found |= {str(p.relative_to(run)) for p in (run / "downloads").rglob("*") if p.is_file()}
    return found


def _refusals(server: Server) -> dict[str, float]:
    """mserve_archive_signature_failures_total{action="refused"} by reason, from /metrics."""
    with urlopen(server.url("metrics", "/metrics"), timeout=10) as answer:
        text = answer.read().decode()
    pattern = r'mserve_archive_signature_failures_total\{action="refused",reason="(\w+)"\} (\S+)'
    return {reason: float(value) for reason, value in re.findall(pattern, text)}


def _register(server: Server, url: str, policy: str | None = None) -> Any:
    query = f"/models?url={url}&initial_workers=1&synchronous=true"
    return server.manage("POST", query + (f"&archive_signatures={policy}" if policy else ""))


def _described(server: Server, name: str) -> dict[str, Any]:
    reply = server.manage("GET", f"/models/{name}")
    assert reply.status == 200, reply.body
    return reply.json()[0]


def _signature(server: Server, name: str) -> dict[str, Any]:
    return _described(server, name)["signature"]


def test_a_signed_archive_loads_and_describe_names_its_signer(served: Any) -> None:
    server, root, alice = served
    _archive(root, "good", "--sign", str(alice.private))
    reply = _register(server, "good.mar", "require")
    assert reply.status == 200, reply.body
    shown = _signature(server, "good")
    assert shown["policy"] == "require"
    assert shown["status"] == "verified"
    assert shown["signer"].startswith(f"the key {alice.public} (sha256:")
    assert shown["verifiedAt"].endswith("Z")
    assert server.predict("good", "hello").body == b"hello"
    described = _described(server, "good")
    assert described["archiveSignatures"] == "require"
    assert described["settingSources"]["archive_signatures"] == "api"
    # the snapshot keeps it, so a restart checks the archive as strictly
    snapshot = json.loads((root / "run" / "snapshot.json").read_text())
    (entry,) = [m for m in snapshot["models"] if m["name"] == "good"]
    assert entry["archive_signatures"] == "require"


def test_a_models_entry_can_require_signatures_for_one_model(served: Any) -> None:
    server, root, alice = served
    _archive(root, "strict")
    reply = _register(server, "strict.mar")
    assert reply.status == 403, reply.body
    assert "strict.mar is not signed" in reply.json()["message"]
    _archive(root, "strict", "--sign", str(alice.private))
    reply = _register(server, "strict.mar")
    assert reply.status == 200, reply.body
    described = _described(server, "strict")
    assert described["signature"]["status"] == "verified"
    assert (described["archiveSignatures"], described["settingSources"]["archive_signatures"]) == (
        "require", "models",
    )  # fmt: skip


@pytest.mark.parametrize(("how", "member", "words"), [
    ("byte", "weights.bin", "'weights.bin' differs from what was signed"),
    ("add", "extra.py", "'extra.py' was added after signing"),
    ("remove", "labels.txt", "'labels.txt' was signed but is missing"),
])  # fmt: skip
def test_a_tampered_archive_is_refused_under_require_and_reported_under_warn(
    served: Any, how: str, member: str, words: str
) -> None:
    server, root, alice = served
    signed = _archive(root, f"t{how}", "--sign", str(alice.private))
    tamper(signed, signed, how, member)
    before = _on_disk(root)
    reply = _register(server, f"t{how}.mar", "require")
    assert reply.status == 403, reply.body
    body = reply.json()
    assert body["type"] == "ArchiveSignatureException"
    assert "does not match its signature by the key" in body["message"]
    assert words in body["message"]
    assert _on_disk(root) == before  # refused before anything was unpacked
    reply = _register(server, f"t{how}.mar")  # the server's warn
    assert reply.status == 200, reply.body
    shown = _signature(server, f"t{how}")
    assert (shown["policy"], shown["status"], shown["verifiedAt"]) == ("warn", "mismatch", None)
    assert words in shown["problem"]
    log = (root / "run" / "logs" / "mserve.log").read_text()
    assert f"archive t{how}.mar: archive" in log and "loading it anyway" in log


def test_unsigned_and_untrusted_archives_are_refused_under_require(served: Any) -> None:
    server, root, _ = served
    _archive(root, "plain")
    mallory = key_pair(root, "mallory")
    other = _archive(root, "other", "--sign", str(mallory.private))
    before = _on_disk(root)
    before_refusals = _refusals(server)
    reply = _register(server, "plain.mar", "require")
    assert reply.status == 403, reply.body
    assert "plain.mar is not signed (no MAR-INF/signature.sigstore.json)" in reply.json()["message"]
    reply = _register(server, "other.mar", "require")
    assert reply.status == 403, reply.body
    assert "is signed by the key sha256:" in reply.json()["message"]
    assert "which is not a trusted signer" in reply.json()["message"]
    assert _on_disk(root) == before
    garbled = root / "store" / "garbled.mar"  # a bundle that does not parse
    with zipfile.ZipFile(other) as zin, zipfile.ZipFile(garbled, "w") as zout:
        for info in zin.infolist():
            garbage = info.filename == "MAR-INF/signature.sigstore.json"
            zout.writestr(info, b"{not json" if garbage else zin.read(info))
    reply = _register(server, "garbled.mar", "require")
    assert reply.status == 403, reply.body
    assert "garbled.mar is not valid: the bundle does not parse" in reply.json()["message"]
    url = f"http://127.0.0.1:{server.web_port}/other.mar"
    reply = _register(server, url, "require")  # downloaded, refused, deleted
    assert reply.status == 403, reply.body
    assert "which is not a trusted signer" in reply.json()["message"]
    assert _on_disk(root) == before
    reply = _register(server, "plain.mar")  # warn: loads, described as unsigned
    assert reply.status == 200, reply.body
    assert _signature(server, "plain")["status"] == "unsigned"
    reply = _register(server, "other.mar", "off")
    assert reply.status == 400
    assert "archive_signatures=off is weaker than the server's warn" in reply.json()["message"]
    after = _refusals(server)
    grown = {k: after[k] - before_refusals.get(k, 0) for k in after}
    assert {k: v for k, v in grown.items() if v} == {
        "unsigned": 1, "untrusted": 2, "invalid": 1,
    }  # fmt: skip


def test_a_tampered_folder_is_read_at_registration(served: Any) -> None:
    """A no-archive folder is served in place: its bytes are checked against the signature."""
    server, root, alice = served
    folder = _archive(root, "folder", "--sign", str(alice.private), fmt="no-archive")
    weights = folder / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:-1] + b"!")
    reply = _register(server, "folder", "require")
    assert reply.status == 403, reply.body
    assert "'weights.bin' sha256" in reply.json()["message"]


@pytest.mark.parametrize(("entry", "words"), [
    ("missing.pem", "trusted_signers: {root}/missing.pem: no such file"),
    ("junk.pem", "trusted_signers: {root}/junk.pem: not a PEM public key or certificate"),
])  # fmt: skip
def test_a_bad_trust_list_stops_the_start_naming_the_file(
    tmp_path: Path, entry: str, words: str
) -> None:
    (tmp_path / "junk.pem").write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n")
    cfg = _config(tmp_path, archive_signatures="require", trusted_signers=[entry])
    out = subprocess.run(
        [MSERVE, "--start", "--config", str(cfg), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0
    assert words.format(root=tmp_path) in out.stdout + out.stderr
