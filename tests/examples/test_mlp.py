"""examples/mlp: the README's own example answers a client's mistake (no ``data``, a wrong
length, not JSON) with 400 and TorchServe's BadInput body naming it, and serves the rest of the
batch; run in process on the worker's real Context, with the example's seed-0 weights."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mserve_worker.context import Context
from mserve_worker.loader import load_handler
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "mlp"


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("mlp")
    for name in ("model.py", "handler.py"):
        (folder / name).write_bytes((EXAMPLE / name).read_bytes())
    subprocess.run(
        [sys.executable, str(EXAMPLE / "make_weights.py"), str(folder / "mlp.pt")], check=True
    )
    context = Context(
        model_name="mlp", model_dir=str(folder),
        manifest={"model": {"modelName": "mlp", "serializedFile": "mlp.pt",
                            "modelFile": "model.py", "handler": "handler.py"}},
        batch_size=4, gpu_id=None, server_name="mserve", server_version="test",
    )  # fmt: skip
    sys.path.insert(0, str(folder))  # as in a worker: the model's folder comes first
    try:
        yield load_handler("handler:handle", str(folder), context), context
    finally:
        sys.path.remove(str(folder))
        for name in ("handler", "model"):  # the next test's handler and model are others
            sys.modules.pop(name, None)


def test_a_clients_mistake_is_a_400_naming_it_and_the_batch_goes_on(handler) -> None:
    loaded, context = handler
    good = json.dumps({"data": [0.01 * i for i in range(256)]}).encode()
    bodies = [good, b'{"dat": [1, 2]}', json.dumps({"data": [1.0, 2.0]}).encode(), b"{oops"]
    context.start_batch([SimpleNamespace(request_id=f"r{i}", headers=[]) for i in range(4)])
    out = loaded.handle([{"body": b} for b in bodies], context)
    assert len(out[0]) == 10 and all(isinstance(v, float) for v in out[0])
    assert out[1] == {
        "code": 400, "type": "BadInput",
        "message": 'expected {"data": [256 numbers]}, found no list under "data"',
    }  # fmt: skip
    assert out[2]["message"] == "expected 256 numbers in 'data', got 2"
    assert out[3]["message"] == 'expected a JSON body {"data": [256 numbers]}'
    assert [context.get_response_status(i)[0] for i in range(4)] == [200, 400, 400, 400]
