"""The HTTP layer (server/http/) sits under the APIs: it knows connections, requests and
answers, and nothing of what a port's paths mean. Routers (server/rest/, server/metrics/server_metrics.py)
import it, never the other way round."""

from __future__ import annotations

import ast
from pathlib import Path

import server.http

HTTP = Path(server.http.__file__).parent
# what the HTTP layer may use of the server: its errors, token authorization, the access log,
# the tenants (a request's sender, found by its key)
BELOW = {"server.errors", "server.auth", "server.accesslog", "server.tenants"}


def _server_imports(path: Path) -> list[tuple[int, str]]:
    """Every import of a ``server`` module in ``path``, wherever it is (type-only ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(n, m) for n, m in found if m == "server" or m.startswith("server.")]


def test_the_http_layer_imports_nothing_above_it() -> None:
    modules = sorted(HTTP.glob("*.py"))
    assert {p.name for p in modules} >= {"request.py", "connection.py", "chunked.py", "server.py"}
    above = [
        f"{path.name}:{lineno} imports {name}"
        for path in modules
        for lineno, name in _server_imports(path)
        if not name.startswith("server.http.") and name not in BELOW
    ]
    assert not above, "\n".join(above)
