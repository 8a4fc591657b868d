"""A module-function handler that reports what it sees and fails on request (fault injection).

The JSON body's "cmd" picks the behaviour for that request: raise, wrong_length, status,
header, set_header, sleep, touch, bytes, big, exit, segfault, spawn, garbage (raw bytes on the
worker's channel), frame (a frame of the given kind nobody asked for). Otherwise it answers a
report of its environment and context.
"""

import json
import os
import tempfile
import time

INIT_CALLS = []


def _report(row, context, i, n):
    body = row.get("body")
    shown = {"bytes": len(body)} if isinstance(body, (bytes, bytearray)) else body
    return {
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_id": context.system_properties["gpu_id"],
        "batch_size": context.system_properties["batch_size"],
        "server_name": context.system_properties["server_name"],
        "model_dir": context.system_properties["model_dir"],
        "model_name": context.model_name,
        "manifest_model": context.manifest["model"]["modelName"],
        "yaml": context.model_yaml_config,
        "request_id": context.get_request_id(i),
        "x_test": context.get_request_header(i, "X-Test"),
        "authorization": context.get_request_header(i, "Authorization"),
        "body_type": type(body).__name__,
        "body": shown,
        "keys": sorted(row),
        "param_x": row.get("x"),  # a query parameter (or form field) named x
        "batch_len": n,
        "init_calls": len(INIT_CALLS),
        "cwd": os.getcwd(),
    }


def _channel(context):
    """The worker's channel to the server (the runtime's, reached through the streaming hook)."""
    return context._mserve_stream._send.__self__


def handle(data, context):
    if data is None:
        INIT_CALLS.append(1)
        return None
    out = []
    for i, row in enumerate(data):
        body = row.get("body")
        cmd = body.get("cmd") if isinstance(body, dict) else None
        if cmd == "raise":
            raise RuntimeError("probe was asked to fail")
        if cmd == "wrong_length":
            return out
        if cmd == "exit":
            os._exit(3)
        if cmd == "segfault":
            import ctypes

            ctypes.string_at(0)
        if cmd == "spawn":  # a forked child that lives on, holding the worker's socket
            child = os.fork()
            if child == 0:
                time.sleep(600)
                os._exit(0)
            out.append({"child": child})
            continue
        if cmd == "big":  # an answer of n bytes
            out.append(b"x" * int(body["n"]))
            continue
        if cmd == "sleep":
            if body.get("mark"):  # says it has begun, in TMPDIR (the sandbox's scratch folder)
                open(os.path.join(tempfile.gettempdir(), body["mark"]), "w").close()
            time.sleep(float(body.get("s", 1)))
        if cmd == "touch":  # leaves a trace, so a test can tell whether a request ran
            with open(body["path"], "w") as f:
                f.write(context.get_request_id(i))
        if cmd == "status":
            context.set_response_status(418, "I'm a teapot", i)
        if cmd == "header":
            context.set_response_header(i, "X-Probe", "yes")
            context.set_response_content_type(i, "text/x-probe")
            out.append("probe says hi")
            continue
        if cmd == "set_header":  # any name and value, even ones HTTP cannot carry
            context.set_response_header(i, body["name"], body["value"])
            out.append("header set")
            continue
        if cmd == "garbage":  # bytes on the worker's channel, as a broken worker sends them
            _channel(context).sock.sendall(body["bytes"].encode("latin-1"))
        if cmd == "frame":  # a well-formed frame nobody asked for
            from mserve_worker.protocol import Frame, Kind

            _channel(context).send(Frame(Kind[body["kind"]], body.get("meta", {})))
        if cmd == "bytes":
            out.append(bytes(range(256)))
            continue
        out.append(_report(row, context, i, len(data)))
    json.dumps(out, default=str)
    return out
