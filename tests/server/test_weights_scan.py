"""Pickled weights scanned at registration (server/weights/, docs/weights-safety.md): a real
mserve, real archives, pickles whose ``__reduce__`` would run ``os.system``.

The hostile pickles' command would create a marker file: every test checks it never appears, so
nothing unpickled them (not the scan, not a worker)."""

from __future__ import annotations

import collections
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from archiver.cli import main as archiver_main
from mserve_worker.sdk.safe_weights import weights_only
from server.weights.policy import strictest
from server.weights.scan import scan_file, scan_folder
from tests.server.conftest import (
    HANDLERS,
    Server,
    http,
    pid_alive,
    server_settings,
    start_daemon,
)
from tests.server.test_url_registration import Route, Upstream

pytestmark = pytest.mark.timeout(180)
FOLDER = HANDLERS / "weights_safety"


class RunsCommand:
    """Unpickled, runs ``touch marker``: what a hostile checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def hostile_files(folder: Path, marker: Path) -> dict[str, Path]:
    """A plain pickle and a torch zip file (its data.pkl names posix.system) that would run a
    command, and a clean state dict."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"evil": folder / "evil.pkl", "evilzip": folder / "evil.pt",
             "clean": folder / "clean.pt"}  # fmt: skip
    files["evil"].write_bytes(pickle.dumps({"w": RunsCommand(marker)}))
    torch.save({"w": torch.zeros(2), "hook": RunsCommand(marker)}, files["evilzip"])
    torch.save(torch.nn.Linear(2, 1).state_dict(), files["clean"])
    return files


def archive(store: Path, name: str, weights: Path, handler: str = "noload:handle",
            *extra: str) -> None:  # fmt: skip
    # the real archiver CLI, in this process (a subprocess each costs seconds of imports)
    out = CliRunner().invoke(archiver_main, [
        "--model-name", name, "--handler", handler, "--model-path", str(FOLDER),
        "--serialized-file", str(weights), "--export-path", str(store), "-f", *extra,
    ], catch_exceptions=False)  # fmt: skip
    assert out.exit_code == 0, out.output


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    """An HTTP server the registration downloads archives from (test_url_registration's)."""
    server = Upstream()
    yield server
    server.close()


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, upstream: Upstream
) -> Iterator[tuple[Server, Path, Path]]:
    """One server (weights_scan warn; the models entry of ``strict`` says require), its store,
    and the marker the hostile pickles would create."""
    root = tmp_path_factory.mktemp("weights")
    store, marker = root / "store", root / "PWNED"
    store.mkdir()
    files = hostile_files(root / "weights", marker)
    archive(store, "strict", files["evil"])
    archive(store, "lenient", files["evil"])
    archive(store, "zipped", files["evilzip"])
    archive(store, "clean", files["clean"])
    config = root / "off.yaml"
    config.write_text("weightsScan: off\n")  # YAML: false
    archive(store, "weaker", files["evilzip"], "noload:handle", "-c", str(config))
    # BaseHandler's own loading: a hostile torch zip (the scan warns; weights_only refuses it),
    # and safetensors weights
    linear = [str(FOLDER / "linear_handler.py"), "--model-file", str(FOLDER / "model.py")]
    archive(store, "loadevil", files["evilzip"], *linear)
    torch.manual_seed(0)
    state = {f"fc.{k}": v for k, v in torch.nn.Linear(2, 1).state_dict().items()}  # Linear2
    save_file(state, root / "weights" / "linear.safetensors")
    archive(store, "safet", root / "weights" / "linear.safetensors", *linear)
    settings = server_settings(
        store, weights_scan="warn",
        allowed_urls=[f"http://127\\.0\\.0\\.1:{upstream.port}/ok/.*"],
        models={"strict": {"1.0": {"weightsScan": "require"}},
                "weaker": {"1.0": {"weightsScan": "require"}}},
    )  # fmt: skip
    server = start_daemon(root / "mserve.yaml", root / "run", settings)
    yield server, store, marker
    if pid_alive(server.pid):
        server.cli("--stop")


def unpacked(server: Server) -> list[str]:
    folder = server.run_dir / "unpacked"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_require_refuses_before_any_worker_and_leaves_nothing(setup) -> None:
    server, _store, marker = setup
    before = unpacked(server)
    reply = server.manage("POST", "/models?url=strict.mar&initial_workers=1")
    assert reply.status == 400, reply.body
    message = reply.json()["message"]
    assert reply.json()["type"] == "InvalidModelException"
    assert "model strict:1.0: weights that would run code when loaded: evil.pkl imports" in message
    assert "posix.system" in message and "weights_scan is require" in message
    assert server.manage("GET", "/models/strict").status == 404
    assert unpacked(server) == before  # no unpacked folder, no marker, no cached verdict
    assert not marker.exists()
    log = (server.run_dir / "logs" / "mserve.log").read_text().splitlines()
    assert not [line for line in log if "strict:1.0" in line and "worker" in line]


