"""What the deploy tests read: the Helm chart rendered with real helm, and the Dockerfile."""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.k8s_tools import helm_path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "mserve"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
KUBE_VERSION = "1.25.0"  # the chart's kubeVersion floor


class HelmFailed(AssertionError):
    pass


def render(*args: str, release: str = "demo") -> list[dict[str, Any]]:
    """``helm template`` with these ``--set``-style arguments; the documents it prints."""
    out = subprocess.run(
        [str(helm_path()), "template", release, str(CHART), "--kube-version", KUBE_VERSION,
         *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if out.returncode != 0:
        raise HelmFailed(out.stderr.strip())
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""

    instructions: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        out, pending = cls(), ""
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            text = pending + stripped
            pending = ""
            word, _, rest = text.partition(" ")
            out.instructions.append((word.upper(), rest.strip()))
        return out

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]

    def entrypoint(self) -> list[str]:
        (value,) = self.all("ENTRYPOINT")
        return json.loads(value)

    def env(self) -> dict[str, str]:
        """ENV name=value pairs (the form this Dockerfile uses)."""
        pairs: dict[str, str] = {}
        for rest in self.all("ENV"):
            for item in shlex.split(rest):
                name, sep, value = item.partition("=")
                assert sep, f"ENV {rest!r}: use the NAME=value form"
                pairs[name] = value
        return pairs

    def args(self) -> dict[str, str]:
        pairs = {}
        for rest in self.all("ARG"):
            name, _, value = rest.partition("=")
            pairs[name] = value
        return pairs


def server_command(dockerfile: Dockerfile) -> list[str]:
    """The image's entry point without its init (tini): the mserve command line."""
    command = dockerfile.entrypoint()
    if command[:2] == ["tini", "--"]:
        command = command[2:]
    return command
