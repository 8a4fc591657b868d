"""Generation benchmark: tokens/s and time to first token of examples/tiny_lm, side by side.

Usage: python scripts/bench_generate.py [--tokens 64] [--streams 1,8,32] [--rounds 2]
                                        [--modes continuous,static,one,bare,litserve]

Each mode serves the same model (examples/tiny_lm, seed-0 weights, one worker, one thread) and
answers ``--streams`` concurrent streams of ``--tokens`` tokens each (``ignore_eos``: every
answer has the same length), ``--rounds`` times per level:

- ``continuous``: mserve with ``continuousBatching: true``, ``batchSize`` 32: one decode step per
  handler call, requests joining and leaving between steps (issue 29 part 1; the row says
  "not available" on a server without it);
- ``static``: mserve, ``batchSize`` 8: each call's requests decoded together until the last ends;
- ``one``: mserve, ``batchSize`` 1: one request at a time;
- ``bare``: the same model in a bare batched decode loop in this process, no server (the
  ceiling): all streams prefilled one after another, then decoded together;
- ``litserve``: LitServe's continuous batching loop (``ContinuousBatchingLoop``, the API's
  ``step``) on the same model, when ``litserve`` is installed.

Per row: tokens/s over all streams (total tokens / wall time of the round, from the moment all
requests are sent), and time to first token p50/p99 over every stream of every round. mserve's
rows stream through TorchServe's path (``/predictions``), each chunk one token.
Goals at 32 streams (issue 29): continuous >= 0.8 of bare, >= 2x static; TTFT p99 <= 2x a lone
request's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import BIN, REPO, Server, archive, free_port, wait_until

EXAMPLE = REPO / "examples" / "tiny_lm"
PROMPT = "user: Tell me a story about a server\nassistant:"
LITSERVE_APP = """
import sys
sys.path[:0] = [{example!r}, {compat!r}]
import litserve as ls
import torch
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.utils import LitAPIStatus
from handler import _State
from model import TinyLM

class TinyLMAPI(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(1)
        self.model = TinyLM()
        self.model.load_state_dict(torch.load({weights!r}, weights_only=True))
        self.model.eval()
        self.active = {{}}

    def add_request(self, uid, request):
        self.active[uid] = _State(request)

    def has_capacity(self):
        return len(self.active) < self.max_batch_size

    def has_active_requests(self):
        return bool(self.active)

    def step(self, prev_outputs):
        # LitServe adds requests from another thread while a step runs: work on a snapshot
        current = list(self.active.items())
        pieces = {{}}
        for uid, s in current:
            if s.cache is None:
                pieces[uid] = s.take(*self.model.prefill(s.ids))
        old = [(u, s) for u, s in current if u not in pieces]
        if old:
            logits, caches = self.model.decode([s.next_token for _, s in old],
                                               [s.cache for _, s in old])
            for j, (uid, s) in enumerate(old):
                pieces[uid] = s.take(logits[j], caches[j])
        out = []
        for uid, piece in pieces.items():
            out.append(Output(uid, piece, LitAPIStatus.OK))
            if "finish_reason" in piece:
                out.append(Output(uid, "", LitAPIStatus.FINISH_STREAMING))
                del self.active[uid]
        return out

    def encode_response(self, output):
        return output

if __name__ == "__main__":
    api = TinyLMAPI(max_batch_size=32, stream=True, loop=ContinuousBatchingLoop())
    ls.LitServer(api, accelerator="cpu", timeout=300).run(port={port}, generate_client_file=False)
"""


def continuous_available() -> bool:
    sys.path.insert(0, str(REPO))
    from server.models.settings import SETTINGS

    return any(s.key == "continuousBatching" for s in SETTINGS)


def one_stream(host: str, port: int, path: str, body: dict[str, Any], headers: dict[str, str],
               start: threading.Barrier, out: list[tuple[float, float, int]]) -> None:  # fmt: skip
    """Send one request when all are lined up; record (first token s, end s, tokens)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.connect()
    start.wait()
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    first, tokens = None, 0
    while True:
        data = resp.read1(65536)
        if not data:
            break
        n = data.count(b'"ids"')
        if n and first is None:
            first = time.perf_counter() - t0
        tokens += n
    conn.close()
    if resp.status != 200:
        return  # missing from ``out``: measure() reports it
    out.append((first or 0.0, time.perf_counter() - t0, tokens))


def measure(host: str, port: int, path: str, body: dict[str, Any], headers: dict[str, str],
            streams: int, rounds: int) -> dict[str, float]:  # fmt: skip
    firsts, rates = [], []
    for r in range(rounds + 1):  # the first round warms up (torch's first calls are slow)
        out: list[tuple[float, float, int]] = []
        barrier = threading.Barrier(streams)
        threads = [threading.Thread(target=one_stream,
                                    args=(host, port, path, body, headers, barrier, out))
                   for _ in range(streams)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        if len(out) != streams or any(n == 0 for *_, n in out):
            raise SystemExit(f"{path}: {streams - len(out)} streams failed, {out}")
        if r == 0:
            continue
        wall = max(end for _, end, _ in out)
        rates.append(sum(n for *_, n in out) / wall)
        firsts += [f for f, _, _ in out]
    return _row(rates, firsts)


def _row(rates: list[float], firsts: list[float]) -> dict[str, float]:
    firsts = sorted(firsts)
    p99 = firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))]
    return {"tok_s": statistics.median(rates), "ttft_p50": statistics.median(firsts),
            "ttft_p99": p99}  # fmt: skip


