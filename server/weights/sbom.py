"""What a model's environment holds: a CycloneDX SBOM of the packages its workers can import.

Recorded when an environment is built for a model (server/model_envs.py), as ``sbom.cdx.json``
beside the environment's own files, by CycloneDX's own generator (``cyclonedx-py environment``,
the ``sbom`` extra) run against the environment's python: it reads the installed packages'
metadata on disk, offline, in about 1.5 s for ~190 packages (scripts/bench_weights_scan.py).
A default environment sees the server's packages behind its own (model_envs.py), so they are
listed too: what the model can import. Models on the server's own python share one SBOM of that
environment, made on the first request for it and kept under ``<run_dir>/sbom/``, named for
the interpreter and its installed distributions (a change in either makes a new one).

``GET /models/{name}/{version}/sbom`` answers it (CycloneDX JSON); an environment built before
this feature, or while the generator was missing, gets its SBOM on that first request.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from server import locks
from server.errors import MserveError

log = logging.getLogger(__name__)

SBOM_FILE = "sbom.cdx.json"
MEDIA_TYPE = "application/vnd.cyclonedx+json"
GENERATOR = "cyclonedx_py"  # the cyclonedx-bom distribution's module
TIMEOUT_S = 300.0


class SbomUnavailable(MserveError):
    """No SBOM can be made: the generator is not installed next to the server, or it failed."""

    status = 503
    type = "ServiceUnavailableException"


def available() -> bool:
    return importlib.util.find_spec(GENERATOR) is not None


def generate(python: str, target: Path, label: str, confined: Sequence[str] = (),
             env: Mapping[str, str] | None = None) -> float:  # fmt: skip
    """Write the SBOM of ``python``'s environment to ``target`` (blocking); seconds taken.
    Written next to the target and renamed into place: a reader finds all of it or none.
    ``confined``, ``env``: the command prefix and environment of an environment's build (the
    generator starts ``python``, which runs the ``.pth`` files of what it holds)."""
    if not available():
        raise SbomUnavailable(
            f"no SBOM for {label}: CycloneDX's generator (cyclonedx-bom) is not installed next"
            " to the server; pip install 'mserve[sbom]'"
        )
    from cyclonedx_py import __version__  # recorded in the log: which generator wrote it

    started = time.monotonic()
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}")
    # --no-validate: the schema check costs ~25x the generation (40 s for 190 packages) and
    # checks the generator's own output
    cmd = [*confined, sys.executable, "-m", GENERATOR, "environment", "--no-validate", "--of",
           "JSON", "-o", str(tmp), python]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        if out.returncode != 0 or not tmp.is_file():
            tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-5:])
            raise SbomUnavailable(
                f"no SBOM for {label}: cyclonedx-py failed (exit code {out.returncode}): {tail}"
            )
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise SbomUnavailable(
            f"no SBOM for {label}: cyclonedx-py took over {TIMEOUT_S:.0f} s"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    took = time.monotonic() - started
    log.info("SBOM of %s's environment (%s) by cyclonedx-py %s in %.2f s", label, python,
             __version__, took)  # fmt: skip
    return took


def record(python: str, folder: Path, label: str, confined: Sequence[str] = (),
           env: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """At an environment's build: its SBOM beside it, or a log line saying why not (the model
    runs without it; the endpoint tries again)."""
    try:
        generate(python, folder / SBOM_FILE, label, confined, env)
    except SbomUnavailable as exc:
        log.info("%s", exc)


def default_env_file(run_dir: Path, python: str) -> Path:
    """Where the SBOM of the server's own environment (``python``) is kept: named for the
    interpreter and the distributions it has, so installing or upgrading one makes a new one."""
    from importlib import metadata

    names = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
    identity = json.dumps([os.path.realpath(python), sys.version, names])
    return run_dir / "sbom" / f"default-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"


def ensure(python: str, target: Path, label: str, confined: Sequence[str] = (),
           env: Mapping[str, str] | None = None) -> bytes:  # fmt: skip
    """The SBOM at ``target``, made first if missing (one maker at a time; blocking);
    ``confined``, ``env``: as :func:`generate`'s."""
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with locks.exclusive(target.parent / f".{target.name}.lock"):
            if not target.is_file():
                generate(python, target, label, confined, env)
    return target.read_bytes()
