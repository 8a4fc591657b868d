"""What the deploy tests read: the Helm chart rendered with real helm, and the Dockerfile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dockerfile
import yaml

from tests.conftest import ARCHIVER_SCRIPT
from tests.deploy.k8s_tools import helm_path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "mserve"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
MLP = REPO / "examples" / "mlp"
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
    """A Dockerfile's instructions as BuildKit's own parser reads them (the ``dockerfile``
    package wraps it): what a real build would see, continuation lines and quoting included."""

    instructions: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        return cls([(c.cmd.upper(), tuple(c.value)) for c in dockerfile.parse_file(str(path))])

    def all(self, word: str) -> list[tuple[str, ...]]:
        return [value for w, value in self.instructions if w == word]

    def entrypoint(self) -> list[str]:
        (value,) = self.all("ENTRYPOINT")
        return list(value)

    def env(self) -> dict[str, str]:
        """ENV name/value pairs, in order."""
        pairs: dict[str, str] = {}
        for value in self.all("ENV"):
            pairs.update(zip(value[::2], value[1::2], strict=True))
        return pairs

    def args(self) -> dict[str, str]:
        pairs = {}
        for (value,) in self.all("ARG"):
            name, _, default = value.partition("=")
            pairs[name] = default
        return pairs


def server_command(
    dockerfile: Dockerfile, args: list[str], environ: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """What the image runs for a container's ``args`` and environment: its entry point without
    its init (tini), and, as that is mserve-container, the command line and environment it
    execs (server/container.py decides; the same code runs in the image)."""
    from server.container import command_for

    command = dockerfile.entrypoint()
    if command[:2] == ["tini", "--"]:
        command = command[2:]
    assert command == ["mserve-container"], command
    return command_for(list(args), environ)


def kserve_storage(root: Path, tmp_path: Path) -> None:
    """What KServe's storage initializer leaves under the mount for its TorchServe runtime."""
    store = root / "model-store"
    store.mkdir(parents=True)
    (root / "config").mkdir()
    weights = tmp_path / "mlp.pt"
    subprocess.run([sys.executable, str(MLP / "make_weights.py"), str(weights)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    subprocess.run(
        [ARCHIVER_SCRIPT, "--model-name", "mlp", "--version", "1.0",
         "--serialized-file", str(weights), "--model-file", str(MLP / "model.py"),
         "--handler", f"{MLP / 'handler.py'}:handle", "-c", str(MLP / "model-config.yaml"),
         "--export-path", str(store)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    snapshot = {"name": "startup.cfg", "modelCount": 1, "models": {"mlp": {"1.0": {
        "defaultVersion": True, "marName": "mlp.mar", "minWorkers": 1, "maxWorkers": 1,
        "batchSize": 1, "maxBatchDelay": 10, "responseTimeout": 120}}}}  # fmt: skip
    (root / "config" / "config.properties").write_text(
        "inference_address=http://0.0.0.0:8085\n"
        "management_address=http://0.0.0.0:8085\n"
        "metrics_address=http://0.0.0.0:8082\n"
        "grpc_inference_port=7070\n"
        "grpc_management_port=7071\n"
        "enable_envvars_config=true\n"
        "enable_metrics_api=true\n"
        "metrics_mode=prometheus\n"
        "number_of_netty_threads=4\n"
        "job_queue_size=10\n"
        f"model_store={root / 'model-store'}\n"
        f"model_snapshot={json.dumps(snapshot)}\n"
    )


def runtime_env(
    container: dict[str, Any], run_dir: Path, key_file: Path, service_envelope: str = "kserve"
) -> dict[str, str]:
    """The runtime's variables, listeners moved to free loopback ports, the run dir to tmp;
    KServe's label filled in as KServe does (``kserve`` for the v1 protocol, its default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSERVE_", "TS_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for var in container["env"]:
        value = var["value"]
        if var["name"].endswith("_ADDRESS"):
            value = re.sub(r"^[0-9.]+:\d+$", "127.0.0.1:0", value)
            assert value == "127.0.0.1:0", var
        env[var["name"]] = value.replace("{{.Labels.serviceEnvelope}}", service_envelope)
    env["MSERVE_RUN_DIR"] = str(run_dir)
    env["MSERVE_TOKEN_KEY_FILE"] = str(key_file)  # where the pod mounts the Secret
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env
