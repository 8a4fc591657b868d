"""BaseHandler's weights without pickle's code (mserve_worker/sdk/safe_weights.py), in process:
weights_only by default and its opt-out, safetensors files, and what a model's author reads
when the safetensors library is missing. End to end: tests/server/test_weights_scan.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mserve_worker.sdk.base_handler import ModelLoadError
from tests.styles import test_base_handler as base
from tests.styles.test_base_handler import EAGER, X, linear_model_dir

load = base.load  # the fixture, for the tests here

CHECKPOINT = "class Checkpoint(dict):\n    '''A state dict in a class of its own.'''\n"


def scores(handler, context) -> list:
    return handler.handle([{"body": X}], context)[0]


def test_a_checkpoint_of_its_own_class_needs_the_opt_out(load, tmp_path: Path) -> None:
    model = linear_model_dir(tmp_path)
    (tmp_path / "ckpt.py").write_text(CHECKPOINT)
    sys.path.insert(0, str(tmp_path))
    import ckpt  # pickled by reference: weights_only refuses the global ckpt.Checkpoint

    state = {f"fc.{k}": v for k, v in model.state_dict().items()}
    torch.save(ckpt.Checkpoint(state), tmp_path / "linear.pt")
    with pytest.raises(ModelLoadError, match="model config weightsOnly must be true or false"):
        load("explain_handler", EAGER, model_yaml_config={"weightsOnly": "no"})
    with pytest.raises(ModelLoadError, match="or set weightsOnly: false in the model config"):
        load("explain_handler", EAGER)
    handler, context = load("explain_handler", EAGER, model_yaml_config={"weightsOnly": False})
    expected = model(torch.tensor([X])).tolist()[0]
    assert scores(handler, context) == pytest.approx(expected)


def test_safetensors_loads_and_without_the_library_says_what_to_add(
    load, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = linear_model_dir(tmp_path)
    state = {f"fc.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, tmp_path / "linear.safetensors")
    manifest = {"serializedFile": "linear.safetensors", "modelFile": "model.py"}
    with monkeypatch.context() as patched:  # as in an environment without the library
        patched.setitem(sys.modules, "safetensors", None)
        patched.setitem(sys.modules, "safetensors.torch", None)
        with pytest.raises(ModelLoadError) as info:
            load("explain_handler", manifest)
    assert "linear.safetensors is a safetensors file, which loads with the safetensors" in str(
        info.value
    )
    assert "add safetensors to the archive's requirements file" in str(info.value)

    handler, context = load("explain_handler", manifest)
    assert scores(handler, context) == pytest.approx(model(torch.tensor([X])).tolist()[0])


def test_safetensors_without_a_model_file_says_what_it_needs(load, tmp_path: Path) -> None:
    linear_model_dir(tmp_path)
    save_file({"w": torch.zeros(2)}, tmp_path / "w.safetensors")
    with pytest.raises(ModelLoadError, match=r"w\.safetensors holds tensors only, not a model"):
        load("explain_handler", {"serializedFile": "w.safetensors"})
