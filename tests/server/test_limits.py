"""Limits and timeouts through a real server: 413, 429 with Retry-After, 504, disconnects."""

from __future__ import annotations

import json
import socket
import threading
import time
from functools import partial
from pathlib import Path

from tests.server.conftest import concurrently, http, wait_until


def test_request_and_response_size_limits(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server(
        "probe=probe.mar",
        config={"max_request_size_bytes": 1000, "max_response_size_bytes": 100},
    )
    big = server.predict("probe", b"x" * 2000, headers={"Content-Type": "application/octet-stream"})
    assert big.status == 413 and big.json()["type"] == "RequestTooLargeException"
    assert "max_request_size_bytes=1000" in big.json()["message"]
    answer = server.predict("probe", {"cmd": "bytes"})  # 256 bytes back
    assert answer.status == 413
    assert answer.json()["type"] == "InternalServerException"
    assert "256 bytes, more than max_response_size_bytes=100" in answer.json()["message"]
    assert server.predict("probe", {"cmd": "header"}).status == 200  # small answers still pass


def test_full_queue_answers_429_at_once_while_accepted_requests_succeed(make_archive, start_server):
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"job_queue_size": 2})
    results: list[tuple[int, str | None, float]] = []
    types: set[str] = set()

    def call() -> None:
        started = time.monotonic()
        reply = server.predict("probe", {"cmd": "sleep", "s": 0.5})
        results.append((reply.status, reply.headers.get("Retry-After"), time.monotonic() - started))
        if reply.status == 429:
            types.add(reply.json()["type"])

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    codes = sorted(code for code, _, _ in results)
    assert set(codes) == {200, 429}, codes
    # one running and two waiting; the two may already sit in the worker's socket, and they
    # count against job_queue_size there too
    assert codes.count(200) == 3, codes
    rejected = [r for r in results if r[0] == 429]
    assert all(retry == "1" for _, retry, _ in rejected)
    assert all(took < 0.4 for _, _, took in rejected)  # refused at once, not after waiting
    assert types == {"TooManyRequestsException"}


