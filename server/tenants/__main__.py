"""``python -m server.tenants [KEY]``: a new inference key (or KEY) and the sha256 line the
tenants file takes for it. The key goes to the client; only the hash goes in the file."""

from __future__ import annotations

import secrets
import sys

from server.tenants.registry import key_hash


def main(argv: list[str]) -> int:
    key = argv[0] if argv else secrets.token_urlsafe(32)
    if not argv:
        print(f"key:  {key}")
    print(f"hash: sha256:{key_hash(key)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
