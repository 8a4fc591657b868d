"""The marked blocks of a Markdown page as one bash script: a fenced block right after a
``<!-- run -->`` line runs; ``bash`` blocks as they are, ``python`` blocks through ``python -``,
in the page's order, in one shell (so a ``cd`` or a variable carries on, as in a reader's
terminal)."""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"^<!-- run -->\n```(bash|python)\n(.*?)^```$", re.S | re.M)


def marked_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every marked block."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(page.read_text(encoding="utf-8"))]


def as_script(blocks: list[tuple[str, str]], ports: dict[int, int]) -> str:
    """One bash script; ``ports``: the pages' default ports -> the ones the test's server took."""
    parts = ["set -euo pipefail"]
    for language, code in blocks:
        if language == "python":
            code = f"python - <<'MSERVE_DOCS_PY'\n{code}MSERVE_DOCS_PY\n"
        for theirs, ours in ports.items():
            code = code.replace(f"127.0.0.1:{theirs}", f"127.0.0.1:{ours}")
        parts.append(code)
    return "\n".join(parts)
