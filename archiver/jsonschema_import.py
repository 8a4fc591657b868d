"""jsonschema, imported without the grammars of its optional ``iri`` format check.

``import jsonschema`` imports ``rfc3987_syntax`` when it is installed
(``jsonschema[format-nongpl]``, which the ``sbom`` extra brings through cyclonedx), and that
module compiles 38 Lark grammars as it is imported: 3-4 s of CPU in every process that validates
a manifest, a model config or an OpenAI request, against ~0.1 s without it (``python -c "import
jsonschema"``). No schema of mserve uses ``format``, and format checks are off unless a validator
is given a format checker, so nothing is lost.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

_SLOW = "rfc3987_syntax"
_lock = threading.Lock()


def import_jsonschema() -> ModuleType:
    """The jsonschema module; call it where ``import jsonschema`` would be (it is imported at the
    first call, and a module that imported ``rfc3987_syntax`` itself keeps it)."""
    with _lock:  # a plain import below: it waits for another thread's import to finish
        hidden = "jsonschema" not in sys.modules and _SLOW not in sys.modules
        if hidden:
            sys.modules[_SLOW] = None  # type: ignore[assignment]  # makes its import fail
        try:
            import jsonschema
        finally:
            if hidden:
                del sys.modules[_SLOW]
    return jsonschema
