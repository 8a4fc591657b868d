"""Handlers that try to reach beyond their model: one entry point per attack, each archived on
its own. The request body (JSON) names the target; the attempt's OS error fails the request."""

import json
import os
import socket
import tempfile


def _target(data):
    body = data[0].get("body") or data[0].get("data")
    return json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body


def read_file(data, context):
    """Reads the file named by ``path`` (the server's key file, another model's files)."""
    if data is None:
        return None
    with open(_target(data)["path"], "rb") as f:
        return [f.read().decode(errors="replace")[:100]]


def write_file(data, context):
    """Writes the file named by ``path`` (another model's folder, outside its scratch)."""
    if data is None:
        return None
    with open(_target(data)["path"], "w") as f:
        f.write("owned")
    return ["written"]


def connect(data, context):
    """Opens a TCP connection to ``port`` on 127.0.0.1 (the server's own ports)."""
    if data is None:
        return None
    with socket.create_connection(("127.0.0.1", _target(data)["port"]), timeout=5):
        return ["connected"]


def bind(data, context):
    """Listens on a TCP port of its own."""
    if data is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", _target(data).get("port", 0)))
        return ["bound"]


def open_files(data, context):
    """Opens files without bound."""
    if data is None:
        return None
    kept = [open(os.devnull) for _ in range(_target(data)["count"])]  # noqa: SIM115
    return [f"opened {len(kept)}"]


def scratch(data, context):
    """What a well-behaved model may do: write a temporary file; reports where, and whether
    it runs with no_new_privs."""
    if data is None:
        return None
    with tempfile.NamedTemporaryFile("w", delete=False) as f:
        f.write("fine")
    with open("/proc/self/status") as status:
        nnp = [line.split()[1] for line in status if line.startswith("NoNewPrivs")]
    return [json.dumps({"tmp": f.name, "no_new_privs": nnp == ["1"]})]
