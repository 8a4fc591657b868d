"""TorchServe's metrics in its layout, checked the way TorchServe's own ``test_metrics.py`` checks
them: the ``torchserve`` command started in a working folder with ``--ts-config`` and the
``TS_*`` variables (``enable_envvars_config=true``), a handler recording metrics as TorchServe's
``examples/custom_metrics`` handler does, then ``logs/ts_metrics.log``, ``logs/model_metrics.log``
and ``/metrics`` read for which metric names each holds, in each ``metrics_mode``, with
``model_metrics_auto_detect``, with ``disable_system_metrics``, and under ``LOG_LOCATION`` and
``METRICS_LOCATION``."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.server.conftest import HANDLERS, http, pid_alive, wait_until
from tests.server.test_torchserve_layout import (
    PROPERTIES,
    TorchServeDir,
    _pid,
    _read,
    torchserve_env,
)

LEGACY = ["ts_inference_requests_total", "ts_inference_latency_microseconds",
          "ts_queue_latency_microseconds"]  # fmt: skip
FRONTEND = ["Requests2XX", "Requests4XX", "Requests5XX", "QueueTime", "WorkerThreadTime",
            "WorkerLoadTime"]  # fmt: skip
SYSTEM = ["CPUUtilization", "MemoryUsed", "MemoryAvailable", "MemoryUtilization", "DiskUsage",
          "DiskUtilization", "DiskAvailable", "GPUMemoryUtilization", "GPUMemoryUsed",
          "GPUUtilization"]  # fmt: skip
BACKEND = ["HandlerTime", "PredictionTime", "InferenceRequestCount", "InitializeCallCount",
           "PreprocessCallCount", "PostprocessCallCount", "RequestBatchSize", "SizeOfImage"]  # fmt: skip
AUTO_DETECT = ["HandlerMethodTime", "ExamplePercentMetric"]
# those one answered request and a model load make (no 4XX or 5XX answer, no GPU)
FRONTEND_SEEN = ["Requests2XX", "QueueTime", "WorkerThreadTime", "WorkerLoadTime"]
SYSTEM_SEEN = SYSTEM[:7]
METRICS_YAML = HANDLERS / "ts_custom_metrics" / "metrics.yaml"
AUTO_DETECT_YAML = HANDLERS / "ts_custom_metrics" / "metrics_auto_detect.yaml"


@pytest.fixture
def ts_dir(tmp_path: Path, make_archive: Callable[..., Path]) -> Iterator[TorchServeDir]:
    root = tmp_path / "serve"
    root.mkdir()
    env = torchserve_env(tmp_path / "run")
    make_archive("ts_custom_metrics", "metrics_example:CustomMetricsHandler", "custom")
    (root / "model_store").symlink_to(tmp_path / "store")
    served = TorchServeDir(root, env)
    yield served
    pid = _pid(served.run_dir)
    if pid is not None and pid_alive(pid):
        served.command("--stop", "--foreground")


def start(ts: TorchServeDir, properties: str = "enable_envvars_config=true\n",
          env: dict[str, str] | None = None, models: bool = True) -> None:  # fmt: skip
    """``torchserve --start`` as TorchServe's test_utils runs it (tokens off, model API on, no
    snapshots), the custom metrics model loaded and asked once."""
    (ts.root / "config.properties").write_text(PROPERTIES + properties)
    args = ["--model-store", "model_store", "--ts-config", "config.properties", "--ncs",
            "--disable-token-auth", "--enable-model-api"]  # fmt: skip
    ts.start(*args, *(["--models", "custom=custom.mar"] if models else []), env=env)
    if models:
        reply = http("POST", f"{ts.status['urls']['inference']}/predictions/custom", b"x" * 2048)
        assert (reply.status, reply.body) == (200, b"2048"), reply.body


def names_in(path: Path, names: list[str]) -> list[str]:
    """Which of ``names`` the file holds, matched as TorchServe's test matches them (any case,
    anywhere); the file must exist, as TorchServe's log4j creates it at start."""
    assert path.is_file(), f"{path} does not exist"
    text = path.read_text()
    return [name for name in names if re.search(name, text, re.IGNORECASE)]


def wait_for_lines(path: Path, names: list[str]) -> None:
    """Metric lines reach the files in the event loop pass that wrote them; system metrics come
    from a thread after the start."""
    deadline = time.monotonic() + 10
    while missing := [n for n in names if not path.is_file() or not names_in(path, [n])]:
        assert time.monotonic() < deadline, f"{missing} not in {path}:\n{_read(path)}"
        time.sleep(0.05)


