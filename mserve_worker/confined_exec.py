"""Run a command confined: how the server runs a model environment's build (uv, pip, the
import probe, the SBOM generator), which may run code of the model's requirements (a source
package's ``setup.py`` or build backend, a ``.pth`` file at interpreter start).

``python -I -m mserve_worker.confined_exec POLICY_JSON COMMAND [ARG...]`` applies ``POLICY_JSON``
(the shape a worker's INIT ``sandbox`` has: ``mserve_worker/confine.py``) to itself, then
executes ``COMMAND``: Landlock and ``no_new_privs`` hold across ``exec`` and for every process
the command starts. Exit status 126 when the policy cannot be applied. Stdlib only.
"""

from __future__ import annotations

import json
import os
import sys

from .confine import apply


def main(argv: list | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m mserve_worker.confined_exec POLICY_JSON COMMAND [ARG...]",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        report = apply(json.loads(args[0]))
    except (OSError, ValueError) as exc:
        print(f"mserve: could not confine {args[1]}: {exc}", file=sys.stderr)
        return 126
    if report.get("reason"):  # said where the build's output is logged
        print(f"mserve: {os.path.basename(args[1])} runs unconfined: {report['reason']}",
              file=sys.stderr)  # fmt: skip
    try:
        os.execv(args[1], args[1:])
    except OSError as exc:
        print(f"mserve: could not run {args[1]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
