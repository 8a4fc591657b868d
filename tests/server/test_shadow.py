"""Shadow traffic (server/rollouts/shadow.py, issue 42) on a real server: a share of a model's
requests also goes to another version, whose answer is compared and never returned.

One server for the module (tests/handlers/shadowed: one handler whose answer depends on its
archive's version); each test sets the shadow it needs, so they run in order."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from click.testing import CliRunner

from archiver.cli import main as archiver_main
from server.rpc.protos import inference_pb2 as ipb
from server.rpc.protos import inference_pb2_grpc, mserve_management_pb2_grpc
from server.rpc.protos import mserve_management_pb2 as mpb
from server.top_data import traffic_line
from tests.server.conftest import HANDLERS, MSERVE, Server, http, pid_alive, wait_until

VERSIONS = ("1.0", "1.1", "2.0", "3.0", "9.0", "9.1")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("shadow")
    store = root / "store"
    store.mkdir()
    # 4.0's model config asks to be shadowed from the default version when registered
    rollout = root / "model-config.yaml"
    rollout.write_text(yaml.safe_dump({"rollout": {"shadow": {"share": 50, "samples": 4}}}))
    for version in (*VERSIONS, "4.0"):
        args = ["--model-name", "shadowed", "--handler", "shadowed", "--model-path",
                str(HANDLERS / "shadowed"), "--export-path", str(root), "--version", version, "-f"]  # fmt: skip
        if version == "4.0":
            args += ["-c", str(rollout)]
        # the real archiver CLI, in this process (a subprocess each costs seconds of imports)
        out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
        assert out.exit_code == 0, out.output
        (root / "shadowed.mar").rename(store / f"shadowed_{version}.mar")
    settings = {f"{api}_address": "127.0.0.1:0" for api in
                ("inference", "management", "metrics", "grpc_inference", "grpc_management")}  # fmt: skip
    settings.update(model_store=str(store), disable_token_authorization=True, enable_model_api=True)
    config = root / "mserve.yaml"
    config.write_text(yaml.safe_dump(settings))
    run_dir = root / "run"
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    started = subprocess.run(
        [MSERVE, "--start", *args, "--models", "shadowed=shadowed_1.0.mar"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    served = Server(run_dir, json.loads((run_dir / "status.json").read_text()), args)
    for version in ("1.1", "2.0"):
        register(served, version)
    register(served, "3.0", inference_log="all")
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def register(server: Server, version: str, **params: str) -> None:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    url = f"/models?url=shadowed_{version}.mar&initial_workers=1&synchronous=true&{query}"
    reply = server.manage("POST", url)
    assert reply.status == 200, reply.body


def set_shadow(server: Server, doc: dict[str, Any]) -> Any:
    return http(
        "PUT", server.url("management", "/models/shadowed/shadow"), json.dumps(doc).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip


def shadow(server: Server) -> dict[str, Any]:
    reply = server.manage("GET", "/models/shadowed/shadow")
    assert reply.status == 200, reply.body
    return reply.json()


def settled(state: dict[str, Any]) -> int:
    return sum(state["counts"].values())


def ask(server: Server, n: int) -> None:
    """``n`` client requests, each answered by version 1.0 at once, whatever the shadow does."""
    for i in range(n):
        reply = server.predict("shadowed", {"x": i})
        assert reply.status == 200, reply.body
        assert reply.json() == {"predictions": [{"label": "cat", "score": float(i)}], "x": i}


def test_equal_answers_count_as_equal(server: Server) -> None:
    assert set_shadow(server, {"version": "1.1"}).status == 200
    ask(server, 6)
    wait_until(lambda: settled(shadow(server)) == 6, what="6 shadow pairs compared")
    state = shadow(server)
    assert state["counts"]["equal"] == 6 and state["counts"]["different"] == 0
    assert state["differences"] == {} and state["samples"] == []
    latency = state["latency_ms"]
    assert latency["primary"]["count"] == latency["shadow"]["count"] == 6
    assert latency["primary"]["p50"] > 0 and latency["shadow"]["p99"] > 0
    described = server.manage("GET", "/models/shadowed").json()[0]["traffic"]["shadow"]
    assert described["settings"]["version"] == "1.1" and described["counts"]["equal"] == 6
    assert described["latency_ms"] == latency and "samples" not in described
    line = traffic_line(server.manage("GET", "/models/shadowed/traffic").json())  # mserve top
    assert "; shadow 1.1 100%: 6 equal, 0 different, 0 dropped; p50 " in line


def test_a_changed_field_is_named_and_samples_are_bounded(server: Server) -> None:
    assert set_shadow(server, {"version": "2.0", "samples": 3}).status == 200
    ask(server, 5)
    wait_until(lambda: settled(shadow(server)) == 5, what="5 shadow pairs compared")
    state = shadow(server)
    assert state["counts"]["different"] == 5
    assert state["differences"] == {"number": 5}
    assert state["fields"] == {"$.predictions[0].score": 5}
    assert len(state["samples"]) == 3  # bounded: the last three of five
    sample = state["samples"][-1]
    assert sample["primary"]["version"] == "1.0" and sample["shadow"]["version"] == "2.0"
    assert json.loads(sample["request"]["body"]) == {"x": 4}
    diff = sample["comparison"]["differences"][0]
    assert diff["path"] == "$.predictions[0].score" and diff["kind"] == "number"
    assert diff["reference"] == 4.0 and diff["candidate"] == 4.001
    metrics = http("GET", server.url("metrics", "/metrics")).body.decode()
    assert (
        'mserve_shadow_differences_total{kind="number",model="shadowed",version="2.0"} 5.0'
        in metrics
    )
    assert (
        'mserve_shadow_requests_total{model="shadowed",outcome="different",version="2.0"} 5.0'
        in metrics
    )


def test_large_answers_are_compared_too(server: Server) -> None:
    """Answers over 64 KB are compared in a thread, off the event loop: same outcome."""
    assert set_shadow(server, {"version": "2.0"}).status == 200
    for i in range(2):
        reply = server.predict("shadowed", {"x": i, "big": True})
        assert reply.status == 200 and len(reply.json()["embedding"]) == 10_000
    wait_until(lambda: settled(shadow(server)) == 2, what="2 large pairs compared")
    state = shadow(server)
    assert state["counts"]["different"] == 2
    assert state["fields"] == {"$.predictions[0].score": 2}


def test_tolerance_is_respected(server: Server) -> None:
    doc = {"version": "2.0", "compare": {"abs_tol": 0.01}}
    assert set_shadow(server, doc).status == 200
    ask(server, 4)
    wait_until(lambda: settled(shadow(server)) == 4, what="4 shadow pairs compared")
    state = shadow(server)
    assert state["counts"]["equal"] == 4
    assert state["max_abs_error"] == pytest.approx(0.001, abs=1e-9)
    # a label is not a number: no tolerance for it
    assert set_shadow(server, {"version": "3.0", "compare": {"abs_tol": 0.01}}).status == 200
    ask(server, 2)
    wait_until(lambda: settled(shadow(server)) == 2, what="2 shadow pairs compared")
    state = shadow(server)
    assert state["counts"]["different"] == 2
    assert state["fields"] == {"$.predictions[0].label": 2}
    # 3.0 logs its requests: the differing pairs are events in its log
    log = Path(server.run_dir) / "inference_log" / "shadowed" / "3.0.jsonl"
    wait_until(lambda: log.exists() and log.read_text().count('"op":"shadow_difference"') == 2,
               what="two shadow_difference events in 3.0's inference log")  # fmt: skip


def test_share_counts_out_evenly(server: Server) -> None:
    assert set_shadow(server, {"version": "1.1", "share": 25}).status == 200
    ask(server, 8)
    wait_until(lambda: settled(shadow(server)) == 2, what="2 of 8 requests shadowed")
    assert shadow(server)["counts"]["equal"] == 2


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"version": "1.0"},
            "body.version: a shadow of version '1.0' onto itself (it is the default version); name another version to shadow onto",
        ),
        (
            {"version": "2.0", "source": "2.0"},
            "body.version: a shadow of version '2.0' onto itself (it is the source)",
        ),
        (
            {"version": "7.0"},
            "body.version: version '7.0' is not registered (registered: 1.0, 1.1, 2.0, 3.0",
        ),
        (
            {"version": "2.0", "share": 150},
            "body.share: 150 is out of range (more than 0, at most 100)",
        ),
        (
            {"version": "2.0", "share": 0},
            "body.share: 0 is out of range (more than 0, at most 100)",
        ),
        (
            {"version": "2.0", "compare": {"abs_tol": -1}},
            "body.compare.abs_tol must be a finite number >= 0, got -1",
        ),
        (
            {"version": "2.0", "queue": 5},
            "body: unknown field(s) queue; expected some of compare, concurrency,",
        ),
        ({"share": 50}, "body.version: the version to shadow onto is required"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(
    server: Server, doc: dict[str, Any], message: str
) -> None:
    # a shadow of its own to keep, whatever ran before (GET answers 404 with none)
    assert set_shadow(server, {"version": "1.1", "share": 50}).status == 200
    before = shadow(server)["settings"]
    reply = set_shadow(server, doc)
    assert reply.status == 400
    assert reply.json()["message"].startswith(message)
    assert shadow(server)["settings"] == before  # nothing changed


def test_a_hanging_shadow_never_holds_the_client(server: Server) -> None:
    register(server, "9.0", response_timeout="30")
    doc = {"version": "9.0", "queue_size": 2, "concurrency": 1, "timeout_s": 2}
    assert set_shadow(server, doc).status == 200
    ask(server, 10)  # every answer is version 1.0's, and in time for the client's
    state = shadow(server)
    assert state["counts"]["dropped"] >= 1  # the lane was full: dropped, not waited for
    wait_until(lambda: shadow(server)["counts"]["timed_out"] >= 1, what="a shadow timed out")


def test_a_crashing_shadow_never_fails_the_client(server: Server) -> None:
    register(server, "9.1")
    doc = {"version": "9.1", "queue_size": 4, "timeout_s": 5}
    assert set_shadow(server, doc).status == 200
    ask(server, 10)
    wait_until(lambda: settled(shadow(server)) == 10, timeout_s=60, what="10 shadows settled")
    state = shadow(server)
    assert state["counts"]["equal"] == 0
    # the worker's death is a status difference; what came while it restarted waited, was
    # refused or dropped: never the client's concern
    assert state["counts"]["different"] >= 1
    assert state["differences"].get("status", 0) >= 1


def test_grpc_sets_and_reads_the_shadow(server: Server) -> None:
    """mserve's gRPC management service sets the shadow; TorchServe's gRPC Predictions are
    shadowed as REST's are."""
    with grpc.insecure_channel(server.status["grpc_management"]) as channel:
        stub = mserve_management_pb2_grpc.MserveManagementServiceStub(channel)
        body = json.dumps({"version": "2.0", "compare": {"abs_tol": 0.01}})
        reply = stub.Shadow(mpb.ShadowRequest(model_name="shadowed", action="set", body=body))
        assert json.loads(reply.msg)["settings"]["compare"]["abs_tol"] == 0.01
        with pytest.raises(grpc.RpcError) as err:
            bad = json.dumps({"version": "2.0", "share": -5})
            stub.Shadow(mpb.ShadowRequest(model_name="shadowed", action="set", body=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "body.share: -5 is out of range (more than 0, at most 100)" in err.value.details()
        with grpc.insecure_channel(server.status["grpc_inference"]) as inference:
            infer = inference_pb2_grpc.InferenceAPIsServiceStub(inference)
            request = ipb.PredictionsRequest(model_name="shadowed", input={"body": b'{"x": 1}'})
            for _ in range(3):
                assert json.loads(infer.Predictions(request).prediction)["x"] == 1

        def counts() -> dict[str, int]:
            reply = stub.Shadow(mpb.ShadowRequest(model_name="shadowed"))
            return json.loads(reply.msg)["counts"]

        wait_until(lambda: counts()["equal"] == 3, what="3 gRPC requests shadowed, equal")
        reply = stub.Shadow(mpb.ShadowRequest(model_name="shadowed", action="clear"))
        assert json.loads(reply.msg)["counts"]["equal"] == 3
        with pytest.raises(grpc.RpcError) as err:
            stub.Shadow(mpb.ShadowRequest(model_name="shadowed"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "model shadowed has no shadow" in err.value.details()


def test_a_model_config_rollout_section_sets_the_shadow(server: Server) -> None:
    register(server, "4.0")
    state = shadow(server)
    assert state["settings"]["version"] == "4.0" and state["settings"]["share"] == 50
    assert state["settings"]["samples"] == 4
    ask(server, 4)
    wait_until(lambda: settled(shadow(server)) == 2, what="2 of 4 requests shadowed")
    assert shadow(server)["counts"]["equal"] == 2


def test_shadow_survives_a_restart(server: Server) -> None:
    doc = {"version": "2.0", "share": 50, "compare": {"rel_tol": 0.1}, "samples": 7}
    assert set_shadow(server, doc).status == 200
    for version in ("1.1", "3.0", "4.0", "9.1"):  # fewer to restore
        assert server.manage("DELETE", f"/models/shadowed/{version}").status == 200
    assert server.cli("--stop").returncode == 0
    started = subprocess.run([MSERVE, "--start", *server.cli_args], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    server.status = json.loads((Path(server.run_dir) / "status.json").read_text())
    state = shadow(server)
    settings = state["settings"]
    assert settings["version"] == "2.0" and settings["share"] == 50
    assert settings["compare"]["rel_tol"] == 0.1 and settings["samples"] == 7
    assert sum(state["counts"].values()) == 0  # counts start again with the server
    ask(server, 2)
    wait_until(lambda: settled(shadow(server)) == 1, what="1 of 2 requests shadowed")
    assert shadow(server)["counts"]["equal"] == 1  # within 10 %
    assert server.manage("DELETE", "/models/shadowed/shadow").status == 200
    assert server.manage("GET", "/models/shadowed/shadow").status == 404
