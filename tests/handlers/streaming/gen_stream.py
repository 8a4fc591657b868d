"""mserve's own streaming: the handler returns, per request, a generator; each item is a chunk.

Same JSON body as ``ts_stream``: ``name``, ``parts``, ``sleep``, ``fail_after``, and ``token``
(the chunk to repeat instead); ``pid`` answers the worker's pid (as the whole, unstreamed
answer) so tests can see the worker survived; ``bogus`` sends, by hand, a CHUNK frame for a
request the batch does not have (a worker breaking the protocol).
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
        elif spec.get("bogus"):
            from mserve_worker.protocol import ChunkItem, chunk_frame

            stream = context._mserve_stream
            stream._send(chunk_frame(stream.batch_id, [ChunkItem(99, b"?", 200)]))
            out.append("never read")
        else:
            out.append(_tokens(spec))
    return out
