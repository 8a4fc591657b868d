"""``mserve replay``'s throughput against wrk's, on the same target at the same concurrency
(issue 46: the replay should reach at least 80% of wrk's requests per second).

One server: ``logged`` (the echo model with every request in its inference log) takes
``--records`` requests of a 64-float JSON body, and that log is replayed against ``echo`` (the
same handler, not logged) with ``-c CONNS``, as fast as the concurrency allows; wrk posts the
same body to ``echo`` with the same number of connections. Rounds alternate the two (the VM's
speed drifts) and the medians are printed, with the replay's client CPU per request.

    python scripts/bench_replay.py [--records 8000] [--conns 16] [--rounds 3] [--no-pin]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import BIN, Client, Server, build_archives, wait_until, wrk_load

BODY = json.dumps({"x": [i / 7 for i in range(64)]}).encode()


def capture(server: Server, records: int, conns: int) -> Path:
    """``records`` requests to the logged model; the log file once every line is in it."""
    status, body = server.request(
        "POST",
        "/models?url=echo.mar&model_name=logged&initial_workers=1&synchronous=true"
        "&inference_log=all",
        api="management",
    )
    assert status == 200, body
    per_client = records // conns

    def send() -> None:
        client = Client(server.status["inference"], server.headers["inference"])
        for _ in range(per_client):
            code, _ = client.request("POST", "/predictions/logged", BODY)
            assert code == 200

    import threading

    threads = [threading.Thread(target=send) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = server.run_dir / "inference_log" / "logged" / "1.0.jsonl"
    total = per_client * conns
    wait_until(lambda: log.exists() and log.read_text().count("\n") >= total, 60, "the log")
    return log


def replay_once(server: Server, log: Path, conns: int, out: Path) -> dict[str, float]:
    base = f"http://{server.status['inference']}"
    args = [str(BIN / "mserve"), "replay", str(log), "--against", base, "--target-model", "echo",
            "-c", str(conns), "--json", str(out), "--quiet"]  # fmt: skip
    key = server.run_dir / "key_file.json"
    if key.exists():
        args += ["--key-file", str(key)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["exit_code"] == 0, (report["verdict"], done.stderr)
    answered = report["counts"]["answered"]
    return {"rps": report["throughput_rps"], "answered": answered,
            "cpu_us": report["client_cpu_us"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=8000)
    parser.add_argument("--conns", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="share every core (by default the server gets the first core and "
                             "wrk or the replay the others, so that neither load generator's CPU "
                             "slows the target it measures)")  # fmt: skip
    parser.add_argument("--wrk-s", type=int, default=8, help="seconds of each wrk run")
    opts = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    pin = opts.pin and len(cores) >= 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_archives(work, with_mlp=False)
        if pin:  # the server (and all it forks) on the first core, the load on the others
            os.sched_setaffinity(0, cores[:1])
        server = Server(work, {"enable_model_api": True, "inference_log_flush_s": 0.2},
                        ["echo=echo.mar"])  # fmt: skip
        if pin:
            os.sched_setaffinity(0, cores[1:])
        try:
            log = capture(server, opts.records, opts.conns)
            wrk_rows, replay_rows = [], []
            for n in range(opts.rounds):
                wrk_rows.append(wrk_load(server, "/predictions/echo", BODY, opts.conns, opts.wrk_s))
                replay_rows.append(replay_once(server, log, opts.conns, work / f"r{n}.json"))
                print(f"round {n + 1}: wrk {wrk_rows[-1]['rps']:.0f} req/s, replay "
                      f"{replay_rows[-1]['rps']:.0f} req/s", file=sys.stderr)  # fmt: skip
        finally:
            server.stop()
    wrk_rps = statistics.median(r["rps"] for r in wrk_rows)
    replay_rps = statistics.median(r["rps"] for r in replay_rows)
    cpu_us = statistics.median(r["cpu_us"] for r in replay_rows)
    where = f"server on core {cores[0]}, load on {cores[1:]}" if pin else "cores shared"
    print(f"echo, 64-float JSON body, {opts.conns} connections, {where}, "
          f"medians of {opts.rounds} rounds")  # fmt: skip
    print(f"  wrk:    {wrk_rps:8.0f} req/s")
    print(f"  replay: {replay_rps:8.0f} req/s ({replay_rows[0]['answered']:.0f} records, "
          f"{cpu_us:.0f} us of the replay's CPU each: reading, sending, comparing)")  # fmt: skip
    print(f"  replay / wrk: {replay_rps / wrk_rps:.2f}")


if __name__ == "__main__":
    main()
