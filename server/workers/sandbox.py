"""What each model's workers may reach: the server side of the sandbox.

The server decides the rules, the worker applies them to itself before its handler is
imported (``mserve_worker/confine.py``: Landlock, ``no_new_privs``, resource limits). A worker
reads its own model folder, its interpreter and the system's libraries, and writes only its
model's scratch folder (also its ``TMPDIR``); it opens no TCP connection and binds no port. A
model config may grant more (``sandbox:`` with ``readPaths``, ``writePaths``, ``connectPorts``,
``bindPorts``, ``maxProcesses``, ``maxOpenFiles``), never the server's own files or ports.
docs/server.md, Sandbox, has the threat model.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mserve_worker.confine import landlock_abi
from server.config import ServerConfig, split_address
from server.errors import InvalidModel

log = logging.getLogger(__name__)

# Limits every worker gets unless its model config says otherwise. Processes count threads,
# per user: they bound a fork bomb once each model runs as its own user (root ignores them).
DEFAULT_MAX_PROCESSES = 4096
DEFAULT_MAX_OPEN_FILES = 65536
_PATH_KEYS = {"readPaths": "read", "writePaths": "write"}
_PORT_KEYS = {"connectPorts": "connect", "bindPorts": "bind"}
_LIMIT_KEYS = {"maxProcesses": "nproc", "maxOpenFiles": "nofile"}
_KEYS = (*_PATH_KEYS, *_PORT_KEYS, *_LIMIT_KEYS)


def _gpu_devices(gpu: str | None) -> list[str]:
    """The device files a worker pinned to ``gpu`` needs: its own, and the driver's shared ones."""
    if gpu is None:
        return []
    own = [f"/dev/nvidia{gpu}"] if gpu.isdigit() else glob.glob("/dev/nvidia[0-9]*")
    shared = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    return [*own, *shared, "/dev/nvidia-caps", "/dev/dri"]


@dataclass(frozen=True)
class ModelSandbox:
    """One model version's rules: what its model config granted, and its scratch folder."""

    label: str
    model_dir: str
    scratch: str
    grants: dict[str, list[Any]] = field(default_factory=dict)

    def policy(self, gpu: str | None) -> dict[str, Any]:
        """INIT's ``sandbox``: what ``mserve_worker.confine.apply`` gets."""
        os.makedirs(self.scratch, mode=0o700, exist_ok=True)
        limits = {"nproc": DEFAULT_MAX_PROCESSES, "nofile": DEFAULT_MAX_OPEN_FILES, "core": 0}
        limits.update(self.grants.get("limits", {}))  # type: ignore[arg-type]
        return {
            "read": [self.model_dir, *self.grants.get("read", [])],
            "write": [self.scratch, *self.grants.get("write", [])],
            "devices": _gpu_devices(gpu),
            "connect": list(self.grants.get("connect", [])),
            "bind": list(self.grants.get("bind", [])),
            "limits": limits,
            "tmpdir": self.scratch,
        }

    def env(self) -> dict[str, str]:
        return {"TMPDIR": self.scratch, "TEMP": self.scratch, "TMP": self.scratch}

    def shown(self) -> dict[str, Any]:
        """What describe says the model was granted beyond the defaults."""
        return {"scratch": self.scratch, **{k: v for k, v in self.grants.items() if v}}

    def remove_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


