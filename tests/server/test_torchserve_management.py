"""TorchServe's management behaviours in its layout, checked as TorchServe's own tests check
them (test/pytest/test_snapshot.py, test_gRPC_model_control.py, test_gRPC_allowed_urls.py,
ModelServerTest's testRegisterModelInvalidPath): the ``torchserve`` command started in a working
folder (tests/server/test_torchserve_layout.py's harness), answers over REST and gRPC.

- a config snapshot that names an archive no longer in the model store stops the start; one
  whose archive was replaced by a file that is no archive starts (TorchServe's test expects it);
- a startup model whose handler cannot load stays registered, retried, then failed: 503
  naming the error;
- ``GET /models`` entries have TorchServe's two keys;
- the model API's refusal over gRPC is TorchServe's ``PERMISSION_DENIED`` "Model API disabled",
  and so is a wrong key's ("Token Authorization failed. ...");
  a registration URL holding ``..`` is its 404 "Relative path is not allowed in url: ...".
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from server.rpc.protos import management_pb2 as mpb
from server.rpc.protos import management_pb2_grpc
from server.ts_config import parse_properties
from tests.server.conftest import wait_until
from tests.server.test_torchserve_layout import TORCHSERVE, Console, TorchServeDir
from tests.server.test_torchserve_layout import ts_dir as layout_ts_dir  # noqa: F401

Code = grpc.StatusCode
TIMEOUT_S = 60


@pytest.fixture
def ts_dir(layout_ts_dir: TorchServeDir) -> TorchServeDir:  # noqa: F811
    """The folder ``torchserve`` runs in, with its archives (the layout tests' fixture)."""
    return layout_ts_dir


def _grpc_error(
    ts_dir: TorchServeDir, method: str, request: object, key: str | None = None
) -> tuple[Code, str]:
    with grpc.insecure_channel(ts_dir.status["grpc_management"]) as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        sent = [("authorization", f"Bearer {key or ts_dir.key('management')}")]
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, method)(request, metadata=sent, timeout=TIMEOUT_S)
    return err.value.code(), err.value.details()


