"""jsonschema, imported without the modules of its optional format checks.

``import jsonschema`` imports ``rfc3987_syntax`` when it is installed
(``jsonschema[format-nongpl]``, which the ``sbom`` extra brings through cyclonedx), and that
module compiles 38 Lark grammars as it is imported: 3-4 s of CPU in every process that validates
a manifest, a model config or an OpenAI request, against ~0.1 s without it (``python -c "import
jsonschema"``). No schema of mserve uses ``format``, and format checks are off unless a validator
is given a format checker, so nothing is lost. The other format checks' modules (idna,
rfc3986_validator, webcolors, ...) are left out the same way: ~0.08 s of CPU more per process.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

# what jsonschema/_format.py imports for its format checks, when installed
_SLOW = ("rfc3987_syntax", "rfc3987", "rfc3986_validator", "rfc3339_validator", "fqdn", "idna",
         "webcolors", "jsonpointer", "uri_template", "isoduration")  # fmt: skip
_lock = threading.Lock()


def import_jsonschema() -> ModuleType:
    """The jsonschema module; call it where ``import jsonschema`` would be (it is imported at the
    first call, and a module that imported one of those modules itself keeps it)."""
    with _lock:  # a plain import below: it waits for another thread's import to finish
        hidden = [] if "jsonschema" in sys.modules else [m for m in _SLOW if m not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]  # makes its import fail
        try:
            import jsonschema
        finally:
            for name in hidden:
                del sys.modules[name]
    return jsonschema