def scrape(ts: TorchServeDir) -> str:
    reply = http("GET", f"{ts.status['urls']['metrics']}/metrics")
    assert reply.status == 200
    return reply.body.decode()


def test_log_mode_is_the_default_and_writes_both_files(ts_dir: TorchServeDir) -> None:
    start(ts_dir, env={"TS_METRICS_CONFIG": str(METRICS_YAML)})
    logs = ts_dir.root / "logs"
    wait_for_lines(logs / "ts_metrics.log", LEGACY + FRONTEND_SEEN + SYSTEM_SEEN)
    wait_for_lines(logs / "model_metrics.log", BACKEND)
    # undeclared metrics are dropped: model_metrics_auto_detect is off by default
    assert names_in(logs / "model_metrics.log", AUTO_DETECT) == []
    model_lines = (logs / "model_metrics.log").read_text()
    # metrics defined without dimensions keep none (no ModelName or Level added)
    assert re.search(r" - InferenceRequestCount\.count:1\.0\|#\|#hostname:", model_lines)
    assert re.search(r" - PreprocessCallCount\.count:1\.0\|#ModelName:custom\|#", model_lines)
    # TorchServe's /metrics has nothing in log mode; ours keeps its mserve_* families
    text = scrape(ts_dir)
    assert [n for n in LEGACY + FRONTEND + SYSTEM + BACKEND + AUTO_DETECT if n in text] == []
    assert "mserve_requests_total" in text


PROMETHEUS_PATTERNS = [
    r"TYPE Requests2XX counter",
    r'Requests2XX\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r'ts_inference_requests_total\{model_name="custom",model_version="default",hostname=".+",\} \d+\.\d+',
    r'QueueTime\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r'WorkerLoadTime\{WorkerName=".+",Level="Host",Hostname=".+",\} \d+\.\d+',
    r'CPUUtilization\{Level="Host",Hostname=".+",\} \d+\.\d+',
    r"TYPE GPUUtilization gauge",
    r'HandlerTime\{ModelName="custom",Level="Model",Hostname=".+",\} \d+\.\d+',
    r'InferenceRequestCount\{Hostname=".+",\} \d+\.\d+',
    r'InitializeCallCount\{ModelName="custom",Level="Model",Hostname=".+",\} \d+\.\d+',
    r'PreprocessCallCount\{ModelName="custom",Hostname=".+",\} \d+\.\d+',
    r'RequestBatchSize\{ModelName="custom",Hostname=".+",\} \d+\.\d+',
    r'SizeOfImage\{ModelName="custom",Level="Model",Hostname=".+",\} 2\.0',
]  # fmt: skip


def test_prometheus_mode_serves_them_and_leaves_the_files_empty(ts_dir: TorchServeDir) -> None:
    start(ts_dir, env={"TS_METRICS_MODE": "prometheus", "TS_METRICS_CONFIG": str(METRICS_YAML)})
    text = scrape(ts_dir)
    assert [n for n in LEGACY + FRONTEND + SYSTEM + BACKEND if n not in text] == []
    assert [n for n in AUTO_DETECT if n in text] == []
    for pattern in PROMETHEUS_PATTERNS:
        assert len(re.findall(pattern, text)) == 1, pattern
    logs = ts_dir.root / "logs"
    everything = LEGACY + FRONTEND + SYSTEM + BACKEND + AUTO_DETECT
    # the files are there (TorchServe's log4j makes them at start) and hold no line
    assert names_in(logs / "ts_metrics.log", everything) == []
    assert names_in(logs / "model_metrics.log", everything) == []


def test_legacy_mode_with_auto_detected_metrics(ts_dir: TorchServeDir) -> None:
    start(ts_dir, env={"TS_METRICS_MODE": "legacy", "TS_METRICS_CONFIG": str(AUTO_DETECT_YAML),
                       "TS_MODEL_METRICS_AUTO_DETECT": "true"})  # fmt: skip
    logs = ts_dir.root / "logs"
    wait_for_lines(logs / "ts_metrics.log", FRONTEND_SEEN + SYSTEM_SEEN)
    wait_for_lines(logs / "model_metrics.log", BACKEND + AUTO_DETECT)
    assert names_in(logs / "ts_metrics.log", LEGACY) == []
    text = scrape(ts_dir)
    assert [n for n in LEGACY if n not in text] == []
    assert [n for n in FRONTEND + SYSTEM + BACKEND + AUTO_DETECT if n in text] == []


