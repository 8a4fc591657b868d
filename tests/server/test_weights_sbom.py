"""GET /models/{name}/{version}/sbom: the CycloneDX SBOM of a model's environment
(server/weights/sbom.py), from a real per-model environment built by uv from a hand-made wheel,
and of the server's own environment for a model without requirements."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from archiver.cli import main as archiver_main
from tests.server.conftest import HANDLERS, Server, pid_alive, server_settings, start_daemon
from tests.wheels import make_wheel

pytestmark = pytest.mark.timeout(240)
PKG = "mservesbompkg"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("sbom")
    store = root / "store"
    store.mkdir()
    wheels = root / "wheels"
    make_wheel(wheels, PKG, "1.2.3", "VERSION = '1.2.3'\n")
    reqs = root / "requirements.txt"
    reqs.write_text(f"{PKG}==1.2.3\n")
    for name, handler, extra in (
        ("ownenv", "echo", ["-r", str(reqs), "--wheelhouse", str(wheels)]),
        ("plain", "echo", []),
    ):
        out = CliRunner().invoke(archiver_main, [
            "--model-name", name, "--handler", handler, "--model-path", str(HANDLERS / "echo_fn"),
            "--export-path", str(store), "-f", *extra,
        ], catch_exceptions=False)  # fmt: skip
        assert out.exit_code == 0, out.output
    served = start_daemon(
        root / "mserve.yaml",
        root / "run",
        server_settings(store),
        ("--models", "ownenv=ownenv.mar", "plain=plain.mar"),
        timeout_s=200,
    )
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def components(reply) -> dict[str, str]:
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"] == "application/vnd.cyclonedx+json"
    bom = reply.json()
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"].startswith("1.")
    return {c["name"].lower(): c.get("version", "") for c in bom["components"]}


def test_a_model_environment_sbom_lists_what_its_requirements_installed(server) -> None:
    described = server.manage("GET", "/models/ownenv").json()[0]
    assert described["environment"]  # a per-model environment was built
    env = server.run_dir / "envs" / described["environment"]
    assert (env / "sbom.cdx.json").is_file()  # recorded at the build, beside it
    listed = components(server.manage("GET", "/models/ownenv/1.0/sbom"))
    assert listed[PKG] == "1.2.3"
    # a default environment sees the server's packages behind its own: they are listed too
    assert "pyyaml" in listed
    # missing (say, the generator was installed after the build): made on request, confined
    # as the build was (the generator starts the environment's interpreter)
    (env / "sbom.cdx.json").unlink()
    assert components(server.manage("GET", "/models/ownenv/1.0/sbom")) == listed
    assert (env / "sbom.cdx.json").is_file()


def test_the_server_environment_sbom_is_made_once(server) -> None:
    listed = components(server.manage("GET", "/models/plain/1.0/sbom"))
    assert PKG not in listed and "pyyaml" in listed
    made = sorted((server.run_dir / "sbom").glob("default-*.json"))
    assert len(made) == 1
    before = made[0].stat().st_mtime_ns
    assert components(server.manage("GET", "/models/plain/1.0/sbom")) == listed
    assert made[0].stat().st_mtime_ns == before  # kept, not made again


def test_an_unknown_model_has_no_sbom(server) -> None:
    reply = server.manage("GET", "/models/nosuch/1.0/sbom")
    assert reply.status == 404
    assert reply.json()["message"] == "Model not found: nosuch"
