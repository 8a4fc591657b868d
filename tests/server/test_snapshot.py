"""Snapshot: kill -9 the server under load, start it again, every model comes back as it was."""

from __future__ import annotations

import os
import signal
import threading

from tests.server.conftest import pid_alive, wait_until


def test_restart_after_kill_restores_models_versions_defaults_and_workers(
    make_archive, start_server, tmp_path
):
    make_archive("probe", "probe:handle", "probe")
    make_archive("probe", "probe:handle", "probe2", "-v", "2.0")
    make_archive("echo_fn", "echo:handle", "echo")
    first = start_server("probe=probe.mar")
    assert (
        first.manage("POST", "/models?url=probe2.mar&model_name=probe&batch_size=2").status == 200
    )
    assert first.manage("PUT", "/models/probe/2.0/set-default").status == 200
    assert first.manage("PUT", "/models/probe/2.0?min_worker=2&synchronous=true").status == 200
    assert first.manage("POST", "/models?url=echo.mar").status == 200

    stop = threading.Event()
    codes: list[int] = []

    def load() -> None:
        while not stop.is_set():
            try:
                codes.append(first.predict("probe", {}).status)
            except OSError:
                return

    clients = [threading.Thread(target=load) for _ in range(4)]
    for c in clients:
        c.start()
    wait_until(lambda: len(codes) > 20, 30, "traffic")
    os.kill(first.pid, signal.SIGKILL)
    stop.set()
    for c in clients:
        c.join(timeout=30)
    wait_until(lambda: not pid_alive(first.pid), 10, "the server to die")

    second = start_server("probe=probe.mar", run_dir=first.run_dir)
    assert second.pid != first.pid
    described = {m["modelVersion"]: m for m in second.manage("GET", "/models/probe/all").json()}
    assert set(described) == {"1.0", "2.0"}
    assert len(described["2.0"]["workers"]) == 2
    assert described["2.0"]["batchSize"] == 2
    assert described["1.0"]["loadedAtStartup"] is True
    assert second.predict("probe", {}).json()["batch_size"] == 2  # 2.0 is still the default
    assert second.predict("echo", "hi").status == 200
    assert "model probe: ready" in second.start_output


def test_no_config_snapshot_flag(make_archive, start_server) -> None:
    make_archive("echo_fn", "echo:handle", "echo")
    first = start_server()
    assert first.manage("POST", "/models?url=echo.mar").status == 200
    assert first.cli("--stop").returncode == 0
    second = start_server(run_dir=first.run_dir, extra=("--ncs",))
    assert second.manage("GET", "/models").json() == {"models": []}
    assert '"echo"' in (first.run_dir / "snapshot.json").read_text()  # left as it was


def test_sigterm_drains_running_and_queued_requests(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    results: list[int] = []

    def call() -> None:
        results.append(server.predict("probe", {"cmd": "sleep", "s": 0.6}).status)

    clients = [threading.Thread(target=call) for _ in range(3)]  # one runs, two queue
    for c in clients:
        c.start()
    wait_until(
        # all three arrived (one runs, two wait): a SIGTERM before the last one arrives would
        # rightly refuse it with 503, which is not what this test is about
        lambda: server.manage("GET", "/models/probe").json()[0]["queueDepth"] >= 2,
        10,
        "a queue",
    )
    os.kill(server.pid, signal.SIGTERM)
    for c in clients:
        c.join(timeout=30)
    assert results == [200, 200, 200]
    wait_until(lambda: not pid_alive(server.pid), 30, "the server to exit")
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "received SIGTERM: shutting down" in log and "mserve stopped" in log


def test_second_signal_forces_exit(make_archive, start_server) -> None:
    import time

    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    errors: list[BaseException] = []

    def slow_call() -> None:
        try:
            server.predict("probe", {"cmd": "sleep", "s": 8})
        except OSError as exc:  # the forced exit drops this connection: expected
            errors.append(exc)

    slow = threading.Thread(target=slow_call)
    slow.start()
    wait_until(lambda: server.manage("GET", "/models/probe").json()[0]["workers"][0]["state"] == "BUSY", 10, "a busy worker")  # fmt: skip
    os.kill(server.pid, signal.SIGTERM)  # drains: would wait for the 8 s request
    time.sleep(0.5)
    assert pid_alive(server.pid)
    started = time.monotonic()
    os.kill(server.pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(server.pid), 5, "the forced exit")
    assert time.monotonic() - started < 3
    slow.join(timeout=30)
    assert len(errors) == 1  # the in-flight request was cut off, not answered


def test_a_model_that_fails_to_restore_stays_in_the_snapshot(
    make_archive, start_server, tmp_path
) -> None:
    """An archive unreadable at one start (a moved file, a mount not up yet) must not make the
    model vanish from every start after it; DELETE drops it on purpose."""
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("probe", "probe:handle", "probe")
    first = start_server()
    assert first.manage("POST", "/models?url=echo.mar").status == 200
    assert first.manage("POST", "/models?url=probe.mar").status == 200
    first.cli("--stop")
    wait_until(lambda: not pid_alive(first.pid), 30, "the server to stop")

    archive = tmp_path / "store" / "echo.mar"
    hidden = archive.with_suffix(".away")
    archive.rename(hidden)
    second = start_server(run_dir=first.run_dir)
    assert second.predict("echo", "hi").status == 404
    assert second.predict("probe", {}).status == 200
    assert second.manage("PUT", "/models/probe?min_worker=2&synchronous=true").status == 200
    second.cli("--stop")  # this snapshot is written without echo registered
    wait_until(lambda: not pid_alive(second.pid), 30, "the server to stop")

    hidden.rename(archive)
    third = start_server(run_dir=first.run_dir)
    assert third.predict("echo", "hi").status == 200  # back, as it was
    assert len(third.worker_pids("probe")) == 2

    archive.rename(hidden)
    third.cli("--stop")
    wait_until(lambda: not pid_alive(third.pid), 30, "the server to stop")
    fourth = start_server(run_dir=first.run_dir)
    gone = fourth.manage("DELETE", "/models/echo")
    assert gone.status == 200 and "removed from the snapshot" in gone.json()["status"]
    assert fourth.manage("DELETE", "/models/echo").status == 404
    hidden.rename(archive)
    fourth.cli("--stop")
    wait_until(lambda: not pid_alive(fourth.pid), 30, "the server to stop")
    fifth = start_server(run_dir=first.run_dir)
    assert fifth.predict("echo", "hi").status == 404  # deleted on purpose: stays deleted