def test_startup_failures_and_a_snapshot_whose_archive_is_gone(
    ts_dir: TorchServeDir, make_archive: Callable[..., Path], tmp_path: Path
) -> None:
    store = (ts_dir.root / "model_store").resolve()
    config = tmp_path / "model_config.yaml"  # broken is retried for 1 s, not 300
    config.write_text("maxRetryTimeoutInSec: 1\n")
    make_archive("bad_import", "broken", "broken", "-c", str(config))
    ts_dir.start("--model-store", "model_store", "--models", "echo.mar", "printer=printer.mar",
                 "broken=broken.mar", "--ts-config", "config.properties")  # fmt: skip

    # GET /models: TorchServe's two keys, no more
    listed = ts_dir.call("management", "GET", "/models").json()["models"]
    assert listed == [
        {"modelName": n, "modelUrl": f"{n}.mar"} for n in ("broken", "echo", "printer")
    ]

    # a startup model whose handler cannot load stays: retried for maxRetryTimeoutInSec
    # (the request waits meanwhile), then failed: 503 naming the load error
    failed = ts_dir.call("inference", "POST", "/predictions/broken", b"x")
    assert failed.status == 503 and failed.json()["type"] == "ServiceUnavailableException"
    message = failed.json()["message"]
    assert message.startswith("model broken:1.0 has failed: worker "), message
    assert (
        "; last: handler of broken:1.0 failed to load: ModuleNotFoundError: No module named"
        " 'mserve_test_missing_dependency'"
    ) in message, message
    described = ts_dir.call("management", "GET", "/models/broken").json()[0]
    assert described["status"] == "FAILED" and "ModuleNotFoundError" in described["failure"]
    wait_until(lambda: ts_dir.status["models"]["broken"].startswith("failed: worker "), 10,
               "broken failed in the status file")  # fmt: skip

    # the model API is off (TorchServe's default): gRPC says so in TorchServe's words
    assert _grpc_error(ts_dir, "RegisterModel", mpb.RegisterModelRequest(url="echo.mar")) == (
        Code.PERMISSION_DENIED, "Model API disabled")  # fmt: skip
    assert _grpc_error(
        ts_dir, "UnregisterModel", mpb.UnregisterModelRequest(model_name="echo")
    ) == (Code.PERMISSION_DENIED, "Model API disabled")
    # a wrong key: TorchServe's GRPCInterceptor's PERMISSION_DENIED and words (its
    # test_gRPC_token_authorization matches them), ours after them
    assert _grpc_error(ts_dir, "ListModels", mpb.ListModelsRequest(), key="incorrect-token") == (
        Code.PERMISSION_DENIED, "Token Authorization failed. Token either incorrect, expired, or"
        " not provided correctly (the key sent is not the management key)")  # fmt: skip
    assert ts_dir.command("--stop", "--foreground").returncode == 0

    # test_replace_mar_file_with_dummy: an archive replaced by junk does not stop the start
    (store / "printer.mar").write_text("junk data")
    ts_dir.start("--model-store", "model_store")
    assert ts_dir.call("inference", "POST", "/predictions/echo", b"back").body == b"back"
    assert ts_dir.status["models"]["printer"].startswith("failed: cannot load archive")
    wait_until(lambda: ts_dir.status["models"]["broken"].startswith("failed: worker "), 30,
               "broken failed again in the status file")  # fmt: skip
    assert ts_dir.command("--stop", "--foreground").returncode == 0
    # printer is kept in the snapshots, as TorchServe (which registered it) would keep it
    shutdown = ts_dir.root / "logs" / "config" / ts_dir.snapshots()[-1]
    props = {k: p.value for k, p in parse_properties(shutdown.read_text(), shutdown).items()}
    recorded = json.loads(props["model_snapshot"])["models"]
    assert sorted(recorded) == ["broken", "echo", "printer"]
    assert recorded["printer"]["1.0"]["marName"] == "printer.mar"
    assert recorded["printer"]["1.0"]["defaultVersion"] is True

    # test_restart_torchserve_with_last_snapshot_with_model_mar_removed: no start at all
    (store / "echo.mar").unlink()
    launched = subprocess.Popen(
        [TORCHSERVE, "--start", "--model-store", "model_store"], cwd=ts_dir.root, env=ts_dir.env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert launched.stdout is not None
    console = Console(launched.stdout)
    code = launched.wait(timeout=120)
    assert console.closed.wait(30), console.text  # nothing of the server is left writing
    out = console.text
    assert code == 1, out
    assert (
        f"Model archive file for model echo, version 1.0 not found in model store: {store}"
        "/echo.mar. The config snapshot restored at this start records it"
    ) in out, out
    assert "Model server started." not in out
    assert ts_dir.command("--stop").stdout.strip() == "TorchServe is not currently running."
    assert not (ts_dir.root / "key_file.json").exists()


def test_a_registration_url_holding_dots_is_refused_as_torchserve_refuses_it(
    ts_dir: TorchServeDir,
) -> None:
    ts_dir.start("--ncs", "--model-store", "model_store", "--enable-model-api",
                 "--ts-config", "config.properties")  # fmt: skip
    for url, shown in [("..%2Fecho.mar", "../echo.mar"),
                       ("model_store%2F..%2Fecho.mar", "model_store/../echo.mar")]:  # fmt: skip
        refused = ts_dir.call("management", "POST", f"/models?url={url}")
        assert (refused.status, refused.json()) == (404, {
            "code": 404, "type": "ModelNotFoundException",
            "message": f"Relative path is not allowed in url: {shown}"})  # fmt: skip
    remote = "https://example.com/mar_files/../mar_files/densenet161.mar"
    assert _grpc_error(ts_dir, "RegisterModel", mpb.RegisterModelRequest(url=remote)) == (
        Code.NOT_FOUND, f"Relative path is not allowed in url: {remote}")  # fmt: skip
    assert ts_dir.call("management", "GET", "/models").json() == {"models": []}
