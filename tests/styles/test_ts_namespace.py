"""Handlers written for TorchServe run unedited: module-level ``ts.*`` imports resolve to mserve's
namespace. Archives are made by the real torch-model-archiver 0.12 and served by a real mserve;
expected answers are computed here from the same seeded models.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.compat_tools import CompatTool
from tests.server import conftest as serving
from tests.server.conftest import concurrently, wait_until
from tests.styles.test_builtin_handlers import (
    CNN,
    HANDLERS,
    LINEAR,
    assert_ranking,
    cnn_names,
    imagenet_tensor,
    model_class,
    noise_png,
    post_image,
    seeded,
    store,  # noqa: F401  (fixture)
    topk,
)
from tests.wheels import make_wheel

start_server = serving.start_server  # the fixtures, for the tests here
make_archive = serving.make_archive

TS_STYLE = HANDLERS / "ts_style"
OUR_TS = str(Path("mserve_worker", "compat", "ts", "__init__.py"))


def tma_archive(tma: CompatTool, folder: Path, name: str, handler: Path, *flags: str) -> None:
    made = tma.run("--model-name", name, "--version", "1.0", "--handler", str(handler),
                   "--export-path", str(folder), "-f", *flags, cwd=folder)  # fmt: skip
    assert made.returncode == 0, made.stderr


def test_torchserve_handlers_run_unedited(start_server, tma, store, tmp_path) -> None:  # noqa: F811
    linear = seeded(model_class(LINEAR, "Linear4"))
    torch.save(linear.state_dict(), tmp_path / "linear.pt")
    cnn = seeded(model_class(CNN, "TinyCNN"))
    torch.save(cnn.state_dict(), tmp_path / "cnn.pt")
    (tmp_path / "profile.yaml").write_text("handler:\n  profile: true\n")
    (tmp_path / "pairs.yaml").write_text("batchSize: 2\nmaxBatchDelay: 20000\n")
    linear_files = ["--serialized-file", str(tmp_path / "linear.pt"), "--model-file",
                    str(LINEAR / "model.py"), "--extra-files", str(TS_STYLE / "index_to_name.json")]  # fmt: skip
    tma_archive(tma, store, "linear", TS_STYLE / "ts_base.py", *linear_files,
                "-c", str(tmp_path / "profile.yaml"))  # fmt: skip
    tma_archive(tma, store, "pairs", TS_STYLE / "ts_base.py", *linear_files,
                "-c", str(tmp_path / "pairs.yaml"))  # fmt: skip
    tma_archive(tma, store, "top3", TS_STYLE / "ts_classifier.py", "--serialized-file",
                str(tmp_path / "cnn.pt"), "--model-file", str(CNN / "model.py"),
                "--extra-files", str(CNN / "index_to_name.json"))  # fmt: skip
    server = start_server("linear=linear.mar", "pairs=pairs.mar", "top3=top3.mar")

    x = [1.0, -2.0, 0.5, 3.0]
    reply = server.predict("linear", {"x": x})
    assert reply.status == 200, reply.body
    with torch.no_grad():
        probs = torch.softmax(linear(torch.tensor([x])), dim=1)[0].tolist()
    answer = reply.json()
    assert answer.pop("labels") == dict(zip(["low", "mid", "high"], probs, strict=True))
    assert answer.pop("ts").endswith(OUR_TS)
    assert answer == {"context": True, "profile": True, "device": "cpu", "batch": 1}

    # PredictionException(message, code): that status and TorchServe's error body.
    failed = server.predict("linear", {"fail": "x must hold 4 numbers", "code": 422})
    assert failed.status == 422
    assert failed.json() == {"code": 422, "type": "InternalServerException",
                             "message": "x must hold 4 numbers"}  # fmt: skip
    odd = server.predict("linear", {"fail": "odd", "code": 999})
    assert odd.status == 500
    assert odd.json()["message"] == "odd (PredictionException code 999 is not an HTTP status)"
    # As in TorchServe, the exception answers every request of its batch (batches of 2 here).
    ok, bad = concurrently(lambda: server.predict("pairs", {"x": x}),
                           lambda: server.predict("pairs", {"fail": "no GPU left", "code": 507}))  # fmt: skip
    for reply in (ok, bad):
        assert (reply.status, reply.json()["message"]) == (507, "no GPU left")
    assert server.predict("linear", {"x": x}).status == 200  # the worker serves on

    png = noise_png(3)
    assert_ranking(post_image(server, "top3", png),
                   topk(cnn, imagenet_tensor(png), cnn_names(), k=3))  # fmt: skip


def test_installed_torchserve_is_shadowed_and_logged(make_archive, start_server, tmp_path) -> None:
    """A model whose requirements install a package named torchserve (a stand-in whose ``ts``
    marks itself) still gets mserve's ``ts``, and the worker logs the version it shadows."""
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "torchserve", "0.12.0", "INSTALLED_TORCHSERVE = True\n", package="ts")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("torchserve==0.12.0\n")
    make_archive("ts_style", "ts_installed:Which", "which", "-r", str(reqs),
                 "--wheelhouse", str(wheels))  # fmt: skip
    server = start_server("which=which.mar")

    reply = server.predict("which", {})
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["ts"].endswith(OUR_TS) and answer["installed_ts"] is False
    log = server.run_dir / "logs" / "mserve.log"
    line = "torchserve 0.12.0 is installed in this environment; handlers importing ts.* get " \
           "mserve's ts"  # fmt: skip
    wait_until(lambda: line in log.read_text(), 10, "the shadowed-torchserve log line")
    described = server.manage("GET", "/models/which").json()[0]
    assert json.dumps(described).count("environment") >= 1  # it ran in its own environment
