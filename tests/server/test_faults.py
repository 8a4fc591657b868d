"""Faults a real server must survive without hanging or losing anything: crashes the socket does
not reveal, segfaults, oversized answers, timeouts, scaling to zero under load, a dead server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.server.conftest import concurrently, pid_alive, wait_until


def _later(delay_s: float, call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``call`` in a thread after ``delay_s``; the thread collects its result, or the
    exception it raised (a server killed under a request closes the connection)."""
    out: list = []

    def run() -> None:
        time.sleep(delay_s)
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_worker_whose_forked_child_holds_its_socket_still_fails_its_requests_at_once(
    make_archive, start_server
) -> None:
    """A handler that forks (multiprocessing, DataLoader workers) leaves a child holding the
    worker's socket: the server must notice the worker's death from the process itself, not
    wait for the socket's EOF (which would only come at response_timeout_s, 120 s here)."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    child = server.predict("probe", {"cmd": "spawn"}).json()["child"]
    assert pid_alive(child)
    victim = server.worker_pids("probe")[0]
    client, answer = _later(0, lambda: server.predict("probe", {"cmd": "sleep", "s": 60}))
    time.sleep(0.5)  # the worker is now in the handler
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    client.join(30)
    assert not client.is_alive(), "the request hung"
    took = time.monotonic() - started
    reply = answer[0]
    assert reply.status == 500
    assert f"(pid {victim}) was killed by SIGKILL" in reply.json()["message"]
    assert took < 10, f"answered {took:.1f} s after the kill"
    wait_until(lambda: not pid_alive(child), 10, "the dead worker's child to be killed")
    wait_until(lambda: server.predict("probe", {}).status == 200, 30, "a replacement worker")


def test_a_segfault_answers_500_naming_the_signal_and_the_worker_is_replaced(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    victim = server.worker_pids("probe")[0]
    reply = server.predict("probe", {"cmd": "segfault"})
    assert reply.status == 500
    assert f"(pid {victim}) was killed by SIGSEGV" in reply.json()["message"]
    wait_until(lambda: server.predict("probe", {}).status == 200, 30, "a replacement worker")
    assert server.worker_pids("probe") != [victim]


def test_a_worker_that_breaks_the_protocol_is_killed_and_replaced(
    make_archive, start_server
) -> None:
    """A worker's channel carries garbage, or a well-formed frame that answers no batch (which
    nobody would read: before, it was queued for ever). Either way the request it was running
    gets a 500 naming the breach, the worker is killed and a new one serves."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    cases = [
        ({"cmd": "garbage", "bytes": "HTTP/1.1 200 OK\r\n\r\n"},
         "bad frame magic b'HT', expected b'MS': the peer is not speaking the mserve worker protocol"),
        ({"cmd": "garbage", "bytes": "MS\x06\x06\x00\x00\xff\xff\xff\xff"},
         "frame meta_len 4294967295 bytes exceeds the limit of 16777216 bytes"),
        ({"cmd": "frame", "kind": "READY"}, "READY frame after the handshake"),
        ({"cmd": "frame", "kind": "HELLO", "meta": {"protocol": 3}}, "HELLO frame after the handshake"),
    ]  # fmt: skip
    for body, breach in cases:
        victim = server.worker_pids("probe")[0]
        reply = server.predict("probe", body)
        assert reply.status == 500, reply.body
        assert (
            reply.json()["message"]
            == f"worker {reply.json()['message'].split()[1]} broke the protocol ({breach}); killed"
        )
        wait_until(lambda victim=victim: server.worker_pids("probe") not in ([], [victim]), 30, "a new worker")  # fmt: skip
        wait_until(lambda: server.predict("probe", {}).status == 200, 30, "a replacement worker")
        assert not pid_alive(victim)


