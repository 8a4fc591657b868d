"""KServe's own TorchServe runtime (kserve_torchserve_runtime.yaml, as KServe ships it) with
mserve's image in place of TorchServe's: its args and environment unchanged, run through the
image's entry point (server/container.py, as the Dockerfile names it), on the storage layout
KServe gives TorchServe.

What the test changes, and why: listeners bind loopback free ports instead of 0.0.0.0:8080 and
the properties file's 8085/8082/7070 (a test may not take fixed ports or all interfaces); the
run dir is the test's own (MSERVE_RUN_DIR). Without a container runtime, the image's build and
KServe's controller are not exercised (tests/deploy/test_entry_command.py says the same)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tests.deploy.manifests import DOCKERFILE, Dockerfile, kserve_storage, server_command
from tests.server.conftest import http, wait_until

RUNTIME = Path(__file__).resolve().parent / "kserve_torchserve_runtime.yaml"


def test_kserves_torchserve_runtime_starts_the_image_unchanged(tmp_path: Path) -> None:
    container = yaml.safe_load(RUNTIME.read_text())["spec"]["containers"][0]
    mount = tmp_path / "mnt" / "models"
    kserve_storage(mount, tmp_path)
    props = mount / "config" / "config.properties"
    text = re.sub(r"http://0\.0\.0\.0:\d+", "http://127.0.0.1:0", props.read_text())
    props.write_text(re.sub(r"(grpc_\w+_port)=\d+", r"\1=0", text))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSERVE_", "TS_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for var in container["env"]:  # KServe fills the label in: kserve for the v1 protocol
        env[var["name"]] = var["value"].replace("{{.Labels.serviceEnvelope}}", "kserve")
    env["MSERVE_RUN_DIR"] = str(tmp_path / "run")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    args = [a.replace("/mnt/models", str(mount)) for a in container["args"]]
    command, env = server_command(Dockerfile.read(DOCKERFILE), args, env)
    # TorchServe's command, attached; KServe's predictor port in place of TorchServe's wrapper
    assert command == [*args, "--foreground"]
    assert env["MSERVE_INFERENCE_ADDRESS"] == "0.0.0.0:8080"
    env["MSERVE_INFERENCE_ADDRESS"] = "127.0.0.1:0"

    home = tmp_path / "home"  # the image's WORKDIR
    home.mkdir()
    out = tmp_path / "console.txt"
    with open(out, "wb") as console:
        proc = subprocess.Popen(command, env=env, cwd=home, stdout=console,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: "Model server started." in out.read_text() or proc.poll() is not None,
                   180, "Model server started.")  # fmt: skip
        assert proc.poll() is None, out.read_text()[-3000:]
        status = json.loads((tmp_path / "run" / "status.json").read_text())
        inference = status["urls"]["inference"]
        assert status["models"] == {"mlp": "ready"}
        assert http("GET", f"{inference}/v2/health/ready").status == 200
        # KServe v1 through the envelope KServe's runtime asks for, keyed as TorchServe 0.12 is
        key = json.loads((home / "key_file.json").read_text())["inference"]["key"]
        row = [0.01 * i for i in range(256)]
        reply = http("POST", f"{inference}/v1/models/mlp:predict",
                     json.dumps({"instances": [row]}).encode(),
                     {"Authorization": f"Bearer {key}"})  # fmt: skip
        assert reply.status == 200, reply.body
        assert [len(p) for p in reply.json()["predictions"]] == [10]
        # the management API stays where config.properties put it (8085 there)
        assert status["urls"]["management"] != inference

        proc.send_signal(signal.SIGTERM)  # what the kubelet sends; tini passes it on
        assert proc.wait(timeout=60) == 0
        kinds = sorted(p.name.rsplit("-", 1)[1] for p in (home / "logs" / "config").iterdir())
        assert kinds == ["shutdown.cfg", "startup.cfg"]  # TorchServe's snapshots, in its place
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
