"""How archives map onto Serve deployments, read from real archives without a cluster (the
deployed behaviour is tests/ray/test_ray_serve.py's)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from server.errors import BadRequest, InvalidModel, MserveError
from server.rayserve.cli import ray_cli
from server.rayserve.plan import Overrides, plan_models, scaled_options
from server.rundir import StartupModel
from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import HANDLERS
from tests.wheels import make_wheel


def _archive(tmp_path: Path, name: str, config: dict | None = None, *extra: str) -> Path:
    args = [ARCHIVER_SCRIPT, "--model-name", name, "--handler", "echo:handle",
            "--model-path", str(HANDLERS / "echo_fn"), "--export-path", str(tmp_path), "-f"]  # fmt: skip
    if config is not None:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        args += ["--config-file", str(tmp_path / f"{name}.yaml")]
    out = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tmp_path / f"{name}.mar"


def _plan(tmp_path: Path, archive: Path, overrides: Overrides | None = None):
    (plan,) = plan_models([StartupModel(None, str(archive))], tmp_path / "cache", overrides)
    return plan


def test_settings_become_batching_replicas_and_queue_bounds(tmp_path: Path) -> None:
    config = {"batchSize": 8, "maxBatchDelay": 50, "minWorkers": 2, "maxWorkers": 2,
              "jobQueueSize": 30, "responseTimeout": 7}  # fmt: skip
    plan = _plan(tmp_path, _archive(tmp_path, "fixed", config))
    options = plan.deployment_options()
    assert options["name"] == "fixed.1.0"
    assert (options["num_replicas"], options["autoscaling_config"]) == (2, None)
    assert options["max_queued_requests"] == 30
    assert options["max_ongoing_requests"] == 16  # two batches: one running, one gathering
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    replica = plan.replica
    assert (replica["batch_size"], replica["max_batch_delay_ms"]) == (8, 50)
    assert replica["response_timeout_s"] == 7
    assert replica["handler"] == "echo:handle" and replica["sha256"]
    assert Path(replica["cache_dir"], replica["sha256"]).is_dir()  # unpacked once, here


def test_a_worker_range_becomes_serve_autoscaling(tmp_path: Path) -> None:
    plan = _plan(tmp_path, _archive(tmp_path, "auto", {"minWorkers": 0, "maxWorkers": 3}))
    options = plan.deployment_options()
    assert options["num_replicas"] is None
    assert options["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 3,
                                             "initial_replicas": 1, "target_ongoing_requests": 2}  # fmt: skip
    scaled = scaled_options(options, 2, None, batch_size=1)
    assert (scaled["num_replicas"], scaled["autoscaling_config"]) == (2, None)
    with pytest.raises(BadRequest, match="must be 0 or more"):
        scaled_options(options, -1, None, batch_size=1)


def test_gpu_pinning_asks_ray_for_a_gpu_per_replica(tmp_path: Path) -> None:
    # no GPU here: only that Ray is asked for one (Ray picks it and sets CUDA_VISIBLE_DEVICES)
    plan = _plan(tmp_path, _archive(tmp_path, "gpu", {"deviceType": "gpu", "deviceIds": [2]}))
    assert plan.deployment_options()["ray_actor_options"]["num_gpus"] == 1.0
    assert plan.replica["use_gpu"] is True
    assert plan.notes == ("deviceIds [2] not honoured: Ray assigns each replica its GPU",)
    half = _plan(tmp_path, tmp_path / "gpu.mar", Overrides(gpus_per_replica=0.5))
    assert half.num_gpus == 0.5
    with pytest.raises(InvalidModel, match="deviceType cpu and deviceIds"):
        _plan(tmp_path, _archive(tmp_path, "bad", {"deviceType": "cpu", "deviceIds": [0]}))


def test_requirements_become_an_offline_runtime_env(tmp_path: Path) -> None:
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# comment\nmservetestpkg==1.0  # pinned\n\n")
    wheels = make_wheel(tmp_path / "wheels", "mservetestpkg", "1.0", "").parent
    archive = _archive(tmp_path, "req", {"isolatedEnv": True}, "-r", str(reqs),
                       "--wheelhouse", str(wheels))  # fmt: skip
    plan = _plan(tmp_path, archive, Overrides(env_builder="ray"))
    assert plan.replica["env"] is None
    env = plan.runtime_env
    assert env is not None and list(env) == ["uv"]
    assert env["uv"]["packages"] == ["mservetestpkg==1.0"]
    options = env["uv"]["uv_pip_install_options"]
    wheelhouse = Path(options[options.index("--find-links") + 1])
    assert "--no-index" in options and (wheelhouse / "mservetestpkg-1.0-py3-none-any.whl").is_file()
    constraints = Path(options[options.index("-c") + 1]).read_text()
    assert "torch==" in constraints  # a model pin cannot replace the base's torch
    assert "isolatedEnv not honoured" in plan.notes[0]
    pip = _plan(tmp_path, archive, Overrides(use_uv=False, env_builder="ray")).runtime_env
    assert pip is not None and pip["pip"]["pip_install_options"] == options
    assert _plan(tmp_path, _archive(tmp_path, "plain")).runtime_env is None


def test_by_default_replicas_build_the_environment_with_mserve(tmp_path: Path) -> None:
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("mservetestpkg==1.0\n")
    wheels = make_wheel(tmp_path / "wheels", "mservetestpkg", "1.0", "").parent
    archive = _archive(tmp_path, "req", None, "-r", str(reqs), "--wheelhouse", str(wheels))
    plan = _plan(tmp_path, archive)
    assert plan.runtime_env is None  # no clone of the Ray worker's virtualenv per environment
    env = plan.replica["env"]
    assert env["requirements"] == "mservetestpkg==1.0\n"
    assert (Path(plan.replica["cache_dir"], plan.replica["sha256"], env["wheelhouse"])
            / "mservetestpkg-1.0-py3-none-any.whl").is_file()  # fmt: skip
    with pytest.raises(BadRequest, match="--env-builder 'conda': say mserve or ray"):
        _plan(tmp_path, archive, Overrides(env_builder="conda"))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/m.mar", "give a path that every Ray node can read"),
        ("/nowhere/m.mar", "archive not found: /nowhere/m.mar"),
    ],
)
def test_archives_that_cannot_be_deployed(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(MserveError, match=message):
        plan_models([StartupModel("m", url)], tmp_path / "cache")


def test_cli_dry_run_and_errors(tmp_path: Path) -> None:
    archive = _archive(tmp_path, "echo", {"batchSize": 2})
    runner = CliRunner()
    dry = runner.invoke(ray_cli, ["deploy", "--models", f"e={archive}", "--dry-run",
                                  "--cache-dir", str(tmp_path / "c")])  # fmt: skip
    assert dry.exit_code == 0, dry.output
    (entry,) = json.loads(dry.output)
    assert (entry["name"], entry["settings"]["batchSize"]) == ("e", 2)
    twice = runner.invoke(ray_cli, ["deploy", "--models", f"e={archive},e={archive}",
                                    "--dry-run", "--cache-dir", str(tmp_path / "c")])  # fmt: skip
    assert twice.exit_code == 1
    assert f"model e:1.0 is given twice ({archive})" in twice.output
    bad = runner.invoke(ray_cli, ["deploy", "--models", "e=b@d.mar", "--dry-run"])
    assert bad.exit_code == 1 and "archive not found: b@d.mar" in bad.output


def test_builder_for_serve_run_and_config_files(tmp_path: Path, monkeypatch) -> None:
    from server.rayserve.app import app

    archive = _archive(tmp_path, "echo")
    monkeypatch.setenv("MSERVE_RAY_MODELS", f"echo={archive}")
    monkeypatch.setenv("MSERVE_RAY_CACHE_DIR", str(tmp_path / "cache"))
    application = app({"cpus_per_replica": "0.5"})
    ingress = application._bound_deployment
    assert ingress.name == "ingress"
    _routes, models = ingress.init_args
    assert list(models["echo"]["versions"]) == ["1.0"]
    assert models["echo"]["versions"]["1.0"]["options"]["ray_actor_options"]["num_cpus"] == 0.5
    with pytest.raises(BadRequest, match="no models to deploy"):
        monkeypatch.delenv("MSERVE_RAY_MODELS")
        app({})