def test_an_answer_too_large_for_a_frame_is_413_and_the_worker_keeps_serving(
    make_archive, start_server
) -> None:
    """The worker checks max_response_size_bytes itself: an answer of 3 MiB against a 1 kB
    limit is more than a worker frame may carry, and must not look like a broken worker."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"max_response_size_bytes": 1000})
    worker = server.worker_pids("probe")
    for _ in range(6):  # more than the failures that would mark the model failed
        reply = server.predict("probe", {"cmd": "big", "n": 3 << 20})
        assert reply.status == 413
        assert reply.json()["message"].endswith(
            f"is {3 << 20} bytes, more than max_response_size_bytes=1000"
        )
    assert server.predict("probe", {"cmd": "big", "n": 1000}).status == 200  # at the limit
    assert server.worker_pids("probe") == worker  # never restarted
    assert server.manage("GET", "/models/probe").json()[0]["status"] != "FAILED"


def test_a_timeout_kills_the_workers_children_and_slow_requests_do_not_fail_the_model(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    assert server.manage("POST", "/models?url=probe.mar&response_timeout=1").status == 200
    child = server.predict("probe", {"cmd": "spawn"}).json()["child"]
    for i in range(6):  # more than the failures that would mark the model failed
        wait_until(lambda: server.predict("probe", {}).status == 200, 30, "a ready worker")
        started = time.monotonic()
        slow = server.predict("probe", {"cmd": "sleep", "s": 30})
        took = time.monotonic() - started
        assert slow.status == 504, slow.body
        assert took < 3, f"504 came {took:.1f} s after the request, with a 1 s timeout"
        if i == 0:
            wait_until(lambda: not pid_alive(child), 10, "the hung worker's child to be killed")
    wait_until(lambda: server.predict("probe", {}).status == 200, 30, "a ready worker")
    described = server.manage("GET", "/models/probe").json()[0]
    assert described.get("failure") is None, described


def test_scaling_to_zero_runs_every_accepted_request(make_archive, start_server) -> None:
    """Twelve requests accepted by one worker (eight sent to it, four still queued): scaling
    to zero answers all twelve, then refuses new ones with 503."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    calls = [partial(server.predict, "probe", {"cmd": "sleep", "s": 0.3}) for _ in range(12)]
    runner_out: list = []
    runner = threading.Thread(target=lambda: runner_out.extend(concurrently(*calls)))
    runner.start()
    wait_until(
        lambda: server.manage("GET", "/models/probe").json()[0]["queueDepth"] >= 10,
        10, "the requests to queue",
    )  # fmt: skip
    scaled = server.manage("PUT", "/models/probe?min_worker=0&synchronous=true")
    assert scaled.status == 200, scaled.body
    runner.join(30)
    assert not runner.is_alive(), "a request hung"
    assert [r.status for r in runner_out] == [200] * 12
    assert server.predict("probe", {}).status == 503


