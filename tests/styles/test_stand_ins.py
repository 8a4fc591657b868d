"""Kernel files and mlrun model classes run with their own imports (``from redhareapi import
Kernel``, ``from mlrun.serving import V2ModelServer``): archived and served by a real mserve,
with mserve's stand-ins where those packages are missing and the real package where installed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from mserve_worker import stand_ins
from mserve_worker.sdk.kernel import Kernel
from mserve_worker.sdk.v2_model import V2ModelServer
from tests.server import conftest as serving
from tests.server.conftest import wait_until
from tests.wheels import make_wheel

make_archive = serving.make_archive  # the real-server fixtures, for the tests here
start_server = serving.start_server

FOLDER = "foreign_imports"
STAND_IN = str(stand_ins.STAND_IN_DIR)
MLRUN_ONLY = (
    "mserve's stand-in for mlrun provides only mlrun.serving.V2ModelServer and "
    "mlrun.serving.v2_serving.V2ModelServer, so that model files written for mlrun run unedited; "
    "install the real mlrun package in the model's environment (its requirements) for the rest"
)


def test_kernel_and_mlrun_files_run_unedited(make_archive, start_server) -> None:
    make_archive(FOLDER, "echo_kernel", "echo")
    forms = {"double": ("serving_form", 2), "triple": ("module_form", 3),
             "quadruple": ("attribute_form", 4)}  # fmt: skip
    for name, (module, _) in forms.items():
        make_archive(FOLDER, module, name)
    make_archive(FOLDER, "needs_more", "more")
    server = start_server("echo=echo.mar", *(f"{name}={name}.mar" for name in forms))

    reply = server.predict("echo", {"q": [1, 2]})
    assert reply.status == 200, reply.body
    assert reply.json() == {"model": "echo", "echo": {"q": [1, 2]}}
    log = server.run_dir / "logs" / "mserve.log"
    wait_until(lambda: "[kernel] INFO: on_kernel_start echo" in log.read_text(), 10, "the log")
    for name, (_, factor) in forms.items():
        reply = server.predict(name, {"inputs": [1, 2.5]})
        assert reply.status == 200, (name, reply.body)
        assert reply.json()["outputs"] == [factor, 2.5 * factor], name

    # A part of mlrun we do not provide: the load fails, and says what to do.
    failed = server.manage("POST", "/models?url=more.mar&synchronous=true")
    assert failed.status >= 400
    message = failed.json()["message"]
    assert f"ImportError: mlrun.get_dataitem is not available: {MLRUN_ONLY}" in message
    assert "needs_more.py" in message  # the user's line that imported it
    assert "not mserve's stand-in" not in log.read_text()  # nothing real to use instead


def test_installed_mlrun_is_used_and_logged(make_archive, start_server, tmp_path) -> None:
    """A model whose requirements install a package named mlrun (a stand-in that marks itself)
    gets that package, and the worker says why ours was not used."""
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "mlrun", "1.7.0", "INSTALLED_MLRUN = True\n")
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("mlrun==1.7.0\n")
    make_archive(FOLDER, "which_mlrun", "which", "-r", str(reqs), "--wheelhouse", str(wheels))
    make_archive(FOLDER, "which_mlrun", "ours")
    server = start_server("which=which.mar", "ours=ours.mar")

    installed = server.predict("which", {}).json()
    assert installed["installed"] is True
    assert installed["mlrun"].endswith("site-packages/mlrun/__init__.py")
    ours = server.predict("ours", {}).json()
    assert ours == {"mlrun": f"{STAND_IN}/mlrun/__init__.py", "installed": False}
    log = server.run_dir / "logs" / "mserve.log"
    line = (
        f"mlrun is installed ({installed['mlrun']}); handlers importing mlrun get that "
        f"package, not mserve's stand-in, which is used only where mlrun is missing"
    )
    wait_until(lambda: line in log.read_text(), 10, "the installed-mlrun log line")
    assert log.read_text().count("mlrun is installed (") == 1  # only the model that has it


# In process: the stand-ins as a worker imports them (their finder installed).


@pytest.fixture
def standing_in() -> Iterator[None]:
    """The stand-in finder installed, as in a worker; it and its modules are gone after."""
    saved_path, saved_finders = list(sys.path), list(sys.meta_path)
    stand_ins.install()
    yield
    sys.path[:], sys.meta_path[:] = saved_path, saved_finders
    for name in [n for n in sys.modules if n.partition(".")[0] in stand_ins.PROVIDES]:
        del sys.modules[name]


def test_the_provided_names_are_mserves(standing_in) -> None:
    import mlrun
    import redhareapi
    from mlrun.serving import V2ModelServer as FromServing
    from mlrun.serving.v2_serving import V2ModelServer as FromModule

    assert FromServing is FromModule is mlrun.serving.V2ModelServer is V2ModelServer
    assert redhareapi.Kernel is Kernel
    assert stand_ins.real_packages() == []  # nothing installed here: ours are used
    # Probing a name behaves as on any module.
    assert not hasattr(mlrun, "get_dataitem")
    assert getattr(redhareapi, "KernelContext", None) is None
    assert not hasattr(mlrun, "__version__")


@pytest.mark.parametrize(
    ("statement", "error", "missing"),
    [
        ("from mlrun import get_or_create_ctx", ImportError, "mlrun.get_or_create_ctx"),
        ("from mlrun.serving import GraphServer", ImportError, "mlrun.serving.GraphServer"),
        ("from mlrun.serving.v2_serving import Foo", ImportError, "mlrun.serving.v2_serving.Foo"),
        ("from mlrun import frameworks", ImportError, "mlrun.frameworks"),
        ("import mlrun.frameworks.sklearn", ModuleNotFoundError, "mlrun.frameworks"),
        ("import mlrun; mlrun.get_dataitem", AttributeError, "mlrun.get_dataitem"),
    ],
)
def test_what_mlrun_lacks_says_so(standing_in, statement, error, missing) -> None:
    with pytest.raises(error) as caught:
        exec(statement, {})
    assert str(caught.value) == f"{missing} is not available: {MLRUN_ONLY}"


def test_what_redhareapi_lacks_says_so(standing_in) -> None:
    with pytest.raises(ImportError) as caught:
        exec("from redhareapi import KernelContext", {})
    assert str(caught.value) == (
        "redhareapi.KernelContext is not available: mserve's stand-in for redhareapi provides "
        "only redhareapi.Kernel, so that model files written for redhareapi run unedited; "
        "install the real redhareapi package in the model's environment (its requirements) for "
        "the rest"
    )


def test_a_real_package_on_the_path_wins(standing_in, tmp_path) -> None:
    (tmp_path / "redhareapi").mkdir()
    (tmp_path / "redhareapi" / "__init__.py").write_text("class Kernel:\n    REAL = True\n")
    sys.path.insert(0, str(tmp_path))
    import redhareapi

    assert redhareapi.Kernel.REAL
    assert stand_ins.real_packages() == [
        ("redhareapi", str(tmp_path / "redhareapi" / "__init__.py"))
    ]
