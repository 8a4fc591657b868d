"""deploy/grafana/ and deploy/prometheus/ against the real thing: Debian's Prometheus scrapes a
running mserve under a short load, every dashboard expression returns data (no dead panels),
every series the alert rules read exists, and the alerts a provoked fault should raise fire.

Prometheus and promtool come from Debian's ``prometheus`` package (scripts/test.sh installs
it); without them these tests skip, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from tests.server.conftest import HANDLERS, Server, http, wait_until
from tests.server.test_auth import _self_signed

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mserve-dashboard.json"
RULES = DEPLOY / "prometheus" / "mserve-alerts.yml"
# metrics no model of this test reports (none now: the load includes a generative model's
# OpenAI requests, for the tokens/s panel)
NOT_YET: tuple[str, ...] = ()
# every series the rules read, to be found in Prometheus after the load
SERIES = re.compile(r"\b(mserve_[a-z_]+|ts_[a-z_]+|Requests[245]XX|QueueTime|WorkerThreadTime)\b")

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="needs Debian's prometheus package (prometheus, promtool): scripts/test.sh installs it"
    " with apt-get; this machine has no apt to install it",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, Grafana's variables filled in as
    Grafana would for "All" models and a 1 s scrape interval."""
    found = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"].replace("$__rate_interval", "30s").replace("$model", ".*")
            found.append((panel["title"], expr))
    return found