class Sandbox:
    """The server's sandbox setting, what the kernel offers, and the paths and ports no model
    may be granted."""

    def __init__(self, config: ServerConfig, abi: int | None = None) -> None:
        self.enabled = config.sandbox
        self.abi = landlock_abi() if abi is None else abi
        self.scratch_root = config.run_path / "scratch"
        # never granted: the server's own files (its run dir holds the key file, the snapshot,
        # the logs, the other models' folders), its model store and environments
        self.protected = [
            p for p in (config.run_path, config.store_path, config.env_path, config.log_path,
                        config.key_path) if p is not None
        ]  # fmt: skip
        self.server_ports = set()
        for key in ("inference_address", "management_address", "metrics_address",
                    "grpc_inference_address", "grpc_management_address"):  # fmt: skip
            try:
                port = split_address(getattr(config, key), key)[2]
            except Exception:  # a unix socket or a bad address: nothing to keep out
                continue
            if port:
                self.server_ports.add(port)
        self.warning = self._warning()

    def _warning(self) -> str | None:
        if not self.enabled:
            return None
        if not sys.platform.startswith("linux"):
            why = f"this platform ({sys.platform}) has no Landlock"
        elif self.abi <= 0:
            why = "this kernel offers no Landlock (it needs Linux 5.13+ with Landlock enabled)"
        else:
            return None
        return (
            f"sandbox: workers are NOT confined: {why}; every model's code can reach what the"
            " server can (its key file, other models' files, its ports). Run on a kernel with"
            " Landlock, or set sandbox: false to silence this warning"
        )

    def summary(self) -> str:
        """One line for ``mserve --status``."""
        if not self.enabled:
            return "off (sandbox: false)"
        if self.warning:
            return "not applied: " + self.warning.split(": ", 2)[2].split(";")[0]
        network = "files and TCP ports" if self.abi >= 4 else "files (no TCP rules before ABI 4)"
        return f"on: Landlock ABI {self.abi} ({network}), no_new_privs, limits"

    def model(self, name: str, version: str, model_dir: Path, model_config: dict[str, Any],
              ) -> ModelSandbox | None:  # fmt: skip
        """The rules of a model version; None when the sandbox is off. ``InvalidModel`` names
        the model config field that is wrong."""
        if not self.enabled:
            return None
        label = f"{name}:{version}"
        scratch = self.scratch_root / f"{name}-{version}"
        grants = self._grants(model_config.get("sandbox"), label)
        return ModelSandbox(label, str(model_dir), str(scratch), grants)

    def _grants(self, section: Any, label: str) -> dict[str, Any]:
        if section is None:
            return {}
        if not isinstance(section, dict):
            raise InvalidModel(f"model config of {label}: sandbox must be a mapping of "
                               f"{', '.join(_KEYS)}, got {section!r:.60}")  # fmt: skip
        unknown = sorted(set(section) - set(_KEYS))
        if unknown:
            raise InvalidModel(f"model config of {label}: sandbox has unknown keys "
                               f"{', '.join(unknown)} (known: {', '.join(_KEYS)})")  # fmt: skip
        grants: dict[str, Any] = {}
        for key, kind in _PATH_KEYS.items():
            grants[kind] = [
                self._path(p, f"sandbox.{key}", label) for p in _list(section, key, label)
            ]
        for key, kind in _PORT_KEYS.items():
            grants[kind] = [
                self._port(p, f"sandbox.{key}", label) for p in _list(section, key, label)
            ]
        limits = {}
        for key, name in _LIMIT_KEYS.items():
            if key in section:
                value = section[key]
                if type(value) is not int or value < 1:
                    raise InvalidModel(f"model config of {label}: sandbox.{key} must be a positive"
                                       f" integer, got {value!r:.60}")  # fmt: skip
                limits[name] = value
        grants["limits"] = limits
        return grants

    def _path(self, value: Any, where: str, label: str) -> str:
        if not isinstance(value, str) or not os.path.isabs(value):
            raise InvalidModel(f"model config of {label}: {where} must hold absolute paths,"
                               f" got {value!r:.80}")  # fmt: skip
        path = Path(os.path.realpath(value))
        for protected in self.protected:
            real = Path(os.path.realpath(protected))
            if path == real or real in path.parents or path in real.parents:
                raise InvalidModel(
                    f"model config of {label}: {where} names {value}, which holds or is inside"
                    f" the server's own files ({protected})"
                )
        return str(path)

    def _port(self, value: Any, where: str, label: str) -> int:
        if type(value) is not int or not 0 < value < 65536:
            raise InvalidModel(f"model config of {label}: {where} must hold TCP ports"
                               f" (1-65535), got {value!r:.60}")  # fmt: skip
        if value in self.server_ports:
            raise InvalidModel(f"model config of {label}: {where} names {value}, one of the"
                               " server's own ports")  # fmt: skip
        return value


def _list(section: dict[str, Any], key: str, label: str) -> list[Any]:
    value = section.get(key) or []
    if not isinstance(value, list):
        raise InvalidModel(f"model config of {label}: sandbox.{key} must be a list,"
                           f" got {value!r:.60}")  # fmt: skip
    return value
