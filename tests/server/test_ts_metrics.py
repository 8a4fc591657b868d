"""TorchServe's metrics on a real server: its default metrics under its names, types and labels
on /metrics, handler metrics from ``context.metrics`` aggregated across workers, the cap on
label sets, metrics_mode, and TorchServe's log files."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.metrics.formats import java_double
from tests.server.conftest import MSERVE, Server, concurrently, http, wait_until

HOST = socket.gethostname()


def scrape(server: Server) -> str:
    reply = http("GET", server.url("metrics", "/metrics"))
    assert reply.status == 200
    return reply.body.decode()


def families(text: str) -> dict[str, object]:
    """Family name (as TorchServe names it) -> family, through prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = family
    return out


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The raw lines of one metric, as Prometheus stores them (no ``_total`` added)."""
    found = []
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1)))
            found.append((labels, float(match.group(2))))
    return found


# A sample line as the Java simpleclient's TextFormat.write004 prints it: labels each followed
# by a comma, no braces without labels, the value as Java's Double.toString writes it.
JAVA_SAMPLE = re.compile(r'[A-Za-z_]\w*(?:\{(?:\w+="(?:[^"\\]|\\.)*",)+\})? (?P<value>\S+)')
JAVA_DOUBLE = re.compile(r"-?(?:\d+\.\d+|\d\.\d+E-?\d+)|[+-]Inf|NaN")


def assert_java_client_text(text: str) -> None:
    """Every TorchServe-named sample on the page reads as TorchServe's frontend prints it."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    torchserve = [line for line in lines if not line.startswith("mserve_")]
    assert torchserve
    for line in torchserve:
        match = JAVA_SAMPLE.fullmatch(line)
        assert match, line
        value = match.group("value")
        assert JAVA_DOUBLE.fullmatch(value), line
        if "E" in value:  # Java writes 10^-3 <= |v| < 10^7 in plain decimals only
            assert not 1e-3 <= abs(float(value)) < 1e7, line
        elif value not in ("+Inf", "-Inf", "NaN") and float(value) != 0:
            assert 1e-3 <= abs(float(value)) < 1e7, line


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3, "3.0"), (0.0, "0.0"), (-0.0, "-0.0"), (2.5, "2.5"), (-2.5, "-2.5"),
        (0.001, "0.001"), (0.0012, "0.0012"), (1e-4, "1.0E-4"), (1.5e-5, "1.5E-5"),
        (9999999.0, "9999999.0"), (1e7, "1.0E7"), (12345678, "1.2345678E7"),
        (5484021.691000001, "5484021.691000001"), (308.94310760498047, "308.94310760498047"),
        (1e16, "1.0E16"), (1.7976931348623157e308, "1.7976931348623157E308"),
        (float("inf"), "+Inf"), (float("-inf"), "-Inf"), (float("nan"), "NaN"),
    ],
)  # fmt: skip
def test_numbers_are_written_as_java_writes_doubles(value: float, text: str) -> None:
    assert java_double(value) == text


