"""What a model environment's build may reach: confined the way a worker is, since it runs code
of the model's requirements (a source package's ``setup.py`` or build backend while uv or pip
installs it, a ``.pth`` file whenever the new interpreter starts: the import probe, the SBOM).

The build's processes (``mserve_worker/confined_exec.py``: Landlock, ``no_new_privs``) read the
system, the server's interpreter and packages (a layered environment sees them), the wheelhouse
and the installer's own configuration; they write the environment being built (its ``TMPDIR``
included) and the installer's cache; they connect to TCP ports 443 and 80 and those of the
index and proxy URLs named in the server's environment or the requirements, none with a
wheelhouse. The run dir (key file, snapshot, other models), the model store and the other
environments are out of reach. They get the environment workers get (``worker_env_deny``
applies) plus the installers' own ``PIP_*`` and ``UV_*`` settings. ``sandbox: false`` turns
this off with the workers' sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from server.config import ServerConfig
from server.workers.env_vars import WorkerEnvironment

INDEX_PORTS = (443, 80)
BUILD_TMP = ".build-tmp"  # the build's TMPDIR, inside the environment; removed after the build
# where installers read index and proxy URLs from the server's environment
_URL_VARIABLES = (
    "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_PROXY", "UV_INDEX_URL",
    "UV_EXTRA_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX", "UV_FIND_LINKS", "HTTPS_PROXY",
    "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy",
)  # fmt: skip
_URL = re.compile(r"\b(?:https?|socks5h?|socks4)://[^\s,;]+", re.IGNORECASE)
_DEFAULT_PORTS = {"https": 443, "http": 80, "socks5": 1080, "socks5h": 1080, "socks4": 1080}
_INSTALLER_PREFIXES = ("PIP_", "UV_")


def url_ports(texts: Iterable[str]) -> list[int]:
    """The TCP ports of every URL in ``texts`` (a bad port is left out)."""
    ports: set[int] = set()
    for text in texts:
        for url in _URL.findall(text):
            with contextlib.suppress(ValueError):
                parts = urlsplit(url)
                port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower())
                if port:
                    ports.add(port)
    return sorted(ports)


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or Path.home())


def installer_caches(environ: Mapping[str, str]) -> list[Path]:
    """uv's and pip's caches, where they would put them."""
    xdg = Path(environ.get("XDG_CACHE_HOME") or _home(environ) / ".cache")
    return [Path(environ.get("UV_CACHE_DIR") or xdg / "uv"),
            Path(environ.get("PIP_CACHE_DIR") or xdg / "pip")]  # fmt: skip


def installer_config(environ: Mapping[str, str]) -> list[Path]:
    """Where uv and pip read their configuration and index credentials."""
    home = _home(environ)
    xdg = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
    named = [environ.get(k) for k in ("PIP_CONFIG_FILE", "UV_CONFIG_FILE", "NETRC")]
    return [xdg / "pip", xdg / "uv", home / ".pip", home / ".netrc",
            *(Path(p) for p in named if p)]  # fmt: skip


class BuildSandbox:
    """How :class:`server.model_envs.EnvCache` runs a build's commands."""

    def __init__(self, environ: Mapping[str, str], deny: tuple[str, ...],
                 deny_regex: str | None = None) -> None:  # fmt: skip
        """``environ``: the server's environment; ``deny``, ``deny_regex``: the workers'
        ``worker_env_deny`` (and its regex), which the build's environment follows too."""
        base = WorkerEnvironment.split(environ, deny, deny_regex).base
        installer = {k: v for k, v in environ.items() if k.startswith(_INSTALLER_PREFIXES)}
        self.environ: dict[str, str] = {**base, **installer}

    @classmethod
    def of(cls, config: ServerConfig) -> BuildSandbox | None:
        """The server's: None when ``sandbox`` is off (builds then run as the server does)."""
        if not config.sandbox:
            return None
        return cls(os.environ, config.worker_env_deny, config.worker_env_deny_regex)

    def prefix(
        self, folder: Path, reads: list[Path], requirements: str, offline: bool
    ) -> list[str]:
        """The command prefix that confines a command of the build of ``folder`` (created
        here, with its ``TMPDIR``): it reads ``reads`` besides what every build reads."""
        scratch = folder / BUILD_TMP
        scratch.mkdir(parents=True, exist_ok=True)
        caches = installer_caches(self.environ)
        for cache in caches:  # a missing one could not be granted, and the installer needs it
            with contextlib.suppress(OSError):
                cache.mkdir(parents=True, exist_ok=True)
        texts = [requirements, *(self.environ.get(k, "") for k in _URL_VARIABLES)]
        policy = {
            "read": [str(p) for p in (*reads, *installer_config(self.environ))],
            "write": [str(folder), *map(str, caches)],
            "connect": [] if offline else sorted({*INDEX_PORTS, *url_ports(texts)}),
            "bind": [],
            "limits": {"core": 0},
            "tmpdir": str(scratch),
        }
        return [sys.executable, "-I", "-m", "mserve_worker.confined_exec", json.dumps(policy)]

    @staticmethod
    def done(folder: Path) -> None:
        """The build of ``folder`` ended: its ``TMPDIR`` goes."""
        shutil.rmtree(folder / BUILD_TMP, ignore_errors=True)