def test_callers_that_left_do_not_fill_the_queue(make_archive, start_server) -> None:
    """job_queue_size=2 with the worker busy: two callers queue and leave; a live request must
    still be accepted, not refused with 429 on their account."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"job_queue_size": 2})
    busy, _ = _later(0, lambda: server.predict("probe", {"cmd": "sleep", "s": 2.5}))
    time.sleep(0.4)
    host, port = server.status["inference"].rsplit(":", 1)
    for _ in range(2):
        with socket.create_connection((host, int(port))) as sock:
            body = b'{"cmd": "sleep", "s": 0.1}'
            sock.sendall(
                b"POST /predictions/probe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.2)  # queued (or waiting in the worker); now the caller goes away
    time.sleep(0.2)
    reply = server.predict("probe", {})
    assert reply.status == 200, reply.body
    busy.join(30)


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_busy_workers_exit_when_the_server_is_killed(make_archive, start_server, fork) -> None:
    """A worker in a long handler call does not read its socket, so the EOF alone would let it
    run on after kill -9 of the server; it must notice the server is gone. Both kinds: workers
    forked from the template, and workers started as fresh interpreters."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"fork_workers": fork})
    child = server.predict("probe", {"cmd": "spawn"}).json()["child"]
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    workers = server.worker_pids("probe")
    parents = {psutil.Process(w).ppid() for w in workers}
    assert len(parents) == 1 and (server.pid in parents) is not fork
    marks = [f"begun-{uuid.uuid4().hex}" for _ in workers]
    clients = [
        _later(0, partial(server.predict, "probe", {"cmd": "sleep", "s": 600, "mark": m}))[0]
        for m in marks
    ]
    # inside their handlers, not only BUSY: the server says BUSY as it queues a batch, one loop
    # turn before the batch is written, and a worker that never got it exits as an idle one
    tmp_dirs = [server.run_dir / "scratch" / "probe-1.0", Path(tempfile.gettempdir())]
    wait_until(
        lambda: all(any((d / m).exists() for d in tmp_dirs) for m in marks),
        10, "both workers to be in the handler",
    )  # fmt: skip
    os.kill(server.pid, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(w) for w in workers), 10, "the busy workers to exit")
    wait_until(lambda: not pid_alive(child), 10, "the first one's child to exit")
    for client in clients:
        client.join(30)


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_an_idle_workers_children_exit_when_the_server_is_killed(
    make_archive, start_server, fork
) -> None:
    """An idle worker exits on the channel's EOF at once, usually before its server-watch
    thread has looked at the server; what its handler started must not live on after it,
    reparented to init (it did in about 4 runs of 10)."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"fork_workers": fork})
    child = server.predict("probe", {"cmd": "spawn"}).json()["child"]
    (worker,) = server.worker_pids("probe")
    os.kill(server.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(worker), 10, "the idle worker to exit")
    try:
        wait_until(lambda: not pid_alive(child), 10, "its handler's child to exit")
    finally:
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_sigterm_while_startup_models_load_stops_at_once(
    make_archive, start_server, tmp_path
) -> None:
    """A model that takes minutes to load must not hold up a SIGTERM sent during startup."""
    make_archive("slow_load", "slow:handle", "slow")
    starting, _ = _later(0, lambda: start_server("slow=slow.mar", expect_ok=False))
    status = tmp_path / "run0" / "status.json"
    wait_until(status.exists, 30, "the server to listen")
    pid = json.loads(status.read_text())["pid"]
    time.sleep(1)  # the worker is now importing the slow module
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(pid), 20, "the server to stop")
    took = time.monotonic() - stopped_at
    starting.join(30)
    assert not starting.is_alive()
    assert took < 15, f"stopped {took:.1f} s after SIGTERM"


def test_a_worker_that_dies_while_idle_is_replaced_without_waiting_for_a_request(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    victim = server.worker_pids("probe")[0]
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        workers = server.manage("GET", "/models/probe").json()[0]["workers"]
        return [w["pid"] for w in workers] not in ([victim], []) and all(
            w["status"] == "READY" for w in workers
        )

    wait_until(replaced, 15, "a replacement, with no request sent")
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert f"(pid {victim}) was killed by SIGKILL; restarting" in log
    assert server.predict("probe", {}).status == 200


def test_a_status_set_for_one_request_of_a_batch_reaches_only_its_caller(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    registered = server.manage(
        "POST",
        "/models?url=probe.mar&batch_size=4&max_batch_delay=1000&batch_wait=fill&initial_workers=1",
    )
    assert registered.status == 200, registered.body
    bodies = [{}, {"cmd": "status"}, {}, {}]
    replies = concurrently(*(partial(server.predict, "probe", body) for body in bodies))
    assert [r.status for r in replies] == [200, 418, 200, 200]
    assert {r.json()["batch_len"] for r in replies} == {4}  # one handler call for all four


def test_scaling_down_retires_the_idle_worker_and_the_busy_one_finishes(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    client, answer = _later(0, lambda: server.predict("probe", {"cmd": "sleep", "s": 2}))
    busy: list[int] = []

    def find_busy() -> bool:
        workers = server.manage("GET", "/models/probe").json()[0]["workers"]
        busy[:] = [w["pid"] for w in workers if w.get("state", w["status"]) == "BUSY"]
        return bool(busy)

    wait_until(find_busy, 10, "a busy worker")
    assert server.manage("PUT", "/models/probe?min_worker=1&synchronous=true").status == 200
    assert server.worker_pids("probe") == busy  # the idle one went
    client.join(30)
    assert answer[0].status == 200 and answer[0].json()["pid"] == busy[0]


def test_callers_that_left_the_frontend_queue_do_not_fill_it(make_archive, start_server) -> None:
    """Past the eight requests a worker holds, requests wait in the server's own queue: with
    job_queue_size=10, one running, seven in the worker and three queued here fill it; when the
    three queued callers leave, a live request must be accepted."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"job_queue_size": 10})
    busy, _ = _later(0, lambda: server.predict("probe", {"cmd": "sleep", "s": 4}))
    time.sleep(0.4)
    held = [_later(0, lambda: server.predict("probe", {"cmd": "sleep", "s": 0.01}))[0]
            for _ in range(7)]  # fmt: skip
    wait_until(
        lambda: server.manage("GET", "/models/probe").json()[0]["queueDepth"] == 7,
        10, "seven requests waiting in the worker",
    )  # fmt: skip
    host, port = server.status["inference"].rsplit(":", 1)
    leaving = []
    body = b'{"cmd": "sleep", "s": 0.01}'
    for _ in range(3):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /predictions/probe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        leaving.append(sock)
    wait_until(
        lambda: server.manage("GET", "/models/probe").json()[0]["queueDepth"] == 10,
        10, "the queue to fill",
    )  # fmt: skip
    assert server.predict("probe", {}).status == 429
    for sock in leaving:
        sock.close()
    time.sleep(0.3)
    live, answer = _later(0, lambda: server.predict("probe", {}))
    live.join(30)
    assert answer[0].status == 200, answer[0].body
    busy.join(30)
    for thread in held:
        thread.join(30)


