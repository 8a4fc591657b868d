"""Which of the server's environment variables its workers get.

A worker runs the model's code, and the server's environment holds what the operator gave the
server: cloud keys, tokens, passwords, mserve's own settings. Workers (and the templates they
are forked from) get the server's environment without the variables whose names match the
deny-list (``worker_env_deny``: shell-style globs, case ignored; TorchServe's
``blacklist_env_vars``, a regular expression the whole name must match, on top). A model gets
a denied variable back only by naming it in its archive's model config (``allowedEnvVars``),
and never one of mserve's own (``MSERVE_*``): a worker has no use for the server's settings.
"""

from __future__ import annotations

import ctypes
import fnmatch
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# mserve's own settings and secrets: never in a worker, whatever the config or the model says.
ALWAYS_DENIED = ("MSERVE_*",)
_PR_SET_DUMPABLE = 4


def _matches(name: str, patterns: Iterable[str]) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, pattern.upper()) for pattern in patterns)


@dataclass(frozen=True)
class WorkerEnvironment:
    """The server's environment split in two: what every worker gets (``base``) and what is
    held back (``withheld``), from which a model may ask for variables by name."""

    base: Mapping[str, str] = field(default_factory=dict)
    withheld: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def split(
        cls, environ: Mapping[str, str], deny: Iterable[str], deny_regex: str | None = None
    ) -> WorkerEnvironment:
        patterns = (*ALWAYS_DENIED, *deny)
        regex = re.compile(deny_regex) if deny_regex else None
        base, withheld = {}, {}
        for name, value in environ.items():
            if _matches(name, patterns) or (regex is not None and regex.fullmatch(name)):
                withheld[name] = value
            else:
                base[name] = value
        return cls(base, withheld)

    def for_model(self, allowed: Iterable[str], label: str) -> dict[str, str]:
        """The withheld variables ``allowed`` names (exact names), to add to a model's workers;
        mserve's own are never given. Called once per model version (it logs what it gives)."""
        given, refused = {}, []
        for name in allowed:
            if name not in self.withheld:
                continue  # not set, or not denied: every worker has it already
            if _matches(name, ALWAYS_DENIED):
                refused.append(name)
            else:
                given[name] = self.withheld[name]
        if given:
            log.info("model %s gets %s from the server's environment (allowedEnvVars)",
                     label, ", ".join(sorted(given)))  # fmt: skip
        if refused:
            log.warning(
                "model %s: allowedEnvVars names %s; mserve's own variables never reach workers",
                label, ", ".join(sorted(refused)),
            )  # fmt: skip
        return given


def hide_own_environ() -> bool:
    """Make this process non-dumpable (Linux), so that /proc/<pid>/environ, which holds the
    environment the server was started with, secrets and all, can no longer be read by a
    worker running as the same user (nor can it ptrace the server). Root still can; so can
    nothing else. Side effect: no core dumps of the server, and a debugger or py-spy must
    attach as root. True when it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
