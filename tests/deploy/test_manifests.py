"""The Helm chart, rendered by real helm for each combination of values that changes what it
writes, validated offline: core objects against Kubernetes' own schemas (kubernetes-validate,
strict, at the chart's oldest and the newest Kubernetes it knows), custom resources against
tests/deploy/crd_schemas.py; and every name the manifests and the Dockerfile hand to mserve (flags,
config keys, MSERVE_* variables, ports, probe paths, mount paths) checked against our CLI and
config, so a manifest naming a flag or key we removed fails here. No cluster exists on this
machine: nothing is applied."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from archiver import __version__
from server.cli import serve_main as mserve_cli
from server.config import ServerConfig, load_config, parse_address
from server.ts_config import load_ts_config
from tests.deploy.crd_schemas import SCHEMAS
from tests.deploy.k8s_tools import helm_path
from tests.deploy.manifests import (
    CHART,
    DOCKERFILE,
    REPO,
    Dockerfile,
    HelmFailed,
    of_kind,
    render,
    server_command,
)

K8S_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
KEYS = ["--set", "auth.keys.inference=inference-key-0123456789",
        "--set", "auth.keys.management=management-key-0123456789"]  # fmt: skip

# name -> (helm arguments, the kinds it must render)
COMBINATIONS: dict[str, tuple[list[str], set[str]]] = {
    "defaults": ([], {"ConfigMap", "Deployment", "Service"}),
    "keys, autoscaling, monitors": (
        [*KEYS, "--set", "autoscaling.enabled=true", "--set", "autoscaling.cpuUtilization=70",
         "--set", "metrics.serviceMonitor.enabled=true",
         "--set", "metrics.podMonitor.enabled=true", "--set", "auth.keys.api=api-key-0123456789"],
        {"ConfigMap", "Deployment", "Service", "Secret", "HorizontalPodAutoscaler",
         "ServiceMonitor", "PodMonitor"},
    ),
    "gpu, existing secret, volume, management exposed": (
        ["--set", "gpu.count=2", "--set", "auth.existingSecret=team-keys",
         "--set", "exposeManagement=true", "--set", "enableModelApi=true",
         "--set-json", 'modelStore.volume={"persistentVolumeClaim":{"claimName":"models"}}',
         "--set-json", 'config={"job_queue_size":500,"batch_size":4}',
         "--set-json", 'models=["mlp=mlp.mar","echo=echo.mar"]',
         "--set", "replicaCount=3", "--set-json", 'nodeSelector={"gpu":"a100"}'],
        {"ConfigMap", "Deployment", "Service"},
    ),
    "token auth off": (
        ["--set", "auth.enabled=false", "--set", "service.type=LoadBalancer"],
        {"ConfigMap", "Deployment", "Service"},
    ),
    "kserve runtime alone": (
        ["--set", "deployment.enabled=false", "--set", "kserve.enabled=true"],
        {"ServingRuntime"},
    ),
    "kserve cluster runtime, gpu": (
        ["--set", "deployment.enabled=false", "--set", "kserve.enabled=true",
         "--set", "kserve.cluster=true", "--set", "gpu.count=1"],
        {"ClusterServingRuntime"},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(*args) for name, (args, _kinds) in COMBINATIONS.items()}


def _validate(doc: dict[str, Any]) -> None:
    schema = SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        return
    jsonschema.Draft202012Validator(schema).validate(doc)
    for container in doc["spec"].get("containers", ()):  # core Containers, by the real schema
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime"},
               "spec": {"containers": [container]}}  # fmt: skip
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.parametrize("name", COMBINATIONS)
def test_every_manifest_validates(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    docs = rendered[name]
    assert {d["kind"] for d in docs} == COMBINATIONS[name][1]
    for doc in docs:
        _validate(doc)


def test_the_validators_catch_mistakes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The checks above can fail: a misspelt field in a core object and in each custom one."""
    deployment = of_kind(rendered["defaults"], "Deployment")[0]
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    for name, kind in (("keys, autoscaling, monitors", "ServiceMonitor"),
                       ("kserve runtime alone", "ServingRuntime")):  # fmt: skip
        doc = yaml.safe_load(yaml.safe_dump(of_kind(rendered[name], kind)[0]))
        doc["spec"]["endpoint" if kind == "ServiceMonitor" else "protocolVersion"] = []
        with pytest.raises(jsonschema.ValidationError):
            _validate(doc)
    runtime = yaml.safe_load(yaml.safe_dump(of_kind(rendered["kserve runtime alone"],
                                                    "ServingRuntime")[0]))  # fmt: skip
    runtime["spec"]["protocolVersions"].append("v3")
    with pytest.raises(jsonschema.ValidationError):
        _validate(runtime)


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
    return spec["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", ())}


def _server_config(doc: dict[str, Any], tmp_path: Path) -> ServerConfig:
    """The config mserve builds from a rendered ConfigMap's file and the container's env."""
    env = _env(_container(doc))
    config_file = None
    if env.get("MSERVE_CONFIG"):
        config_file = tmp_path / "mserve.yaml"
        config_file.write_text(doc["_config_text"])
    return load_config(config_file, {}, environ=env)


