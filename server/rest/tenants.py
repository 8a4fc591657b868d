"""The management API's tenants paths (docs/tenants.md), over server/tenants/edit.py:

- ``GET /tenants``: the tenants in force; ``POST /tenants``: add one (JSON body), with a key
  made by the server and answered once;
- ``GET | PUT | DELETE /tenants/{name}``: one tenant with its live usage, change its weight
  and quotas (JSON body), remove it;
- ``POST /tenants/{name}/keys``: a new key for it (answered once);
  ``DELETE /tenants/{name}/keys/{id}``: revoke one.

Each change is written to the tenants file and applied as a reload of it. Without a
``tenants_file`` every path is a 404 saying so.
"""

from __future__ import annotations

from server import tenants
from server.http import Connection, Request
from server.models.registry import Registry
from server.rest.rollouts import json_body
from server.tenants import edit


def manage(conn: Connection, req: Request, registry: Registry) -> bool:
    """Answer ``req`` when it is one of these paths (True), else leave it (False)."""
    parts = req.parts
    if not parts or parts[0] != "tenants" or len(parts) > 4:
        return False
    n = len(parts)
    if n >= 3 and parts[2] != "keys":
        return False
    methods = {1: ("GET", "POST"), 2: ("GET", "PUT", "DELETE"), 3: ("POST",), 4: ("DELETE",)}
    method = req.allow(*methods[n])
    current = edit.required(tenants.current)
    if n == 1:
        if method == "GET":
            answer = edit.listing(current)
        else:
            answer = edit.add_tenant(current, json_body(req))
    elif n == 2:
        name = parts[1]
        if method == "GET":
            queues = ((mv.name, mv.queue) for mv in registry.all())
            answer = edit.detail(current, name, queues)
        elif method == "PUT":
            answer = edit.change_tenant(current, name, json_body(req))
        else:
            answer = edit.remove_tenant(current, name)
    elif n == 3:
        answer = edit.add_key(current, parts[1])
    else:
        answer = edit.revoke_key(current, parts[1], parts[3])
    conn.answer_json(req, 200, answer)
    return True
