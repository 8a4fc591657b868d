"""The documentation site (mkdocs.yml, issue 47) builds with ``--strict``: a broken link or
anchor, a page left out of the nav, a nav entry without its page, or a generated reference that
no longer builds from the code fails here. The generated references are checked for what a
reader looks them up for."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from docs_site import settings_page
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
    # meanings from the code's comments, a <placeholder> in them shown as written
    assert "the folder of the archives: startup models' paths and registration urls" in html
    assert "JSON lines under &lt;run_dir&gt;/inference_log/" in html
    # TorchServe's key beside ours, where the names differ
    assert "default_response_timeout" in html and "blacklist_env_vars" in html


def test_every_setting_has_a_meaning_in_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference reads a setting's meaning from its comment in ServerConfig; none may be
    left blank (a guide's table is no fallback: the guides are rewritten in their own words)."""
    monkeypatch.setattr(settings_page, "guide_meanings", dict, raising=False)
    rows = [line for line in settings_page.render().splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    blank = [row.split("|")[1].strip() for row in rows if re.search(r"\|\s*\|\s*$", row)]
    assert not blank, f"settings without a comment in server/config/server_config.py: {blank}"


def test_comparison_page_is_dated_and_every_note_is_defined(site: Path) -> None:
    """The comparison with other servers says when it was checked, and every cell's note
    exists (an undefined footnote is left as text: ``mkdocs build --strict`` does not see it)."""
    html = (site / "explanations/comparison/index.html").read_text(encoding="utf-8")
    assert "Checked 2026-11" in html
    assert "[^" not in html
    for server in ("Triton", "KServe", "Ray Serve", "BentoML", "LitServe"):
        assert f"<th>{server}</th>" in html, server


def test_cli_rest_and_metrics_references(site: Path) -> None:
    cli = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    for flag in ("--model-store", "--export-path", "--handler", "--interval"):
        assert flag in cli, flag
    assert "Sentinel" not in cli  # click's UNSET default, as mkdocs-click's tables show it
    rest = (site / "reference/rest/index.html").read_text(encoding="utf-8")
    assert "/predictions/{model_name}" in rest and "/models/{model_name}" in rest
    for path in (
        "/models/{model_name}/traffic",
        "/models/{model_name}/canary/{action}",
        "/models/{model_name}/shadow",
        "/models/{model_name}/{model_version}/swap",
    ):
        assert path in rest, path
    assert "max_error_ratio" in rest  # the canary body's fields
    metrics = (site / "reference/metrics/index.html").read_text(encoding="utf-8")
    for name in ("mserve_requests", "mserve_queue_depth", "ts_inference_requests_total"):
        assert name in metrics, name


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (its search index is fetched: not over file:)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_site_renders_and_searches_in_a_real_browser(site_url: str, tmp_path: Path) -> None:
    """Home page and a guide render, the search box finds "canary", no console error and no
    request leaves the site (Debian's chromium through Playwright, as tests/server/
    test_replay.py drives it)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    problems: list[str] = []
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(
                executable_path=shutil.which("chromium") or shutil.which("chromium-browser")
            )
        except sync_api.Error as exc:  # neither Debian's chromium nor Playwright's
            pytest.skip(f"no headless chromium here: {str(exc).splitlines()[0]}")
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on(
            "request",
            lambda r: None if r.url.startswith((site_url, "data:")) else problems.append(r.url),
        )
        page.goto(site_url)
        assert page.title() == "mserve"
        assert "Get started" in page.inner_text(".md-tabs")
        page.screenshot(path=str(tmp_path / "home.png"))
        page.goto(site_url + "rollouts/")
        assert page.locator("h1").first.inner_text().strip() != ""
        assert page.locator("article pre").count() > 0  # code blocks rendered
        page.screenshot(path=str(tmp_path / "guide.png"))
        page.click("input.md-search__input")  # the search box, as a reader types into it
        page.keyboard.type("canary")
        results = page.locator(".md-search-result__item")
        results.first.wait_for(timeout=20_000)
        assert results.count() > 0
        assert "canary" in page.inner_text(".md-search-result").lower()
        page.screenshot(path=str(tmp_path / "search.png"))
        browser.close()
    assert problems == []
    for name in ("home.png", "guide.png", "search.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name


def test_a_pipe_in_a_tables_code_span_shows_as_on_github(site: Path) -> None:
    """`POST\\|PUT` in a table cell keeps GitHub from ending the cell there and shows `POST|PUT`
    on GitHub; the site shows it the same (docs_site/hooks.py), not with the backslash."""
    apis = (site / "apis/index.html").read_text(encoding="utf-8")
    assert "<code>POST|PUT /predictions/{m}[/{v}]</code>" in apis
    for page in ("apis", "rollouts", "migration", "workflows", "reference/settings"):
        assert "\\|" not in (site / page / "index.html").read_text(encoding="utf-8"), page
