"""TorchServe's workflows end to end: a real ``.war`` built by our workflow archiver, served by a
real server in TorchServe's layout (``torchserve --start``, keys on, the workflow store from
``config.properties``), its nodes on real workers.

The workflow: ``pre`` (a function of the .war's handler) -> ``upper`` and ``count`` (two
models, in parallel) -> ``post`` (a function getting both answers). One server serves every
test of the module; they run in order (register first, unregister last).
"""

from __future__ import annotations

import subprocess
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from archiver.workflow_cli import main as workflow_archiver
from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import HANDLERS, Reply, Server, http, pid_alive
from tests.server.test_torchserve_layout import PROPERTIES, TorchServeDir, _pid, torchserve_env

WORKFLOW = HANDLERS / "workflow"


def _mar(store: Path, folder: str, handler: str, name: str) -> None:
    out = subprocess.run(
        [ARCHIVER_SCRIPT, "--model-name", name, "--handler", handler, "--model-path",
         str(WORKFLOW / folder), "--export-path", str(store), "-f"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def _war(export: Path, name: str, spec: Path, handler: Path = WORKFLOW / "war" / "pipeline.py",
         *extra: str) -> Path:  # fmt: skip
    """A .war from our torch-workflow-archiver, run as its console script would be."""
    result = CliRunner().invoke(
        workflow_archiver,
        ["--workflow-name", name, "--spec-file", str(spec), "--handler", str(handler),
         "--export-path", str(export), "-f", *extra],
        prog_name="torch-workflow-archiver",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output == ""  # TorchServe's archiver prints nothing when it succeeds
    return export / f"{name}.war"


@pytest.fixture(scope="module")
def ts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServeDir]:
    tmp = tmp_path_factory.mktemp("workflows")
    root, store, wf_store = tmp / "serve", tmp / "store", tmp / "serve" / "wf"
    wf_store.mkdir(parents=True)
    store.mkdir()
    _mar(store, "upper", "upper:handle", "wf_upper")
    _mar(store, "count", "count:handle", "wf_count")
    _war(wf_store, "pipe", WORKFLOW / "war" / "spec.yaml")
    # TorchServe's token test reads workflow_store relative to the folder it starts from
    (root / "config.properties").write_text(
        PROPERTIES + f"model_store={store}\nworkflow_store=wf\n"
    )
    env = torchserve_env(tmp / "run")
    served = TorchServeDir(root, env)
    console = served.start("--ncs", "--ts-config", "config.properties", "--enable-model-api")
    # TorchServe's banner names the workflow store (relative to the start folder, as there)
    assert f"Workflow Store: {wf_store.resolve()}" in console.text
    served.wf_store = wf_store  # type: ignore[attr-defined]
    yield served
    pid = _pid(served.run_dir)
    if pid is not None and pid_alive(pid):
        served.command("--stop", "--foreground")


def _no_key(ts: TorchServeDir, api: str, method: str, path: str) -> Reply:
    return http(method, f"{ts.status['urls'][api]}{path}", b"" if method != "GET" else None)


def _models(ts: TorchServeDir) -> list[str]:
    return [m["modelName"] for m in ts.call("management", "GET", "/models").json()["models"]]


def test_register_needs_the_management_key(ts: TorchServeDir) -> None:
    # TorchServe's test_token_authorization: no key is a 400 (its answer) in its layout
    refused = _no_key(ts, "management", "POST", "/workflows?url=pipe.war&workflow_name=pipe")
    assert refused.status == 400 and refused.json()["type"] == "InvalidKeyException"
    wrong = http("POST", f"{ts.status['urls']['management']}/workflows?url=pipe.war",
                 b"", {"Authorization": f"Bearer {ts.key('inference')}"})  # fmt: skip
    assert wrong.status == 400
    assert _no_key(ts, "management", "GET", "/workflows").status == 400
    assert "pipe__pre" not in _models(ts)


def test_register_lists_describes_and_registers_its_models(ts: TorchServeDir) -> None:
    reply = ts.call("management", "POST", "/workflows?url=pipe.war&workflow_name=pipe")
    assert reply.status == 200, reply.body
    assert reply.json() == {"status": "Workflow pipe has been registered and scaled successfully."}
    assert ts.call("management", "GET", "/workflows").json() == {
        "workflows": [{"workflowName": "pipe", "workflowUrl": "pipe.war"}]
    }
    described = ts.call("management", "GET", "/workflows/pipe").json()
    assert described == [{
        "workflowName": "pipe", "workflowUrl": "pipe.war", "minWorkers": 1, "maxWorkers": 1,
        "batchSize": 1, "maxBatchDelay": 10,
        "workflowDag": "{pre=[upper, count], upper=[post], count=[post]}",
    }]  # fmt: skip
    # every node is a model <workflow>__<node>, with the spec's settings, on its own worker
    assert {"pipe__pre", "pipe__upper", "pipe__count", "pipe__post"} <= set(_models(ts))
    count = ts.call("management", "GET", "/models/pipe__count").json()[0]
    assert (count["batchSize"], count["maxBatchDelay"], len(count["workers"])) == (2, 10, 1)
    pre = ts.call("management", "GET", "/models/pipe__pre").json()[0]
    assert (pre["batchSize"], pre["minWorkers"], pre["maxWorkers"]) == (1, 1, 1)
    assert pre["handler"] == "pipeline.py:pre"


def test_a_second_registration_of_the_name_conflicts(ts: TorchServeDir) -> None:
    reply = ts.call("management", "POST", "/workflows?url=pipe.war&workflow_name=pipe")
    assert reply.status == 409
    assert reply.json()["message"] == "Workflow pipe is already registered."


def test_wfpredict_runs_the_dag_and_needs_the_inference_key(ts: TorchServeDir) -> None:
    reply = ts.call("inference", "POST", "/wfpredict/pipe", b"  hello  ")
    assert reply.status == 200, reply.body
    # pre's answer went to both models; post got one field per parent, each its answer's bytes
    assert reply.json() == {
        "upper": "HELLO",
        "count": {"chars": 5, "batch": 1},
        "fields": ["count", "upper"],
    }
    # TorchServe's token test sends a file as a form field (requests' files={"data": ...})
    boundary = "b0undary"
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="data"; filename="x.txt"\r\n'
            f"\r\nworkflow\r\n--{boundary}--\r\n").encode()  # fmt: skip
    keyed = {"Authorization": f"Bearer {ts.key('inference')}",
             "Content-Type": f"multipart/form-data; boundary={boundary}"}  # fmt: skip
    url = f"{ts.status['urls']['inference']}/wfpredict/pipe"
    assert http("POST", url, form, keyed).json()["upper"] == "WORKFLOW"
    assert http("POST", url, form, {"Content-Type": keyed["Content-Type"]}).status == 400
    wrong = {**keyed, "Authorization": f"Bearer {ts.key('management')}"}
    assert http("POST", url, form, wrong).status == 400


def test_a_failing_node_fails_the_request_naming_it(ts: TorchServeDir) -> None:
    reply = ts.call("inference", "POST", "/wfpredict/pipe", b"boom")
    assert reply.status == 500
    message = reply.json()["message"]
    assert message == (
        "workflow pipe: node count (model pipe__count) failed: handler of pipe__count:1.0"
        " failed: ValueError: count cannot count 'boom'"
    )
    # the workflow serves on
    assert ts.call("inference", "POST", "/wfpredict/pipe", b"ok").json()["upper"] == "OK"


def test_unknown_workflows_and_archives(ts: TorchServeDir) -> None:
    missing = ts.call("management", "POST", "/workflows?url=nope.war")
    assert (missing.status, missing.json()["message"]) == (
        404,
        "Workflow not found in workflow store: nope.war",
    )
    assert ts.call("management", "POST", "/workflows").json()["message"] == (
        "Parameter url is required."
    )
    for method, api, path in (("GET", "management", "/workflows/nope"),
                              ("DELETE", "management", "/workflows/nope"),
                              ("POST", "inference", "/wfpredict/nope")):  # fmt: skip
        reply = ts.call(api, method, path)
        assert (reply.status, reply.json()["message"]) == (404, "Workflow not found: nope")


def _bad_war(ts: TorchServeDir, tmp: Path, name: str, spec: str) -> Path:
    (tmp / f"{name}.yaml").write_text(spec)
    return _war(ts.wf_store, name, tmp / f"{name}.yaml")  # type: ignore[attr-defined]


def _left_behind(ts: TorchServeDir, name: str) -> list[str]:
    models = [m for m in _models(ts) if m.startswith(f"{name}__")]
    unpacked = ts.run_dir / "workflows"
    folders = [p.name for p in unpacked.iterdir()] if unpacked.is_dir() else []
    return models + (["workflow"] if ts.call("management", "GET", f"/workflows/{name}").status
                     != 404 else []) + [f for f in folders if f.startswith(".")]  # fmt: skip


def test_a_bad_war_is_refused_clearly_and_leaves_nothing(ts: TorchServeDir, tmp_path: Path) -> None:
    folders_before = sorted(p.name for p in (ts.run_dir / "workflows").iterdir())
    cases = {
        # a model the store lacks: the other nodes registered meanwhile are removed again
        "lacking": (
            "models:\n  upper:\n    url: wf_upper.mar\n  gone:\n    url: gone.mar\n"
            "dag:\n  pre: [upper, gone]\n  upper: [post]\n  gone: [post]\n",
            404,
            "workflow lacking failed to register, and none of its models was kept: node"
            " gone (model lacking__gone): archive not found: gone.mar",
        ),
        "cyclic": (
            "models:\n  upper:\n    url: wf_upper.mar\ndag:\n  pre: [upper]\n  upper: [post]\n"
            "  post: [upper]\n",
            400,
            "workflow spec cyclic.yaml, dag: not acyclic (a cycle through post, upper)",
        ),
        "stray": (
            "models:\n  upper:\n    url: wf_upper.mar\ndag:\n  pre: [upper]\n  upper: [nothing]\n",
            400,
            "workflow spec stray.yaml, dag: node 'nothing' is neither a model of the models"
            " section (upper) nor a function of the handler pipeline.py",
        ),
        "twostarts": (
            "models:\n  upper:\n    url: wf_upper.mar\ndag:\n  pre: [post]\n  upper: [post]\n",
            400,
            "workflow spec twostarts.yaml, dag: a workflow has one start node, where"
            " requests enter; found 2 (pre, upper)",
        ),
    }
    for name, (spec, status, message) in cases.items():
        _bad_war(ts, tmp_path, name, spec)
        reply = ts.call("management", "POST", f"/workflows?url={name}.war")
        assert (reply.status, reply.json()["message"]) == (status, message), name
        assert _left_behind(ts, name) == [], name
    # not a workflow archive at all
    (ts.wf_store / "plain.war").write_bytes(b"not a zip")  # type: ignore[attr-defined]
    reply = ts.call("management", "POST", "/workflows?url=plain.war")
    assert (
        reply.status == 400 and "cannot load workflow archive plain.war" in reply.json()["message"]
    )
    # a zip without WAR-INF/MANIFEST.json
    with zipfile.ZipFile(ts.wf_store / "bare.war", "w") as zf:  # type: ignore[attr-defined]
        zf.writestr("spec.yaml", "dag: {}\n")
    reply = ts.call("management", "POST", "/workflows?url=bare.war")
    assert reply.status == 400
    assert "WAR-INF/MANIFEST.json is missing; not a workflow archive" in reply.json()["message"]
    assert sorted(p.name for p in (ts.run_dir / "workflows").iterdir()) == folders_before


def test_unregister_removes_the_workflow_and_its_models(ts: TorchServeDir) -> None:
    reply = ts.call("management", "DELETE", "/workflows/pipe")
    assert (reply.status, reply.json()) == (200, {"status": 'Workflow "pipe" unregistered'})
    assert [m for m in _models(ts) if m.startswith("pipe__")] == []
    assert ts.call("management", "GET", "/workflows").json() == {"workflows": []}
    assert ts.call("inference", "POST", "/wfpredict/pipe", b"x").status == 404
    assert list((ts.run_dir / "workflows").iterdir()) == []


def test_model_api_control_covers_workflows(start_server: Callable[..., Server]) -> None:
    server = start_server(config={"enable_model_api": False})
    for method, path in (("POST", "/workflows?url=pipe.war"), ("DELETE", "/workflows/pipe")):
        reply = server.manage(method, path)
        assert reply.status == 405, path
        assert reply.json()["message"].startswith(
            ("registering" if method == "POST" else "unregistering")
            + " workflows through the API is disabled (model API control): start mserve with"
            " --enable-model-api"
        )
    assert server.manage("GET", "/workflows").json() == {"workflows": []}