def test_torchserve_default_metrics_with_torchserve_names_types_and_labels(
    make_archive, start_server
) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar")
    for _ in range(3):
        assert server.predict("probe", {}).status == 200
    assert server.predict("probe", {}, version="1.0").status == 200
    assert server.predict("probe", {"cmd": "status"}).status == 418
    assert http("GET", server.url("inference", "/nothing-here")).status == 404
    assert server.predict("probe", {"cmd": "raise"}).status == 500
    text = scrape(server)
    parsed = families(text)  # the whole exposition parses

    # ours stay
    assert 'mserve_requests_total{code="200",model="probe",version="1.0"} 4.0' in text

    assert samples(text, "Requests2XX") == [({"Level": "Host", "Hostname": HOST}, 4.0)]
    # byte for byte as TorchServe's Java client prints them (people grep this text)
    assert (
        "# HELP Requests2XX Torchserve prometheus counter metric with unit: Count\n"
        "# TYPE Requests2XX counter\n"
        f'Requests2XX{{Level="Host",Hostname="{HOST}",}} 4.0\n'
    ) in text
    assert re.search(
        r'^ts_inference_requests_total\{uuid="[-0-9a-f]{36}",model_name="probe",'
        rf'model_version="default",hostname="{re.escape(HOST)}",\}} 5\.0$',
        text, re.MULTILINE,
    )  # fmt: skip
    assert_java_client_text(text)
    assert samples(text, "Requests4XX") == [({"Level": "Host", "Hostname": HOST}, 2.0)]
    assert samples(text, "Requests5XX") == [({"Level": "Host", "Hostname": HOST}, 1.0)]
    for name in ("Requests2XX", "Requests4XX", "Requests5XX"):
        assert f"# TYPE {name} counter" in text

    requests = {s[0]["model_version"]: s for s in samples(text, "ts_inference_requests_total")}
    assert set(requests) == {"default", "1.0"}  # TorchServe's "default": no version in the URL
    labels, value = requests["default"]
    assert value == 5.0 and labels["model_name"] == "probe" and labels["hostname"] == HOST
    assert set(labels) == {"uuid", "model_name", "model_version", "hostname"}
    assert requests["1.0"][1] == 1.0
    for name in ("ts_inference_latency_microseconds", "ts_queue_latency_microseconds"):
        assert f"# TYPE {name} counter" in text
        rows = {s[0]["model_version"]: s[1] for s in samples(text, name)}
        assert rows["default"] > 0 and rows["1.0"] > 0
    latency = {
        s[0]["model_version"]: s[1] for s in samples(text, "ts_inference_latency_microseconds")
    }
    assert latency["1.0"] < 10_000_000  # microseconds: one quick request

    host = {"Level": "Host", "Hostname": HOST}
    for name in ("QueueTime", "WorkerThreadTime", "CPUUtilization", "MemoryUsed",
                 "MemoryAvailable", "MemoryUtilization", "DiskUsage", "DiskUtilization",
                 "DiskAvailable"):  # fmt: skip
        assert parsed[name].type == "gauge", name
        [(labels, value)] = samples(text, name)
        assert labels == host, name
        assert value >= 0
    [(_labels, used)] = samples(text, "MemoryUsed")
    assert 1 < used < 1 << 30  # megabytes
    [(labels, load_ms)] = samples(text, "WorkerLoadTime")
    assert re.fullmatch(r"W-\d+-probe_1\.0", labels["WorkerName"]) and labels["Level"] == "Host"
    assert 0 < load_ms < 300_000
    for name in ("HandlerTime", "PredictionTime"):
        assert parsed[name].type == "gauge"
        [(labels, value)] = samples(text, name)
        assert labels == {"ModelName": "probe", "Level": "Model", "Hostname": HOST}
        assert 0 <= value < 60_000
    # the GPU families are declared, as in TorchServe's registry; no GPU here, so no sample
    assert parsed["GPUUtilization"].type == "gauge" and parsed["GPUUtilization"].samples == []

    # TorchServe's metrics API filter: ?name[]=...&name[]=...
    query = "/metrics?name[]=ts_inference_requests_total&name[]=Requests2XX&name[]=mserve_requests_total"
    picked = families(http("GET", server.url("metrics", query)).body.decode())
    assert set(picked) == {"ts_inference_requests", "Requests2XX", "mserve_requests"}


