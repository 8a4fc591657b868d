"""The documentation site (mkdocs.yml, issue 47) builds with ``--strict``: a broken link or
anchor, a page left out of the nav, a nav entry without its page, or a generated reference that
no longer builds from the code fails here. The generated references are checked for what a
reader looks them up for."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_every_page_in_docs_is_built(site: Path) -> None:
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        built = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert built.is_file(), f"{page} was not built"


def test_settings_reference_lists_every_setting(site: Path) -> None:
    html = (site / "reference/settings/index.html").read_text(encoding="utf-8")
    internal = {"start_dir", "ts_properties", "ts_config_file"}
    for field in dataclasses.fields(ServerConfig):
        if field.name not in internal:
            assert f"MSERVE_{field.name.upper()}" in html, field.name
    # TorchServe's key beside ours, where the names differ
    assert "default_response_timeout" in html and "blacklist_env_vars" in html


def test_cli_rest_and_metrics_references(site: Path) -> None:
    cli = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    for flag in ("--model-store", "--export-path", "--handler", "--interval"):
        assert flag in cli, flag
    rest = (site / "reference/rest/index.html").read_text(encoding="utf-8")
    assert "/predictions/{model_name}" in rest and "/models/{model_name}" in rest
    metrics = (site / "reference/metrics/index.html").read_text(encoding="utf-8")
    for name in ("mserve_requests", "mserve_queue_depth", "ts_inference_requests_total"):
        assert name in metrics, name
