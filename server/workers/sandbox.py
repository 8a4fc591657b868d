"""What each model's workers may reach: the server side of the sandbox.

The server decides the rules, the worker applies them to itself before its handler is
imported (``mserve_worker/confine.py``: Landlock, ``no_new_privs``, resource limits). A worker
reads its own model folder, its interpreter and the system's libraries, and writes only its
model's scratch folder (also its ``TMPDIR``); it opens no TCP connection and binds no port.
Every model also reads the model caches the server's environment names, its user's own and the
``sandbox_read_paths`` setting (``server/workers/sandbox_caches.py``). A model config may grant
more (``sandbox:`` with ``readPaths``, ``writePaths``, ``connectPorts``,
``bindPorts``, ``maxProcesses``, ``maxOpenFiles``), never the server's own files or ports.
docs/security.md, Sandbox, has the threat model.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mserve_worker
from mserve_worker.confine import landlock_abi
from server.config import ServerConfig, split_address
from server.errors import ConfigError, InvalidModel
from server.workers.env_vars import WorkerEnvironment
from server.workers.sandbox_caches import SharedCaches, find_caches, for_other_users
from server.workers.sandbox_users import (
    Reach,
    UidMap,
    WorkerUser,
    own_scratch,
    parse_uid_range,
    share_model_folder,
)

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
    """The device files a worker pinned to ``gpu`` (one id, or a parallel worker's ids joined
    by commas) needs: its own, and the driver's shared ones."""
    if gpu is None:
        return []
    ids = gpu.split(",")
    if all(i.isdigit() for i in ids):
        own = [f"/dev/nvidia{i}" for i in ids]
    else:  # UUIDs: which file is which is the driver's to know
        own = glob.glob("/dev/nvidia[0-9]*")
    shared = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    return [*own, *shared, "/dev/nvidia-caps", "/dev/dri"]


@dataclass(frozen=True)
class ModelSandbox:
    """One model version's rules: what its model config granted, and its scratch folder."""

    label: str
    model_dir: str
    scratch: str
    grants: dict[str, list[Any]] = field(default_factory=dict)
    user: WorkerUser | None = None  # its own uid, when the server runs as root
    reach: Reach | None = field(default=None, compare=False, repr=False)
    # what every model reads: the model caches and sandbox_read_paths
    caches: SharedCaches = field(default_factory=SharedCaches, compare=False, repr=False)
    # a parallel model's ranks (parallelType pp, tp, pptp): the TCP ports they may bind and
    # connect to, to rendezvous and talk to each other (server/workers/ranks.py)
    peer_ports: tuple[tuple[int, int], ...] = ()

    def policy(self, gpu: str | None, python: str | None = None) -> dict[str, Any]:
        """INIT's ``sandbox``: what ``mserve_worker.confine.apply`` gets. Under its own uid,
        the worker must reach ``python`` (its environment's, known once that is built)."""
        os.makedirs(self.scratch, mode=0o700, exist_ok=True)
        if self.user is not None:
            own_scratch(Path(self.scratch), self.user)
            if python and self.reach is not None:
                self.reach.path(Path(python).parent / ".")
                self.reach.path(python)
        limits = {"nproc": DEFAULT_MAX_PROCESSES, "nofile": DEFAULT_MAX_OPEN_FILES, "core": 0}
        limits.update(self.grants.get("limits", {}))  # type: ignore[arg-type]
        return {
            "read": [self.model_dir, *self.caches.paths, *self.grants.get("read", [])],
            "write": [self.scratch, *self.grants.get("write", [])],
            "devices": _gpu_devices(gpu),
            "connect": list(self.grants.get("connect", [])),
            "bind": list(self.grants.get("bind", [])),
            "limits": limits,
            **({"peer_ports": [list(r) for r in self.peer_ports]} if self.peer_ports else {}),
            "tmpdir": self.scratch,
            "user": self.user.as_policy() if self.user is not None else None,
        }

    def env(self) -> dict[str, str]:
        """Temporary files, ``HOME`` and caches in the scratch folder: the server's home is out
        of a confined worker's reach, and libraries that write ``~/.cache`` (Hugging Face,
        torch hub) then work unedited. An operator's own ``XDG_CACHE_HOME`` is kept (a shared
        cache, read-only), and the caches every model reads are where the worker looks."""
        env = {"TMPDIR": self.scratch, "TEMP": self.scratch, "TMP": self.scratch,
               "HOME": self.scratch}  # fmt: skip
        if "XDG_CACHE_HOME" not in os.environ:
            env["XDG_CACHE_HOME"] = os.path.join(self.scratch, ".cache")
        env.update(self.caches.env)
        return env

    def shown(self) -> dict[str, Any]:
        """What describe says the model was granted beyond the defaults."""
        shown: dict[str, Any] = {"scratch": self.scratch}
        if self.user is not None:
            shown.update(uid=self.user.uid, gid=self.user.gid)
        if self.caches.read:  # every model's: the model caches and sandbox_read_paths
            shown["readShared"] = self.caches.paths
        if self.peer_ports:  # its ranks talk to each other
            shown["peerPorts"] = [f"{low}-{high}" for low, high in self.peer_ports]
        return {**shown, **{k: v for k, v in self.grants.items() if v}}

    def remove_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


