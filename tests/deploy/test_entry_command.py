"""The image's entry command run here, without a container runtime (none exists on this machine):
the same command line the KServe runtime gives the container (entry point + args), the same
MSERVE_* variables, the key file as the chart's Secret writes it, and the storage layout KServe
gives TorchServe (model-store/ and config/config.properties, in KServe's own style: both APIs on
port 8085, model_snapshot), with the example MLP archived as scripts/demo.sh does. It must serve
predictions on TorchServe's and KServe's paths, answer the probes, export the autoscaling
metrics, and stop within the pod's grace period on SIGTERM.

What this cannot show: the image building, the pod starting on a cluster, KServe's storage
initializer and ingress. Listeners bind 127.0.0.1 on free ports (port 0) here, not 0.0.0.0."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import (
    DOCKERFILE,
    Dockerfile,
    kserve_storage,
    of_kind,
    render,
    runtime_env,
    server_command,
)
from tests.server.conftest import http, wait_until

KEYS = {"inference": "inference-key-0123456789", "management": "management-key-0123456789",
        "api": "api-key-0123456789abcdef"}  # fmt: skip


@pytest.mark.timeout(240)
def test_the_image_command_serves_kserve_torchserve_storage(tmp_path: Path) -> None:
    docs = render("--set", "kserve.enabled=true", "--set", f"auth.keys.inference={KEYS['inference']}",
                  "--set", f"auth.keys.management={KEYS['management']}",
                  "--set", f"auth.keys.api={KEYS['api']}")  # fmt: skip
    runtime = of_kind(docs, "ServingRuntime")[0]
    container = runtime["spec"]["containers"][0]
    secret = of_kind(docs, "Secret")[0]
    key_file = tmp_path / "keys" / "key_file.json"
    key_file.parent.mkdir()
    key_file.write_text(secret["stringData"]["key_file.json"])
    grace_s = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]  # fmt: skip

    mount = tmp_path / "mnt" / "models"
    kserve_storage(mount, tmp_path)
    args = [a.replace("/mnt/models", str(mount)) for a in container["args"]]
    run_dir = tmp_path / "run"
    command, env = server_command(Dockerfile.read(DOCKERFILE), args,
                                  runtime_env(container, run_dir, key_file))  # fmt: skip
    log = tmp_path / "mserve.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path)  # fmt: skip
    try:
        status: dict[str, Any] = {}
        probes: list[int] = []  # readiness answers while the model was still loading

        def read_status() -> None:
            with contextlib.suppress(OSError, ValueError):  # not written yet, or mid-write
                status.update(json.loads((run_dir / "status.json").read_text()))

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            read_status()
            if status.get("state") == "ready":
                return True
            if status.get("urls"):  # listening, the startup model still loading
                code = http("GET", f"{status['urls']['inference']}/v2/health/ready").status
                read_status()
                if status.get("state") != "ready":
                    probes.append(code)
            return False

        wait_until(ready, 180, "the server to load the KServe layout's model")
        # the readiness probe kept traffic away until the model could answer it
        assert probes and set(probes) == {503}, probes
        assert status["models"] == {"mlp": "ready"}, log.read_text()[-3000:]
        inference, management = status["urls"]["inference"], status["urls"]["management"]
        metrics = status["urls"]["metrics"]

        # the probes, without a key
        assert http("GET", f"{inference}/v2/health/ready").status == 200
        assert http("GET", f"{inference}/v2/health/live").status == 200
        # TorchServe's path, with the Secret's key (the same on every replica); a wrong key fails
        row = [0.01 * i for i in range(256)]
        body = json.dumps({"data": row}).encode()
        bearer = {"Authorization": f"Bearer {KEYS['inference']}",
                  "Content-Type": "application/json"}  # fmt: skip
        answer = http("POST", f"{inference}/predictions/mlp", body, bearer)
        assert answer.status == 200, answer.body
        assert len(answer.json()) == 10
        wrong = {**bearer, "Authorization": "Bearer not-the-key-0123456789"}
        assert http("POST", f"{inference}/predictions/mlp", body, wrong).status == 401
        # KServe v1's model readiness, as KServe's clients ask it
        v1 = http("GET", f"{inference}/v1/models/mlp", headers=bearer)
        assert v1.status == 200, v1.body
        assert v1.json() == {"name": "mlp", "ready": True}
        # KServe v1 through the kserve envelope KServe asks for: one batch row per instance
        body = json.dumps({"instances": [row, row[::-1]]}).encode()
        v1 = http("POST", f"{inference}/v1/models/mlp:predict", body, bearer)
        assert v1.status == 200, v1.body
        predictions = v1.json()["predictions"]
        assert [len(p) for p in predictions] == [10, 10]
        assert predictions[0] == pytest.approx(answer.json(), abs=1e-5)  # batch 2 vs batch 1
        # fixed keys are not rotated through the API: a rotation would reach one replica only
        rotate = http("GET", f"{management}/token?type=inference",
                      headers={"Authorization": f"Bearer {KEYS['api']}"})  # fmt: skip
        assert rotate.status == 400
        assert "the keys are fixed (token_key_file)" in rotate.json()["message"]
        # what the autoscaler's metric is made of
        text = http("GET", f"{metrics}/metrics").body.decode()
        assert 'mserve_requests_pending{model="mlp",version="1.0"} 0.0' in text
        assert 'mserve_workers_ready{model="mlp",version="1.0"} 1.0' in text

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=grace_s) == 0
        assert time.monotonic() - started < grace_s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