@pytest.mark.parametrize("name", COMBINATIONS)
def test_config_keys_and_env_exist(
    rendered: dict[str, list[dict[str, Any]]], name: str, tmp_path: Path
) -> None:
    """Every key of the generated mserve.yaml and every MSERVE_* variable is one mserve knows,
    with a value it accepts (load_config refuses unknown keys, naming them)."""
    docs = rendered[name]
    for doc in [*of_kind(docs, "Deployment"), *of_kind(docs, "ServingRuntime"),
                *of_kind(docs, "ClusterServingRuntime")]:  # fmt: skip
        if doc["kind"] == "Deployment":
            doc = {**doc, "_config_text": of_kind(docs, "ConfigMap")[0]["data"]["mserve.yaml"]}
        config = _server_config(doc, tmp_path)
        assert config.grpc


@pytest.mark.parametrize("name", [n for n in COMBINATIONS if "Deployment" in COMBINATIONS[n][1]])
def test_deployment_wiring(
    rendered: dict[str, list[dict[str, Any]]], name: str, tmp_path: Path
) -> None:
    """Ports, probes, mounts and the stop deadline agree with the config mserve will run."""
    docs = rendered[name]
    deployment = of_kind(docs, "Deployment")[0]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    text = of_kind(docs, "ConfigMap")[0]["data"]["mserve.yaml"]
    config = _server_config({**deployment, "_config_text": text}, tmp_path)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert parse_address(config.inference_address, "") == ("0.0.0.0", ports["http"])
    assert parse_address(config.metrics_address, "") == ("0.0.0.0", ports["metrics"])
    assert parse_address(config.grpc_inference_address, "") == ("0.0.0.0", ports["grpc"])
    if "management" in ports:
        assert parse_address(config.management_address, "") == ("0.0.0.0", ports["management"])
    else:
        assert parse_address(config.management_address, "")[0] == "127.0.0.1"
    # probes: real paths on the inference port that need no key, even with token auth on
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "http"
        assert get["path"] in config.token_exempt_paths
    # a stop: preStop's sleep, then the drain, then as long again for workers, within the grace
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + 2 * config.shutdown_drain_s
    # mounts: the config file, the model store, the run dir and the key file where config says
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert _env(container)["MSERVE_CONFIG"] == f"{mounts['config']}/mserve.yaml"
    assert config.model_store == mounts["models"]
    assert config.run_dir == mounts["run-dir"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    if config.token_key_file:
        assert Path(config.token_key_file).parent == Path(mounts["keys"])
        items = volumes["keys"]["secret"]["items"]
        assert [i["path"] for i in items] == [Path(config.token_key_file).name]
        secret_name = volumes["keys"]["secret"]["secretName"]
        for secret in of_kind(docs, "Secret"):
            assert secret["metadata"]["name"] == secret_name
            assert set(secret["stringData"]) == {i["key"] for i in items}
    else:
        assert "keys" not in volumes
    assert config.disable_token_authorization == (name == "token auth off")
    # the Service reaches the named ports; the monitors scrape the Service's metrics port
    service = of_kind(docs, "Service")[0]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    labels = pod.get("labels") or deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    for monitor in [*of_kind(docs, "ServiceMonitor"), *of_kind(docs, "PodMonitor")]:
        endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        assert endpoints[0]["port"] == "metrics"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for hpa in of_kind(docs, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    limits = container["resources"].get("limits", {})
    assert int(limits.get("nvidia.com/gpu", 0)) == (config.number_of_gpu or 0)


def test_cli_flags_named_by_the_manifests_exist(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The image's command with each runtime's arguments parses with mserve's own CLI; and a
    flag we do not have fails the same check."""
    docker = Dockerfile.read(DOCKERFILE)
    runtimes = [
        *of_kind(rendered["kserve runtime alone"], "ServingRuntime"),
        *of_kind(rendered["kserve cluster runtime, gpu"], "ClusterServingRuntime"),
    ]
    for runtime in runtimes:
        command, _env = server_command(docker, _container(runtime).get("args", []), {})
        assert command[:3] == ["mserve", "--start", "--foreground"]
        mserve_cli.make_context("mserve", command[1:])
    command, _env = server_command(docker, ["--model-dir=/mnt/models"], {})
    with pytest.raises(click.NoSuchOption):
        mserve_cli.make_context("mserve", command[1:])


def test_kserve_runtime_reads_torchserves_layout(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """KServe's TorchServe runtime's layout under the storage mount, its ports and protocols;
    the container is named as KServe expects and runs as the image's user."""
    runtime = of_kind(rendered["kserve runtime alone"], "ServingRuntime")[0]
    container = _container(runtime)
    assert container["name"] == "kserve-container"
    assert container["args"] == ["--model-store=/mnt/models/model-store",
                                 "--ts-config=/mnt/models/config/config.properties"]  # fmt: skip
    assert runtime["spec"]["protocolVersions"] == ["v1", "v2", "grpc-v2"]
    assert [p["containerPort"] for p in container["ports"]] == [8080]
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == "8082"
    config = load_config(None, {}, environ=_env(container))
    assert parse_address(config.inference_address, "")[1] == 8080
    assert parse_address(config.grpc_inference_address, "")[1] == 7070
    # KServe fills in the envelope as for its TorchServe runtime; the properties file decides
    # (enable_envvars_config) whether it is read, as TorchServe does
    env = _env(container)
    assert env["TS_SERVICE_ENVELOPE"] == "{{.Labels.serviceEnvelope}}"
    for label in ("kserve", "kservev2", ""):
        props = tmp_path / "config.properties"
        props.write_text("enable_envvars_config=true\n")
        ts = load_ts_config(props, {**env, "TS_SERVICE_ENVELOPE": label})
        config = load_config(None, {}, environ=env, ts_layers=list(ts.layers))
        assert config.service_envelope == label
    uid = Dockerfile.read(DOCKERFILE).args()["UID"]
    assert container["securityContext"]["runAsUser"] == int(uid)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "config.model_store=/elsewhere"], "config.model_store is set by the chart"),
        (["--set", "auth.keys.inference=only-one-key-given"],
         "give both inference and management keys"),
    ],
)  # fmt: skip
def test_chart_refuses_values_that_would_break_the_pod(args: list[str], message: str) -> None:
    with pytest.raises(HelmFailed, match=re.escape(message)):
        render(*args)