def test_a_registration_can_only_make_it_stricter(setup) -> None:
    server, _store, marker = setup
    reply = server.manage("POST", "/models?url=zipped.mar&weights_scan=require")
    assert reply.status == 400
    assert (
        "model zipped:1.0: weights that would run code when loaded: evil.pt imports"
        in (reply.json()["message"])
    )
    reply = server.manage("POST", "/models?url=zipped.mar&weights_scan=never")
    assert reply.status == 400
    assert reply.json()["message"] == (
        "model zipped:1.0: weights_scan should be one of off, warn, require, found 'never'"
    )
    assert server.manage("POST", "/models?url=strict.mar&weights_scan=off").status == 400
    assert not marker.exists()


def test_a_refused_download_leaves_nothing(setup, upstream: Upstream) -> None:
    server, store, marker = setup
    upstream.routes["/ok/strict.mar"] = Route(body=(store / "strict.mar").read_bytes())
    before = unpacked(server)
    url = upstream.url("/ok/strict.mar")
    reply = server.manage("POST", f"/models?url={url}&weights_scan=require")
    assert reply.status == 400
    assert "evil.pkl imports posix.system" in reply.json()["message"]
    assert upstream.routes["/ok/strict.mar"].hits == 1  # downloaded, then refused
    downloads = server.run_dir / "downloads"
    assert not [p for p in downloads.rglob("*") if p.is_file()]  # the download was removed
    assert unpacked(server) == before
    assert not marker.exists()


def test_a_model_config_cannot_weaken_the_policy(setup) -> None:
    server, _store, marker = setup
    reply = server.manage("POST", "/models?url=weaker.mar")  # weightsScan off in its config
    assert reply.status == 400
    assert "evil.pt imports posix.system" in reply.json()["message"]
    assert not marker.exists()


def test_warn_registers_and_says_so(setup) -> None:
    server, _store, marker = setup
    assert server.manage("POST", "/models?url=lenient.mar&initial_workers=1").status == 200
    described = server.manage("GET", "/models/lenient").json()[0]
    assert described["weightsScan"] == "warn"
    assert described["settingSources"]["weights_scan"] == "server"
    result = described["weightsScanResult"]
    assert result["files"] == 1 and not result["cached"]
    assert result["flagged"] == [{"path": "evil.pkl", "verdict": "dangerous",
                                  "dangerous": ["posix.system"], "unknown": []}]  # fmt: skip
    log = (server.run_dir / "logs" / "mserve.log").read_text()
    assert "model lenient:1.0: evil.pkl imports posix.system: loading it may run code" in log
    assert server.predict("lenient", {"x": 1}).json() == {"ok": True}
    assert not marker.exists()

    # the same bytes again: the verdict kept beside the unpack cache, no second scan
    assert server.manage("DELETE", "/models/lenient").status == 200
    assert server.manage("POST", "/models?url=lenient.mar&initial_workers=0").status == 200
    again = server.manage("GET", "/models/lenient").json()[0]["weightsScanResult"]
    assert again["cached"] and again["flagged"] == result["flagged"]


def test_torch_zip_data_pkl_is_flagged_and_clean_state_dict_passes(setup) -> None:
    server, _store, marker = setup
    assert server.manage("POST", "/models?url=zipped.mar&initial_workers=0").status == 200
    flagged = server.manage("GET", "/models/zipped").json()[0]["weightsScanResult"]["flagged"]
    assert [(f["path"], f["dangerous"]) for f in flagged] == [("evil.pt", ["posix.system"])]
    assert server.manage("POST", "/models?url=clean.mar&initial_workers=0").status == 200
    clean = server.manage("GET", "/models/clean").json()[0]["weightsScanResult"]
    assert clean == {"files": 1, "flagged": [], "cached": False}
    assert not marker.exists()


def test_base_handler_loads_with_weights_only_and_refuses_a_hostile_checkpoint(setup) -> None:
    server, _store, marker = setup
    reply = server.manage("POST", "/models?url=loadevil.mar&initial_workers=1")
    assert reply.status == 400, reply.body
    message = reply.json()["message"]
    assert "evil.pt is not a plain state dict (torch.load with weights_only=True refused" in message
    assert "or set weightsOnly: false in the model config" in message
    assert not marker.exists()  # refused by torch's own unpickler: nothing ran


