"""GPU check: on a machine with NVIDIA GPUs, serve models on them end to end and check every GPU
path the server has; a line per check, exit status 1 when one fails (2: no GPU here).

Usage: python scripts/check_gpu.py [--keep]

The test suite runs where there is no GPU (tests/server/test_gpus.py hands out GPUs that do not
exist and checks what each worker is told); this is the same contract on the real thing, run
by hand on a GPU machine (docs/workers.md, GPUs). With the server's defaults (GPUs detected,
workers confined by the sandbox, forked from the torch-preloaded template):

- detection: every worker of a model is pinned to a GPU, round robin, described with its id;
- a TorchServe handler (``BaseHandler``, a TorchScript model loaded with its ``map_location``)
  runs on its worker's ``cuda:0``, which is the physical GPU the worker was described with, and
  answers what the same model answers on the CPU; the worker shows on ``nvidia-smi``;
- a ``deviceType: cpu`` model's worker sees no GPU;
- a worker killed mid-life comes back on its GPU and answers there; a scaled-up one gets one;
- the GPU gauges (``GPUUtilization``, ``GPUMemoryUsed``, ...) are on ``/metrics``;
- examples/tiny_lm, continuous batching on the GPU: concurrent streamed OpenAI completions;
- the warm tier (docs/warm-tier.md) on the GPU: a ``BaseHandler`` model with a state dict,
  evicted to the warm tier and woken, answers on ``cuda:0`` what it answered loaded, and the
  wake is faster than the cold load. Not yet run on a GPU: called on the CPU, its flow runs
  and only the cuda:0 part fails (cold 8.1 s, wake 0.41 s for its 256 MiB model).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import REPO, Server, archive, wait_until

PROBE = '''
import os

import torch
from ts.torch_handler.base_handler import BaseHandler


class GpuProbe(BaseHandler):
    """BaseHandler picks the device and loads the TorchScript model onto it."""

    def handle(self, data, context):
        out = []
        for row in data:
            body = row.get("body") or row.get("data")
            x = torch.tensor(body["x"], device=self.device)
            with torch.no_grad():
                y = self.model(x)
            out.append({
                "y": y.tolist(),
                "device": str(self.device),
                "weights_on": str(next(self.model.parameters()).device),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu_id": context.system_properties.get("gpu_id"),
                "gpu_name": torch.cuda.get_device_name(0) if self.device.type == "cuda" else None,
                "pid": os.getpid(),
            })
        return out
'''
X = [[0.5 * i - j for i in range(16)] for j in range(3)]

failures: list[str] = []


def check(what: str, ok: bool, detail: Any = "") -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{f': {detail}' if detail != '' else ''}", flush=True)
    if not ok:
        failures.append(what)
    return ok


def smi(*query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def build(work: Path) -> list[list[float]]:
    """The archives in ``<work>/store``; the probe model's answer to ``X`` on the CPU."""
    import torch

    torch.manual_seed(0)
    model = torch.jit.script(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    )
    model.save(str(work / "probe.pt"))
    (work / "gpu_probe.py").write_text(PROBE)
    (work / "probe.yaml").write_text("minWorkers: 2\nmaxWorkers: 4\n")
    (work / "cpu.yaml").write_text("deviceType: cpu\nminWorkers: 1\nmaxWorkers: 1\n")
    for name, config in (("probe", "probe.yaml"), ("cpuonly", "cpu.yaml")):
        archive(
            work / "store",
            name,
            "--version",
            "1.0",
            "--serialized-file",
            work / "probe.pt",
            "--handler",
            f"{work / 'gpu_probe.py'}:GpuProbe",
            "-c",
            work / config,
        )
    lm = REPO / "examples" / "tiny_lm"
    subprocess.run([sys.executable, str(lm / "make_weights.py"), str(work / "tiny_lm.pt")],
                   check=True, capture_output=True)  # fmt: skip
    archive(
        work / "store",
        "tiny_lm",
        "--version",
        "1.0",
        "--serialized-file",
        work / "tiny_lm.pt",
        "--model-file",
        lm / "model.py",
        "--handler",
        f"{lm / 'handler.py'}:TinyLMHandler",
        "-c",
        lm / "model-config.yaml",
    )
    with torch.no_grad():
        return model(torch.tensor(X)).tolist()


def close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(
        abs(p - q) <= 1e-3 * (1 + abs(q))
        for ra, rb in zip(a, b, strict=True)
        for p, q in zip(ra, rb, strict=True)
    )