def test_dockerfile() -> None:
    """Entry point, variants, non-root user, the baked config (every key known), and the
    exposed ports equal to that config's; the files it copies exist."""
    docker = Dockerfile.read(DOCKERFILE)
    assert docker.entrypoint() == ["tini", "--", "mserve-container"]
    for args, command in [
        ([], ["mserve", "--start", "--foreground"]),
        (["--models", "all"], ["mserve", "--start", "--foreground", "--models", "all"]),
        (["torchserve", "--start", "--ncs"], ["torchserve", "--start", "--ncs", "--foreground"]),
        (["mserve", "--start", "--foreground"], ["mserve", "--start", "--foreground"]),
        (["torchserve", "--stop"], ["torchserve", "--stop"]),
        (["bash", "-c", "ls"], ["bash", "-c", "ls"]),
    ]:  # fmt: skip
        assert server_command(docker, args, {})[0] == command
    stages = {value[-1] for value in docker.all("FROM")}
    assert {"base-cpu", "base-cuda", "runtime"} <= stages
    assert ("base-${VARIANT}", "AS", "runtime") in docker.all("FROM")
    args = docker.args()
    assert args["VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"  # the project's pin (scripts/test.sh)
    assert "torch==2.13.0" in (REPO / "scripts" / "test.sh").read_text()
    assert docker.all("USER") == [("${UID}",)] and int(args["UID"]) > 0
    for value in docker.all("COPY"):
        for source in value[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
    env = docker.env()
    baked = REPO / "deploy" / "docker" / Path(env["MSERVE_CONFIG"]).name
    assert (f"deploy/docker/{baked.name}", env["MSERVE_CONFIG"]) in docker.all("COPY")
    config = load_config(baked, {}, environ={k: v for k, v in env.items() if k != "MSERVE_CONFIG"})
    exposed = {int(p) for value in docker.all("EXPOSE") for p in value}
    bound = {parse_address(getattr(config, k), k)[1] for k in (
        "inference_address", "management_address", "metrics_address",
        "grpc_inference_address", "grpc_management_address")}  # fmt: skip
    assert exposed == bound
    (volumes,) = docker.all("VOLUME")
    assert {config.model_store, config.run_dir} == set(volumes)
    # traces and SBOMs work in the image: the package goes in with its otel and sbom extras
    runs = " ".join(" ".join(value) for value in docker.all("RUN"))
    assert 'pip install "/tmp/mserve-src[otel,sbom]"' in runs


def test_hadolint_is_clean() -> None:
    """hadolint's checks of the Dockerfile (each ignore in it says why)."""
    hadolint = Path(sys.executable).parent / "hadolint"
    out = subprocess.run([str(hadolint), "--no-color", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_chart_version_follows_the_package() -> None:
    """The default image tag is <appVersion>-<variant>: appVersion must be the version built."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__


def test_helm_lint_is_clean() -> None:
    """helm's own checks of the chart (warnings fail too)."""
    out = subprocess.run([str(helm_path()), "lint", "--strict", str(CHART)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_grafana_dashboard_lays_out_on_its_grid() -> None:
    """Every panel has whole-number x, y, w, h on Grafana's 24-column grid, none overlapping and
    every one with a title (a description once landed in a panel's width, which Grafana cannot
    lay out); its queries are checked against a real Prometheus in
    tests/server/test_prometheus_kit.py."""
    import json

    dashboard = json.loads((REPO / "deploy" / "grafana" / "mserve-dashboard.json").read_text())
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid, title = panel["gridPos"], panel["title"]
        assert title and all(type(grid[k]) is int for k in "xywh"), (title, grid)
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, (title, grid)
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{title} overlaps {taken[(x, y)]}"
                taken[(x, y)] = title
