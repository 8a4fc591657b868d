"""Traffic between a model's versions (docs/rollouts.md), on one real server: a split's shares
within binomial bounds, a request naming its version, stickiness by header and by body field
(and few keys moved by a weight change), the canary rolled back on a version that fails and on
one that is slow, promoted when it holds, the operator's pause/resume/abort, the 400s naming
the field, and the state surviving a restart. Real archives of tests/handlers/rollout/, real
workers; the guard judges 1 s windows, and the tests wait on the server's own counters."""

from __future__ import annotations

import functools
import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from click.testing import CliRunner

from archiver.cli import main as archiver_main
from server.errors import BadRequest
from server.models.version_order import sorted_versions
from server.rollouts.policy import parse_policy
from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc, mserve_management_pb2_grpc
from server.rpc.protos import mserve_management_pb2 as mpb
from server.top_data import traffic_line
from tests.server.conftest import (
    HANDLERS,
    Server,
    concurrently,
    http,
    pid_alive,
    server_settings,
    start_daemon,
    wait_until,
)
from tests.server.test_torchserve_layout import PROPERTIES, TorchServeDir, torchserve_env

pytestmark = pytest.mark.timeout(240)

# version -> what its model config makes it do (tests/handlers/rollout/versioned.py)
VERSIONS = {"1.0": {}, "2.0": {}, "3.0": {"fail": True}, "4.0": {"delay_ms": 400}}


def _archive(root: Path, file: str, version: str, config: dict[str, Any]) -> None:
    config_file = root / f"{file}-config.yaml"
    config_file.write_text(yaml.safe_dump({"minWorkers": 1, "maxWorkers": 1, **config}))
    # the real archiver CLI, in this process (a subprocess each cost seconds of imports)
    out = CliRunner().invoke(archiver_main, [
        "--model-name", file, "--version", version, "--handler", "versioned:handle",
        "--model-path", str(HANDLERS / "rollout"), "--config-file", str(config_file),
        "--export-path", str(root / "store"), "-f",
    ], catch_exceptions=False)  # fmt: skip
    assert out.exit_code == 0, out.output


def _start(root: Path) -> Server:
    settings = server_settings(root / "store", default_workers_per_model=1)
    return start_daemon(root / "mserve.yaml", root / "run", settings)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("rollouts")
    (root / "store").mkdir()
    for version, faults in VERSIONS.items():
        _archive(root, f"m{version[0]}", version, {"rollout_test": faults})
    _archive(root, "solo", "1.0", {})
    server = _start(root)
    first = server.manage("POST", "/models?url=m1.mar&model_name=m")  # 1.0: the default
    assert first.status == 200, first.body
    # 3.0 (the one that fails) logs its requests, and its canary's events, to a file
    logged = "&inference_log=request&inference_log_file=true"
    replies = concurrently(*(
        functools.partial(server.manage, "POST", f"/models?url={file}.mar&model_name={name}{extra}")
        for file, name, extra in (("m2", "m", ""), ("m3", "m", logged), ("m4", "m", ""),
                                  ("solo", "solo", ""))
    ))  # fmt: skip
    assert all(r.status == 200 for r in replies), [r.body for r in replies if r.status != 200]
    try:
        yield server, root
    finally:
        if pid_alive(server.pid):
            server.cli("--stop")


def _send(server: Server, method: str, path: str, doc: Any = None) -> tuple[int, Any]:
    body = json.dumps(doc).encode() if doc is not None else (b"" if method != "GET" else None)
    reply = http(method, server.url("management", path), body)
    return reply.status, reply.json()


def _version(server: Server, body: dict[str, Any] | None = None, **headers: str) -> str:
    reply = server.predict("m", body or {"x": 1}, headers=headers)
    assert reply.status == 200, reply.body
    return str(reply.json()["version"])


def _within(count: int, n: int, p: float) -> bool:
    """``count`` of ``n`` draws is within 5 standard deviations of a share ``p`` (a false
    failure about once in 3.5 million runs)."""
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def _reset(server: Server) -> None:
    status, _ = _send(server, "DELETE", "/models/m/traffic")
    assert status == 200
    if _send(server, "GET", "/models/m/canary")[0] == 200:
        assert _send(server, "DELETE", "/models/m/canary")[0] == 200
    http("PUT", server.url("management", "/models/m/1.0/set-default"), b"")


