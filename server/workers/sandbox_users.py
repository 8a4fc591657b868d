"""Each model's workers under their own unprivileged user, when the server runs as root.

Landlock keeps a worker out of other models' files, but processes of one user share what the
kernel grants per user: ``RLIMIT_NPROC`` counts every process of the user (a fork bomb in one
model would starve the others), and a process may read the ``/proc/<pid>/environ`` and memory of
another process of the same user. So each model gets a uid (and a group of the same number) from
the ``sandbox_uid_range`` setting, recorded in the run dir, so that a model keeps its uid across
restarts and two models never share one.

A worker under another uid must still reach what it runs: the folders on the way to its model
folder, its scratch folder and its interpreter become traversable by others (search, never
listing: ``o+x``), its model folder is readable by its group only, its scratch folder is its
own. The key file, the snapshot and the logs stay the server's (0600, or in folders workers
cannot list, with names and modes of their own).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from server.errors import ConfigError, InvalidModel
from server.rundir import write_json_atomic

log = logging.getLogger(__name__)

UIDS_FILE = "sandbox_uids.json"  # in the run dir: model name -> uid, 0600


@dataclass(frozen=True)
class WorkerUser:
    """The credentials a model's workers run under: their own uid and group, and the group of
    their model folder (shared with models registered from the same archive bytes)."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def as_policy(self) -> dict[str, object]:
        return {"uid": self.uid, "gid": self.gid, "groups": list(self.groups)}


def parse_uid_range(value: str) -> tuple[int, int] | None:
    """``sandbox_uid_range``: ``FIRST-LAST``, or ``off`` (workers keep the server's user)."""
    text = value.strip().lower()
    if text in ("", "off", "false", "none"):
        return None
    first, sep, last = text.partition("-")
    try:
        low, high = int(first), int(last)
    except ValueError:
        low = high = -1
    if not sep or not 0 < low <= high < 2**32 - 1:
        raise ConfigError(
            f"sandbox_uid_range should be FIRST-LAST (uids, 1 to 4294967294, FIRST <= LAST)"
            f" or off, found {value!r}"
        )
    return low, high


class UidMap:
    """Model name -> uid, recorded in ``<run_dir>/sandbox_uids.json``. A new model takes the
    lowest uid of the range that no recorded model holds and no account of this machine has."""

    def __init__(self, run_dir: Path, uid_range: tuple[int, int]) -> None:
        self.path = run_dir / UIDS_FILE
        self.range = uid_range
        self._lock = threading.Lock()
        self._uids: dict[str, int] | None = None

    def _load(self) -> dict[str, int]:
        if self._uids is None:
            try:
                raw = json.loads(self.path.read_text()).get("models", {})
                low, high = self.range
                self._uids = {
                    str(k): v for k, v in raw.items() if type(v) is int and low <= v <= high
                }
            except (OSError, ValueError, AttributeError):
                self._uids = {}
        return self._uids

    def uid(self, model: str) -> int:
        """The model's uid; ``InvalidModel`` when the range has none left."""
        with self._lock:
            uids = self._load()
            if model in uids:
                return uids[model]
            taken = set(uids.values())
            low, high = self.range
            for uid in range(low, high + 1):
                if uid not in taken and not _account_exists(uid):
                    uids[model] = uid
                    write_json_atomic(self.path, {"models": uids}, mode=0o600)
                    return uid
        raise InvalidModel(
            f"sandbox_uid_range {low}-{high} has no uid left for model {model}"
            f" ({len(taken)} models hold one, see {self.path}); widen the range"
        )


def _account_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


class Reach:
    """Makes folders reachable by workers under other uids, each folder once per server."""

    def __init__(self, own_folders: list[Path]) -> None:
        # folders the server made: searchable, never listable, by others (0711)
        self.own = [Path(os.path.realpath(p)) for p in own_folders]
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def path(self, target: str | Path) -> None:
        """Every folder above ``target`` (after links) gets the search bit for others. A folder
        of the server's own gets 0711; any other one keeps its mode plus ``o+x``, logged,
        since that is a change to the operator's machine."""
        real = os.path.realpath(target)
        with self._lock:
            if real in self._done:
                return
            self._done.add(real)
        for folder in reversed(Path(real).parents):
            self._search(folder)

    def _search(self, folder: Path) -> None:
        key = str(folder)
        try:
            mode = folder.stat().st_mode
        except OSError:
            return
        if folder in self.own:
            if stat.S_IMODE(mode) & 0o077 != 0o011:
                os.chmod(folder, stat.S_IMODE(mode) & 0o700 | 0o011)
            return
        if mode & stat.S_IXOTH or key in self._done:
            return
        with self._lock:
            self._done.add(key)
        os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
        log.warning(
            "sandbox: %s was not searchable by other users; added o+x (search, not listing) so"
            " that workers under their own uid reach their model (set sandbox_uid_range: off"
            " to run workers as the server's user)",
            folder,
        )

    def own_folder(self, folder: Path) -> None:
        """A folder of the server's (the run dir, its unpacked and scratch folders): 0711."""
        folder.mkdir(parents=True, exist_ok=True)
        self.path(folder / ".")
        self._search(folder)


def share_model_folder(model_dir: Path, gid: int, uid_range: tuple[int, int]) -> int:
    """The group whose members read ``model_dir``: the folder's own when another model's
    group holds it already (same archive bytes, same files), else ``gid``, given to the folder
    and everything in it (group-readable, the top folder 0750: others cannot enter)."""
    current = model_dir.stat().st_gid
    if uid_range[0] <= current <= uid_range[1]:
        return current
    for root, dirs, files in os.walk(model_dir):
        for name in [*dirs, *files]:
            _give_group(Path(root) / name, gid)
    _give_group(model_dir, gid)
    os.chmod(model_dir, 0o750)
    return gid


def _give_group(path: Path, gid: int) -> None:
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return
    os.chown(path, -1, gid)
    mode = stat.S_IMODE(st.st_mode)
    os.chmod(path, mode | 0o040 | (0o010 if mode & 0o100 or stat.S_ISDIR(st.st_mode) else 0))


def own_scratch(scratch: Path, user: WorkerUser) -> None:
    """The worker's scratch folder: its own, and nobody else's (0700)."""
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = scratch.stat()
    if (st.st_uid, st.st_gid) != (user.uid, user.gid):
        os.chown(scratch, user.uid, user.gid)