def test_safetensors_weights_load_without_pickle_and_answer(setup, tmp_path: Path) -> None:
    server, _store, _marker = setup
    assert server.manage("POST", "/models?url=safet.mar&initial_workers=1").status == 200
    described = server.manage("GET", "/models/safet").json()[0]
    assert described["weightsScanResult"] == {"files": 0, "flagged": [], "cached": False}
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    expected = model(torch.tensor([[1.0, 2.0]])).item()
    reply = server.predict("safet", b"[1.0, 2.0]", headers={"Content-Type": "application/json"})
    score = reply.json()["score"]
    assert score == pytest.approx(expected, abs=1e-6)


def test_weights_only_opt_out_is_checked() -> None:
    assert weights_only({}) and weights_only({"weightsOnly": True})
    assert not weights_only({"weightsOnly": False})
    with pytest.raises(ValueError, match="model config weightsOnly must be true or false"):
        weights_only({"weightsOnly": "no"})


def test_flagged_files_are_counted_by_verdict(setup) -> None:
    server, _store, _marker = setup
    refused = ('mserve_weights_flagged_files_total{action="refused",model="strict",'
               'verdict="dangerous",version="1.0"}')  # fmt: skip

    def rows() -> dict[str, float]:
        text = http("GET", server.url("metrics", "/metrics")).body.decode()
        pairs = (line.rsplit(" ", 1) for line in text.splitlines()
                 if line.startswith("mserve_weights_flagged_files_total"))  # fmt: skip
        return {name: float(value) for name, value in pairs}

    before = rows().get(refused, 0.0)
    assert server.manage("POST", "/models?url=strict.mar").status == 400
    after = rows()
    assert after[refused] == before + 1  # each refusal counts its flagged file
    assert any('model="lenient"' in r and 'action="warned"' in r for r in after)


def test_verdicts_of_files(tmp_path: Path) -> None:
    """The scanner alone: a whole pickled module is off the allow-list (unknown); a legacy
    (non-zip) torch file's later pickles are read too."""
    marker = tmp_path / "PWNED"
    torch.save(torch.nn.Linear(2, 1), tmp_path / "module.pt")
    torch.save({"hook": RunsCommand(marker)}, tmp_path / "legacy.pt",
               _use_new_zipfile_serialization=False)  # fmt: skip
    module = scan_file(tmp_path / "module.pt", "module.pt")
    assert module.verdict == "unknown"
    assert "torch.nn.modules.linear.Linear" in module.unknown
    legacy = scan_file(tmp_path / "legacy.pt", "legacy.pt")
    assert (legacy.verdict, legacy.dangerous) == ("dangerous", ("posix.system",))
    assert not marker.exists()
    # a pickle that breaks off after naming globals: what follows cannot be vouched for
    whole = pickle.dumps(collections.OrderedDict(a=1), protocol=2)
    (tmp_path / "cut.pkl").write_bytes(whole[:-3])
    cut = scan_file(tmp_path / "cut.pkl", "cut.pkl")
    assert cut.verdict == "unscannable"
    assert cut.reason() == "cut.pkl could not be read to its end as a pickle"


def test_picklescans_own_log_lines_name_files_inside_the_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """picklescan warns with the path it scanned: the unpacked model's folder, a host path;
    the server's log names the file as the model knows it."""
    folder = tmp_path / "unpacked" / "abc123"
    (folder / "weights").mkdir(parents=True)
    torch.save({"hook": RunsCommand(tmp_path / "PWNED")}, folder / "weights" / "legacy.pt",
               _use_new_zipfile_serialization=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="picklescan"):
        scan = scan_folder(folder)
    assert [f.verdict for f in scan.files] == ["dangerous"]
    lines = [r.getMessage() for r in caplog.records if r.name == "picklescan"]
    assert lines and all(line.startswith("weights/legacy.pt: ") for line in lines), lines
    assert not any(str(tmp_path) in line for line in lines)


def test_stricter_only() -> None:
    assert strictest("warn", "require", None, "m:1") == ("require", "models")
    assert strictest("require", None, "off", "m:1") == ("require", "server")
    assert strictest("off", None, "warn", "m:1") == ("warn", "archive")
    assert strictest("warn", None, None, "m:1", api="require") == ("require", "api")
    with pytest.raises(Exception, match="m:1: weightsScan should be one of off, warn, require"):
        strictest("warn", None, "never", "m:1")
