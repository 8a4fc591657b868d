"""``bench_server.py --inference-log``: what inference logging costs the request path.

Echo and (with torch) the MLP, each registered twice on one server: as is, and with the
inference log on for every request (``inference_log=all``, sample 1) into both sinks, the
JSON-lines file and a CloudEvents receiver in its own process answering 200 to every event
(asyncio and httptools: a receiver runs on another machine in production; on this shared
2-core VM one on ``http.server`` could not keep up and took the CPU the server needed; ``recv
us`` shows what ours costs).
Round by round, each model without then with logging at 16 connections; the medians and the
ratio with/without, the CPU per request of the frontend and of the receiver, the machine's
busy and steal, then what the sinks did (sent, dropped, failed) from the metrics port. A
receiver slower than the server makes the logger drop (counted) rather than slow requests.
``--callgrind N``: the frontend's instructions per echo request under valgrind, logging off
and on (steady whatever the load).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import quote

from harness import Server, cpu_seconds, free_port, medians, wait_until

RECEIVER = textwrap.dedent("""
    import asyncio
    import sys

    import httptools

    OK = b"HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\n\\r\\n"

    class Receiver(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.done = 0

        def on_message_complete(self):
            self.done += 1

        def data_received(self, data):
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()
                return
            if self.done:  # one write answers every event this read completed
                self.transport.write(OK * self.done)
                self.done = 0

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Receiver, "127.0.0.1", int(sys.argv[1]))
        await server.serve_forever()

    asyncio.run(main())
""")
CONNECTIONS = 16
BATCH = 32  # records per send: one file write, 32 events posted together


def receiver(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])

    def listening() -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, 10, "the CloudEvents receiver")
    return proc


def register(server: Server, archive: str, name: str, url: str | None) -> None:
    path = f"/models?url={archive}&model_name={name}&initial_workers=1"
    if url is not None:
        path += (f"&inference_log=all&inference_log_batch={BATCH}"
                 f"&inference_log_url={quote(url, safe='')}")  # fmt: skip
    status, body = server.request("POST", path, api="management")
    assert status == 200, body


def sink_counts(server: Server) -> dict[tuple[str, str, str], float]:
    _, text = server.request("GET", "/metrics", api="metrics")
    out = {}
    pattern = r"^mserve_inference_log_records_total\{([^}]*)\} (\S+)$"
    for labels, value in re.findall(pattern, text.decode(), re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(got["model"], got["sink"], got["outcome"])] = float(value)
    return out


def inference_log_rows(
    work: Path, load, bodies: dict[str, bytes], duration: int, rounds: int, measured,
    callgrind=None,
) -> None:  # fmt: skip
    """``measured(server, model, load, path, body, conns, duration)``: bench_server's run;
    ``callgrind(work, body, config_lines, label)``: the frontend's instructions per request."""
    port = free_port()
    proc = receiver(port)
    print(f"load average at the start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    try:
        server = Server(work, {"enable_model_api": True}, name="inflog")
        url = f"http://127.0.0.1:{port}/"
        archives = {"echo": "echo.mar", "mlp": "mlp.mar"}
        for model in bodies:
            register(server, archives[model], model, None)
            register(server, archives[model], f"{model}_log", url)
        print(f"inference log: all, sample 1, batch {BATCH}, file + CloudEvents;"
              f" {CONNECTIONS} connections, {rounds} rounds of {duration} s")  # fmt: skip
        print(f"{'model':<10} {'off req/s':>10} {'on req/s':>10} {'on/off':>7}"
              f" {'off us':>8} {'on us':>8} {'recv us':>8}  (CPU per request: frontend,"
              " receiver)")  # fmt: skip
        for model, body in bodies.items():
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            for name in (model, f"{model}_log"):  # warm both
                server.request("POST", f"/predictions/{name}", body)
            for _ in range(rounds):
                for key, name in (("off", model), ("on", f"{model}_log")):
                    before = cpu_seconds([proc.pid])
                    r = measured(server, name, load, f"/predictions/{name}", body, CONNECTIONS,
                                 duration)  # fmt: skip
                    r["recv_us"] = (cpu_seconds([proc.pid]) - before) / max(r["rps"] * duration,
                                                                            1.0) * 1e6  # fmt: skip
                    runs[key].append(r)
            off, on = medians(runs["off"]), medians(runs["on"])
            print(f"{model:<10} {off['rps']:>10.0f} {on['rps']:>10.0f}"
                  f" {on['rps'] / off['rps']:>7.2f} {off['frontend_us']:>8.0f}"
                  f" {on['frontend_us']:>8.0f} {on['recv_us']:>8.0f}"
                  f"  busy {off['busy']:.0f}/{on['busy']:.0f}%"
                  f" steal {off['steal']:.0f}/{on['steal']:.0f}%")  # fmt: skip
        counts = sink_counts(server)
        for (model, sink, outcome), value in sorted(counts.items()):
            print(f"  {model} {sink} {outcome}: {value:.0f}")
        server.stop()
        if callgrind is not None:
            url = f"http://127.0.0.1:{port}/"
            on_lines = (
                f"inference_log: all\ninference_log_batch: {BATCH}\ninference_log_url: {url}\n"
            )
            off = callgrind(work, bodies["echo"], "", "inference log off")
            on = callgrind(work, bodies["echo"], on_lines, "inference log on (both sinks)")
            if off and on:
                print(f"  logging adds {on - off:,.0f} instructions per request ({on / off:.2f}x)")
    finally:
        proc.terminate()
        proc.wait(10)
