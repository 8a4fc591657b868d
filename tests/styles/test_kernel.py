"""Kernel style end to end: kernel files archived, served by a real mserve, queried over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from tests.conftest import ARCHIVER_SCRIPT, REPO
from tests.server import conftest as serving
from tests.server.conftest import HANDLERS, concurrently, http, wait_until

# The real-server fixtures of tests/server, used here too.
make_archive = serving.make_archive
start_server = serving.start_server


def _linear_weights(tmp_path: Path) -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    torch.save(model.state_dict(), tmp_path / "linear.pt")
    return model


def _request(req_id: str, values: list[float]) -> dict:
    return {"id": req_id, "inputs": [{"name": "input0", "datatype": "FP32", "data": values}]}


def _expected(model: nn.Linear, values: list[float]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([values])).tolist()[0]


def _config(tmp_path: Path, name: str, settings: dict) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def test_documented_kernel_file_serves_its_model(make_archive, start_server, tmp_path) -> None:
    model = _linear_weights(tmp_path)
    make_archive(
        "kernel_linear", "kernel", "match", "--serialized-file", str(tmp_path / "linear.pt")
    )
    server = start_server("match=match.mar")
    assert "model match: ready" in server.start_output
    values = [0.5, -1.0, 2.0, 0.25]
    reply = server.predict("match", _request("req-1", values))
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"] == "application/json"
    answer = reply.json()
    assert answer["id"] == "req-1"
    (output,) = answer["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("output0", "FP32", [1, 3])
    assert output["data"] == pytest.approx(_expected(model, values), abs=1e-6)
    # The same request over the KServe v2 path reaches the same kernel.
    v2 = http(
        "POST", server.url("inference", "/v2/models/match/infer"),
        json.dumps(_request("req-2", values)).encode(), {"Content-Type": "application/json"},
    )  # fmt: skip
    assert v2.status == 200 and v2.json()["id"] == "req-2"
    explain = http("POST", server.url("inference", "/explanations/match"), b"{}")
    assert explain.status == 404
    assert b"serves predictions only; it has no 'explain' operation" in explain.body
    described = server.manage("GET", "/models/match").json()[0]
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert f"[kernel] INFO: on_kernel_start: instance {described['workers'][0]['id']}" in log


def test_batch_of_four_gets_one_result_per_task(make_archive, start_server, tmp_path) -> None:
    model = _linear_weights(tmp_path)
    batching = {"batchSize": 4, "maxBatchDelay": 500, "batchWait": "fill"}
    make_archive(
        "kernel_linear", "kernel", "match", "--serialized-file", str(tmp_path / "linear.pt"),
        "-c", _config(tmp_path, "match", batching),
    )  # fmt: skip
    make_archive("kernel_probe", "probe_kernel", "probe", "-c", _config(tmp_path, "p", batching))
    server = start_server("match=match.mar", "probe=probe.mar")

    inputs = [[float(i), 1.0, -float(i), 0.5 * i] for i in range(4)]
    replies = concurrently(
        *(partial(server.predict, "match", _request(f"r{i}", v)) for i, v in enumerate(inputs))
    )
    for i, reply in enumerate(replies):
        assert reply.status == 200, reply.body
        answer = reply.json()
        assert answer["id"] == f"r{i}"
        assert answer["outputs"][0]["data"] == pytest.approx(_expected(model, inputs[i]), abs=1e-6)

    bodies = [{"n": 0}, {"cmd": "skip"}, {"cmd": "bad"}, {"n": 3}]
    replies = concurrently(*(partial(server.predict, "probe", b) for b in bodies))
    ok = [r.json() for r in (replies[0], replies[3])]
    assert len(ok[0]["batch_ids"]) == 4, "the four requests should share one batch"
    assert ok[0]["batch_ids"] == ok[1]["batch_ids"] and ok[0]["batches"] == 1
    order = ok[0]["batch_ids"]
    for reply, report in zip((replies[0], replies[3]), ok, strict=True):
        assert report["id"] == reply.headers["X-Request-Id"]
        assert json.loads(report["input"]) in bodies
        position = order.index(report["id"])
        assert report["position"] == position
        assert report["prev_id"] == (order[position - 1] if position else None)
    skipped = replies[1]
    assert skipped.status == 500
    assert skipped.body.decode() == (
        f"the kernel set no output for task {skipped.headers['X-Request-Id']}"
    )
    assert replies[2].status == 400 and replies[2].json() == {"error": "bad input"}


def test_inputs_reach_the_kernel_as_text_or_bytes(make_archive, start_server) -> None:
    make_archive("kernel_probe", "probe_kernel", "probe")
    server = start_server("probe=probe.mar")
    as_json = server.predict("probe", {"text": "héllo", "n": [1, 2]}).json()
    assert as_json["input_type"] == "str"
    assert json.loads(as_json["input"]) == {"text": "héllo", "n": [1, 2]}
    scalar = server.predict(
        "probe", b'"just a string"', headers={"Content-Type": "application/json"}
    )
    assert json.loads(scalar.json()["input"]) == "just a string"  # still JSON text
    sent = b'{"b": 1.50,  "a": [1e3]}'  # the kernel parses it itself: it gets these exact bytes
    exact = server.predict("probe", sent, headers={"Content-Type": "application/json"}).json()
    assert exact["input"] == sent.decode()
    text = server.predict("probe", "plain words").json()
    assert (text["input_type"], text["input"]) == ("str", "plain words")
    raw = server.predict("probe", b"\x89PNG\x00\x01", headers={"Content-Type": "image/png"}).json()
    assert (raw["input_type"], raw["input"]) == ("bytes", 6)


def test_model_description_and_instance_id(make_archive, start_server, tmp_path) -> None:
    settings = {
        "kernel": {
            "attributes": [{"key": "labels", "value": "a,b"}],
            "mk_environments": [{"key": "OMP_NUM_THREADS", "value": "1"}],
            "creator": "ml-team",
        }
    }
    before = int(time.time()) - 2
    make_archive("kernel_probe", "probe_kernel", "probe", "-v", "2.1", "-c", _config(tmp_path, "d", settings))  # fmt: skip
    server = start_server("probe=probe.mar")
    report = server.predict("probe", {}).json()
    worker = server.manage("GET", "/models/probe").json()[0]["workers"][0]
    assert report["instance_id"] == worker["id"]
    assert report["version"] == "2.1"
    desc = report["description"]
    model_path = Path(desc["model_path"])
    assert (model_path / "probe_kernel.py").is_file()
    size = sum(p.stat().st_size for p in model_path.rglob("*") if p.is_file())
    expected_uid = str(uuid.uuid5(uuid.NAMESPACE_URL, "mserve:model/probe/2.1"))
    now = int(time.time())
    assert desc == {
        "name": "probe",
        "uid": expected_uid,
        "tag": "2.1",
        "size": size,
        "weight_path": "./",
        "weight_file": "",
        "model_path": str(model_path),
        "create_time": desc["create_time"],
        "last_updated_time": desc["last_updated_time"],
        "started_at": desc["started_at"],
        "creator": "ml-team",
        "runtime": "python",
        "kernel_path": "probe_kernel.py",
        "service_uri": "/predictions/probe/2.1",
        "attributes": [{"key": "labels", "value": "a,b"}],
        "mk_environments": [{"key": "OMP_NUM_THREADS", "value": "1"}],
        "schema_version": "1",
    }
    assert before <= desc["create_time"] <= now
    assert before <= desc["started_at"] <= now
    assert before <= desc["last_updated_time"] <= now


def test_kernel_shutdown_runs_on_scale_down_unregister_and_server_stop(
    make_archive, start_server, tmp_path
) -> None:
    out = tmp_path / "out"  # the kernel writes here: outside its scratch, so granted
    out.mkdir()
    marker = out / "shutdown.txt"
    settings = {
        "kernel": {"attributes": [{"key": "shutdown_marker", "value": str(marker)}]},
        "sandbox": {"writePaths": [str(out)]},
    }
    make_archive("kernel_probe", "probe_kernel", "probe", "-c", _config(tmp_path, "s", settings))
    server = start_server("probe=probe.mar")
    uid = server.manage("GET", "/models/probe").json()[0]["sandbox"].get("uid")
    if uid is not None:  # a root server runs the model as its own uid: let it write there
        os.chown(out, uid, uid)
    first = server.predict("probe", {}).json()["instance_id"]
    assert not marker.exists()
    assert server.manage("PUT", "/models/probe?min_worker=0&synchronous=true").status == 200
    wait_until(marker.exists, 15, "on_kernel_shutdown after scaling to 0")
    assert marker.read_text() == first
    marker.unlink()

    assert server.manage("PUT", "/models/probe?min_worker=1&synchronous=true").status == 200
    second = server.predict("probe", {}).json()["instance_id"]
    assert second != first
    assert server.manage("DELETE", "/models/probe").status == 200
    wait_until(marker.exists, 15, "on_kernel_shutdown after unregistering")
    assert marker.read_text() == second
    marker.unlink()

    assert server.manage("POST", "/models?url=probe.mar&synchronous=true").status == 200
    third = server.predict("probe", {}).json()["instance_id"]
    assert server.cli("--stop").returncode == 0
    assert marker.read_text() == third
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "[kernel] INFO: probe kernel shutting down" in log
    assert "[kernel] WARN: probe kernel started as instance" in log


def test_kernel_misuse_fails_at_load_with_its_reason(make_archive, start_server) -> None:
    make_archive("kernel_forms", "no_invoke", "lazy")
    make_archive("kernel_forms", "bad_signature", "noarg")
    make_archive("kernel_forms", "duck", "duck")
    server = start_server("lazy=lazy.mar", "noarg=noarg.mar", "duck=duck.mar", expect_ok=False)
    out = server.start_output
    assert (
        "model lazy: failed: handler of lazy:1.0 failed to load: kernel class 'no_invoke:LazyKernel' does not define "
        "on_task_invoke(self, task_context); a kernel must override it to run its tasks"
    ) in out, out
    assert (
        "model noarg: failed: handler of noarg:1.0 failed to load: kernel class 'bad_signature:NoArgKernel': on_task_invoke() "
        "cannot be called as on_task_invoke(self, task_context)"
    ) in out, out
    # A class that only looks like a kernel is served as one.
    reply = server.predict("duck", "hello")
    assert (reply.status, reply.body) == (200, b"quack hello")
    assert reply.headers["Content-Type"].startswith("text/plain")


def test_running_the_kernel_file_says_how_to_serve_it() -> None:
    script = HANDLERS / "kernel_linear" / "kernel.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2
    assert (
        "MatchKernel is a model kernel: mserve loads it, it does not run on its own." in out.stderr
    )
    assert "--handler kernel.py" in out.stderr


def test_example_runs_as_its_readme_says(start_server, tmp_path) -> None:
    """examples/kernel, archived and served with the README's commands, batch of valid and bad."""
    example = REPO / "examples" / "kernel"
    weights = tmp_path / "linear.pt"
    subprocess.run([sys.executable, str(example / "make_weights.py"), str(weights)], check=True)
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    archived = subprocess.run(
        [
            ARCHIVER_SCRIPT, "--model-name", "iris", "--handler", str(example / "kernel.py"),
            "--serialized-file", str(weights), "-c", str(example / "model-config.yaml"),
            "--export-path", str(store), "--force",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert archived.returncode == 0, archived.stderr
    server = start_server("iris=iris.mar")
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    rows = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]]
    bodies = [_request(f"r{i}", row) for i, row in enumerate(rows)] + [{"inputs": []}]
    replies = concurrently(*(partial(server.predict, "iris", b) for b in bodies))
    labels = ["setosa", "versicolor", "virginica"]
    for i, row in enumerate(rows):
        assert replies[i].status == 200, replies[i].body
        answer = replies[i].json()
        with torch.no_grad():
            expected = torch.softmax(model(torch.tensor([row])), dim=1)[0].tolist()
        assert answer["outputs"][0]["data"] == pytest.approx(expected, abs=1e-6)
        assert answer["label"] == labels[max(range(3), key=expected.__getitem__)]
        assert answer["id"] == f"r{i}"
    assert replies[3].status == 400
    assert replies[3].json() == {"error": "bad request: IndexError('list index out of range')"}
