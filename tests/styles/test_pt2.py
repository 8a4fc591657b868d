"""The model config's ``pt2`` section: ``BaseHandler`` serves the model through ``torch.compile``
in each of TorchServe's forms (TorchServe's test_torch_compile.py cases, with the CPU-quick
``eager``/``aot_eager`` backends where the model is called), falls back with a log line, and
refuses a value of no known form. In process, then once through a real mserve."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml

from mserve_worker.sdk.base_handler import ModelLoadError
from tests.server import conftest as serving
from tests.styles.test_base_handler import (  # noqa: F401  (load: fixture)
    EAGER,
    LINEAR,
    X,
    linear_model_dir,
    load,
    start,
)
from tests.styles.test_builtin_handlers import archive, store  # noqa: F401  (store: fixture)

start_server = serving.start_server
PT2_LOG = "mserve_worker.sdk.pt2"


def _compiled(model: object) -> bool:
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.parametrize(
    ("pt2", "backend"),
    [
        ({"compile": {"enable": True, "backend": "aot_eager"}}, "aot_eager"),
        (
            {
                "compile": {
                    "enable": True,
                    "backend": "eager",
                    "options": {"guard_nn_modules": True},
                }
            },
            "eager",
        ),
        ("eager", "eager"),  # the older forms: the backend alone, torch.compile's kwargs
        ({"backend": "eager", "fullgraph": True}, "eager"),
    ],
)
def test_the_served_model_is_compiled(load, tmp_path, caplog, pt2, backend) -> None:  # noqa: F811
    model = linear_model_dir(tmp_path)
    with caplog.at_level(logging.INFO, logger=PT2_LOG):
        handler, ctx = load("explain_handler", EAGER, model_yaml_config={"pt2": pt2})
    served = handler.instance.model
    assert _compiled(served)
    assert served._orig_mod.fc.weight.equal(model.weight)
    assert f"Compiled model with backend {backend}" in caplog.text
    start(ctx, 2)
    out = handler.handle([{"body": X}, {"body": [0, 0, 0, 1]}], ctx)
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(out), model(torch.tensor([X, [0, 0, 0, 1.0]])))


@pytest.mark.parametrize(
    ("pt2", "compiled"),
    [
        ({"compile": {"enable": True}}, True),  # torch.compile's default backend (not called)
        ({"compile": {"enable": False, "backend": "inductor", "mode": "reduce-overhead"}}, False),
        ({"compile": {"backend": "eager"}}, False),  # no enable: true
        ({"export": {"aot_compile": False}}, False),
    ],
)
def test_enable_and_export(load, tmp_path, pt2, compiled) -> None:  # noqa: F811
    linear_model_dir(tmp_path)
    handler, _ = load("explain_handler", EAGER, model_yaml_config={"pt2": pt2})
    assert _compiled(handler.instance.model) is compiled


@pytest.mark.parametrize(
    ("pt2", "said"),
    [
        ({"compile": {"enable": True, "backend": "warp_drive"}},
         "pt2 backend 'warp_drive' is neither one TorchServe accepts (eager, aot_eager, inductor,"),
        ({"compile": {"enable": True, "backend": "eager", "mode": "default", "options": {}}},
         "Compiling model with backend eager, mode default, options {} has failed (RuntimeError: "
         "Either mode or options can be specified, but both can't be specified at the same "
         "time.); proceeding without compilation"),
    ],
)  # fmt: skip
def test_what_cannot_compile_is_served_as_is(load, tmp_path, caplog, pt2, said) -> None:  # noqa: F811
    model = linear_model_dir(tmp_path)
    with caplog.at_level(logging.WARNING, logger=PT2_LOG):
        handler, ctx = load("explain_handler", EAGER, model_yaml_config={"pt2": pt2})
    assert not _compiled(handler.instance.model)
    assert said in caplog.text
    start(ctx, 1)
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(handler.handle([{"body": X}], ctx)),
                                   model(torch.tensor([X])))  # fmt: skip


@pytest.mark.parametrize(
    ("pt2", "message"),
    [
        (["eager"], "the model config's pt2 must be a backend name or a mapping (pt2: {compile: "
                    "{enable: true, backend: inductor}}), found list ['eager']"),
        ({"compile": "eager"}, "the model config's pt2.compile must be a mapping ({enable: true, "
                               "backend: inductor}), found str 'eager'"),
    ],
)  # fmt: skip
def test_a_pt2_of_no_known_form_fails_the_load(load, tmp_path, pt2, message) -> None:  # noqa: F811
    linear_model_dir(tmp_path)
    with pytest.raises(ModelLoadError) as failed:
        load("explain_handler", EAGER, model_yaml_config={"pt2": pt2})
    assert str(failed.value) == message


def test_compiled_model_served_by_mserve(start_server, store, tmp_path) -> None:  # noqa: F811
    model = linear_model_dir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"pt2": {"compile": {"enable": True, "backend": "eager"}}}))
    archive(store, "compiled", str(LINEAR / "explain_handler.py"), "--serialized-file",
            str(tmp_path / "linear.pt"), "--model-file", str(LINEAR / "model.py"),
            "-c", str(config))  # fmt: skip
    server = start_server("compiled=compiled.mar")
    reply = server.predict("compiled", json.dumps(X), headers={"Content-Type": "application/json"})
    assert reply.status == 200, reply.body
    with torch.no_grad():
        assert reply.json() == pytest.approx(model(torch.tensor(X)).tolist())
    assert (
        "Compiled model with backend eager" in (server.run_dir / "logs" / "mserve.log").read_text()
    )
