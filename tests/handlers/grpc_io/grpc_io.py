"""Answers requests as a gRPC client sends them (TorchServe's ``input`` map: named byte fields)
and fails on request. The ``data`` field is a command:

- (anything else): a JSON report of the fields the request got, their types, the ``data``
  value and the sequence-id and Content-Type headers;
- ``raise``: raises; ``sleep:<s>``: sleeps that long; ``status:<code>``: answers with that status;
- ``stream:<n>``: returns a generator of n chunks; ``ts_stream:<n>``: n chunks sent with
  TorchServe's ``send_intermediate_predict_response``, then a last one.
"""

import json
import time


def _chunks(n):
    for i in range(n):
        yield f"part{i};"


def handle(data, context):
    if data is None:
        return None
    out = []
    for i, row in enumerate(data):
        raw = row.get("data")
        cmd = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else ""
        if cmd == "raise":
            raise RuntimeError("grpc_io was asked to fail")
        if cmd.startswith("sleep:"):
            time.sleep(float(cmd[len("sleep:") :]))
            out.append("slept")
        elif cmd.startswith("status:"):
            context.set_response_status(int(cmd[len("status:") :]), "", i)
            out.append("the handler set this status")
        elif cmd.startswith("stream:"):
            out.append(_chunks(int(cmd[len("stream:") :])))
        elif cmd.startswith("ts_stream:"):
            from ts.handler_utils.utils import send_intermediate_predict_response

            for part in range(int(cmd[len("ts_stream:") :])):
                ids = {i: context.request_ids[i]}
                send_intermediate_predict_response({i: f"ts{part};"}, ids, "", 200, context)
            out.append("last;")
        else:
            out.append(json.dumps({
                "keys": sorted(row),
                "types": {k: type(v).__name__ for k, v in row.items()},
                "data": raw.decode("latin-1") if isinstance(raw, (bytes, bytearray)) else raw,
                "extra": list(row["extra"]) if "extra" in row else None,
                "sequence": context.get_request_header(i, "ts_request_sequence_id"),
                "content_type": context.get_request_header(i, "Content-Type"),
            }))  # fmt: skip
    return out
