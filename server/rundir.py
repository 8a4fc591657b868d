"""What lives in the run dir, shared by the server process and the light ``mserve`` CLI.

Kept free of heavy imports so ``mserve --start/--stop/--status`` start in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server import locks

STATUS_FILE = "status.json"
KEY_FILE = "key_file.json"  # token authorization's keys (server/auth.py), TorchServe's name
PID_FILE = "mserve.pid"
LOCK_FILE = "mserve.lock"
SNAPSHOT_FILE = "snapshot.json"  # the registered models, restored at the next start
ENV_META_FILE = ".mserve-env.json"  # written last into a finished per-model environment


@dataclass(frozen=True)
class StartupModel:
    name: str | None
    url: str


def parse_models(values: list[str]) -> list[StartupModel]:
    """``NAME=PATH``, ``PATH``, comma lists, as TorchServe accepts them."""
    out = []
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, url = item.partition("=")
            out.append(StartupModel(name=name, url=url) if sep else StartupModel(None, item))
    return out


def write_json_atomic(
    path: Path, data: dict[str, Any], mode: int = 0o644, durable: bool = True
) -> None:
    """:func:`write_text_atomic` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2), mode, durable)


def write_text_atomic(path: Path, text: str, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` so that a reader, a crash or a power cut finds the old file or the new
    one, never a mix: the data reaches the disk before the rename, the rename before return.
    ``mode`` is the file's from its creation (0o600 for secrets: never readable by others, not
    even for an instant). ``durable=False``: readers still see the old file or the new one, but
    a power cut may lose it (no fsync, which can take tens of ms on a busy disk): for files
    that describe a running process or can be rebuilt."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a crash's leftover may carry another mode
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if not durable:
        return
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def server_holds_lock(run_dir: Path) -> bool:
    """The server holds an exclusive lock on the run dir for its whole life; the kernel drops it
    when the process dies, so this is right even after kill -9, with an unreaped zombie or a
    reused pid."""
    return locks.held_elsewhere(run_dir / LOCK_FILE)


def running_pid(run_dir: Path) -> int | None:
    """The server's pid from the pid file, if a server is alive on this run dir."""
    if not server_holds_lock(run_dir):
        return None
    try:
        pid = int((run_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid
