"""Generation benchmark: tokens/s and time to first token of examples/tiny_lm, side by side.

Usage: python scripts/bench_generate.py [--tokens 64] [--streams 1,8,32] [--rounds 10]
                                        [--modes continuous,static,one,bare,litserve]
                                        [--model-dim 64] [--model-layers 2] [--device cpu]

Each mode serves the same model (examples/tiny_lm, seed-0 weights, one worker, one thread) and
answers ``--streams`` concurrent streams of ``--tokens`` tokens each (``ignore_eos``: every
answer has the same length), ``--rounds`` times per level:

- ``continuous``: mserve with ``continuousBatching: true``, ``batchSize`` 32: one decode step per
  handler call, requests joining and leaving between steps (issue 29 part 1; the row says
  "not available" on a server without it);
- ``fill``: the same as ``continuous`` with ``batchWait: fill`` and ``maxBatchDelay`` 10 ms:
  an idle worker's first step waits up to 10 ms for company (TorchServe's way of starting one),
  so a burst is prefilled in one call; a lone request waits out the 10 ms;
- ``openai``: the same as ``continuous`` (a server of its own), the streams asked through the
  OpenAI-compatible API (``/openai/v1/completions``, ``stream: true``, vLLM's ``ignore_eos``),
  each token one server-sent event: what the ``openai`` client and vLLM's benchmark get;
- ``static``: mserve, ``batchSize`` 8: each call's requests decoded together until the last ends;
- ``one``: mserve, ``batchSize`` 1: one request at a time;
- ``bare``: the same model in a bare batched decode loop in this process, no server (the
  ceiling): all streams prefilled in one forward, then decoded together, with the handler's
  own batched calls;
- ``litserve``: LitServe's continuous batching loop (``ContinuousBatchingLoop``, the API's
  ``step``) on the same model, when ``litserve`` is installed; frozen (SIGSTOP) between its own
  rounds, since its loop polls a whole core while idle and would slow the other modes' rounds.

Every mode is up for the whole run and the modes take turns, round by round (their order
rotating), so that the shared machine's drifting speed (it moves by a third over minutes here)
weighs on each alike; the goals' ratios are the medians of each round's ratio. Per row: tokens/s
over all streams (total tokens / wall time of the round, from the moment all requests are
sent), and time to first token p50/p99 over every stream of every round. mserve's
rows stream through TorchServe's path (``/predictions``), each chunk one token. The clients are
one asyncio loop in this process (a connection per stream, every request of a round sent in one
go), cheap next to the server they measure.
Goals at 32 streams (issue 29): continuous >= 0.8 of bare, >= 2x static; TTFT p99 <= 2x a lone
request's.

``--model-dim``/``--model-layers`` serve a wider/deeper model (the weights say its size; the
handler reads it from them). At the example's size a decode step is mostly fixed per-kernel
overhead (~0.4 ms at 1 request, ~1 ms at 32 on one core), so the server's own per-token costs
weigh far more than next to a real LLM, whose step is dominated by the matrix work that grows
with the width and depth; a bigger model brings the ratios measured here closer to a real one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
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
from handler import _Engine, _State
from model import load

class TinyLMAPI(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(1)
        self.engine = _Engine(load({weights!r}), self.max_batch_size)
        self.active = {{}}

    def add_request(self, uid, request):
        self.active[uid] = _State(request)

    def has_capacity(self):
        return len(self.active) < self.max_batch_size

    def has_active_requests(self):
        return bool(self.active)

    def step(self, prev_outputs):
        # LitServe adds requests from another thread while a step runs: work on a snapshot.
        # The new ones prefilled together, the running ones decoded together (the handler's
        # calls); a finished one's slot is given back by the engine.
        current = list(self.active.items())
        pieces = {{}}
        for call, group in ((self.engine.start, [(u, s) for u, s in current if s.made == 0]),
                            (self.engine.step, [(u, s) for u, s in current if s.made > 0])):
            if group:
                pieces.update(zip([u for u, _ in group], call([s for _, s in group])))
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
    from server.config.model_settings import SETTINGS

    return any(s.key == "continuousBatching" for s in SETTINGS)


class _Stream(asyncio.Protocol):
    """One streamed request read as it arrives: its status, when its first token came, how many
    tokens (each piece holds ``"ids"`` once) and when it ended. A plain asyncio protocol with a
    small HTTP/1.1 reader (chunked or Content-Length), so that 32 clients cost the machine less
    than the server they measure: a thread per client cost ~30 us of CPU per token here."""

    def __init__(self, done: asyncio.Future[None], count: Callable[[bytes], int]) -> None:
        self.done = done
        self.count = count  # the tokens in a chunk
        self.buf = bytearray()
        self.status = 0
        self.length: int | None = None  # Content-Length, when the answer is not chunked
        self.chunked = False
        self.t0 = self.first = self.end = 0.0
        self.tokens = 0

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.status:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            lines = bytes(self.buf[:head_end]).decode("latin-1").split("\r\n")
            del self.buf[: head_end + 4]
            self.status = int(lines[0].split()[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.lower() == "content-length":
                    self.length = int(value)
                elif name.lower() == "transfer-encoding" and "chunked" in value.lower():
                    self.chunked = True
        if not self.chunked:
            if self.length is not None and len(self.buf) >= self.length:
                self._seen(self.buf[: self.length])
                self._finish()
            return
        while True:  # each complete chunk: its size line, its body, CRLF
            line_end = self.buf.find(b"\r\n")
            if line_end < 0:
                return
            size = int(self.buf[:line_end].split(b";")[0], 16)
            if len(self.buf) < line_end + 2 + size + 2:
                return
            if size == 0:
                self._finish()
                return
            self._seen(self.buf[line_end + 2 : line_end + 2 + size])
            del self.buf[: line_end + 4 + size]

    def _seen(self, body: bytes | bytearray) -> None:
        n = self.count(bytes(body))
        if n and not self.first:
            self.first = time.perf_counter() - self.t0
        self.tokens += n

    def _finish(self) -> None:
        self.end = time.perf_counter() - self.t0
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():  # closed before the end: counted as failed
            self.status = self.status or 599
            self.done.set_result(None)


def count_pieces(chunk: bytes) -> int:
    """Tokens in a chunk of TorchServe's path: each piece holds ``"ids"`` once."""
    return chunk.count(b'"ids"')


_TOKEN_EVENT = re.compile(rb'"text":\s*"(?!")')


def count_events(chunk: bytes) -> int:
    """Tokens in a chunk of an OpenAI stream: its events with text (the last has none)."""
    return len(_TOKEN_EVENT.findall(chunk))


async def _round(host: str, port: int, path: str, bodies: list[dict[str, Any]],
                 headers: dict[str, str], count: Callable[[bytes], int] = count_pieces,
                 ) -> list[tuple[float, float, int]]:  # fmt: skip
    """Open a connection per stream, then send every request in one go; (first token s, end
    s, tokens) of each stream answered 200."""
    loop = asyncio.get_running_loop()
    streams = []
    for body in bodies:
        stream = _Stream(loop.create_future(), count)
        transport, _ = await loop.create_connection(lambda s=stream: s, host, port)
        payload = json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                   f"Content-Type: application/json\r\n{head}"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload  # fmt: skip
        streams.append((stream, transport, request))
    for stream, transport, request in streams:
        stream.t0 = time.perf_counter()
        transport.write(request)
    await asyncio.wait_for(asyncio.gather(*(s.done for s, _, _ in streams)), 600)
    for _, transport, _ in streams:
        transport.close()
    return [(s.first, s.end, s.tokens) for s, _, _ in streams if s.status == 200]