def test_promtool_checks_the_rules_and_the_example_config() -> None:
    rules = subprocess.run(["promtool", "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 6 rules found" in rules.stdout
    config = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert config.returncode == 0, config.stdout + config.stderr


class Prometheus:
    """A real Prometheus on 127.0.0.1, its own data folder, scraping one target every second and
    evaluating the rules every second."""

    def __init__(self, folder: Path, target: str, rules: Path) -> None:
        self.port = _free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "mserve", "static_configs": [{"targets": [target]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(self._ready, 30, "prometheus to be ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
        try:
            return http("GET", f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except urllib.error.URLError:  # not listening yet
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        reply = http("GET", url, timeout=10)
        assert reply.status == 200, reply.body
        return reply.json()["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def firing(self) -> set[tuple[str, str]]:
        """(alert name, model or file) of each firing alert."""
        return {
            (a["labels"]["alertname"], a["labels"].get("model") or a["labels"].get("file", ""))
            for a in self.api("alerts")["alerts"]
            if a["state"] == "firing"
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.log.close()


@pytest.fixture
def loaded_server(
    tmp_path: Path, make_archive: Callable[..., Path], start_server: Callable[..., Server]
) -> Iterator[tuple[Server, Prometheus, Path]]:
    """A server (https inference, memory budget) with a healthy model under load, a model that
    loads on demand and is unloaded when idle, and a model whose handler fails to load; a
    Prometheus scraping it with the rules' ``for`` set to 0 s."""
    cert, key = _self_signed(tmp_path)
    make_archive("echo_fn", "echo", "echo")
    make_archive("path_faults", "load_fails:WeightsHandler", "broken")
    make_archive("generative", "lm:handle", "gen", "--config-file",
                 str(HANDLERS / "generative" / "chat.yaml"))  # fmt: skip
    server = start_server("echo=echo.mar", "gen=gen.mar", config={
        "certificate_file": str(cert), "private_key_file": str(key),
        "inference_address": "https://127.0.0.1:0", "worker_memory_budget_mb": 4096,
    })  # fmt: skip
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    fast_rules = tmp_path / "rules.yml"
    fast_rules.write_text(yaml.safe_dump(rules))
    prom = Prometheus(tmp_path, server.status["metrics"], fast_rules)
    try:
        yield server, prom, cert
    finally:
        prom.stop()


def _load(server: Server, cert: Path, seconds: float) -> None:
    """Requests for a while: answers, a 404 (a model that does not exist), the failed model's
    errors and a generative model's completions (its tokens; streamed, its time to first
    token), over https."""
    context = ssl.create_default_context(cafile=str(cert))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in ("/predictions/echo", "/predictions/echo", "/predictions/broken",
                     "/predictions/nope"):  # fmt: skip
            req = urllib.request.Request(server.url("inference", path), b"hi", method="POST")
            try:
                urllib.request.urlopen(req, timeout=10, context=context).read()
            except urllib.error.HTTPError as exc:
                exc.read()
        for stream in (False, True):  # whole (its tokens), streamed (its time to first token)
            body = json.dumps({"model": "gen", "prompt": "hi", "max_tokens": 3,
                               "stream": stream}).encode()  # fmt: skip
            req = urllib.request.Request(server.url("inference", "/openai/v1/completions"), body,
                                         {"Content-Type": "application/json"}, method="POST")  # fmt: skip
            answer = urllib.request.urlopen(req, timeout=10, context=context).read()
            assert answer.endswith(b"data: [DONE]\n\n") if stream else json.loads(answer)["usage"]
        time.sleep(0.02)


def test_every_panel_has_data_and_the_fault_fires_its_alerts(
    loaded_server: tuple[Server, Prometheus, Path],
) -> None:
    server, prom, cert = loaded_server
    # a model that loads on demand (a load) and is unloaded after 1 s idle (an eviction); a
    # model whose handler cannot load: no ready worker, and its requests fail
    lazy = server.manage("POST", "/models?url=echo.mar&model_name=lazy&initial_workers=0"
                                 "&idle_unload_timeout=1")  # fmt: skip
    assert lazy.status == 200, lazy.body
    assert server.manage("POST", "/models?url=broken.mar&synchronous=false").status == 202
    context = ssl.create_default_context(cafile=str(cert))
    req = urllib.request.Request(server.url("inference", "/predictions/lazy"), b"x", method="POST")
    assert urllib.request.urlopen(req, timeout=60, context=context).read() == b"x"
    wait_until(lambda: server.manage("GET", "/models/broken").json()[0]["status"] == "FAILED",
               60, "the broken model to fail")  # fmt: skip
    loader = threading.Thread(target=_load, args=(server, cert, 6.0))
    loader.start()
    try:
        wait_until(lambda: bool(prom.query("mserve_model_evictions_total")), 30,
                   "the idle model's eviction to be scraped")  # fmt: skip
    finally:
        loader.join(timeout=30)
    # every panel shows data (a few scrapes after the load, for rate() windows)
    exprs = [(t, e) for t, e in dashboard_exprs() if not any(n in e for n in NOT_YET)]
    assert len(exprs) >= 20

    def dead() -> list[tuple[str, str]]:
        return [(title, expr) for title, expr in exprs if not prom.query(expr)]

    try:
        wait_until(lambda: not dead(), 20, "every dashboard expression to return data")
    except AssertionError:
        raise AssertionError(f"dashboard expressions without data: {dead()}") from None
    # every series the rules read is there
    names = set(SERIES.findall(RULES.read_text()))
    assert names >= {"mserve_workers_ready", "mserve_tls_certificate_expiry_timestamp_seconds"}
    assert [n for n in sorted(names) if not prom.query(f"count({n})")] == []
    # the certificate's notAfter, as the certificate says it
    [expiry] = prom.query("mserve_tls_certificate_expiry_timestamp_seconds")
    not_after = x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc
    assert float(expiry["value"][1]) == not_after.timestamp()
    # the fault: the failed model has no ready worker and its requests all fail; the
    # certificate (a day left) is about to expire. The healthy model raises nothing.
    expected = {
        ("MserveModelNoReadyWorker", "broken"),
        ("MserveHighErrorRatio", "broken"),
        ("MserveCertificateExpiresSoon", str(cert)),
    }
    wait_until(lambda: prom.firing() >= expected, 20, f"alerts {expected} to fire")
    assert {model for _alert, model in prom.firing()} <= {"broken", str(cert)}
