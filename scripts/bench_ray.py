"""Ray Serve vs single-node mserve: the same archives, the same requests, in the same run.

Usage: python scripts/bench_ray.py [--duration 5] [--rounds 3] [--conns 1,16]

Starts a local Ray (2 CPUs, temp folder under /tmp) and deploys the echo and MLP archives of
scripts/bench_server.py with ``server.rayserve`` (one replica each), and starts an mserve with
the same archives (one worker each). Prints:

- deploy to first answer: from planning the deployment (archives unpacked) to the first 200 on
  ``/predictions/echo`` through Serve's proxy, and mserve's ``--start`` to its first answer;
- for echo and the MLP at each connection count: requests/s, p50 and p99 (ms) through each
  engine, medians over the rounds; the engines take turns within each round, so both see the
  same minutes of this VM (whose speed drifts), and both stay up throughout, so both pay for
  Ray's idle daemons;
- the hop: Ray's p50 minus mserve's at one connection (what a lone request pays for Serve's
  proxy, the ingress deployment and the call to the model's replica), and the req/s ratio;
- the load average and the hypervisor's steal during each row.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import psutil
from harness import Server, build_archives, cpu_split, free_port, load_generator, medians


class RayTarget:
    """Serve's HTTP proxy, in the shape the load generators of bench_server.py take."""

    def __init__(self, port: int) -> None:
        self.host, self.port = "127.0.0.1", port
        # the ingress checks no key (docs/ray.md, Security); the generators always send one
        self.headers = {"inference": {"Content-Type": "application/json",
                                      "Authorization": "Bearer unused"}}  # fmt: skip

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, path, body, self.headers["inference"])
            resp = conn.getresponse()
            return resp.status, resp.read()
        except OSError:
            return 0, b""
        finally:
            conn.close()


def _first_answer(target, path: str, body: bytes, timeout_s: float = 600) -> float:
    started = time.perf_counter()
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        status, _ = target.request("POST", path, body)
        if status == 200:
            return time.perf_counter() - started
        time.sleep(0.05)
    raise SystemExit(f"no answer on {path} within {timeout_s:g} s")


def start_ray(work: Path) -> tuple[float, float, int]:
    """Local Ray, then the deployment; seconds to start Ray, and from deploy to first answer."""
    import ray

    from server.rayserve import app
    from server.rayserve.plan import Overrides, plan_models
    from server.rundir import StartupModel

    # token authorization stays on (Ray's default), with a token of our own, not ~/.ray's
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    started = time.perf_counter()
    ray.init(num_cpus=2, _temp_dir=str(work / "ray"), include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    ray_s = time.perf_counter() - started
    # Serve's proxy: outside the kernel's ephemeral range and Ray's worker ports (10002-19999),
    # which Ray's own processes keep taking while it starts
    port = free_port(random.sample(range(20000, 30000), 200))
    started = time.perf_counter()
    models = [StartupModel("echo", str(work / "store" / "echo.mar")),
              StartupModel("mlp", str(work / "store" / "mlp.mar"))]  # fmt: skip
    plans = plan_models(models, work / "cache", Overrides(cpus_per_replica=0.5))
    app.deploy(plans, http_port=port)
    _first_answer(RayTarget(port), "/predictions/echo", b'{"x": 1}')
    return ray_s, time.perf_counter() - started, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conns", default="1,16", help="connection counts, comma-separated")
    args = parser.parse_args()
    conns = [int(c) for c in args.conns.split(",")]
    load, generator = load_generator()
    print(f"load generator: {generator};"
          f" {args.duration} s per run, {args.rounds} rounds; load average at start"
          f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    # a short folder: Ray's Unix socket paths must stay under ~107 characters
    work = Path(tempfile.mkdtemp(prefix="bray", dir="/tmp"))
    server = None
    try:
        build_archives(work, with_mlp=True)
        t0 = time.perf_counter()
        server = Server(work, {"enable_model_api": True}, ["echo=echo.mar", "mlp=mlp.mar"])
        status, _ = server.request("POST", "/predictions/echo", b'{"x": 1}')
        assert status == 200
        print(f"mserve: --start to first answer {time.perf_counter() - t0:.2f} s")
        ray_s, deploy_s, port = start_ray(work)
        print(f"ray: ray.init {ray_s:.2f} s; deploy (2 models) to first answer {deploy_s:.2f} s")
        ray_target = RayTarget(port)
        bodies = {"echo": json.dumps({"data": [0.5] * 256}).encode(),
                  "mlp": json.dumps({"data": [0.01 * i for i in range(256)]}).encode()}  # fmt: skip
        for model, body in bodies.items():  # warm both engines
            assert ray_target.request("POST", f"/predictions/{model}", body)[0] == 200
            assert server.request("POST", f"/predictions/{model}", body)[0] == 200
        engines = {"mserve": server, "ray": ray_target}
        results: dict[tuple[str, str, int], list[dict[str, float]]] = {}
        for round_no in range(args.rounds):
            for model, body in bodies.items():
                for c in conns:
                    for engine, target in engines.items():
                        machine = psutil.cpu_times()
                        r = load(target, f"/predictions/{model}", body, c, args.duration)
                        r.update(cpu_split(machine, psutil.cpu_times()))
                        r["load1"] = os.getloadavg()[0]
                        results.setdefault((model, engine, c), []).append(r)
            print(f"round {round_no + 1} done; load average {os.getloadavg()[0]:.2f}")
        print(f"{'model':<6} {'engine':<7} {'conns':>5} {'req/s':>8} {'p50 ms':>7}"
              f" {'p99 ms':>7} {'errors':>6}  load1  steal")  # fmt: skip
        med: dict[tuple[str, str, int], dict[str, float]] = {}
        for key, runs in results.items():
            med[key] = medians(runs)
        for (model, engine, c), r in sorted(med.items()):
            print(f"{model:<6} {engine:<7} {c:>5} {r['rps']:>8.0f} {r['p50']:>7.2f}"
                  f" {r['p99']:>7.2f} {int(r['errors']):>6}  {r['load1']:>5.2f}"
                  f" {r['steal']:>4.0f}%")  # fmt: skip
        for model in bodies:
            for c in conns:
                m, r = med[(model, "mserve", c)], med[(model, "ray", c)]
                print(
                    f"ray hop, {model} at {c} conn: p50 +{r['p50'] - m['p50']:.2f} ms,"
                    f" p99 +{r['p99'] - m['p99']:.2f} ms, req/s x{r['rps'] / m['rps']:.2f}"
                )
        print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        try:
            import ray

            if ray.is_initialized():
                from ray import serve

                serve.shutdown()
                ray.shutdown()
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