def bare(weights: Path, tokens: int, streams: int, rounds: int) -> dict[str, float]:
    """The ceiling: prefill each stream in turn, then decode all of them together."""
    import torch

    sys.path[:0] = [str(EXAMPLE), str(REPO / "mserve_worker" / "compat")]
    from handler import _State
    from model import TinyLM

    torch.set_num_threads(1)
    model = TinyLM()
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    firsts, rates = [], []
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "seed": 0}
    for r in range(rounds + 1):  # the first round warms up
        if r == 1:
            firsts, rates = [], []
        t0 = time.perf_counter()
        states = [_State(dict(body)) for _ in range(streams)]
        for s in states:
            s.take(*model.prefill(s.ids))
            firsts.append(time.perf_counter() - t0)
        for _ in range(tokens - 1):
            logits, caches = model.decode([s.next_token for s in states], [s.cache for s in states])
            for j, s in enumerate(states):
                s.take(logits[j], caches[j])
        rates.append(streams * tokens / (time.perf_counter() - t0))
    return _row(rates, firsts)


def serve_mode(work: Path, mode: str, weights: Path, args: argparse.Namespace,
               levels: list[int]) -> dict[int, dict[str, float]]:  # fmt: skip
    config = {"minWorkers": 1, "maxWorkers": 1, "responseTimeout": 600,
              "generative": {"context_length": 256}, "handler": {"threads": 1},
              "batchSize": {"continuous": 32, "static": 8, "one": 1}[mode],
              "maxBatchDelay": {"continuous": 1, "static": 20, "one": 1}[mode]}  # fmt: skip
    if mode == "continuous":
        config["continuousBatching"] = True
    (work / f"{mode}.yaml").write_text(json.dumps(config))
    archive(work / "store", f"tiny_lm_{mode}", "--version", "1.0", "--serialized-file", weights,
            "--model-file", EXAMPLE / "model.py",
            "--handler", f"{EXAMPLE / 'handler.py'}:TinyLMHandler",
            "-c", work / f"{mode}.yaml", "-f")  # fmt: skip
    server = Server(work, {"grpc": False, "disable_token_authorization": True},
                    [f"tiny_lm_{mode}=tiny_lm_{mode}.mar"], name=mode)  # fmt: skip
    body = {"prompt": PROMPT, "max_tokens": args.tokens, "ignore_eos": True}
    try:
        return {c: measure(server.host, server.port, f"/predictions/tiny_lm_{mode}", body, {},
                           c, args.rounds) for c in levels}  # fmt: skip
    finally:
        server.stop()


def litserve_mode(work: Path, weights: Path, args: argparse.Namespace,
                  levels: list[int]) -> dict[int, dict[str, float]] | str:  # fmt: skip
    try:
        import litserve  # noqa: F401
    except ImportError:
        return "not installed (pip install litserve)"
    port = free_port()
    app = work / "lit_app.py"
    app.write_text(LITSERVE_APP.format(example=str(EXAMPLE), weights=str(weights), port=port,
                                       compat=str(REPO / "mserve_worker" / "compat")))  # fmt: skip
    with open(work / "litserve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(app)], stdout=log, stderr=log)

    def up() -> bool:
        if proc.poll() is not None:
            tail = (work / "litserve.log").read_text()[-2000:]
            raise SystemExit(f"LitServe exited ({proc.returncode}):\n{tail}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    try:
        wait_until(up, 120, "LitServe to start")
        body = {"prompt": PROMPT, "max_tokens": args.tokens, "ignore_eos": True}
        return {c: measure("127.0.0.1", port, "/predict", body, {}, c, args.rounds)
                for c in levels}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="continuous,static,one,bare,litserve")
    args = parser.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    modes = args.modes.split(",")
    results: dict[str, dict[int, dict[str, float]] | str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        work = Path(tmp)
        subprocess.run([str(BIN / "python"), str(EXAMPLE / "make_weights.py"),
                        str(work / "tiny_lm.pt")], check=True, capture_output=True)  # fmt: skip
        weights = work / "tiny_lm.pt"
        for mode in modes:
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            if mode == "continuous" and not continuous_available():
                results[mode] = "not available: this server has no continuousBatching yet"
            elif mode in ("continuous", "static", "one"):
                results[mode] = serve_mode(work, mode, weights, args, levels)
            elif mode == "bare":
                results[mode] = {c: bare(weights, args.tokens, c, args.rounds) for c in levels}
            elif mode == "litserve":
                results[mode] = litserve_mode(work, weights, args, levels)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
    print(f"{args.tokens} tokens per stream, {args.rounds} rounds; TTFT in ms")
    print(f"{'mode':<11}{'streams':>8}{'tokens/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}")
    for mode, rows in results.items():
        if isinstance(rows, str):
            print(f"{mode:<11}  {rows}")
            continue
        for c, r in rows.items():
            print(f"{mode:<11}{c:>8}{r['tok_s']:>11.0f}{r['ttft_p50'] * 1e3:>10.1f}"
                  f"{r['ttft_p99'] * 1e3:>10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