def test_handler_metrics_are_aggregated_across_workers(
    make_archive, start_server, tmp_path
) -> None:
    declared = tmp_path / "metrics.yaml"
    declared.write_text(
        "dimensions:\n  - &model_name ModelName\n  - &level Level\n"
        "ts_metrics:\n  counter:\n    - name: Requests2XX\n      unit: Count\n"
        "      dimensions: [*level, Hostname]\n"
        "model_metrics:\n  histogram:\n    - name: LatencyHist\n      unit: ms\n"
        "      dimensions: [*model_name, *level]\n"
    )
    make_archive("custom_metrics", "metrics_handler:handle", "custom")
    server = start_server("custom=custom.mar", config={"metrics_config": str(declared)})
    assert server.manage("PUT", "/models/custom?min_worker=2&synchronous=true").status == 200
    pids: set[int] = set()
    deadline = 40
    while len(pids) < 2 and deadline:
        replies = concurrently(*[lambda: server.predict("custom", {"color": "blue"})] * 8)
        pids |= {r.json()["pid"] for r in replies}
        deadline -= 1
    assert len(pids) == 2, "both workers served"
    sent = 8 * (40 - deadline)
    text = scrape(server)
    parsed = families(text)
    # the config's ts_metrics lists only Requests2XX: TorchServe emits no other frontend metric
    assert "Requests2XX" in parsed and "QueueTime" not in parsed and "CPUUtilization" not in parsed
    assert "ts_inference_requests" not in parsed

    model = {"ModelName": "custom", "Level": "Model", "Hostname": HOST}
    assert samples(text, "ItemsSeen") == [({"Color": "blue", **model}, float(sent))]
    assert parsed["ItemsSeen"].type == "counter"
    assert samples(text, "DistanceInKM") == [(model, 3.0 * sent)]  # add_metric: a counter
    assert samples(text, "QueueLen") == [(model, 7.0)]  # ... unless metric_type says otherwise
    assert parsed["QueueLen"].type == "gauge"
    assert samples(text, "StepTime") == [({"Stage": "pre", **model}, 2.5)]  # a gauge
    assert parsed["StepTime"].type == "gauge"
    assert "# HELP StepTime Torchserve prometheus gauge metric with unit: Milliseconds" in text
    assert samples(text, "PayloadSize") == [(model, 0.5)]
    assert samples(text, "Confidence") == [(model, 90.0)]
    # the load-time counter of each worker, added up
    assert samples(text, "ModelLoads") == [({"Stage": "load", **model}, 2.0)]
    # declared a histogram in metrics.yaml: add_time's values are counted into buckets
    assert parsed["LatencyHist"].type == "histogram"
    labels = f'ModelName="custom",Level="Model",Hostname="{HOST}",'
    assert f"LatencyHist_count{{{labels}}} {float(sent)}" in text
    assert f'LatencyHist_bucket{{{labels}le="0.5",}} {float(sent)}' in text
    assert f'LatencyHist_bucket{{{labels}le="+Inf",}} {float(sent)}' in text
    assert_java_client_text(text)


def test_metric_log_lines_reach_the_file_in_the_loop_pass_that_wrote_them(tmp_path) -> None:
    """TorchServe's test_metrics reads ts_metrics.log right after its answer: a line is in the
    file once the event loop has gone round, written with the others of its pass."""
    import asyncio

    from server.metrics.formats import MetricLog

    path = tmp_path / "ts_metrics.log"

    async def write() -> list[str]:
        log = MetricLog(path)
        log.add("Requests2XX.Count:1.0|#Level:Host|#hostname:h")
        log.add("QueueTime.Milliseconds:0.1|#Level:Host|#hostname:h")
        assert path.read_text() == ""  # not a write per line
        await asyncio.sleep(0)
        lines = path.read_text().splitlines()
        log.close()
        return lines

    lines = asyncio.run(write())
    assert [line.split(" - ", 1)[1].split("|")[0] for line in lines] == [
        "Requests2XX.Count:1.0",
        "QueueTime.Milliseconds:0.1",
    ]


def test_metrics_the_config_declares_need_no_definition_in_the_handler(
    make_archive, start_server, tmp_path
) -> None:
    """TorchServe's worker reads metrics.yaml: a handler's ``get_metric`` finds what its
    model_metrics declare without ``add_metric_to_cache`` (TorchServe's custom_metrics
    example relies on it); without a config, HandlerTime and PredictionTime are declared."""
    declared = tmp_path / "metrics.yaml"
    declared.write_text(
        "model_metrics:\n  counter:\n    - name: RequestBatchSize\n      unit: count\n"
        "      dimensions: [ModelName, Level]\n"
    )
    make_archive("declared_metrics", "declared_handler:handle", "declared")
    server = start_server("declared=declared.mar", config={"metrics_config": str(declared)})
    for _ in range(3):
        reply = server.predict("declared", {"x": 1})
        assert reply.status == 200, reply.body
    model = {"ModelName": "declared", "Level": "Model", "Hostname": HOST}
    assert samples(scrape(server), "RequestBatchSize") == [(model, 3.0)]


