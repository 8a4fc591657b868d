"""Many models on one server: loading on demand, idle unload, the budget and its evictions
(docs/many-models.md, Loading on demand). Real servers, real workers."""

from __future__ import annotations

import json
import re
import threading
from functools import partial

import grpc
import psutil
import pytest

from server.rpc.protos import management_pb2 as mpb
from server.rpc.protos import management_pb2_grpc
from tests.server.conftest import Server, concurrently, http, pid_alive, wait_until


def _register(server: Server, name: str, archive: str, extra: str = "") -> None:
    reply = server.manage(
        "POST", f"/models?url={archive}&model_name={name}&initial_workers=0{extra}"
    )
    assert reply.status == 200, reply.body


def _described(server: Server, name: str) -> dict:
    return server.manage("GET", f"/models/{name}").json()[0]


def _state(server: Server, name: str) -> str:
    return _described(server, name)["loadState"]


def _metric(server: Server, pattern: str) -> float:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_zero_worker_model_loads_once_for_concurrent_first_requests(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    _register(server, "probe", "probe.mar")
    described = _described(server, "probe")
    assert (described["minWorkers"], described["workers"]) == (0, [])
    assert described["loadState"] == "unloaded" and described["status"] == "READY"
    listed = server.manage("GET", "/models").json()["models"]
    assert listed == [{"modelName": "probe", "modelUrl": "probe.mar", "loadState": "unloaded"}]

    calls = [partial(server.predict, "probe", {"cmd": "sleep", "s": 0.2}) for _ in range(6)]
    replies = concurrently(*calls)
    assert [r.status for r in replies] == [200] * 6, [r.body for r in replies]
    pids = {r.json()["pid"] for r in replies}
    assert len(pids) == 1, pids  # one worker started, not six
    described = _described(server, "probe")
    assert [w["pid"] for w in described["workers"]] == list(pids)
    assert described["loadState"] == "loaded" and described["minWorkers"] == 0
    loads = 'mserve_model_loads_total{model="probe",outcome="ok",version="1.0"}'
    assert _metric(server, re.escape(loads)) == 1.0
    assert _metric(server, "mserve_model_load_seconds_count") == 1.0


def test_a_load_that_fails_fails_the_waiting_requests_with_its_error(
    make_archive, start_server
) -> None:
    make_archive("bad_import", "broken", "broken")
    server = start_server()
    _register(server, "broken", "broken.mar")
    replies = concurrently(*[partial(server.predict, "broken", {}) for _ in range(3)])
    for reply in replies:
        body = reply.json()
        assert (reply.status, body["type"]) == (503, "ServiceUnavailableException"), body
        assert body["message"].startswith("model broken:1.0 could not be loaded: ")
        assert "No module named 'mserve_test_missing_dependency'" in body["message"]
    assert _state(server, "broken") == "unloaded"
    failed = 'mserve_model_loads_total{model="broken",outcome="failed",version="1.0"}'
    assert _metric(server, re.escape(failed)) == 1.0


def test_scaled_to_zero_with_max_workers_zero_keeps_torchserves_503(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    assert server.manage("PUT", "/models/probe?min_worker=0&synchronous=true").status == 200
    reply = server.predict("probe", {})
    assert (
        reply.status == 503
        and "has no worker to serve inference request. Please use scale workers API"
        in reply.json()["message"]
    )
    scaled = server.manage("PUT", "/models/probe?min_worker=0&max_worker=1&synchronous=true")
    assert scaled.status == 200
    assert server.predict("probe", {}).status == 200  # max_worker 1: loads on demand


def test_idle_models_unload_and_the_next_request_reloads(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    _register(server, "idle", "probe.mar", "&idle_unload_timeout=1")
    _register(server, "kept", "probe.mar")  # no idle_unload_s: stays loaded
    assert _described(server, "idle")["idleUnloadTimeout"] == 1
    first = server.predict("idle", {}).json()["pid"]
    kept = server.predict("kept", {}).json()["pid"]
    wait_until(lambda: _state(server, "idle") == "unloaded", 15, "the idle model to unload")
    wait_until(lambda: not pid_alive(first), 10, "its worker to exit")
    assert _state(server, "kept") == "loaded" and pid_alive(kept)
    evicted = 'mserve_model_evictions_total{model="idle",reason="idle",version="1.0"}'
    assert _metric(server, re.escape(evicted)) == 1.0
    again = server.predict("idle", {})
    assert again.status == 200 and again.json()["pid"] != first


def test_the_snapshot_restores_unloaded_models_without_loading_them(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    first = start_server()
    _register(first, "lazy", "probe.mar", "&idle_unload_timeout=30")
    assert first.predict("lazy", {}).status == 200  # loaded on demand: minWorkers stays 0
    assert first.cli("--stop").returncode == 0
    second = start_server(run_dir=first.run_dir)
    described = _described(second, "lazy")
    assert (described["loadState"], described["workers"]) == ("unloaded", [])
    assert described["idleUnloadTimeout"] == 30
    assert second.predict("lazy", {}).status == 200
    assert _state(second, "lazy") == "loaded"


def test_max_loaded_models_evicts_the_least_recently_used_idle_model(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server(config={"max_loaded_models": 2, "load_wait_s": 20})
    for name in ("a", "b", "c"):
        _register(server, name, "probe.mar")
    pid_a = server.predict("a", {}).json()["pid"]
    pid_b = server.predict("b", {}).json()["pid"]
    assert server.predict("a", {}).json()["pid"] == pid_a  # a is now the most recent
    assert server.predict("c", {}).status == 200  # b, least recently used, makes room
    states = {n: _state(server, n) for n in ("a", "b", "c")}
    assert states == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    wait_until(lambda: not pid_alive(pid_b), 10, "b's worker to exit")
    assert _metric(server, "mserve_models_loaded") == 2.0
    evicted = 'mserve_model_evictions_total{model="b",reason="budget",version="1.0"}'
    assert _metric(server, re.escape(evicted)) == 1.0


def test_a_busy_worker_is_never_evicted(make_archive, start_server) -> None:
    """With room for one model, a request to a second waits while the first one's worker is
    busy (load_wait_s), then evicts it once idle; past load_wait_s it fails naming the limit."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server(config={"max_loaded_models": 1, "load_wait_s": 1.5})
    _register(server, "a", "probe.mar")
    _register(server, "b", "probe.mar")
    pid_a = server.predict("a", {}).json()["pid"]
    busy: list = []
    runner = threading.Thread(
        target=lambda: busy.append(server.predict("a", {"cmd": "sleep", "s": 4}))
    )
    runner.start()
    wait_until(lambda: _described(server, "a")["workers"][0]["state"] == "BUSY", 10, "a busy")
    refused = server.predict("b", {})
    assert refused.status == 503, refused.body
    assert refused.json()["message"] == (
        "cannot load model b:1.0: max_loaded_models=1 models have workers, and no idle model"
        " could be unloaded within load_wait_s=1.5"
    )
    assert pid_alive(pid_a) and _state(server, "a") == "loaded"
    runner.join(30)
    assert [r.status for r in busy] == [200] and busy[0].json()["pid"] == pid_a
    assert server.predict("b", {}).status == 200  # a is idle now: evicted for b
    assert _state(server, "a") == "unloaded"


def test_requests_racing_evictions_all_succeed(make_archive, start_server) -> None:
    """Two models with room for one, asked for alternately from several threads: every
    request evicts the other model or races its eviction; none may be lost or refused."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server(config={"max_loaded_models": 1, "load_wait_s": 60})
    _register(server, "a", "probe.mar")
    _register(server, "b", "probe.mar")

    def hammer(name: str) -> list[int]:
        return [server.predict(name, {}).status for _ in range(8)]

    results = concurrently(*(partial(hammer, n) for n in ("a", "b", "a", "b")))
    assert results == [[200] * 8] * 4
    assert _metric(server, "mserve_models_loaded") == 1.0


def test_the_memory_budget_evicts_for_a_new_model_and_names_itself(
    make_archive, start_server, tmp_path
) -> None:
    make_archive("probe", "probe:handle", "probe")
    probe = start_server(config={"fork_workers": False})  # exec'd workers in both servers
    _register(probe, "a", "probe.mar")
    pid = probe.predict("a", {}).json()["pid"]
    pss_mb = psutil.Process(pid).memory_full_info().pss / 2**20
    probe.cli("--stop")
    budget = int(pss_mb * 1.5) + 1  # room for one worker, not two
    server = start_server(
        config={"worker_memory_budget_mb": budget, "load_wait_s": 1, "fork_workers": False},
        run_dir=tmp_path / "budget",
    )
    _register(server, "a", "probe.mar")
    _register(server, "b", "probe.mar")
    assert server.predict("a", {}).status == 200
    assert server.predict("b", {}).status == 200  # a evicted to make room
    assert (_state(server, "a"), _state(server, "b")) == ("unloaded", "loaded")
    assert _metric(server, "mserve_worker_memory_budget_bytes") == budget * 2**20
    runner = threading.Thread(target=lambda: server.predict("b", {"cmd": "sleep", "s": 3}))
    runner.start()
    wait_until(lambda: _described(server, "b")["workers"][0]["state"] == "BUSY", 10, "b busy")
    refused = server.predict("a", {}).json()
    assert refused["code"] == 503
    assert refused["message"].startswith(
        f"cannot load model a:1.0: worker_memory_budget_mb={budget}: workers use "
    )
    assert refused["message"].endswith("and no idle model could be unloaded within load_wait_s=1")
    runner.join(30)


def _status_file(server: Server) -> dict:
    return json.loads((server.run_dir / "status.json").read_text())["models"]


def test_an_unloaded_model_is_ready_and_the_server_healthy(make_archive, start_server) -> None:
    """Readiness follows KServe's multi-model serving (ModelMesh's Standby): a model that loads
    on demand is ready while unloaded, since a request is served; the server stays healthy.
    ``mserve --status`` and status.json say whether it is resident."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server()
    _register(server, "lazy", "probe.mar")
    assert _state(server, "lazy") == "unloaded"
    ping = http("GET", server.url("inference", "/ping"))
    assert (ping.status, ping.json()) == (200, {"status": "Healthy"})
    assert http("GET", server.url("inference", "/v2/health/ready")).status == 200
    ready = http("GET", server.url("inference", "/v2/models/lazy/ready"))
    assert (ready.status, ready.json()["ready"]) == (200, True)
    v1 = http("GET", server.url("inference", "/v1/models/lazy"))
    assert (v1.status, v1.json()) == (200, {"name": "lazy", "ready": True})
    # Triton's own gRPC client (its protos; ours would clash with them in one test process)
    triton = pytest.importorskip("tritonclient.grpc").InferenceServerClient(
        server.status["grpc_inference"]
    )
    assert triton.is_model_ready("lazy") and triton.is_server_ready()
    triton.close()
    assert _status_file(server) == {"lazy": "unloaded (loads on demand)"}
    assert "lazy" in (shown := server.cli("--status").stdout) and "unloaded (loads" in shown
    assert _state(server, "lazy") == "unloaded"  # asking for readiness loads nothing

    assert server.predict("lazy", {}).status == 200
    wait_until(lambda: _status_file(server) == {"lazy": "ready"}, 10, "status.json to say ready")
    # max_workers 0 keeps TorchServe's meaning, no worker and none on demand: not ready
    server.manage("PUT", "/models/lazy?min_worker=0&max_worker=0&synchronous=true")
    assert http("GET", server.url("inference", "/v2/models/lazy/ready")).status == 503
    wait_until(lambda: _status_file(server) == {"lazy": "unloaded"}, 10, "status.json")
    assert http("GET", server.url("inference", "/ping")).status == 200


def test_scale_requests_keep_to_the_budget(make_archive, start_server) -> None:
    """Scaling through the management APIs (REST and gRPC) evicts idle models like a load on
    demand does, and is refused naming the limit (settings unchanged) when nothing can go."""
    make_archive("probe", "probe:handle", "probe")
    server = start_server(config={"max_loaded_models": 1, "load_wait_s": 1})
    _register(server, "a", "probe.mar")
    _register(server, "b", "probe.mar")
    pid_a = server.predict("a", {}).json()["pid"]
    scaled = server.manage("PUT", "/models/b?min_worker=1&synchronous=true")
    assert scaled.status == 200, scaled.body
    assert (_state(server, "a"), _state(server, "b")) == ("unloaded", "loaded")
    wait_until(lambda: not pid_alive(pid_a), 10, "a's worker to exit")
    evicted = 'mserve_model_evictions_total{model="a",reason="budget",version="1.0"}'
    assert _metric(server, re.escape(evicted)) == 1.0
    pid_b = _described(server, "b")["workers"][0]["pid"]

    refused = server.manage("PUT", "/models/a?min_worker=1")  # b is kept by its minWorkers
    assert refused.status == 503, refused.body
    assert refused.json()["message"] == (
        "cannot load model a:1.0: max_loaded_models=1 models have workers, and no idle model"
        " could be unloaded within load_wait_s=1"
    )
    assert (_described(server, "a")["minWorkers"], _state(server, "a")) == (0, "unloaded")
    with grpc.insecure_channel(server.status["grpc_management"]) as channel:
        management = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            management.ScaleWorker(
                mpb.ScaleWorkerRequest(model_name="a", min_worker=2, max_worker=2), timeout=30
            )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith(
        "cannot start 2 workers of model a:1.0: max_loaded_models=1 models have workers"
    )
    assert _described(server, "a")["minWorkers"] == 0
    assert [w["pid"] for w in _described(server, "b")["workers"]] == [pid_b]
