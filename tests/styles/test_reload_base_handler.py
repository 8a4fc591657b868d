"""BaseHandler's model kept across hot reloads (docs/hot-reload.md): a reload loads the handler
again, in process here as a worker's reload does (mserve_worker/reload.py), and finds the model
it loaded in the keep store, unless what the model depends on changed (the weights file, the
code of an overridden ``_load*`` method)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mserve_worker.loader import load_handler
from mserve_worker.sdk import keep
from tests.handlers.base_linear.model import Linear4
from tests.styles.test_base_handler import LINEAR, make_context

HANDLER = (
    "from mserve_worker.sdk.base_handler import BaseHandler\n\n\nclass H(BaseHandler):\n{body}"
)


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """A BaseHandler model folder, first on sys.path; a fresh keep store, forgotten after."""
    shutil.copy(LINEAR / "model.py", tmp_path / "model.py")
    torch.manual_seed(0)
    torch.save(Linear4().state_dict(), tmp_path / "model.pt")
    saved_path, before = list(sys.path), set(sys.modules)
    sys.path.insert(0, str(tmp_path))
    keep.STORE.__init__()  # type: ignore[misc]
    yield tmp_path
    keep.STORE.__init__()  # type: ignore[misc]
    sys.path[:] = saved_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def load(folder: Path, body: str = "    pass\n") -> object:
    """Write the handler module and load it as a (re)load does: a fresh module, a new handler."""
    (folder / "handler.py").write_text(HANDLER.format(body=body))
    sys.modules.pop("handler", None)
    sys.modules.pop("model", None)
    manifest = {"serializedFile": "model.pt", "modelFile": "model.py"}
    return load_handler("handler:H", str(folder), make_context(folder, manifest)).instance


def reload(folder: Path, body: str = "    pass\n") -> object:
    """A hot reload's load: what it asks the keep store for is the new code's; committed."""
    keep.STORE.begin()
    try:
        instance = load(folder, body)
    finally:
        keep.STORE.commit(keep.STORE.end())
    return instance


def test_a_reload_keeps_the_model_object(folder: Path) -> None:
    first = load(folder)
    second = reload(folder, "    def postprocess(self, data):\n        return ['changed']\n")
    assert second.model is first.model  # type: ignore[attr-defined]
    assert type(second) is not type(first)  # new code
    assert len(keep.STORE) == 1


def test_new_weights_or_a_changed_loader_load_the_model_again(folder: Path) -> None:
    first = load(folder)
    os.utime(folder / "model.pt", ns=(1, 1))  # the weights file was rewritten
    second = reload(folder)
    assert second.model is not first.model  # type: ignore[attr-defined]
    loader = (
        "    def _load_pickled_model(self, model_dir, model_file, model_pt_path):\n"
        "        return super()._load_pickled_model(model_dir, model_file, model_pt_path)\n"
    )
    third = reload(folder, loader)
    assert third.model is not second.model  # type: ignore[attr-defined]
    fourth = reload(folder, "\n\n" + loader)  # the same code two lines lower: kept
    assert fourth.model is third.model  # type: ignore[attr-defined]
    assert len(keep.STORE) == 1  # what the last code did not ask for was released
