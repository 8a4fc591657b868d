"""The caches handlers load pretrained weights from, readable by confined workers.

torchvision, timm and transformers handlers load their weights through torch.hub
(``$TORCH_HOME/hub/checkpoints``) and huggingface_hub (``$HF_HUB_CACHE``), caches a deployment
fills ahead of time (baked into the image, a mounted volume) so that a server offline finds
them. A confined worker reads only what it is granted, and its ``HOME`` is its scratch folder,
so without this it neither may read those caches nor looks where they are. Every model's
workers get, read-only:

- each folder the server's environment names in a variable those libraries read (as the
  workers get it: after ``worker_env_deny``), the variable passed on as an absolute path (a
  ``~`` or relative path means what it means to the server, not to a worker whose ``HOME``
  and working directory differ);
- where the environment names none for a library, the server user's own cache when it exists:
  ``~/.cache/torch``, and of ``~/.cache/huggingface`` the hub and assets caches only (the
  folder also holds the user's login token), the worker pointed at it with ``TORCH_HOME``,
  ``HF_HUB_CACHE`` and ``HF_ASSETS_CACHE``;
- the folders of the ``sandbox_read_paths`` setting.

Writing stays confined: a handler that downloads into one of these caches fails unless its
model config grants the folder (``writePaths``). Under a uid per model (a root server) a worker
also needs the folders' permissions: a home cache other users cannot read is left out (the
worker keeps its scratch cache), and a named one is granted with a warning saying so.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# What torch.hub, huggingface_hub, transformers and sentence-transformers read a cache's place
# from (torch.hub's TORCH_HUB only warns that it is deprecated; it names no folder).
CACHE_VARIABLES = (
    "TORCH_HOME", "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
    "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE", "TRANSFORMERS_CACHE",
    "PYTORCH_TRANSFORMERS_CACHE", "PYTORCH_PRETRAINED_BERT_CACHE", "SENTENCE_TRANSFORMERS_HOME",
)  # fmt: skip
# The server user's own caches, under ~/.cache: (folder, the variable that points a worker at
# it, the variables any of which, set, means the libraries look elsewhere).
_HOME_CACHES = (
    ("torch", "TORCH_HOME", ("TORCH_HOME", "XDG_CACHE_HOME")),
    ("huggingface/hub", "HF_HUB_CACHE",
     ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")),
    ("huggingface/assets", "HF_ASSETS_CACHE",
     ("HF_HOME", "HF_ASSETS_CACHE", "HUGGINGFACE_ASSETS_CACHE", "XDG_CACHE_HOME")),
)  # fmt: skip


@dataclass(frozen=True)
class SharedCaches:
    """What every model's workers may read besides their own model: ``read`` (each path with
    what granted it, for messages), and ``env``, the variables that make them look there."""

    read: tuple[tuple[str, str], ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def paths(self) -> list[str]:
        return [path for path, _why in self.read]


def _absolute(value: str, home: str, cwd: str) -> str:
    """``value`` as the server means it: ``~`` is the server user's home, a relative path is
    relative to the folder the server started in."""
    if value == "~" or value.startswith("~/"):
        value = home + value[1:]
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(value)))


def find_caches(
    worker_environ: Mapping[str, str], read_paths: tuple[str, ...], home: str, cwd: str
) -> SharedCaches:
    """The caches of the server's environment (``worker_environ``: the variables workers get),
    its user's (``home``) and the ``sandbox_read_paths`` setting (``read_paths``, absolute)."""
    read: dict[str, str] = {}
    env: dict[str, str] = {}
    for name in CACHE_VARIABLES:
        value = worker_environ.get(name, "")
        if value.strip():
            path = _absolute(value, home, cwd)
            read.setdefault(path, name)
            if path != value:
                env[name] = path
    for folder, variable, overridden in _HOME_CACHES:
        path = os.path.join(home, ".cache", folder)
        if not any(worker_environ.get(v, "").strip() for v in overridden) and os.path.isdir(path):
            read.setdefault(path, f"~/.cache/{folder}")
            env[variable] = path
    for path in read_paths:
        read.setdefault(path, "sandbox_read_paths")
    return SharedCaches(tuple(read.items()), env)


def others_can_read(path: str) -> str | None:
    """None when a user other than the owner may read ``path`` by its mode (every folder above
    searchable, the folder itself listable and searchable, a file readable); else the first
    folder or file that stops them. ACLs are not read: they may let in more."""
    real = Path(os.path.realpath(path))
    for folder in reversed(real.parents):
        try:
            if not folder.stat().st_mode & stat.S_IXOTH:
                return str(folder)
        except OSError:
            return str(folder)
    try:
        mode = real.stat().st_mode
    except OSError:
        return str(real)
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return None if mode & need == need else str(real)


def for_other_users(caches: SharedCaches) -> SharedCaches:
    """``caches`` as workers under their own uid can use them: a home cache that others cannot
    read is left out (the worker keeps the cache in its scratch folder, where it may download);
    a folder the operator named stays, with a warning: its workers' reads will fail."""
    read: list[tuple[str, str]] = []
    env = dict(caches.env)
    for path, why in caches.read:
        closed = others_can_read(path)
        if closed is None:
            read.append((path, why))
        elif why.startswith("~/"):
            variable = next(v for f, v, _o in _HOME_CACHES if why == f"~/.cache/{f}")
            env.pop(variable, None)
            log.warning(
                "sandbox: %s is not readable by other users (%s stops them): workers under"
                " their own uid do not use it and cache in their scratch folder; to share"
                " it, let others read it (chmod o+x on the folders above, o+rX on it) or set"
                " sandbox_uid_range: off",
                path, closed,
            )  # fmt: skip
        else:
            read.append((path, why))
            log.warning(
                "sandbox: %s (%s) is not readable by other users (%s stops them): workers"
                " under their own uid will be refused reading it; let others read it (chmod"
                " o+x on the folders above, o+rX on it; or a group, an ACL) or set"
                " sandbox_uid_range: off",
                path, why, closed,
            )  # fmt: skip
    return SharedCaches(tuple(read), env)
