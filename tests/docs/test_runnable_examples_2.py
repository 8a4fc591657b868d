"""Each example's README runs as pasted (issue 47): the other half of test_runnable_examples.py
(see there), in a file of its own so that xdist runs the two side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
from runnable import EXAMPLE_SPLIT, ROOT, run_page

# what each README's run prints, beside its exit status 0
EXPECTED = {
    "hooks": ['"samples":2'],
    "tiny_lm": ["CompletionUsage(", "data: [DONE]", "leaves no room to answer (HTTP 400)"],
    "waveglow": ["wrote out/waveglow_synthesizer.mar"],
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", EXAMPLE_SPLIT[1])
def test_example_readme_runs_as_pasted(name: str, tmp_path: Path) -> None:
    example = ROOT / "examples" / name
    out = run_page(example / "README.md", tmp_path, example=example, timeout_s=240)
    for expected in EXPECTED[name]:
        assert expected in out, out[-3000:]
