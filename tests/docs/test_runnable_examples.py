"""Each example's README runs as pasted (issue 47), once, from a fresh folder holding the example
where the repository has it (the READMEs run from the repository root), with a fresh home,
against the real server it starts (runnable.py). Half of the examples; the other half is in
test_runnable_examples_2.py, so that xdist runs the two side by side. That a second paste runs
too is checked by reading the page (test_runnable_docs.py): running each twice would double
the cost, torch imports and server starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from runnable import EXAMPLE_SPLIT, ROOT, run_page

# what each README's run prints, beside its exit status 0
EXPECTED = {
    "image_classifier": ['"goldfish"', '{"label":'],  # the top 5, then top1_handler's
    "kernel": ['"label": "', "(HTTP 400)"],
    "mlp": ["verify:   OK"],
    "v2_model": ['"model_name":"iris"', '"top_k":2', "(HTTP 400)", "(HTTP 404)"],
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", EXAMPLE_SPLIT[0])
def test_example_readme_runs_as_pasted(name: str, tmp_path: Path) -> None:
    example = ROOT / "examples" / name
    out = run_page(example / "README.md", tmp_path, example=example, timeout_s=240)
    for expected in EXPECTED[name]:
        assert expected in out, out[-3000:]
