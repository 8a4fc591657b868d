"""``mserve`` entry point. The server itself is not built yet (issue 3)."""

from __future__ import annotations

import sys


def main() -> None:
    print(
        "mserve: the server is not implemented yet; use model-archiver to build archives for now",
        file=sys.stderr,
    )
    sys.exit(2)