def _run(coroutine: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def cpu_of(pid: int | None) -> Callable[[], tuple[float, float, float]]:
    """CPU seconds so far of (the server process ``pid``, its children: workers, this process:
    the clients' threads); pid None: a bare loop, all in this process."""
    server = psutil.Process(pid) if pid is not None else None

    def read() -> tuple[float, float, float]:
        mine = time.process_time()
        if server is None:
            return 0.0, 0.0, mine
        own = sum(server.cpu_times()[:2])
        workers = 0.0
        for child in server.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                workers += sum(child.cpu_times()[:2])
        return own, workers, mine

    return read


def lengths(streams: int, tokens: int, mixed: bool) -> list[int]:
    """Each stream's answer length: ``tokens``, or (mixed) drawn from ``tokens/4 .. 7*tokens/4``
    (mean ``tokens``), the same draws for every mode."""
    if not mixed:
        return [tokens] * streams
    rng = random.Random(streams)
    return [rng.randint(max(1, tokens // 4), tokens * 7 // 4) for _ in range(streams)]


Stream = tuple[float, float, int]  # (first token s, end s, tokens) of one stream


class Mode:
    """One way of serving the model, up for the whole run: ``round`` sends every stream of a
    round at once and returns each one's timings; ``cpu`` reads the CPU seconds so far (see
    ``cpu_of``)."""

    def __init__(self, name: str, cpu: Callable[[], tuple[float, float, float]],
                 stop: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        self.name, self.cpu, self.stop = name, cpu, stop

    def round(self, bodies: list[dict[str, Any]]) -> list[Stream]:
        raise NotImplementedError

    def hold(self, held: bool) -> None:
        """Freeze (``held``) or thaw the mode between its own rounds: nothing for a server that
        sleeps when idle (mserve's processes block on their sockets)."""


class Frozen(Mode):
    """A mode whose processes burn CPU while idle (LitServe's continuous-batching loop polls:
    a whole core here), frozen by SIGSTOP between its rounds so that it does not slow the other
    modes' rounds; wraps the mode that serves (``inner``)."""

    def __init__(self, inner: Mode, group: int) -> None:
        super().__init__(inner.name, inner.cpu, self._stop)
        self.inner, self.group = inner, group

    def round(self, bodies: list[dict[str, Any]]) -> list[Stream]:
        return self.inner.round(bodies)

    def hold(self, held: bool) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.group, signal.SIGSTOP if held else signal.SIGCONT)

    def _stop(self) -> None:
        self.hold(False)  # a stopped process would not see the SIGTERM
        self.inner.stop()


class Served(Mode):
    """A server answering ``path`` (mserve's or LitServe's)."""

    def __init__(self, name: str, host: str, port: int, path: str, pid: int,
                 stop: Callable[[], None], extra: dict[str, Any] | None = None,
                 count: Callable[[bytes], int] = count_pieces) -> None:  # fmt: skip
        super().__init__(name, cpu_of(pid), stop)
        self.host, self.port, self.path = host, port, path
        self.extra, self.count = extra or {}, count  # added to each body; tokens in a chunk

    def round(self, bodies: list[dict[str, Any]]) -> list[Stream]:
        bodies = [{**body, **self.extra} for body in bodies]
        out = _run(_round(self.host, self.port, self.path, bodies, {}, self.count))
        if len(out) != len(bodies) or any(n == 0 for *_, n in out):
            raise SystemExit(f"{self.path}: {len(bodies) - len(out)} streams failed, {out}")
        return out


class Bare(Mode):
    """The ceiling: the same model in a bare batched decode loop in this process, no server.
    A round's streams are prefilled in one forward, then decoded together (the handler's
    batched calls), each leaving the batch when it has its tokens."""

    def __init__(self, weights: Path, slots: int, device: str) -> None:
        import torch

        sys.path[:0] = [str(EXAMPLE), str(REPO / "mserve_worker" / "compat")]
        from handler import _Engine, _State
        from model import load

        torch.set_num_threads(1)
        super().__init__("bare", cpu_of(None))
        self.engine, self.state = _Engine(load(weights, device), slots), _State

    def round(self, bodies: list[dict[str, Any]]) -> list[Stream]:
        t0 = time.perf_counter()
        states = [self.state({**body, "seed": 0}) for body in bodies]
        self.engine.start(states)
        first = time.perf_counter() - t0
        ends = {id(s): first for s in states if s.slot < 0}  # done in one token
        live = [s for s in states if s.slot >= 0]  # a finished one gave its slot back
        while live:
            self.engine.step(live)
            now = time.perf_counter() - t0
            ends.update((id(s), now) for s in live if s.slot < 0)
            live = [s for s in live if s.slot >= 0]
        return [(first, ends[id(s)], s.made) for s in states]


def measure(modes: list[Mode], bodies: list[dict[str, Any]], rounds: int,
            ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every mode's row at one level, the modes taking turns round by round (their order
    rotating), so that the machine's drifting speed weighs on each alike: a warm-up round each
    (torch's first calls are slow), then ``rounds`` measured ones."""

    def one(mode: Mode) -> list[Stream]:
        mode.hold(False)
        try:
            return mode.round(bodies)
        finally:
            mode.hold(True)

    for mode in modes:
        one(mode)
    taken: dict[str, dict[str, Any]] = {
        m.name: {"rates": [], "firsts": [], "cpu": [0.0, 0.0, 0.0], "tokens": 0} for m in modes
    }
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            before = mode.cpu()
            out = one(mode)
            after = mode.cpu()
            row = taken[mode.name]
            tokens = sum(n for *_, n in out)
            row["rates"].append(tokens / max(end for _, end, _ in out))
            row["firsts"] += [first for first, _, _ in out]
            row["cpu"] = [u + b - a for u, a, b in zip(row["cpu"], before, after, strict=True)]
            row["tokens"] += tokens
    return {name: _row(**row) for name, row in taken.items()}


def _row(rates: list[float], firsts: list[float], cpu: list[float], tokens: int,
         ) -> dict[str, Any]:  # fmt: skip
    firsts = sorted(firsts)
    p99 = firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))]
    used = [seconds / tokens * 1e6 for seconds in cpu]
    return {"tok_s": statistics.median(rates), "rates": rates,
            "ttft_p50": statistics.median(firsts), "ttft_p99": p99, "cpu_server": used[0],
            "cpu_worker": used[1], "cpu_client": used[2]}  # fmt: skip


def bodies(streams: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT, "max_tokens": n, "ignore_eos": True}
            for n in lengths(streams, args.tokens, args.lengths == "mixed")]  # fmt: skip


def serve_mode(work: Path, mode: str, weights: Path, device: str) -> Served:
    config = {"minWorkers": 1, "maxWorkers": 1, "responseTimeout": 600,
              "generative": {"context_length": 256}, "handler": {"threads": 1},
              "batchSize": {"static": 8, "one": 1}.get(mode, 32),
              "maxBatchDelay": 20 if mode == "static" else 1}  # fmt: skip
    if mode in ("continuous", "fill", "openai"):
        config["continuousBatching"] = True
    if mode == "fill":
        config["batchWait"], config["maxBatchDelay"] = "fill", 10
    (work / f"{mode}.yaml").write_text(json.dumps(config))
    archive(work / "store", f"tiny_lm_{mode}", "--version", "1.0", "--serialized-file", weights,
            "--model-file", EXAMPLE / "model.py",
            "--handler", f"{EXAMPLE / 'handler.py'}:TinyLMHandler",
            "-c", work / f"{mode}.yaml", "-f")  # fmt: skip
    # on cpu, a machine's GPUs stay out of it; on cuda, the server finds them (its worker's cuda:0)
    gpus = {"number_of_gpu": 0} if device == "cpu" else {}
    server = Server(work, {"grpc": False, "disable_token_authorization": True, **gpus},
                    [f"tiny_lm_{mode}=tiny_lm_{mode}.mar"], name=mode)  # fmt: skip
    if mode == "openai":
        extra = {"model": f"tiny_lm_{mode}", "stream": True}
        return Served(mode, server.host, server.port, "/openai/v1/completions", server.pid,
                      server.stop, extra, count_events)  # fmt: skip
    return Served(mode, server.host, server.port, f"/predictions/tiny_lm_{mode}", server.pid,
                  server.stop)  # fmt: skip


def litserve_mode(work: Path, weights: Path) -> Mode | str:
    try:
        import litserve  # noqa: F401
    except ImportError:
        return "not installed (pip install litserve)"
    port = free_port()
    app = work / "lit_app.py"
    app.write_text(LITSERVE_APP.format(example=str(EXAMPLE), weights=str(weights), port=port,
                                       compat=str(REPO / "mserve_worker" / "compat")))  # fmt: skip
    with open(work / "litserve.log", "w") as log:
        # its own process group: LitServe's inference workers are processes of their own,
        # which outlive the app when it alone is stopped (and spin, skewing the next runs)
        proc = subprocess.Popen([sys.executable, str(app)], stdout=log, stderr=log,
                                start_new_session=True)  # fmt: skip

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
    except BaseException:
        stop_group(proc)
        raise
    served = Served("litserve", "127.0.0.1", port, "/predict", proc.pid, lambda: stop_group(proc))
    frozen = Frozen(served, proc.pid)  # its own process group (above)
    frozen.hold(True)  # until its first round
    return frozen


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc`` and every process of its group: SIGTERM, then SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # the group's stragglers
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--lengths", choices=("mixed", "fixed"), default="mixed",
                        help="answer lengths: drawn around --tokens (as real answers vary), or"
                        " all --tokens long")  # fmt: skip
    parser.add_argument("--modes", default="continuous,fill,openai,static,one,bare,litserve")
    parser.add_argument("--model-dim", type=int, help="the model's width (default 64)")
    parser.add_argument("--model-layers", type=int, help="the model's blocks (default 2)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where every mode runs the model: cuda is the machine's first GPU"
        " (the servers' one worker is given it; the bare loop uses cuda:0)",
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    load_start = os.getloadavg()[0]
    names = args.modes.split(",")
    unknown = set(names) - {"continuous", "fill", "openai", "static", "one", "bare", "litserve"}
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}")
    results: dict[str, dict[int, dict[str, Any]] | str] = {}
    modes: list[Mode] = []
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        work = Path(tmp)
        size = [f"--{k}={v}" for k, v in (("dim", args.model_dim), ("layers", args.model_layers))
                if v]  # fmt: skip
        subprocess.run([str(BIN / "python"), str(EXAMPLE / "make_weights.py"),
                        str(work / "tiny_lm.pt"), *size],
                       check=True, capture_output=True)  # fmt: skip
        weights = work / "tiny_lm.pt"
        try:
            for name in names:  # every mode up at once: the rounds take turns
                print(f"starting {name} ...", file=sys.stderr, flush=True)
                if name in ("continuous", "fill", "openai") and not continuous_available():
                    results[name] = "not available: this server has no continuousBatching yet"
                elif name == "bare":
                    modes.append(Bare(weights, max(levels), args.device))
                elif name == "litserve" and args.device != "cpu":
                    results[name] = "CPU only here"
                elif name == "litserve":
                    mode = litserve_mode(work, weights)
                    if isinstance(mode, str):
                        results[name] = mode
                    else:
                        modes.append(mode)
                else:
                    modes.append(serve_mode(work, name, weights, args.device))
            for level in levels:
                print(f"{level} streams ...", file=sys.stderr, flush=True)
                rows = measure(modes, bodies(level, args), args.rounds)
                for name, row in rows.items():
                    results.setdefault(name, {})[level] = row  # type: ignore[index]
        finally:
            for mode in modes:
                mode.stop()
    results = {name: results[name] for name in names if name in results}
    load_end = os.getloadavg()[0]
    print(
        f"{args.tokens} tokens per stream ({args.lengths}), {args.rounds} rounds (medians); TTFT"
        " in ms; CPU in us per token: the server process, its workers, the clients (this process)"
    )
    print(f"{os.cpu_count()} CPUs, load average {load_start:.1f} at the start, {load_end:.1f}"
          f" at the end; the model on {args.device}")  # fmt: skip
    print(f"{'mode':<11}{'streams':>8}{'tokens/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'server':>8}{'worker':>8}{'client':>8}")  # fmt: skip
    for mode, rows in results.items():
        if isinstance(rows, str):
            print(f"{mode:<11}  {rows}")
            continue
        for c, r in rows.items():
            print(f"{mode:<11}{c:>8}{r['tok_s']:>11.0f}{r['ttft_p50'] * 1e3:>10.1f}"
                  f"{r['ttft_p99'] * 1e3:>10.1f}{r['cpu_server']:>8.0f}{r['cpu_worker']:>8.0f}"
                  f"{r['cpu_client']:>8.0f}")  # fmt: skip
    goals(results, levels)


