"""No server paths in API answers: load failures, handler errors, a failed model, archive errors
and startup models named by path answer with model-relative names; the log keeps them whole."""

from __future__ import annotations

import json
from pathlib import Path

from server.redaction import PathRedactor
from tests.server.conftest import Server, http, wait_until

OPEN = {"disable_token_authorization": True, "enable_model_api": True}
REPO = str(Path(__file__).resolve().parents[2])


def _no_server_paths(server: Server, tmp_path: Path, *bodies: bytes) -> None:
    for body in bodies:
        text = body.decode()
        for path in (str(server.run_dir), str(tmp_path), REPO, "pytest-of", "/unpacked/"):
            assert path not in text, f"{path} in {text}"


def test_the_redactor_names_model_files_and_server_folders() -> None:
    sha = "ab" * 32
    redact = PathRedactor.for_server(
        Path("/srv/run"), Path("/srv/store"), Path("/srv/run/envs"), Path("/srv/run/logs"),
        ["/data/models"],
    )  # fmt: skip
    text = (
        f'File "/srv/run/unpacked/{sha}/handler.py", line 3\n'
        f"No such file or directory: '/srv/run/unpacked/{sha}/weights.bin'\n"
        f"unpacked into /srv/run/unpacked/{sha} from /srv/store/m.mar and /data/models/x.mar\n"
        'File "/opt/elsewhere/lib/thing.py", line 9\n'
        "/srv/run/envs/k1/bin/python, /srv/runner/x, /x/srv/store, GET /predictions/m/1"
    )
    assert redact(text) == (
        'File "handler.py", line 3\n'
        "No such file or directory: 'weights.bin'\n"
        "unpacked into <model_dir> from <model_store>/m.mar and <allowed_path>/x.mar\n"
        'File ".../thing.py", line 9\n'
        "<env_dir>/k1/bin/python, /srv/runner/x, /x/srv/store, GET /predictions/m/1"
    )


def test_load_failures_name_the_models_file_not_the_run_dir(
    make_archive, start_server, tmp_path: Path
) -> None:
    make_archive("bad_import", "broken:handle", "imports")
    make_archive("path_faults", "load_fails:WeightsHandler", "weights")
    server = start_server(config=OPEN)
    imports = server.manage("POST", "/models?url=imports.mar")
    assert imports.status == 400 and imports.json()["type"] == "InvalidModelException"
    message = imports.json()["message"]
    assert message.startswith(
        "handler of imports:1.0 failed to load: ModuleNotFoundError: No module named"
        " 'mserve_test_missing_dependency'"
    )
    assert 'File "broken.py", line 3, in <module>' in message
    weights = server.manage("POST", "/models?url=weights.mar")
    assert weights.status == 400
    message = weights.json()["message"]
    assert message.startswith(
        "handler of weights:1.0 failed to load: FileNotFoundError: [Errno 2] No such file or"
        " directory: 'weights.bin'"
    )
    assert 'File "load_fails.py", line 10, in initialize' in message
    _no_server_paths(server, tmp_path, imports.body, weights.body)
    # the log keeps the whole story
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert f"{server.run_dir}/unpacked/" in log and "weights.bin" in log


def test_a_failed_model_and_handler_errors_on_the_inference_port(
    make_archive, start_server, tmp_path: Path
) -> None:
    make_archive("path_faults", "load_fails:WeightsHandler", "weights")
    make_archive("path_faults", "predict_fails:handle", "labels")
    server = start_server("labels=labels.mar", config=OPEN)
    # loading in the background: the model fails, and says so on the inference port
    assert server.manage("POST", "/models?url=weights.mar&synchronous=false").status == 202
    wait_until(
        lambda: server.manage("GET", "/models/weights").json()[0]["status"] == "FAILED",
        60, "the model to fail",
    )  # fmt: skip
    failed = server.predict("weights", {})
    assert failed.status == 503 and failed.json()["type"] == "ServiceUnavailableException"
    message = failed.json()["message"]
    assert message.startswith("model weights:1.0 has failed: worker "), message
    assert (
        " without loading again within maxRetryTimeoutInSec=10; last: handler of"
        " weights:1.0 failed to load: FileNotFoundError: [Errno 2] No such file or directory:"
        " 'weights.bin'"
    ) in message
    described = server.manage("GET", "/models/weights")
    assert "No such file or directory: 'weights.bin'" in described.json()[0]["failure"]
    # a handler error while predicting
    error = server.predict("labels", {})
    assert error.status == 500 and error.json()["type"] == "InternalServerException"
    assert error.json()["message"] == (
        "handler of labels:1.0 failed: FileNotFoundError: [Errno 2] No such file or directory:"
        " 'labels.json'"
    )
    # describe keeps the operator's facts (python, modelUrl); the worker's words lose the paths
    words = {k: described.json()[0][k] for k in ("failure", "lastOutput")}
    assert '  File "load_fails.py", line 10, in initialize' in words["lastOutput"]
    _no_server_paths(server, tmp_path, failed.body, json.dumps(words).encode(), error.body)


def test_archive_errors_and_startup_model_urls(make_archive, start_server, tmp_path: Path) -> None:
    store = make_archive("probe", "probe:handle", "probe").parent
    (store / "corrupt.mar").write_bytes(b"PK\x03\x04 not really a zip")
    server = start_server(f"probe={store / 'probe.mar'}", config=OPEN)
    corrupt = server.manage("POST", "/models?url=corrupt.mar")
    assert corrupt.status == 400 and corrupt.json()["type"] == "InvalidModelException"
    assert corrupt.json()["message"].startswith(
        "cannot load archive corrupt.mar: cannot read archive <model_store>/corrupt.mar:"
    )
    # the inference port lists a startup model named by its path without the server's folders
    listed = http("GET", server.url("inference", "/models"))
    assert json.loads(listed.body)["models"] == [
        {"modelName": "probe", "modelUrl": "<model_store>/probe.mar", "loadState": "loaded"}
    ]
    _no_server_paths(server, tmp_path, corrupt.body, listed.body)
    # the management port, the operator's, shows it as registered
    managed = server.manage("GET", "/models").json()["models"]
    assert managed == [
        {"modelName": "probe", "modelUrl": str(store / "probe.mar"), "loadState": "loaded"}
    ]