def test_split_shares_and_describe(served: tuple[Server, Path]) -> None:
    server, _ = served
    _reset(server)
    status, shown = _send(server, "PUT", "/models/m/traffic", {"weights": {"1.0": 70, "2.0": 30}})
    assert status == 200, shown
    assert shown["weights"] == {"1.0": 70.0, "2.0": 30.0}
    n = 240
    counts = Counter(_version(server) for _ in range(n))
    assert set(counts) == {"1.0", "2.0"}
    assert _within(counts["2.0"], n, 0.3), counts
    # a request naming its version gets it, whatever the split
    assert all(_version_named(server, "4.0") == "4.0" for _ in range(2))
    described = server.manage("GET", "/models/m").json()[0]["traffic"]
    assert described["served"]["1.0"]["requests"] == counts["1.0"]
    assert described["served"]["2.0"]["requests"] == counts["2.0"]
    assert described["served"]["4.0"]["requests"] == 2
    assert described["split"] == {"1.0": 70.0, "2.0": 30.0}
    metrics = http("GET", server.url("metrics", "/metrics")).body.decode()
    # the metrics carry the version that answered
    line = f'mserve_requests_total{{code="200",model="m",version="2.0"}} {counts["2.0"]}.0'
    assert line in metrics


def _version_named(server: Server, version: str) -> str:
    reply = server.predict("m", {"x": 1}, version=version)
    assert reply.status == 200, reply.body
    return str(reply.json()["version"])


def test_sticky_keys_stay_and_few_move_when_the_weights_change(
    served: tuple[Server, Path],
) -> None:
    server, _ = served
    _reset(server)
    doc = {"weights": {"1.0": 70, "2.0": 30}, "sticky": {"header": "X-User"}}
    assert _send(server, "PUT", "/models/m/traffic", doc)[0] == 200
    users = [f"user-{i}" for i in range(120)]
    first = {u: _version(server, **{"X-User": u}) for u in users}
    assert all(_version(server, **{"X-User": u}) == first[u] for u in users[:40])
    assert _within(sum(v == "2.0" for v in first.values()), len(users), 0.3)
    doc["weights"] = {"1.0": 60, "2.0": 40}
    assert _send(server, "PUT", "/models/m/traffic", doc)[0] == 200
    after = {u: _version(server, **{"X-User": u}) for u in users}
    moved = [u for u in users if after[u] != first[u]]
    # rendezvous hashing: only keys 1.0 gives up move, all to 2.0 (1/7 of 1.0's expected)
    assert all(first[u] == "1.0" and after[u] == "2.0" for u in moved), moved
    assert len(moved) <= 0.25 * len(users), len(moved)
    # by a field of the JSON body
    doc = {"weights": {"1.0": 50, "2.0": 50}, "sticky": {"field": "user"}}
    assert _send(server, "PUT", "/models/m/traffic", doc)[0] == 200
    by_field = {u: _version(server, {"user": u}) for u in users[:30]}
    assert all(_version(server, {"user": u, "n": 2}) == by_field[u] for u in users[:30])
    assert set(by_field.values()) == {"1.0", "2.0"}