def goals(results: dict[str, Any], levels: list[int]) -> None:
    """Issue 29's goals at the highest level, where the rows to judge them are there."""
    top, rows = max(levels), {m: r for m, r in results.items() if not isinstance(r, str)}
    if "continuous" not in rows:
        return
    cont = rows["continuous"][top]
    lines = []
    for other, what, goal in (("bare", "the bare loop", ">= 0.8"), ("static", "static batching",
                                                                     ">= 2")):  # fmt: skip
        if other in rows:  # each round's ratio: the two ran one after the other
            ratios = sorted(
                a / b for a, b in zip(cont["rates"], rows[other][top]["rates"], strict=True)
            )
            lines.append(
                f"tokens/s vs {what}: {statistics.median(ratios):.2f}x, median of the rounds'"
                f" ratios ({', '.join(f'{r:.2f}' for r in ratios)}; goal {goal})"
            )
    for mode, against, what, note in (
        ("fill", "bare", "with batchWait: fill (10 ms), vs the bare loop",
         "the goals are judged on the default"),
        ("openai", "continuous", "through the OpenAI API, vs TorchServe's path", "no goal"),
    ):  # fmt: skip
        if mode in rows and against in rows:
            ratios = sorted(
                a / b
                for a, b in zip(rows[mode][top]["rates"], rows[against][top]["rates"], strict=True)
            )
            lines.append(
                f"tokens/s {what}: {statistics.median(ratios):.2f}x"
                f" ({', '.join(f'{r:.2f}' for r in ratios)}; {note})"
            )
    if 1 in rows["continuous"]:
        alone = rows["continuous"][1]["ttft_p99"]
        lines.append(f"TTFT p99 vs a lone request's: {cont['ttft_p99'] / alone:.1f}x (goal <= 2)")
    for line in lines:
        print(f"continuous at {top} streams: {line}")


if __name__ == "__main__":
    main()