def test_invented_label_values_are_capped_with_one_warning(make_archive, start_server) -> None:
    from server.metrics.handler import MAX_SERIES_PER_METRIC

    make_archive("custom_metrics", "metrics_handler:handle", "custom")
    server = start_server("custom=custom.mar", config={"batch_size": 8})
    for start in range(0, MAX_SERIES_PER_METRIC + 50, 25):
        concurrently(*[
            (lambda u=u: server.predict("custom", {"user": u})) for u in range(start, start + 25)
        ])  # fmt: skip
    users = samples(scrape(server), "PerUser")
    assert len(users) == MAX_SERIES_PER_METRIC
    assert all(value == 1.0 for _labels, value in users)
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    warning = (
        f"metric PerUser has {MAX_SERIES_PER_METRIC} label sets, the most one metric may have:"
        " values with new labels are dropped"
    )
    assert log.count(warning) == 1
    assert server.predict("custom", {"user": "again"}).status == 200  # serving goes on


LINE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} - (?P<name>\w+)\.(?P<unit>\w+):(?P<value>[-\d.e+]+)"
    r"\|#(?P<dims>[^|]*)\|#hostname:(?P<host>[^,]+)(?:,requestID:(?P<ids>[^,]+(?:,[^,:]+)*))?"
    r",timestamp:\d+"
)


def metric_lines(path: Path) -> list[dict[str, str]]:
    lines = path.read_text().splitlines()
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if not m]
    return [m.groupdict() for m in parsed if m]


def test_log_mode_writes_torchserve_metric_lines(make_archive, start_server) -> None:
    make_archive("custom_metrics", "metrics_handler:handle", "custom")
    server = start_server(
        "custom=custom.mar", config={"metrics_mode": "log", "log_layout": "torchserve"}
    )
    reply = server.predict("custom", {"color": "green"})
    assert reply.status == 200
    request_id = reply.headers["X-Request-Id"]
    logs = server.run_dir / "logs"
    ts_metrics, model_metrics = logs / "ts_metrics.log", logs / "model_metrics.log"
    wait_until(lambda: "Requests2XX" in ts_metrics.read_text(), 10, "ts_metrics.log")
    wait_until(lambda: "ItemsSeen" in model_metrics.read_text(), 10, "model_metrics.log")

    frontend = {m["name"]: m for m in metric_lines(ts_metrics)}
    assert frontend["Requests2XX"]["unit"] == "Count" and frontend["Requests2XX"]["value"] == "1.0"
    assert (
        frontend["Requests2XX"]["dims"] == "Level:Host" and frontend["Requests2XX"]["host"] == HOST
    )
    assert (
        frontend["ts_inference_requests_total"]["dims"] == "model_name:custom,model_version:default"
    )
    assert frontend["QueueTime"]["unit"] == "Milliseconds"
    assert frontend["CPUUtilization"]["unit"] == "Percent"
    assert frontend["MemoryUsed"]["unit"] == "Megabytes"
    assert frontend["DiskAvailable"]["unit"] == "Gigabytes"
    assert re.fullmatch(
        r"WorkerName:W-\d+-custom_1\.0,Level:Host", frontend["WorkerLoadTime"]["dims"]
    )

    model = {m["name"]: m for m in metric_lines(model_metrics)}
    items = model["ItemsSeen"]
    assert items["unit"] == "Count" and items["value"] == "1.0"
    assert items["dims"] == "Color:green,ModelName:custom,Level:Model"
    assert items["ids"] == request_id
    assert model["StepTime"]["unit"] == "Milliseconds"
    assert (
        model["HandlerTime"]["unit"] == "ms"
        and model["HandlerTime"]["dims"] == "ModelName:custom,Level:Model"
    )

    # log mode: TorchServe's metrics are not on /metrics, ours are
    text = scrape(server)
    assert "Requests2XX" not in text and "ItemsSeen" not in text
    assert "mserve_requests_total" in text

    # TorchServe's own log files, in its line formats; access lines are written in batches by
    # the server's flusher (within a second), so the line may come after the answer
    access_line = re.compile(
        r'^\d{4}-\d\d-\d\dT[\d:]+,\d{3} - /127\.0\.0\.1 "POST /predictions/custom HTTP/1\.1" 200 \d+$',
        re.M,
    )  # fmt: skip
    wait_until(lambda: access_line.search((logs / "access_log.log").read_text()) is not None,
               10, "the prediction's line in access_log.log")  # fmt: skip
    ts_log = (logs / "ts_log.log").read_text()
    assert re.search(
        r"^\d{4}-\d\d-\d\dT[\d:]+,\d{3} \[INFO \] main org\.pytorch\.serve\.ModelServer - mserve .* ready$",
        ts_log,
        re.M,
    )  # fmt: skip
    assert not (logs / "mserve.log").exists() and not (logs / "access.log").exists()
    model_log = (logs / "model_log.log").read_text()
    line = r"\[INFO \] W-\d+-custom_1\.0-stdout MODEL_LOG - custom metrics handler loaded$"
    assert re.search(line, model_log, re.M)
    assert re.search(line, ts_log, re.M)  # and in ts_log.log, as TorchServe's log4j2.xml has it


