"""mserve's own streaming: the handler returns, per request, a generator; each item is a chunk.

Same JSON body as ``ts_stream``: ``name``, ``parts``, ``sleep``, ``fail_after``; ``pid`` answers
the worker's pid (as the whole, unstreamed answer) so tests can see the worker survived.
"""

import os
import time


def _tokens(spec):
    for part in range(int(spec.get("parts", 0))):
        if part and spec.get("sleep"):
            time.sleep(float(spec["sleep"]))
        if spec.get("fail_after") == part:
            raise RuntimeError(f"{spec.get('name')} failed after {part} parts")
        yield spec.get("token", f"{spec.get('name')}:{part};")


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        spec = row.get("body") or {}
        if spec.get("pid"):
            out.append({"pid": os.getpid()})
        else:
            out.append(_tokens(spec))
    return out
