"""Hot reload of a handler's code (docs/hot-reload.md): ``PUT /models/{name}/reload`` on a real
server with two real workers, the model registered from a folder (no-archive) whose handler the
tests edit. One server for the module; each test leaves the handler answering as it found it
apart from its ANSWER."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from server.rpc.protos import mserve_management_pb2 as mpb
from server.rpc.protos import mserve_management_pb2_grpc
from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import (
    HANDLERS,
    Server,
    http,
    pid_alive,
    server_settings,
    start_daemon,
)

pytestmark = pytest.mark.timeout(120)
SOURCE = (HANDLERS / "hot_reload" / "handler.py").read_text()


def start(root: Path, extra: tuple[str, ...] = ()) -> Server:
    """A server on free ports over ``root/store``, without token keys (tests send none)."""
    settings = server_settings(root / "store")
    return start_daemon(root / "mserve.yaml", root / "run", settings, extra)


def folder_model(root: Path, name: str) -> Path:
    """The fixture handler archived as a folder in the store (served in place): its
    handler.py is the file the tests edit."""
    (root / "store").mkdir(exist_ok=True)
    out = subprocess.run(
        [ARCHIVER_SCRIPT, "--model-name", name, "--handler", "handler:Handler",
         "--model-path", str(HANDLERS / "hot_reload"), "--export-path", str(root / "store"),
         "--archive-format", "no-archive", "-f"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return root / "store" / name


def stop(server: Server) -> None:
    if pid_alive(server.pid):
        server.cli("--stop")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("reload")
    folder = folder_model(root, "hot")
    server = start(root)
    try:
        reply = server.manage("POST", "/models?url=hot&initial_workers=2&synchronous=true")
        assert reply.status == 200, reply.body
        yield server, folder / "handler.py"
    finally:
        stop(server)


def answers(server: Server, n: int = 6) -> list[dict]:
    """``n`` answers (both workers answer some of them)."""
    replies = [server.predict("hot", {"x": 1}) for _ in range(n)]
    assert all(r.status == 200 for r in replies), [r.body for r in replies]
    return [r.json() for r in replies]


def edit(handler: Path, answer: str, extra: str = "") -> None:
    text = SOURCE.replace('ANSWER = "v1"', f"ANSWER = {answer!r}") + extra
    handler.write_text(text)


def test_a_reload_changes_the_answer_without_loading_the_weights_again(
    served: tuple[Server, Path],
) -> None:
    server, handler = served
    before = answers(server)
    pids = {a["pid"] for a in before}
    assert {a["answer"] for a in before} == {"v1"} and {a["loads"] for a in before} == {1}
    edit(handler, "v2")
    reply = server.manage("PUT", "/models/hot/reload")
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["workers"] == 2 and body["code"]["files"] == ["handler.py"]
    assert body["status"].startswith("handler of model hot:1.0 reloaded on 2 worker(s) in ")
    after = answers(server)
    assert {a["answer"] for a in after} == {"v2"}
    assert {a["loads"] for a in after} == {1}  # the weights were kept, not loaded again
    assert {a["pid"] for a in after} <= pids  # the same worker processes
    (described,) = server.manage("GET", "/models/hot").json()
    code = described["handlerCode"]
    assert code["digest"] == body["code"]["digest"] and code["files"] == ["handler.py"]
    assert code["lastReload"]["outcome"] == "ok" and code["reloads"] >= 1
    metrics = http("GET", server.url("metrics", "/metrics")).body.decode()
    assert 'mserve_handler_reloads_total{model="hot",outcome="ok",version="1.0"}' in metrics


def test_a_syntax_error_is_answered_and_the_old_code_serves_on(
    served: tuple[Server, Path],
) -> None:
    server, handler = served
    edit(handler, "v3")
    assert server.manage("PUT", "/models/hot/1.0/reload").status == 200
    edit(handler, "v4", "\ndef broken(:\n    pass\n")
    line = SOURCE.count("\n") + 2  # the line of "def broken(:"
    reply = server.manage("PUT", "/models/hot/reload")
    assert reply.status == 400, reply.body
    message = reply.json()["message"]
    assert message.startswith("handler of model hot:1.0 failed to reload on worker ")
    assert "the old code serves on: SyntaxError: " in message
    assert f"(handler.py, line {line})" in message
    assert {a["answer"] for a in answers(server)} == {"v3"}
    (described,) = server.manage("GET", "/models/hot").json()
    assert described["handlerCode"]["lastReload"]["outcome"] == "failed"
    assert described["handlerCode"]["lastReload"]["error"] == message


def test_initialize_raising_is_answered_and_no_worker_switches(
    served: tuple[Server, Path],
) -> None:
    server, handler = served
    edit(handler, "v3")
    assert server.manage("PUT", "/models/hot/reload").status == 200
    raising = SOURCE.replace('ANSWER = "v1"', 'ANSWER = "v5"').replace(
        "        self.weights = keep(", '        raise RuntimeError("no weights today")\n'
        "        self.weights = keep(",
    )  # fmt: skip
    line = raising.splitlines().index('        raise RuntimeError("no weights today")') + 1
    handler.write_text(raising)
    reply = server.manage("PUT", "/models/hot/reload")
    assert reply.status == 400, reply.body
    message = reply.json()["message"]
    assert message.endswith(
        f"the old code serves on: RuntimeError: no weights today (handler.py, line {line})"
    )
    assert {a["answer"] for a in answers(server, 8)} == {"v3"}  # on every worker


def test_requests_in_flight_during_reloads_all_succeed(served: tuple[Server, Path]) -> None:
    server, handler = served
    results: list[int] = []
    stop_asking = threading.Event()

    def ask() -> None:
        while not stop_asking.is_set():
            results.append(server.predict("hot", {"sleep": 0.01}).status)

    clients = [threading.Thread(target=ask) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        for answer in ("r1", "r2", "r3"):
            edit(handler, answer)
            assert server.manage("PUT", "/models/hot/reload").status == 200
    finally:
        stop_asking.set()
        for client in clients:
            client.join(30)
    assert results and set(results) == {200}, sorted(set(results))
    assert {a["answer"] for a in answers(server)} == {"r3"}


def test_a_reload_of_an_unknown_model_is_a_404(served: tuple[Server, Path]) -> None:
    server, _ = served
    reply = server.manage("PUT", "/models/nope/reload")
    assert reply.status == 404


def test_a_model_without_workers_with_continuous_batching_or_parallel(
    served: tuple[Server, Path], tmp_path: Path
) -> None:
    """Nothing to reload without a worker (the next one loads the files on disk); a model whose
    workers run continuous batching, or a parallel one, is refused naming what to do instead."""
    server, handler = served
    store = handler.parent.parent
    steps, ranks = tmp_path / "steps.yaml", tmp_path / "ranks.yaml"
    steps.write_text("continuousBatching: true\n")
    ranks.write_text("parallelType: tp\ndeviceType: cpu\ntorchrun:\n  nproc-per-node: 2\n")
    for name, extra in (("idle", ()), ("steps", ("--config-file", str(steps))),
                        ("ranks", ("--config-file", str(ranks)))):  # fmt: skip
        out = subprocess.run(
            [ARCHIVER_SCRIPT, "--model-name", name, "--handler", "handler:Handler",
             "--model-path", str(HANDLERS / "hot_reload"), "--export-path", str(store),
             "--archive-format", "no-archive", "-f", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert server.manage("POST", f"/models?url={name}&initial_workers=0").status == 200
    reply = server.manage("PUT", "/models/idle/1.0/reload")
    assert reply.status == 200, reply.body
    assert reply.json()["status"] == (
        "no worker of model idle:1.0 is running: the next one to start loads the code on disk"
    )
    assert reply.json()["workers"] == 0
    reply = server.manage("PUT", "/models/steps/reload")
    assert reply.status == 400, reply.body
    assert reply.json()["message"] == (
        "model steps:1.0 runs continuous batching, whose workers run their steps themselves:"
        " hot reload is not supported for it; restart its workers instead (scale to 0 and back)"
    )
    reply = server.manage("PUT", "/models/ranks/reload")
    assert reply.status == 400, reply.body
    assert reply.json()["message"] == (
        "model ranks:1.0 is a parallel model (parallelType tp): hot reload is not supported for"
        " its ranks; restart its workers instead (scale to 0 and back)"
    )


def test_the_grpc_management_address_reloads_too(served: tuple[Server, Path]) -> None:
    """mserve's own gRPC management service, beside TorchServe's on the management address."""
    server, handler = served
    edit(handler, "over grpc")
    with grpc.insecure_channel(server.status["grpc_management"]) as channel:
        stub = mserve_management_pb2_grpc.MserveManagementServiceStub(channel)
        reply = stub.ReloadModel(mpb.ReloadModelRequest(model_name="hot"), timeout=60)
        assert json.loads(reply.msg)["workers"] == 2
        assert {a["answer"] for a in answers(server)} == {"over grpc"}
        with pytest.raises(grpc.RpcError) as missing:
            stub.ReloadModel(mpb.ReloadModelRequest(), timeout=60)
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert missing.value.details() == "parameter 'model_name' is required"
        edit(handler, "x", "\ndef broken(:\n")
        with pytest.raises(grpc.RpcError) as err:
            stub.ReloadModel(mpb.ReloadModelRequest(model_name="hot", model_version="1.0"),
                             timeout=60)  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the old code serves on: SyntaxError: " in err.value.details()
    assert {a["answer"] for a in answers(server)} == {"over grpc"}