def test_legacy_mode_serves_the_ts_counters_and_logs_the_rest(make_archive, start_server) -> None:
    make_archive("probe", "probe:handle", "probe")
    server = start_server("probe=probe.mar", config={"metrics_mode": "legacy"})
    assert server.predict("probe", {}).status == 200
    text = scrape(server)
    assert samples(text, "ts_inference_requests_total")
    assert "Requests2XX" not in text and "CPUUtilization" not in text
    ts_metrics = server.run_dir / "logs" / "ts_metrics.log"
    wait_until(lambda: "Requests2XX.Count" in ts_metrics.read_text(), 10, "ts_metrics.log")
    assert "ts_inference_requests_total" not in ts_metrics.read_text()
    assert (server.run_dir / "logs" / "mserve.log").exists()  # our layout unless asked


def start_output(tmp_path: Path, settings: dict[str, object]) -> str:
    """What ``mserve --start`` says when it refuses to start."""
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"metrics_address": "127.0.0.1:0",
                                      "inference_address": "127.0.0.1:0",
                                      "management_address": "127.0.0.1:0",
                                      "grpc_inference_address": "127.0.0.1:0",
                                      "grpc_management_address": "127.0.0.1:0", **settings}))  # fmt: skip
    out = subprocess.run(
        [MSERVE, "--start", "--config", str(config), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    return out.stdout + out.stderr


def test_bad_metrics_mode_is_refused_at_start(tmp_path) -> None:
    output = start_output(tmp_path, {"metrics_mode": "statsd"})
    assert "'metrics_mode' should be one of prometheus, log, legacy, found 'statsd'" in output


def test_bad_metrics_config_is_refused_at_start(tmp_path) -> None:
    bad = tmp_path / "metrics.yaml"
    bad.write_text("model_metrics:\n  summary:\n    - name: X\n")
    output = start_output(tmp_path, {"metrics_config": str(bad)})
    assert f"metrics_config: {bad}: model_metrics type 'summary' is not one of counter" in output


def test_every_gpu_has_its_sample_under_one_family() -> None:
    """Two GPUs measured: one GPUUtilization family with a sample per DeviceId, as TorchServe's
    gauge holds one child per label set (the second GPU's samples were dropped before)."""
    from server.metrics.server_metrics import Metrics

    metrics = Metrics("prometheus", hostname="h")
    metrics.record_system([
        (name, "Percent", (("Level", "Host"), ("DeviceId", str(device))), 10.0 * (device + 1))
        for device in (0, 1) for name in ("GPUUtilization", "GPUMemoryUtilization")
    ])  # fmt: skip
    text = metrics.torchserve_text()
    assert text.count("# TYPE GPUUtilization gauge") == 1
    assert samples(text, "GPUUtilization") == [
        ({"Level": "Host", "DeviceId": "0", "Hostname": "h"}, 10.0),
        ({"Level": "Host", "DeviceId": "1", "Hostname": "h"}, 20.0),
    ]
    assert samples(text, "GPUMemoryUsed") == []  # not measured: the family without samples
    assert "# TYPE GPUMemoryUsed gauge" in text
