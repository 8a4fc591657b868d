"""Server paths out of what the APIs answer.

Error messages carry what a worker, an archive or the filesystem said: a handler's traceback
names ``/home/svc/.mserve/unpacked/<sha256>/handler.py``, an archive error the store's path,
an environment build the interpreter's. A client of the inference port has no business knowing
the server's layout (user name, where secrets or models live), so every error answer and
describe's ``failure`` and ``lastOutput`` go through :class:`PathRedactor` on the way out: a
file of a model becomes its name inside the model (``handler.py``), the server's folders become
a name for them (``<run_dir>``, ``<model_store>``, ``<python>``, ...), and a traceback line
naming a file anywhere else keeps only the file's name. The log keeps every message whole.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_BEFORE = r"(?<![\w.-])"  # a root starts a path, not the middle of a longer name
_AFTER = r"(?![\w.-])"  # and ends at a path separator or outside the path
_OTHER_TRACEBACK_FILE = re.compile(r'File "/[^"\n]*/([^"/\n]+)"')


class PathRedactor:
    """``roots`` maps a folder to the name shown in its place; ``model_caches`` are folders of
    unpacked models (``<cache>/<sha256>/...``), whose files are shown relative to the model."""

    def __init__(self, roots: Mapping[str, str], model_caches: Iterable[str] = ()) -> None:
        tokens: dict[str, str] = {}
        for path, token in roots.items():
            for variant in _variants(path):
                tokens.setdefault(variant, token)
        self._tokens = tokens
        caches = sorted({v for c in model_caches for v in _variants(c)}, key=len, reverse=True)
        alternatives = sorted(tokens, key=len, reverse=True)
        parts = []
        if caches:
            parts.append(
                rf"(?P<model>{_BEFORE}(?:{'|'.join(map(re.escape, caches))})/[0-9a-f]{{64}})"
                rf"(?:(?P<slash>/)|{_AFTER})"
            )
        if alternatives:
            either = "|".join(map(re.escape, alternatives))
            parts.append(rf"(?P<root>{_BEFORE}(?:{either})){_AFTER}")
        self._pattern = re.compile("|".join(parts)) if parts else None

    @classmethod
    def for_server(
        cls,
        run_dir: Path,
        model_store: Path | None,
        env_dir: Path,
        log_dir: Path,
        allowed_paths: Iterable[str] = (),
    ) -> PathRedactor:
        """The folders a server's answers could name: its own, the Python installations (ours
        and the models' environments), mserve's code, the home and temp folders."""
        roots = {
            str(run_dir): "<run_dir>",
            str(env_dir): "<env_dir>",
            str(log_dir): "<log_dir>",
            str(Path(__file__).resolve().parent.parent): "<mserve>",
            sys.prefix: "<python>",
            sys.base_prefix: "<python>",
            sys.exec_prefix: "<python>",
            tempfile.gettempdir(): "<tmp>",
            str(Path.home()): "~",
        }
        if model_store is not None:
            roots[str(model_store)] = "<model_store>"
        for path in allowed_paths:
            roots[str(Path(path).expanduser().absolute())] = "<allowed_path>"
        return cls(roots, [str(run_dir / "unpacked")])

    def __call__(self, text: str) -> str:
        if self._pattern is not None and "/" in text:
            text = self._pattern.sub(self._replace, text)
        return _OTHER_TRACEBACK_FILE.sub(r'File ".../\1"', text)

    def _replace(self, match: re.Match[str]) -> str:
        if match.group("root") is not None:
            return self._tokens[match.group("root")]
        return "" if match.group("slash") else "<model_dir>"

    def describe(self, described: dict[str, Any]) -> dict[str, Any]:
        """Describe's answer with its worker output (``failure``, ``lastOutput``) redacted."""
        if described.get("failure"):
            described["failure"] = self(described["failure"])
        if described.get("lastOutput"):
            described["lastOutput"] = [self(line) for line in described["lastOutput"]]
        return described


def _variants(path: str) -> set[str]:
    """The path as given and with its links resolved, without a trailing slash; not ``/``."""
    out = set()
    for variant in (path, os.path.realpath(path)):
        variant = variant.rstrip("/")
        if variant.count("/") >= 1 and len(variant) > 1:
            out.add(variant)
    return out