def test_requests_waiting_in_the_worker_count_as_queued(make_archive, start_server) -> None:
    """A worker is sent up to eight batch-1 requests ahead; the ones it has not started are
    still waiting, and describe, the metric and job_queue_size must all count them."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    calls = [partial(server.predict, "probe", {"cmd": "sleep", "s": 1.5}) for _ in range(4)]
    runner = threading.Thread(target=concurrently, args=calls)
    runner.start()
    try:
        # one runs; the other three are in the worker's socket, none in the frontend's queue
        wait_until(
            lambda: server.manage("GET", "/models/probe").json()[0]["queueDepth"] == 3,
            10, "three requests waiting",
        )  # fmt: skip
        text = http("GET", server.url("metrics", "/metrics")).body.decode()
        assert 'mserve_queue_depth{model="probe",version="1.0"} 3.0' in text, text
        described = server.manage("GET", "/models/probe").json()[0]
        # TorchServe's view of the same: a busy worker is READY, as one that waits for work
        assert described["jobQueueStatus"] == {"remainingCapacity": 97, "pendingRequests": 3}
        [worker] = described["workers"]
        assert (worker["status"], worker["state"]) == ("READY", "BUSY")
    finally:
        runner.join(timeout=30)
    assert server.manage("GET", "/models/probe").json()[0]["queueDepth"] == 0


def test_response_timeout_answers_504_and_replaces_the_worker(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    assert server.manage("POST", "/models?url=probe.mar&response_timeout=1").status == 200
    timeout = server.manage("GET", "/models/probe").json()[0]["responseTimeout"]
    assert (timeout, type(timeout)) == (1, int)
    old = server.worker_pids("probe")[0]
    started = time.monotonic()
    slow = server.predict("probe", {"cmd": "sleep", "s": 30})
    took = time.monotonic() - started
    assert slow.status == 504 and slow.json()["type"] == "InternalServerException"
    assert "response_timeout_s=1" in slow.json()["message"]
    assert took < 5  # at the deadline, not when the handler would have finished
    wait_until(lambda: server.predict("probe", {}).status == 200, 30, "a fresh worker")
    assert server.worker_pids("probe") != [old]


def test_client_that_left_before_dispatch_costs_no_worker_time(
    make_archive, start_server, tmp_path: Path
):
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    busy = threading.Thread(target=server.predict, args=("probe", {"cmd": "sleep", "s": 1.5}))
    busy.start()
    time.sleep(0.3)  # the only worker is now busy; the next request waits in the queue
    trace = tmp_path / "ran.txt"
    body = json.dumps({"cmd": "touch", "path": str(trace)}).encode()
    host, port = server.status["inference"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /predictions/probe HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.2)  # queued behind the busy worker; now the client goes away
    busy.join(timeout=30)
    assert server.predict("probe", {}).status == 200  # the queue moved past it
    time.sleep(0.3)
    assert not trace.exists()


def test_sigkill_a_worker_with_64_requests_in_flight(make_archive, start_server) -> None:
    """Every request gets an answer (200, or a 500 naming the dead worker), none hangs, and the
    worker count recovers."""
    import os
    import signal

    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"job_queue_size": 200})
    assert server.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    victim = server.worker_pids("probe")[0]
    answers: list[tuple[int, str]] = []
    lock = threading.Lock()

    def call() -> None:
        reply = server.predict("probe", {"cmd": "sleep", "s": 0.05})
        with lock:
            answers.append((reply.status, reply.body.decode(errors="replace")))

    clients = [threading.Thread(target=call) for _ in range(64)]
    for c in clients:
        c.start()
    time.sleep(0.3)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for c in clients:
        c.join(timeout=60)
    assert not any(c.is_alive() for c in clients), "a request hung"
    codes = [code for code, _ in answers]
    failed = [body for code, body in answers if code != 200]
    print(f"\nfault run: sent 64, succeeded {codes.count(200)}, failed {len(failed)}, hung 0")
    assert len(answers) == 64
    assert set(codes) <= {200, 500}
    assert all(f"(pid {victim}) was killed by SIGKILL" in body for body in failed)
    wait_until(lambda: len(server.worker_pids("probe")) == 2 and victim not in server.worker_pids("probe")
               and all(w["status"] == "READY" for w in server.manage("GET", "/models/probe").json()[0]["workers"]),
               30, "the worker count to recover")  # fmt: skip
    print(f"worker count recovered {time.monotonic() - killed_at:.2f} s after the kill")


def test_a_dead_workers_requests_are_retried_once_when_the_model_allows_it(
    make_archive, start_server, tmp_path
) -> None:
    """SIGKILL the worker running a request: with retryOnWorkerDeath the other worker answers
    it; without, the caller gets the 500 naming the dead worker."""
    import os
    import signal

    config = tmp_path / "retry.yaml"
    config.write_text("minWorkers: 2\nretryOnWorkerDeath: true\n")
    make_archive("probe", "probe:handle", "retry", "-c", str(config))
    make_archive("probe", "probe:handle", "once")
    server = start_server("retry=retry.mar", "once=once.mar")
    assert server.manage("PUT", "/models/once?min_worker=2&synchronous=true").status == 200
    described = server.manage("GET", "/models/retry").json()[0]
    assert described["retryOnWorkerDeath"] is True
    assert described["settingSources"]["retry_on_worker_death"] == "archive"

    def kill_the_busy_worker(model: str) -> int:
        busy: list[int] = []

        def find() -> bool:
            workers = server.manage("GET", f"/models/{model}").json()[0]["workers"]
            busy[:] = [w["pid"] for w in workers if w["state"] == "BUSY"]
            return bool(busy)

        wait_until(find, 10, f"a busy worker of {model}")
        os.kill(busy[0], signal.SIGKILL)
        return busy[0]

    for model, retried in (("retry", True), ("once", False)):
        answer: list = []
        client = threading.Thread(
            target=lambda m=model, out=answer: out.append(
                server.predict(m, {"cmd": "sleep", "s": 1.5})
            )
        )
        client.start()
        victim = kill_the_busy_worker(model)
        client.join(30)
        assert not client.is_alive(), "the request hung"
        reply = answer[0]
        if retried:
            assert reply.status == 200, reply.body
            assert reply.json()["pid"] != victim  # answered by another worker
        else:
            assert reply.status == 500
            assert f"(pid {victim}) was killed by SIGKILL" in reply.json()["message"]


def test_a_waiting_batch_gets_its_own_timeout_and_outlives_a_hung_one(
    make_archive, start_server
) -> None:
    """Two batches are in flight per worker. The second one's clock starts when the worker
    starts it, and when the first hangs, the second (which never ran) goes to a fresh worker."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    assert server.manage("POST", "/models?url=probe.mar&response_timeout=1").status == 200
    timeout = server.manage("GET", "/models/probe").json()[0]["responseTimeout"]
    assert (timeout, type(timeout)) == (1, int)

    # each takes 0.7 s of a 1 s budget; the second waits 0.7 s behind the first and still fits
    first, second = concurrently(
        partial(server.predict, "probe", {"cmd": "sleep", "s": 0.7}),
        partial(server.predict, "probe", {"cmd": "sleep", "s": 0.7}),
    )
    assert (first.status, second.status) == (200, 200), (first.body, second.body)
    assert first.json()["pid"] == second.json()["pid"]  # one worker ran both

    hung, quick = concurrently(
        partial(server.predict, "probe", {"cmd": "sleep", "s": 30}),
        lambda: (time.sleep(0.2), server.predict("probe", {"n": 1}))[1],
    )
    assert hung.status == 504
    assert quick.status == 200, quick.body  # requeued, answered by the replacement worker
    assert quick.json()["pid"] != first.json()["pid"]