def test_prometheus_mode_with_auto_detected_metrics(ts_dir: TorchServeDir) -> None:
    start(ts_dir, env={"TS_METRICS_MODE": "prometheus", "TS_METRICS_CONFIG": str(AUTO_DETECT_YAML),
                       "TS_MODEL_METRICS_AUTO_DETECT": "true"})  # fmt: skip
    text = scrape(ts_dir)
    assert [n for n in BACKEND + AUTO_DETECT if n not in text] == []
    for pattern in [
        r"TYPE HandlerMethodTime gauge",
        r'HandlerMethodTime\{MethodName="preprocess",ModelName="custom",Level="Model",Hostname=".+",\} \d+\.\d+',
        r"TYPE ExamplePercentMetric histogram",
        r'ExamplePercentMetric_sum\{ModelName="custom",Level="Model",Hostname=".+",\} \d+\.\d+',
        r'ExamplePercentMetric_count\{ModelName="custom",Level="Model",Hostname=".+",\} \d+\.\d+',
        r'PredictionTime\{ModelName="custom",Level="Model",Hostname=".+",\} \d+\.\d+',
        # defined with add_metric_to_cache and no dimensions: none added (TorchServe's pattern)
        r'InferenceRequestCount\{Hostname=".+",\} \d+\.\d+',
    ]:  # fmt: skip
        assert len(re.findall(pattern, text)) == 1, pattern
    assert names_in(ts_dir.root / "logs" / "model_metrics.log", BACKEND + AUTO_DETECT) == []


def test_disable_system_metrics_in_config_properties(ts_dir: TorchServeDir) -> None:
    start(ts_dir, "enable_envvars_config=true\ndisable_system_metrics=true\n",
          env={"TS_METRICS_CONFIG": str(METRICS_YAML)})  # fmt: skip
    ts_metrics = ts_dir.root / "logs" / "ts_metrics.log"
    wait_for_lines(ts_metrics, FRONTEND_SEEN)  # the file is written, without system metrics
    assert names_in(ts_metrics, SYSTEM) == []
    # and no warning that the key has no effect
    ts_log = _read(ts_dir.root / "logs" / "ts_log.log").splitlines()
    assert [line for line in ts_log if "no effect" in line and "system_metrics" in line] == []


def test_disable_system_metrics_from_the_environment(ts_dir: TorchServeDir) -> None:
    start(ts_dir, env={"TS_DISABLE_SYSTEM_METRICS": "true", "TS_METRICS_MODE": "prometheus"})
    text = scrape(ts_dir)
    # as TorchServe's registry: the families are declared, none has a sample
    assert "# TYPE CPUUtilization gauge" in text
    assert [line for line in text.splitlines() if line.startswith(tuple(SYSTEM))] == []
    assert re.search(r'^Requests2XX\{Level="Host"', text, re.M)


def test_only_log_location_set_leaves_the_metric_logs_in_logs(
    ts_dir: TorchServeDir, tmp_path: Path
) -> None:
    custom = tmp_path / "custom_logs"
    start(ts_dir, env={"LOG_LOCATION": str(custom)}, models=False)
    logs = ts_dir.root / "logs"
    # both made at start, before any metric, where TorchServe's log4j2.xml puts them:
    # METRICS_LOCATION, else logs/ (LOG_LOCATION moves the other logs only)
    assert (logs / "ts_metrics.log").is_file() and (logs / "model_metrics.log").is_file()
    assert sorted(p.name for p in logs.iterdir()) == ["model_metrics.log", "ts_metrics.log"]
    assert {"access_log.log", "model_log.log", "ts_log.log"} <= {p.name for p in custom.iterdir()}
    assert not (custom / "ts_metrics.log").exists()
    wait_for_lines(logs / "ts_metrics.log", SYSTEM_SEEN)


def test_a_metrics_location_that_cannot_be_written_does_not_stop_the_start(
    ts_dir: TorchServeDir, tmp_path: Path
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    start(ts_dir, env={"METRICS_LOCATION": str(blocker / "metrics")})
    logs = ts_dir.root / "logs"
    assert {p.name for p in logs.iterdir()} == {"access_log.log", "model_log.log", "ts_log.log"}
    wait_until(lambda: "ts_metrics.log" in _read(logs / "ts_log.log"), 10, "the warning")
    warning = next(line for line in _read(logs / "ts_log.log").splitlines()
                   if "ts_metrics.log" in line)  # fmt: skip
    assert "[WARN ]" in warning and "metrics" in warning, warning
