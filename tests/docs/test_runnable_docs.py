"""Docs that run (issue 47): the marked shell and Python blocks of Get started and of the
README's five-minute example are run as pasted, in a fresh folder with a fresh home, against the
real server they start, twice, as a newcomer would paste them again (runnable.py). The examples'
READMEs run once each, in test_runnable_examples.py and test_runnable_examples_2.py; what a second
paste needs of any page is checked here by reading it (``rerun_problems``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runnable import EXAMPLE_SPLIT, ROOT, marked_blocks, rerun_problems, run_page

EXAMPLE_PAGES = sorted(p for p in (ROOT / "examples").glob("*/README.md") if marked_blocks(p))
PAGES = [ROOT / "docs" / "get-started.md", ROOT / "README.md", *EXAMPLE_PAGES]


# each run imports torch three or four times (weights, archive, worker): ~15-40 s a run
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_get_started_runs_as_pasted_twice(tmp_path: Path) -> None:
    out = run_page(ROOT / "docs" / "get-started.md", tmp_path, times=2)
    assert '"probabilities"' in out  # curl's answer
    assert "BadInput" in out and "(HTTP 400)" in out  # the mistake, named
    assert "stopped" in out.lower()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_five_minute_example_runs_as_pasted_twice(tmp_path: Path) -> None:
    out = run_page(ROOT / "README.md", tmp_path, times=2)
    assert '"score"' in out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_second_paste_would_run_too(page: Path) -> None:
    assert rerun_problems(page) == []


def test_rerun_problems_are_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run -->\n```bash\nmkdir out\nmodel-archiver --model-name m \\\n    --export-path out\n"
        "model-archiver --inspect out/m.mar\nmserve --start --models m=m.mar\n```\n"
    )
    assert rerun_problems(page) == [
        "mkdir without -p: mkdir out",
        "model-archiver without --force: model-archiver --model-name m --export-path out",
        "the server it starts is not stopped at the end (mserve --stop)",
    ]


def test_every_example_readme_runs() -> None:
    """Each example's README has marked blocks and is run by one of the two example files."""
    examples = sorted(p.parent.name for p in (ROOT / "examples").glob("*/README.md"))
    assert sorted(name for part in EXAMPLE_SPLIT for name in part) == examples
    assert [e for e in examples if not marked_blocks(ROOT / "examples" / e / "README.md")] == []
