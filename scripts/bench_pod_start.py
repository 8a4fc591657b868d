"""How soon a new replica serves: the container's entry command (the KServe runtime's command
line, variables and storage layout, as tests/deploy/test_entry_command.py runs it) from process
start to ready (``/v2/health/ready`` 200) and to its first prediction, and from SIGTERM to exit.
This is what an autoscaler waits for after it adds a pod, less image pull and scheduling, which
depend on the cluster. Each round starts with an empty run dir (the archive is unpacked, the
worker template warmed, the first worker loaded), as a new pod does.

Prints each round, the medians (of ``--rounds``, at least 3) and the machine's load average and
CPU steal over the run.

    .venv/bin/python scripts/bench_pod_start.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.deploy.manifests import (
    DOCKERFILE,
    Dockerfile,
    kserve_storage,
    of_kind,
    render,
    runtime_env,
    server_command,
)

KEY = "bench-inference-key-0123456789"
TIMEOUT_S = 300.0


def _get(url: str, body: bytes | None = None) -> int:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError):
        return 0  # not listening yet


def one_round(work: Path, mount: Path, container: dict, key_file: Path, n: int) -> dict[str, float]:
    run_dir = work / f"run{n}"
    args = [a.replace("/mnt/models", str(mount)) for a in container["args"]]
    command, env = server_command(Dockerfile.read(DOCKERFILE), args,
                                  runtime_env(container, run_dir, key_file))  # fmt: skip
    out = open(work / f"mserve{n}.out", "wb")  # noqa: SIM115 (closed below)
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env,
                            stdout=out, stderr=subprocess.STDOUT, cwd=work)  # fmt: skip
    try:
        url = None
        while time.monotonic() - start < TIMEOUT_S:
            if proc.poll() is not None:
                sys.exit(f"server exited with {proc.returncode}; see {out.name}")
            try:
                url = json.loads((run_dir / "status.json").read_text())["urls"]["inference"]
            except (OSError, ValueError, KeyError):
                url = None
            if url and _get(f"{url}/v2/health/ready") == 200:
                break
            time.sleep(0.02)
        else:
            sys.exit(f"not ready within {TIMEOUT_S:g} s; see {out.name}")
        ready = time.monotonic() - start
        body = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
        code = _get(f"{url}/predictions/mlp", body)
        if code != 200:
            sys.exit(
                f"the first prediction answered {code}; see {out.name}:\n"
                + Path(out.name).read_text()[-2000:]
            )
        first = time.monotonic() - start
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        return {"ready_s": ready, "first_answer_s": first, "stop_s": time.monotonic() - stop}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = max(3, parser.parse_args().rounds)
    docs = render("--set", "kserve.enabled=true", "--set", f"auth.keys.inference={KEY}",
                  "--set", "auth.keys.management=bench-management-key-0123456789")  # fmt: skip
    container = of_kind(docs, "ServingRuntime")[0]["spec"]["containers"][0]
    secret = of_kind(docs, "Secret")[0]["stringData"]["key_file.json"]
    with tempfile.TemporaryDirectory(prefix="bench-pod-start-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        key_file = work / "key_file.json"
        key_file.write_text(secret)
        mount = work / "mnt" / "models"
        kserve_storage(mount, work)
        cpu_before, load_before = psutil.cpu_times(), os.getloadavg()
        rows = []
        for n in range(rounds):
            row = one_round(work, mount, container, key_file, n)
            rows.append(row)
            print(
                f"round {n + 1}: ready {row['ready_s']:.2f} s, first answer"
                f" {row['first_answer_s']:.2f} s, SIGTERM to exit {row['stop_s']:.2f} s"
            )
        cpu_after, load_after = psutil.cpu_times(), os.getloadavg()
    steal = getattr(cpu_after, "steal", 0.0) - getattr(cpu_before, "steal", 0.0)
    total = sum(cpu_after) - sum(cpu_before)
    print(
        f"median of {rounds}: ready {statistics.median(r['ready_s'] for r in rows):.2f} s,"
        f" first answer {statistics.median(r['first_answer_s'] for r in rows):.2f} s,"
        f" SIGTERM to exit {statistics.median(r['stop_s'] for r in rows):.2f} s"
    )
    print(
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), {os.cpu_count()}"
        f" CPUs; steal {steal / max(total, 1e-9) * 100:.0f}% of CPU time"
    )


if __name__ == "__main__":
    main()