class Sandbox:
    """The server's sandbox setting, what the kernel offers, and the paths and ports no model
    may be granted."""

    def __init__(self, config: ServerConfig, abi: int | None = None,
                 environ: Mapping[str, str] | None = None) -> None:  # fmt: skip
        """``environ``: the server's environment (where its model caches are named)."""
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
        # each model's own uid (server/workers/sandbox_users.py): only a root server can
        # switch users, and only where the workers are confined at all
        uid_range = parse_uid_range(config.sandbox_uid_range)
        self.uid_range = (
            uid_range if self.enabled and sys.platform.startswith("linux") and os.geteuid() == 0
            else None
        )  # fmt: skip
        self.uids = UidMap(config.run_path, uid_range) if self.uid_range else None
        self.reach = Reach([config.run_path, config.run_path / "unpacked", self.scratch_root])
        self._reached = False
        self.caches = self._caches(config, os.environ if environ is None else environ)

    def _caches(self, config: ServerConfig, environ: Mapping[str, str]) -> SharedCaches:
        """What every model reads (server/workers/sandbox_caches.py), found once at start.
        ``ConfigError`` names a ``sandbox_read_paths`` entry that is not absolute or that
        reaches the server's own files; a cache variable naming those is left out, logged."""
        home = os.path.expanduser("~")
        read_paths = []
        for value in config.sandbox_read_paths:
            path = os.path.expanduser(value)
            if not os.path.isabs(path):
                raise ConfigError(f"sandbox_read_paths must hold absolute paths, found {value!r}")
            protected = self._protected_by(path)
            if protected is not None:
                raise ConfigError(f"sandbox_read_paths names {value}, which holds or is inside"
                                  f" the server's own files ({protected})")  # fmt: skip
            read_paths.append(os.path.normpath(path))
        if not self.enabled:
            return SharedCaches()
        deny = WorkerEnvironment.split(environ, config.worker_env_deny,
                                       config.worker_env_deny_regex)  # fmt: skip
        cwd = config.start_dir or os.getcwd()
        caches = find_caches(deny.base, tuple(read_paths), home, cwd)
        read, left_out = [], set()
        for path, why in caches.read:
            protected = self._protected_by(path)
            if protected is None:
                read.append((path, why))
                continue
            left_out.add(path)
            log.warning(
                "sandbox: %s (%s) holds or is inside the server's own files (%s); workers are"
                " not granted it", path, why, protected,
            )  # fmt: skip
        env = {name: path for name, path in caches.env.items() if path not in left_out}
        return SharedCaches(tuple(read), env)

    def _protected_by(self, path: str) -> Path | None:
        """The server's own file or folder that ``path`` holds or lies inside, if any."""
        real = Path(os.path.realpath(path))
        for protected in self.protected:
            own = Path(os.path.realpath(protected))
            if real == own or own in real.parents or real in own.parents:
                return protected
        return None

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
        users = ""
        if self.uid_range is not None:
            users = f", a uid per model ({self.uid_range[0]}-{self.uid_range[1]})"
        return f"on: Landlock ABI {self.abi} ({network}), no_new_privs, limits{users}"

    def model(self, name: str, version: str, model_dir: Path, model_config: dict[str, Any],
              ranks: bool = False) -> ModelSandbox | None:  # fmt: skip
        """The rules of a model version; None when the sandbox is off. ``InvalidModel`` names
        the model config field that is wrong. ``ranks``: its workers are torchrun's ranks."""
        if not self.enabled:
            return None
        label = f"{name}:{version}"
        scratch = self.scratch_root / f"{name}-{version}"
        grants = self._grants(model_config.get("sandbox"), label)
        user = self._user(name, model_dir, grants)
        peers = peer_port_ranges(self.server_ports) if ranks else ()
        return ModelSandbox(label, str(model_dir), str(scratch), grants, user, self.reach,
                            self.caches, peers)  # fmt: skip

    def _user(self, name: str, model_dir: Path, grants: dict[str, Any]) -> WorkerUser | None:
        """The model's own uid, and what it must reach made reachable; None: the workers keep
        the server's user (not root, or ``sandbox_uid_range: off``)."""
        if self.uids is None or self.uid_range is None:
            return None
        uid = self.uids.uid(name)
        if not self._reached:
            for folder in self.reach.own:
                self.reach.own_folder(folder)
            self.reach.path(Path(mserve_worker.__file__).parent / ".")
            # now that the run dir's folders are reachable: which caches its uids can read
            self.caches = for_other_users(self.caches)
            self._reached = True
        groups: tuple[int, ...] = ()
        unpacked = self.reach.own[1]
        if Path(os.path.realpath(model_dir)).parent == unpacked:  # ours: its group reads it
            folder_gid = share_model_folder(model_dir, uid, self.uid_range)
            groups = (folder_gid,) if folder_gid != uid else ()
        else:  # the operator's folder (an archive folder in the store): as it is
            self.reach.path(Path(model_dir) / ".")
        # granted paths stay as they are: the model config is the archive's own file, and an
        # archive must not make the server open folders of the machine; the operator gives
        # the model's uid (describe shows it) what it should reach
        return WorkerUser(uid, uid, groups)

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
        protected = self._protected_by(value)
        if protected is not None:
            raise InvalidModel(
                f"model config of {label}: {where} names {value}, which holds or is inside"
                f" the server's own files ({protected})"
            )
        return os.path.realpath(value)

    def _port(self, value: Any, where: str, label: str) -> int:
        if type(value) is not int or not 0 < value < 65536:
            raise InvalidModel(f"model config of {label}: {where} must hold TCP ports"
                               f" (1-65535), got {value!r:.60}")  # fmt: skip
        if value in self.server_ports:
            raise InvalidModel(f"model config of {label}: {where} names {value}, one of the"
                               " server's own ports")  # fmt: skip
        return value


def peer_port_ranges(
    server_ports: set[int], ephemeral: str = "/proc/sys/net/ipv4/ip_local_port_range"
) -> tuple[tuple[int, int], ...]:
    """The TCP ports a parallel model's ranks may bind and connect to: the kernel's ephemeral
    range, less the server's own ports. The rendezvous port is drawn from it, and gloo (NCCL's
    bootstrap too) listens on a port the kernel picks there and connects to the other ranks'
    ones, which no list made in advance can name. Well-known ports (the server's defaults,
    databases, ...) lie below it and stay closed."""
    try:
        with open(ephemeral) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    ranges, start = [], low
    for port in sorted(p for p in server_ports if low <= p <= high):
        if port > start:
            ranges.append((start, port - 1))
        start = port + 1
    if start <= high:
        ranges.append((start, high))
    return tuple(ranges)


def _list(section: dict[str, Any], key: str, label: str) -> list[Any]:
    value = section.get(key) or []
    if not isinstance(value, list):
        raise InvalidModel(f"model config of {label}: sandbox.{key} must be a list,"
                           f" got {value!r:.60}")  # fmt: skip
    return value
