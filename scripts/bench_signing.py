"""What checking an archive's signature costs (docs/signing.md): verification of a signed
archive against reading its digests once, and a registration of a signed archive against an
unsigned one.

Usage: python scripts/bench_signing.py [--size-mb 1024] [--rounds 5]

The weights are random bytes (seed 0) in a temp folder, archived with model-archiver (stored:
random bytes do not deflate). Targets: verification <= 1.1x reading the digests once,
registration <= 1.05x.

- verify: ``check_signature`` (the manifest and the bundle) then ``Archive.verify()`` (every
  member's bytes against the signed digests, one read), against ``Archive.verify()`` alone.
- register: ``POST /models?url=...&initial_workers=0&synchronous=true`` on a server with
  ``archive_signatures: require`` (signed archive) and one with ``off`` (unsigned archive); each
  round unregisters and empties the unpack cache, so every registration hashes and unpacks the
  whole archive (after one registration each that is not counted: the first imports what the
  others reuse). No worker starts: what differs is all in the registration's archive stage.

Rows alternate within each round (the VM's speed drifts); figures are medians.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, Server, archive, cpu_seconds

sys.path.insert(0, str(REPO))
from archiver import open_archive
from archiver.signing import TrustList, check_signature

HANDLER = "def handle(data, context):\n    return data\n"


def make_weights(path: Path, size_bytes: int) -> None:
    rng = random.Random(0)
    with open(path, "wb") as f:
        left = size_bytes
        while left:
            n = min(left, 64 << 20)
            f.write(rng.randbytes(n))
            left -= n


def make_key(folder: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / "signer.key.pem", folder / "signer.pub.pem"
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    private.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain))
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    public.write_bytes(key.public_key().public_bytes(pem, spki))
    return private, public


def timed(call) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, this process's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def digests_once(path: Path) -> None:
    with open_archive(path) as a:
        assert a.verify().ok


def signature_and_digests(path: Path, trust: TrustList) -> None:
    with open_archive(path) as a:
        check_signature(a, trust)
        assert a.verify().ok


def register(server: Server, name: str) -> tuple[float, float]:
    """(wall seconds, the server's CPU seconds) of one registration."""
    url = f"/models?url={name}.mar&initial_workers=0&synchronous=true"
    wall, cpu = time.perf_counter(), cpu_seconds([server.pid])
    status, body = server.request("POST", url, api="management")
    elapsed = time.perf_counter() - wall, cpu_seconds([server.pid]) - cpu
    assert status == 200, body
    status, body = server.request("DELETE", f"/models/{name}/1.0", api="management")
    assert status == 200, body
    shutil.rmtree(server.run_dir / "unpacked", ignore_errors=True)
    return elapsed


def report(
    title: str, rows: dict[str, list[tuple[float, float]]], base: str, row: str, target: float
) -> None:
    """Medians of wall and CPU seconds, and the ratios (CPU is steadier on a shared VM)."""
    print(f"{title} (median of {len(rows[base])}):       wall s    CPU s")
    med = {name: [statistics.median(t[i] for t in times) for i in (0, 1)]
           for name, times in rows.items()}  # fmt: skip
    for name, (wall, cpu) in med.items():
        print(f"  {name:<34} {wall:8.3f} {cpu:8.3f}")
    ratios = [med[row][i] / med[base][i] for i in (0, 1)]
    print(f"  {'ratio':<34} {ratios[0]:7.3f}x {ratios[1]:7.3f}x  (target <= {target}x)")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-signing-"))
    servers: list[Server] = []
    try:
        store = work / "store"
        (work / "handler.py").write_text(HANDLER)
        make_weights(work / "weights.bin", args.size_mb << 20)
        private, public = make_key(work)
        common = ["--handler", work / "handler.py", "--serialized-file", work / "weights.bin"]
        archive(store, "signed", *common, "--sign", private)
        archive(store, "plain", *common)
        signed = store / "signed.mar"
        trust = TrustList.load([str(public)])
        digests_once(signed)  # the page cache holds the archive for every row alike
        verify: dict[str, list[tuple[float, float]]] = {"digests once": [],
                                                        "signature + digests": []}  # fmt: skip
        for _ in range(args.rounds):
            verify["digests once"].append(timed(lambda: digests_once(signed)))
            verify["signature + digests"].append(
                timed(lambda: signature_and_digests(signed, trust))
            )
        size = f"{args.size_mb} MiB archive"
        report(f"verify a {size}", verify, "digests once", "signature + digests", 1.1)

        base = {"grpc": False, "disable_token_authorization": True, "enable_model_api": True}
        trusting = {"archive_signatures": "require", "trusted_signers": [str(public)]}
        servers.append(Server(work, {**base, **trusting}, name="require"))
        servers.append(Server(work, {**base, "archive_signatures": "off"}, name="off"))
        require, off = servers
        register(off, "plain")  # a first registration imports what later ones reuse
        register(require, "signed")
        reg: dict[str, list[tuple[float, float]]] = {"unsigned, off": [],
                                                     "signed, require": []}  # fmt: skip
        for _ in range(args.rounds):
            reg["unsigned, off"].append(register(off, "plain"))
            reg["signed, require"].append(register(require, "signed"))
        report(f"register a {size}, no workers", reg, "unsigned, off", "signed, require", 1.05)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
