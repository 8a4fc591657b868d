"""The management API's paths for a model's traffic (docs/rollouts.md), beside TorchServe's:

- ``GET | PUT | DELETE /models/{name}/traffic``: the split between versions and the sticky key
  (``PUT`` takes a JSON body ``{"weights": {...}, "sticky": {...}}``);
- ``GET | POST | DELETE /models/{name}/canary``: a canary rollout (``POST`` takes the plan as a
  JSON body), ``PUT /models/{name}/canary/{pause|resume|promote|abort}``;
- ``GET | PUT | DELETE /models/{name}/shadow``: the shadow onto another version (``PUT`` takes
  its settings as a JSON body; ``GET`` adds the kept differing pairs; server/rollouts/shadow.py).

``traffic``, ``canary`` and ``shadow`` in the third segment are these paths, not versions of
that name.
"""

from __future__ import annotations

import json
from typing import Any

from server.errors import BadRequest
from server.http import Connection, Request
from server.rollouts import control
from server.rollouts.router import Router


class RolloutAPI:
    def __init__(self, router: Router) -> None:
        self.router = router

    def manage(self, conn: Connection, req: Request) -> bool:
        """Answer ``req`` when it is one of these paths (True), else leave it (False)."""
        parts = req.parts
        if len(parts) not in (3, 4) or parts[0] != "models":
            return False
        name, what = parts[1], parts[2]
        router = self.router
        if what == "traffic" and len(parts) == 3:
            method = req.allow("GET", "PUT", "DELETE")
            if method == "GET":
                answer = control.traffic(router, name)
            elif method == "PUT":
                answer = control.set_traffic(router, name, json_body(req))
            else:
                answer = control.clear_traffic(router, name)
        elif what == "canary" and len(parts) == 3:
            method = req.allow("GET", "POST", "DELETE")
            if method == "GET":
                answer = control.canary_state(router, name)
            elif method == "POST":
                answer = control.start_canary(router, name, json_body(req))
            else:
                answer = control.forget_canary(router, name)
        elif what == "canary":
            req.allow("PUT")
            answer = control.canary_action(router, name, parts[3])
        elif what == "shadow" and len(parts) == 3 and router.shadows is not None:
            method = req.allow("GET", "PUT", "DELETE")  # server/rollouts/shadow.py
            if method == "GET":
                answer = router.shadows.inspect(name)
            elif method == "PUT":
                answer = router.shadows.put(name, json_body(req))
            else:
                answer = router.shadows.delete(name)
        else:
            return False
        conn.answer_json(req, 200, answer)
        return True

    def described(self, name: str, described: Any) -> Any:
        """Describe's entries with the model's ``traffic`` section (when it has a policy)."""
        shown = self.router.describe(name)
        if shown is None or not isinstance(described, list):
            return described
        return [{**entry, "traffic": shown} for entry in described]


def json_body(req: Request) -> Any:
    try:
        return json.loads(bytes(req.body) or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body: not JSON ({exc})") from None
