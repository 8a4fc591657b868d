"""AOTInductor models: ``BaseHandler`` loads a ``.so`` compiled by AOTInductor through
``torch._export.aot_load`` when the model config says ``pt2: {export: {aot_compile: true}}``
(TorchServe's rule and example), and a ``.pt2`` package through
``torch._inductor.aoti_load_package``. A tiny model is compiled for real, once per test session
(about 40 s on 2 cores: AOTInductor writes C++ and builds it with the machine's compiler),
archived both ways, served by a real mserve, and its answers compared with eager PyTorch's.
The ``.so`` is the library the package holds: the one ``aot_compile`` would write, without a
second build. The messages for a ``.so`` without the config key and a ``.pt2`` without a
compiled model are checked in process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from mserve_worker.sdk.base_handler import ModelLoadError
from tests.server import conftest as serving
from tests.server.conftest import concurrently
from tests.styles.test_base_handler import LINEAR, X, load  # noqa: F401  (load: fixture)
from tests.styles.test_builtin_handlers import archive, store  # noqa: F401  (store: fixture)

start_server = serving.start_server
pytestmark = pytest.mark.timeout(300)  # the session's one compile counts in its first test
ROWS = [X, [0.0, 0.0, 0.0, 1.0], [0.25, 4.0, -1.0, 2.0]]
AOT_CONFIG = {"pt2": {"export": {"aot_compile": True}}}

# Run in a child process: the compile loads inductor's C++ toolchain into it, not into pytest.
COMPILE = """
import os, sys, zipfile, torch
folder = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(4, 3).eval()
torch.save(model.state_dict(), os.path.join(folder, "weights.pt"))
batch = torch.export.Dim("batch", min=1, max=16)
exported = torch.export.export(model, (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
package = torch._inductor.aoti_compile_and_package(
    exported, package_path=os.path.join(folder, "linear.pt2"))
with zipfile.ZipFile(package) as z:
    [so] = [n for n in z.namelist() if n.endswith(".so")]
    with open(os.path.join(folder, "linear.so"), "wb") as f:
        f.write(z.read(so))
"""


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with linear.pt2, linear.so and the eager model's weights.pt."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("AOTInductor builds C++ and this machine has no C++ compiler (g++)")
    folder = tmp_path_factory.mktemp("aoti")
    out = subprocess.run(
        ["nice", "-n", "5", sys.executable, "-c", COMPILE, str(folder)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return folder


def eager(folder: Path) -> torch.nn.Module:
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(torch.load(folder / "weights.pt", weights_only=True))
    return model.eval()


@pytest.mark.slow  # a real AOTInductor build with g++ (40-80 s), then two workers importing inductor
def test_aoti_library_and_package_served_as_eager_pytorch_answers(
    start_server,
    store,  # noqa: F811
    tmp_path,
    compiled,
) -> None:
    aot_config = tmp_path / "aot.yaml"
    aot_config.write_text(yaml.safe_dump({**AOT_CONFIG, "batchSize": 3, "maxBatchDelay": 10000,
                                          "batchWait": "fill"}))  # fmt: skip
    batch_config = tmp_path / "batch.yaml"
    batch_config.write_text("batchSize: 3\nmaxBatchDelay: 10000\nbatchWait: fill\n")
    handler = str(LINEAR / "explain_handler.py")
    archive(store, "aot_so", handler, "--serialized-file", str(compiled / "linear.so"),
            "-c", str(aot_config))  # fmt: skip
    archive(store, "aot_pt2", handler, "--serialized-file", str(compiled / "linear.pt2"),
            "-c", str(batch_config))  # fmt: skip
    server = start_server("aot_so=aot_so.mar", "aot_pt2=aot_pt2.mar")
    with torch.no_grad():
        expected = eager(compiled)(torch.tensor(ROWS))
    for name in ("aot_so", "aot_pt2"):
        replies = concurrently(*(
            lambda row=row, name=name: server.predict(name, json.dumps(row),
                                           headers={"Content-Type": "application/json"})
            for row in ROWS
        ))  # fmt: skip
        assert [r.status for r in replies] == [200] * 3, [r.body for r in replies]
        got = torch.tensor([r.json() for r in replies])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "with torch._export.aot_load on cpu" in log
    assert "with torch._inductor.aoti_load_package" in log


def test_a_library_without_the_config_key_names_it(load, tmp_path) -> None:  # noqa: F811
    shutil.copy(LINEAR / "explain_handler.py", tmp_path)
    (tmp_path / "linear.so").write_bytes(b"\x7fELF")  # refused before it is opened
    with pytest.raises(ModelLoadError) as failed:
        load("explain_handler", {"serializedFile": "linear.so"})
    assert str(failed.value) == (
        "linear.so is a shared library, which BaseHandler loads as an AOTInductor model "
        "(torch._export.aot_load) when the model config says pt2: {export: {aot_compile: "
        "true}}, as TorchServe's does; add that to the model config (model-archiver -c), or "
        "override initialize()"
    )


def test_a_package_without_a_compiled_model_is_refused(load, tmp_path) -> None:  # noqa: F811
    shutil.copy(LINEAR / "explain_handler.py", tmp_path)
    with zipfile.ZipFile(tmp_path / "exported.pt2", "w") as package:  # torch.export.save's kind
        package.writestr("exported/models/model.json", "{}")
    with pytest.raises(ModelLoadError) as failed:
        load("explain_handler", {"serializedFile": "exported.pt2"}, model_yaml_config=AOT_CONFIG)
    assert str(failed.value) == (
        "exported.pt2 holds no AOTInductor model (no data/aotinductor/ in the package); "
        "BaseHandler loads .pt2 files written by "
        "torch._inductor.aoti_compile_and_package(torch.export.export(model, ...))"
    )