@pytest.mark.parametrize(
    ("method", "path", "doc", "message"),
    [
        ("PUT", "/models/m/traffic", {"weights": {"1.0": 70, "2.0": 20}},
         "body.weights: the weights add up to 90, not 100"),
        ("PUT", "/models/m/traffic", {"weights": {"1.0": 50, "9.9": 50}},
         "body.weights: version '9.9' is not registered (registered: 1.0, 2.0, 3.0, 4.0)"),
        ("PUT", "/models/m/traffic", {"weights": {"1.0": 100}, "colour": 1},
         "body: unknown field(s) colour; expected 'weights' and/or 'sticky'"),
        ("PUT", "/models/m/traffic", {"sticky": {"cookie": "x"}},
         'body.sticky: expected {"header": "<name>"} or {"field": "<name>"} (exactly one)'),
        ("POST", "/models/solo/canary", {"version": "1.0"},
         "body: a canary needs two versions of the model, and it has one (1.0): register the"
         " new version first"),
        ("POST", "/models/m/canary", {"version": "7.0"},
         "body.version: version '7.0' is not registered"),
        ("POST", "/models/m/canary", {"version": "1.0"},
         "body.version: the canary '1.0' is the baseline itself"),
        ("POST", "/models/m/canary", {"version": "2.0", "steps": [50, 25, 100]},
         "body.steps: expected rising percentages ending at 100, got [50.0, 25.0, 100.0]"),
        ("POST", "/models/m/canary", {"version": "2.0", "window_s": "soon"},
         "body.window_s: expected a number, got 'soon'"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(
    served: tuple[Server, Path], method: str, path: str, doc: Any, message: str
) -> None:
    server, _ = served
    _reset(server)
    status, answer = _send(server, method, path, doc)
    assert status == 400, answer
    assert message in answer["message"]
    assert _send(server, "GET", "/models/nosuch/traffic")[0] == 404


def _drive_until(server: Server, done: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Send requests (no version named) until the canary's state satisfies ``done``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _ in range(10):
            server.predict("m", {"x": 1})
        state = _send(server, "GET", "/models/m/canary")[1]
        if done(state):
            return state  # type: ignore[no-any-return]
    raise AssertionError(f"the canary did not get there: {state}")


GUARD = {"window_s": 1, "interval_s": 60, "min_requests": 5, "steps": [20, 100]}


def test_messages_list_versions_in_version_order() -> None:
    """1.9 before 1.10, 2.0 before 10.0: numbers as numbers, the rest as text."""
    versions = ["10.0", "1.10", "2.0", "1.9", "1.9b", "v2"]
    assert sorted_versions(versions) == ["1.9", "1.9b", "1.10", "2.0", "10.0", "v2"]
    with pytest.raises(BadRequest) as refused:
        parse_policy({"weights": {"3.0": 100}}, versions)
    assert refused.value.message == (
        "body.weights: version '3.0' is not registered (registered: 1.9, 1.9b, 1.10, 2.0, 10.0, v2)"
    )


def test_a_canary_that_fails_is_rolled_back_at_once(served: tuple[Server, Path]) -> None:
    server, root = served
    _reset(server)
    status, state = _send(server, "POST", "/models/m/canary", {"version": "3.0", **GUARD})
    assert status == 200, state
    assert (state["state"], state["share"], state["baseline"]) == ("running", 20.0, "1.0")
    state = _drive_until(server, lambda s: s["state"] != "running")
    assert state["state"] == "rolled_back"
    assert "error ratio 1.000 of version 3.0" in state["reason"]
    assert "above the baseline 1.0's 0.000 + max_error_ratio 0.01" in state["reason"]
    # the baseline takes every request again
    assert {_version(server) for _ in range(20)} == {"1.0"}
    status, answer = _send(server, "PUT", "/models/m/canary/resume")
    assert status == 400
    assert "cannot resume the canary of model m: it has ended (rolled_back:" in answer["message"]
    metrics = http("GET", server.url("metrics", "/metrics")).body.decode()
    assert (
        'mserve_canary_outcomes_total{model="m",outcome="rolled_back",version="3.0"} 1.0' in metrics
    )
    # an event in the canary's inference log, beside its requests
    log_file = root / "run" / "inference_log" / "m" / "3.0.jsonl"

    def events() -> list[dict[str, Any]]:
        lines = log_file.read_text().splitlines() if log_file.exists() else []
        return [r for r in map(json.loads, lines) if r["api"] == "event"]

    wait_until(lambda: bool(events()), 30, "the rollback's event in the inference log")
    (event,) = events()
    assert event["op"] == "canary.rolled_back"
    assert event["error"] == state["reason"]
    assert event["request"]["state"] == "rolled_back"


def test_a_slow_canary_is_rolled_back(served: tuple[Server, Path]) -> None:
    server, _ = served
    _reset(server)
    plan = {"version": "4.0", **GUARD, "steps": [50, 100], "p99_floor_ms": 100}
    assert _send(server, "POST", "/models/m/canary", plan)[0] == 200
    state = _drive_until(server, lambda s: s["state"] != "running")
    assert state["state"] == "rolled_back", state
    assert "p99 latency" in state["reason"]
    assert "of version 4.0 is above max_p99_ratio 2 x the baseline 1.0's" in state["reason"]


def test_a_canary_that_holds_is_promoted(served: tuple[Server, Path]) -> None:
    server, _ = served
    _reset(server)
    # p99_floor_ms: latency is not what this test is about (the shared machine's hiccups)
    plan = {"version": "2.0", "window_s": 0.5, "interval_s": 0.5, "min_requests": 5,
            "steps": [30, 100], "p99_floor_ms": 1000}  # fmt: skip
    assert _send(server, "POST", "/models/m/canary", plan)[0] == 200
    state = _drive_until(server, lambda s: s["state"] != "running")
    assert state["state"] == "promoted", state
    assert server.manage("GET", "/models/m").json()[0]["modelVersion"] == "2.0"
    assert {_version(server) for _ in range(10)} == {"2.0"}


def test_the_operator_pauses_resumes_promotes_and_aborts(served: tuple[Server, Path]) -> None:
    server, _ = served
    _reset(server)
    plan = {"version": "2.0", "steps": [10, 50, 100], "interval_s": 3600}
    assert _send(server, "POST", "/models/m/canary", plan)[0] == 200
    status, answer = _send(server, "POST", "/models/m/canary", plan)
    assert status == 400
    assert "model m already has a canary of version 2.0 running (running)" in answer["message"]
    assert _send(server, "PUT", "/models/m/canary/pause")[1]["state"] == "paused"
    assert _send(server, "PUT", "/models/m/canary/resume")[1]["state"] == "running"
    status, answer = _send(server, "PUT", "/models/m/canary/jump")
    assert status == 404
    assert (
        "no canary action 'jump': expected one of pause, resume, promote, abort"
        in (answer["message"])
    )
    state = _send(server, "PUT", "/models/m/canary/abort")[1]
    assert (state["state"], state["reason"]) == ("aborted", "aborted by the operator")
    assert {_version(server) for _ in range(10)} == {"1.0"}
    assert _send(server, "POST", "/models/m/canary", plan)[0] == 200
    state = _send(server, "PUT", "/models/m/canary/promote")[1]
    assert (state["state"], state["reason"]) == ("promoted", "promoted by the operator")
    assert server.manage("GET", "/models/m").json()[0]["modelVersion"] == "2.0"


def test_grpc_sets_the_split_and_follows_it(served: tuple[Server, Path]) -> None:
    """mserve's gRPC management service sets the split; TorchServe's gRPC Predictions and the
    sticky key in the call's metadata follow it."""
    server, _ = served
    _reset(server)
    with grpc.insecure_channel(server.status["grpc_management"]) as channel:
        stub = mserve_management_pb2_grpc.MserveManagementServiceStub(channel)
        body = json.dumps({"weights": {"2.0": 100}, "sticky": {"header": "x-user"}})
        reply = stub.Traffic(mpb.TrafficRequest(model_name="m", action="set", body=body))
        assert json.loads(reply.msg)["split"] == {"2.0": 100.0}
        with pytest.raises(grpc.RpcError) as err:
            bad = json.dumps({"weights": {"2.0": 60}})
            stub.Traffic(mpb.TrafficRequest(model_name="m", action="set", body=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "body.weights: the weights add up to 60, not 100" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Canary(mpb.CanaryRequest(model_name="solo", action="start",
                                          body='{"version": "1.0"}'))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a canary needs two versions of the model" in err.value.details()
    with grpc.insecure_channel(server.status["grpc_inference"]) as channel:
        infer = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = ipb.PredictionsRequest(model_name="m", input={"x": b"1"})
        answers = {
            json.loads(infer.Predictions(request, metadata=(("x-user", f"u{i}"),)).prediction)[
                "version"
            ]
            for i in range(5)
        }
    assert answers == {"2.0"}
    line = traffic_line(_send(server, "GET", "/models/m/traffic")[1])  # what mserve top shows
    assert line.startswith("split 2.0 100% (served 2.0 100.0%), sticky by header x-user")


def test_unregistering_the_canarys_version_aborts_it(served: tuple[Server, Path]) -> None:
    """(4.0, the slow version, is gone after this test.)"""
    server, _ = served
    _reset(server)
    doc = {"weights": {"1.0": 50, "4.0": 50}}
    assert _send(server, "PUT", "/models/m/traffic", doc)[0] == 200
    plan = {"version": "4.0", "steps": [10, 100], "interval_s": 3600}
    assert _send(server, "POST", "/models/m/canary", plan)[0] == 200
    assert server.manage("DELETE", "/models/m/4.0").status == 200
    shown = _send(server, "GET", "/models/m/traffic")[1]
    canary = shown["canary"]
    assert (canary["state"], canary["reason"]) == ("aborted", "version 4.0 was unregistered")
    assert shown["weights"] == {"1.0": 100.0}  # out of the split too
    assert {_version(server) for _ in range(10)} == {"1.0"}


def test_the_state_survives_a_restart(served: tuple[Server, Path]) -> None:
    """Last in the module: it restarts the server (and registers a version whose model config
    starts its own canary)."""
    server, root = served
    _reset(server)
    doc = {"weights": {"1.0": 80, "2.0": 20}, "sticky": {"header": "X-User"}}
    assert _send(server, "PUT", "/models/m/traffic", doc)[0] == 200
    _archive(root, "m5", "5.0", {"rollout": {"canary": {"steps": [15, 100],
                                                        "interval_s": 3600}}})  # fmt: skip
    assert server.manage("POST", "/models?url=m5.mar&model_name=m").status == 200
    state = _send(server, "GET", "/models/m/canary")[1]
    assert (state["version"], state["baseline"], state["share"]) == ("5.0", "1.0", 15.0)
    assert _send(server, "PUT", "/models/m/canary/pause")[0] == 200
    assert server.cli("--stop").returncode == 0
    again = _start(root)
    try:
        shown = _send(again, "GET", "/models/m/traffic")[1]
        assert shown["weights"] == {"1.0": 80.0, "2.0": 20.0}
        assert shown["sticky"] == {"header": "x-user"}
        canary = shown["canary"]
        assert (canary["version"], canary["state"], canary["share"]) == ("5.0", "paused", 15.0)
        assert shown["split"] == {"1.0": 85.0, "5.0": 15.0}
    finally:
        again.cli("--stop")


def test_torchserve_layouts_config_snapshot_keeps_the_split(
    tmp_path: Path, make_archive: Any
) -> None:
    """In TorchServe's layout the state goes in its config snapshots (``model_snapshot``'s
    ``mserveTraffic``, a key TorchServe does not read) and comes back at the next start."""
    root = tmp_path / "serve"
    root.mkdir()
    (root / "config.properties").write_text(PROPERTIES)
    make_archive("echo_fn", "echo:handle", "e1")
    make_archive("echo_fn", "echo:handle", "e2", "--version", "2.0")
    (root / "model_store").symlink_to(tmp_path / "store")
    ts = TorchServeDir(root, torchserve_env(tmp_path / "run"))
    try:
        ts.start("--model-store", "model_store", "--models", "echo=e1.mar", "--enable-model-api",
                 "--ts-config", "config.properties")  # fmt: skip
        reply = ts.call(
            "management", "POST", "/models?url=e2.mar&model_name=echo&initial_workers=1"
        )
        assert reply.status == 200, reply.body
        split = json.dumps({"weights": {"1.0": 30, "2.0": 70}}).encode()
        assert ts.call("management", "PUT", "/models/echo/traffic", split).status == 200
        assert ts.command("--stop").returncode == 0
        ts.start("--model-store", "model_store")  # the newest snapshot
        shown = ts.call("management", "GET", "/models/echo/traffic").json()
        assert shown["weights"] == {"1.0": 30.0, "2.0": 70.0}
    finally:
        ts.command("--stop", "--foreground")