def workers(server: Server, model: str) -> list[dict[str, Any]]:
    status, body = server.request("GET", f"/models/{model}", api="management")
    assert status == 200, body
    return json.loads(body)[0]["workers"]


def predict(server: Server, model: str) -> dict[str, Any]:
    status, body = server.request("POST", f"/predictions/{model}", json.dumps({"x": X}).encode())
    if status != 200:
        raise SystemExit(f"/predictions/{model}: {status} {body[:500]!r}")
    return json.loads(body)


WARM_HANDLER = """
import hashlib

import torch
from ts.torch_handler.base_handler import BaseHandler


class WarmProbe(BaseHandler):
    def handle(self, data, context):
        x = torch.ones(len(data), 1024, device=self.device)
        with torch.no_grad():
            y = self.model(x).cpu()
        return [{"digest": hashlib.sha256(row.numpy().tobytes()).hexdigest(),
                 "weights_on": str(next(self.model.parameters()).device)} for row in y]
"""
WARM_MODEL = """
import torch


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(64)])

    def forward(self, x):
        return self.layers(x)
"""


def check_warm_tier(work: Path) -> None:
    """A 256 MiB state-dict model on a server with the warm tier: loaded cold, evicted by its
    idle unload into the warm tier, woken: on cuda:0 both times, the same answer, and the
    wake faster than the cold load (one copy from the mapped pages to the device)."""
    import torch

    (work / "warm_probe.py").write_text(WARM_HANDLER)
    (work / "warm_model.py").write_text(WARM_MODEL)
    sys.path.insert(0, str(work))
    from warm_model import Stack  # type: ignore[import-not-found]

    torch.manual_seed(0)
    torch.save(Stack().state_dict(), work / "warm.pt")
    archive(work / "store", "warm", "--version", "1.0", "--serialized-file", work / "warm.pt",
            "--model-file", work / "warm_model.py",
            "--handler", f"{work / 'warm_probe.py'}:WarmProbe")  # fmt: skip
    settings = {"grpc": False, "disable_token_authorization": True, "enable_model_api": True,
                "warm_tier_budget_mb": 2048}  # fmt: skip
    server = Server(work, settings, name="warm")
    try:
        status, body = server.request(
            "POST", "/models?url=warm.mar&initial_workers=0&idle_unload_timeout=1",
            api="management",
        )  # fmt: skip
        assert status == 200, body
        started = time.perf_counter()
        cold = predict(server, "warm")
        cold_s = time.perf_counter() - started

        def tier() -> str:
            _s, described = server.request("GET", "/models/warm", api="management")
            return json.loads(described)[0]["footprint"]["tier"]

        wait_until(lambda: tier() == "warm", 60, "the model in the warm tier")
        started = time.perf_counter()
        woken = predict(server, "warm")
        wake_s = time.perf_counter() - started
        check(
            "warm tier on the GPU: woken on cuda:0, the same answer, faster than cold",
            cold["weights_on"] == woken["weights_on"] == "cuda:0"
            and cold["digest"] == woken["digest"]
            and wake_s < cold_s,
            f"cold {cold_s:.2f} s, wake {wake_s:.2f} s, {woken['weights_on']}",
        )
    finally:
        server.stop()


def on_smi() -> set[int]:
    return {int(row[0]) for row in smi("--query-compute-apps=pid,used_memory") if row[0].isdigit()}


