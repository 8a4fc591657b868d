"""Echoes what the handler sees of its request's trace: ``context.trace_context(i)``, the
``traceparent`` header, the request id, and the trace id of the OpenTelemetry span current in
the handler (0 when opentelemetry is missing or no context was set). A BaseHandler subclass, so
its preprocess / inference / postprocess phases are timed. Body ``{"stream": n}``: n chunks;
``{"fail": true}``: raises in inference."""

import json

from ts.torch_handler.base_handler import BaseHandler


def _current_trace_id():
    try:
        from opentelemetry import trace
    except ImportError:
        return 0
    return trace.get_current_span().get_span_context().trace_id


def _chunks(n):
    for i in range(n):
        yield f"chunk{i};"


class TraceEcho(BaseHandler):
    def initialize(self, context):
        self.initialized = True

    def preprocess(self, data):
        # REST: the JSON body; gRPC: the input map's fields (a "stream" field: chunks)
        return [
            row.get("body") or ({"stream": int(row["stream"])} if "stream" in row else {})
            for row in data
        ]

    def inference(self, rows):
        if any(isinstance(r, dict) and r.get("fail") for r in rows):
            raise RuntimeError("trace_echo was asked to fail")
        return rows

    def postprocess(self, rows):
        out = []
        for i, row in enumerate(rows):
            if isinstance(row, dict) and row.get("stream"):
                out.append(_chunks(int(row["stream"])))
                continue
            ctx = self.context
            out.append(
                json.dumps(
                    {
                        "trace_context": ctx.trace_context(i),
                        "traceparent": ctx.get_request_header(i, "traceparent"),
                        "request_id": ctx.get_request_id(i),
                        "current_trace_id": f"{_current_trace_id():032x}",
                    }
                )
            )
        return out
