"""mkdocs.yml's hook: adds the generated reference pages (settings, REST APIs, metrics) to the
site at build time, so they are rebuilt from the code on every build and never committed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # docs_site and the server

from docs_site import metrics_page, rest_page, settings_page

PAGES = {
    "reference/settings.md": settings_page.render,
    "reference/rest.md": rest_page.render,
    "reference/metrics.md": metrics_page.render,
}


def on_files(files: Files, config: Any) -> Files:
    for uri, render in PAGES.items():
        files.append(File.generated(config, uri, content=render()))
    return files
