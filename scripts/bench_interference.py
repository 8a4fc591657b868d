"""What the machine itself takes from a worker's compute: the example MLP's forward, timed alone
and beside what serving does to it, rounds interleaved.

Usage: python scripts/bench_interference.py [--rounds 40] [--calls 200]

The figure goals of bench_server.py and bench_generate.py compare a server with a bare loop that
runs the same model alone on an idle machine. A serving worker never runs alone: the frontend
and the clients work on the other CPUs, and between requests the worker waits on its socket.
This prints what each of those does to the very same forward (examples/mlp, seed 0, one thread,
this process pinned to CPU 0), with nothing of mserve in it:

- ``alone``: back to back, the other CPUs idle (the bare loops' condition);
- ``other CPU: python`` / ``numpy``: a pure-Python loop / a numpy matrix product spinning on
  CPU 1 (a frontend's work is the first kind);
- ``idle 0.15 ms`` / ``idle 1 ms``: sleeping that long before each call, as a worker waits for
  its next batch.

On a machine whose CPUs share a physical core, or whose hypervisor deschedules an idle virtual
CPU, the rows differ a lot; on a machine with idle cores to spare they should not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from harness import REPO

SPINNERS = {
    "python": "while True: pass",
    "numpy": "import numpy as np\na = np.random.rand(1000, 1000)\nwhile True: a @ a",
}


def forward() -> Callable[[], float]:
    """One call of the MLP as its handler makes it (JSON body in, tensor, forward, list out),
    returning the seconds the forward and its tensors took."""
    import torch

    sys.path.insert(0, str(REPO / "examples" / "mlp"))
    from model import IN_FEATURES, MLP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP().eval()
    body = json.dumps({"data": [0.01 * i for i in range(IN_FEATURES)]}).encode()

    def call() -> float:
        rows = [json.loads(body)["data"]]
        started = time.perf_counter()
        with torch.inference_mode():
            out = model(torch.tensor(rows, dtype=torch.float32)).tolist()
        took = time.perf_counter() - started
        json.dumps(out)
        return took

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200, help="calls per row per round")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs")
    os.sched_setaffinity(0, {cpus[0]})
    call = forward()
    for _ in range(500):
        call()
    # the spinners run for the whole benchmark, stopped (SIGSTOP) but while their row is timed
    spinners = {
        name: subprocess.Popen(["taskset", "-c", str(cpus[1]), sys.executable, "-c", code])
        for name, code in SPINNERS.items()
    }
    rows: dict[str, list[float]] = {}

    def timed(sleep_s: float = 0.0) -> float:
        spent = []
        for _ in range(args.calls):
            if sleep_s:
                time.sleep(sleep_s)
            spent.append(call())
        return statistics.median(spent) * 1e6

    try:
        time.sleep(1)  # imported and spinning
        for spinner in spinners.values():
            spinner.send_signal(signal.SIGSTOP)
        for _ in range(args.rounds):  # short rounds, each row beside the others: the VM drifts
            rows.setdefault("alone", []).append(timed())
            for name, spinner in spinners.items():
                spinner.send_signal(signal.SIGCONT)
                time.sleep(0.01)
                try:
                    rows.setdefault(f"other CPU: {name}", []).append(timed())
                finally:
                    spinner.send_signal(signal.SIGSTOP)
            for sleep_ms in (0.15, 1.0):
                rows.setdefault(f"idle {sleep_ms:g} ms", []).append(timed(sleep_ms / 1000))
    finally:
        for spinner in spinners.values():
            spinner.kill()
            spinner.wait()
    load = os.getloadavg()[0]
    print(f"examples/mlp forward (us, median of each round's median, {args.calls} calls per row"
          f" per round), {args.rounds} rounds, {os.cpu_count()} CPUs, load average {load:.1f};"
          " ratio: the median of each round's ratio to that round's alone")  # fmt: skip
    alone = rows["alone"]
    for name, values in rows.items():
        ratios = sorted(v / a for v, a in zip(values, alone, strict=True))
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"{name:<20}{statistics.median(values):>8.0f} us  {statistics.median(ratios):>5.2f}x"
              f" alone (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
