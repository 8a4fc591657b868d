"""mkdocs.yml's hook: adds the generated reference pages (settings, REST APIs, metrics) to the
site at build time, so they are rebuilt from the code on every build and never committed; and
reads a table's escaped pipes inside code spans as GitHub does."""

from __future__ import annotations

import re
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


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _bare_pipes(span: re.Match[str]) -> str:
    return span.group(1) + span.group(2).replace("\\|", "|") + span.group(1)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """A pipe inside a code span of a table row is written `\\|` so that GitHub does not end the
    cell there; GitHub then shows `|`, but Python-Markdown keeps code spans verbatim and would
    show the backslash (it does not split cells inside backticks, so a bare pipe is safe here)."""
    out, fence = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and line.lstrip().startswith("|") and "\\|" in line:
            line = _CODE_SPAN.sub(_bare_pipes, line)
        out.append(line)
    return "\n".join(out)