@pytest.mark.slow  # a 25 s chaos run: 16 clients, workers killed and the model rescaled
@pytest.mark.timeout(240)
def test_workers_killed_after_serving_are_restarted_and_the_model_never_answers_503(
    make_archive, start_server, tmp_path
) -> None:
    """Workers that loaded and served, then were killed (OOM killer, an operator, a node agent),
    are restarted and the model keeps serving: the breaker is for handlers that cannot load,
    which still mark their model FAILED meanwhile."""
    import itertools
    import random

    (tmp_path / "retry.yaml").write_text("retryOnWorkerDeath: true\nminWorkers: 2\nmaxWorkers: 3\n")
    make_archive("probe", "probe:handle", "probe", "-c", str(tmp_path / "retry.yaml"))
    make_archive("bad_import", "broken", "broken")
    server = start_server("probe=probe.mar")
    assert server.manage("POST", "/models?url=broken.mar&synchronous=false").status == 202
    run_s, stop = 25.0, threading.Event()
    statuses: list[int] = []

    def client() -> None:
        while not stop.is_set():
            statuses.append(server.predict("probe", {}).status)

    def ready_pids() -> list[int]:
        workers = server.manage("GET", "/models/probe").json()[0]["workers"]
        return [w["pid"] for w in workers if w["status"] == "READY" and w["pid"]]

    clients = [threading.Thread(target=client) for _ in range(16)]
    for thread in clients:
        thread.start()
    chaos = random.Random(26)
    kills = rescales = 0
    deadline = time.monotonic() + run_s
    try:
        # every 2-3 s a served worker is killed, every 6th time the model is rescaled instead
        # (a scale request clears the failure count: six kills in a row pass the old breaker)
        for event in itertools.count(1):
            time.sleep(chaos.uniform(2, 3))
            if time.monotonic() >= deadline:
                break
            pids = ready_pids()
            if event % 7 and pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(chaos.choice(pids), signal.SIGKILL)
                kills += 1
            elif not event % 7:
                wanted = chaos.randint(1, 3)
                reply = server.manage("PUT", f"/models/probe?min_worker={wanted}&max_worker=3")
                assert reply.status == 202, reply.body
                rescales += 1
    finally:
        stop.set()
        for thread in clients:
            thread.join(90)
    assert not any(thread.is_alive() for thread in clients), "a request hung"
    assert kills >= 6 and rescales >= 1, (kills, rescales)
    counts = {code: statuses.count(code) for code in set(statuses)}
    assert 503 not in counts, counts
    assert counts.get(200, 0) >= 0.9 * len(statuses), counts  # the rest: a death retried twice
    described = server.manage("GET", "/models/probe").json()[0]
    assert described["status"] != "FAILED", described["failure"]
    assert server.predict("probe", {}).status == 200
    # a handler that cannot load is still a crash loop: FAILED, with its 503
    wait_until(
        lambda: server.manage("GET", "/models/broken").json()[0]["status"] == "FAILED",
        60, "the model that cannot load to be marked failed",
    )  # fmt: skip
    failed = server.predict("broken", {})
    assert failed.status == 503
    assert "without loading again within maxRetryTimeoutInSec=10" in failed.json()["message"]