def stream(server: Server, prompt: str, out: list[Any]) -> None:
    """One streamed OpenAI completion: (events with text, finish reason, error)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    body = {"model": "tiny_lm", "prompt": prompt, "max_tokens": 48, "stream": True, "seed": 1}
    conn.request(
        "POST", "/openai/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        out.append((0, None, f"{resp.status} {resp.read()[:300]!r}"))
        return
    pieces, finish = 0, None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        pieces += bool(choice.get("text"))
        finish = choice.get("finish_reason") or finish
    out.append((pieces, finish, None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work dir (its logs)")
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("no nvidia-smi on PATH: no NVIDIA GPU to check here", file=sys.stderr)
        sys.exit(2)
    gpus = smi("--query-gpu=index,name,memory.total")
    print(f"GPUs: {gpus}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="check-gpu-"))
    server = None
    try:
        expected = build(work)
        server = Server(
            work,
            {"grpc": False, "disable_token_authorization": True},
            ["probe=probe.mar", "cpuonly=cpuonly.mar", "tiny_lm=tiny_lm.mar"],
        )
        print(f"server up in {server.ready_s:.1f} s", flush=True)
        # the probe's and tiny_lm's workers share one round-robin counter (in registration
        # order): each on a GPU there is, as many GPUs used as there are workers or GPUs
        ids = [w["gpuId"] for m in ("probe", "tiny_lm") for w in workers(server, m)]
        check(
            "detected: every GPU model's worker pinned to a GPU, round robin",
            all(i in range(len(gpus)) for i in ids) and len(set(ids)) == min(len(gpus), len(ids)),
            ids,
        )
        answers = [predict(server, "probe") for _ in range(8)]
        by_pid = {w["pid"]: w["gpuId"] for w in workers(server, "probe")}
        check(
            "the handler's device is cuda:0 and the weights are on it",
            all(a["device"] == "cuda:0" and a["weights_on"] == "cuda:0" for a in answers),
            sorted({(a["device"], a["weights_on"]) for a in answers}),
        )
        check(
            "each worker sees the physical GPU it is described with",
            all(a["cuda_visible_devices"] == str(by_pid.get(a["pid"])) for a in answers),
            sorted({(a["pid"], a["cuda_visible_devices"], by_pid.get(a["pid"])) for a in answers}),
        )
        check("the answer on the GPU is the CPU's", all(close(a["y"], expected) for a in answers))
        print(f"     on {answers[0]['gpu_name']}", flush=True)
        check(
            "every probe worker is on nvidia-smi (its model loaded there)",
            set(by_pid) <= on_smi(),
            (sorted(by_pid), sorted(on_smi())),
        )
        cpu = predict(server, "cpuonly")
        check(
            "a deviceType: cpu worker sees no GPU",
            cpu["device"] == "cpu"
            and cpu["cuda_visible_devices"] == ""
            and [w["gpuId"] for w in workers(server, "cpuonly")] == [None],
            (cpu["device"], cpu["cuda_visible_devices"]),
        )
        # a crashed worker comes back on its GPU (a fresh fork of the template)
        victim = answers[0]["pid"]
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            now = workers(server, "probe")
            return victim not in {w["pid"] for w in now} and all(
                w["status"] == "READY" for w in now
            )

        wait_until(replaced, 120, "the killed worker's replacement")
        again = [predict(server, "probe") for _ in range(4)]
        now = {w["pid"]: w["gpuId"] for w in workers(server, "probe")}
        check(
            "a killed worker's replacement is back on its GPU and answers there",
            all(a["device"] == "cuda:0" and close(a["y"], expected) for a in again)
            and sorted(now.values()) == sorted(by_pid.values())
            and set(now) <= on_smi(),
            (now, sorted(on_smi())),
        )
        status, body = server.request("PUT", "/models/probe?min_worker=3&synchronous=true",
                                      api="management")  # fmt: skip
        ids = [w["gpuId"] for w in workers(server, "probe")]
        check(
            "scaled up to 3 workers, each on a GPU",
            status == 200 and len(ids) == 3 and all(i is not None for i in ids),
            (status, ids),
        )
        status, body = server.request("GET", "/metrics", api="metrics")
        text = body.decode()
        gauges = [
            n
            for n in ("GPUUtilization", "GPUMemoryUtilization", "GPUMemoryUsed")
            if any(line.startswith(n) for line in text.splitlines())
        ]
        check("GPU gauges on /metrics", len(gauges) == 3, gauges)
        # the generative example, continuous batching, on the GPU
        results: list[Any] = []
        started = time.perf_counter()
        threads = [threading.Thread(target=stream, args=(server, f"prompt {i}", results))
                   for i in range(16)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        took = time.perf_counter() - started
        pieces = sum(r[0] for r in results)
        check(
            "tiny_lm on the GPU: 16 concurrent streamed completions (up to 48 tokens each)",
            len(results) == 16
            and all(r[1] in ("stop", "length") and r[2] is None for r in results),
            f"{sorted(set(results))[:3]}: {pieces} pieces in {took:.2f} s",
        )
        lm_pids = {w["pid"] for w in workers(server, "tiny_lm")}
        check("tiny_lm's worker is on nvidia-smi", lm_pids <= on_smi(), sorted(lm_pids))
        server.stop()
        server = None
        check_warm_tier(work)
    finally:
        if server is not None:
            server.stop()
        if args.keep:
            print(f"work dir (logs under run/): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} check(s) failed: {failures}" if failures else "all GPU checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
