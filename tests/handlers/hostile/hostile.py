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
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "hub")
    os.makedirs(os.path.expanduser(cache), exist_ok=True)  # as a model hub's client does
    with open("/proc/self/status") as status:
        nnp = [line.split()[1] for line in status if line.startswith("NoNewPrivs")]
    return [json.dumps({"tmp": f.name, "no_new_privs": nnp == ["1"], "cache": cache,
                        "home": os.path.expanduser("~")})]  # fmt: skip


def spawn(data, context):
    """Starts ``count`` processes that wait (a fork bomb with a bound of its own), then ends
    them: the fork that fails is the request's error."""
    if data is None:
        return None
    read_end, write_end = os.pipe()
    children = []
    try:
        while len(children) < _target(data)["count"]:
            pid = os.fork()
            if pid == 0:  # waits until the parent closes the pipe, then leaves
                os.close(write_end)
                os.read(read_end, 1)
                os._exit(0)
            children.append(pid)
    finally:
        os.close(write_end)
        os.close(read_end)
        for pid in children:
            os.waitpid(pid, 0)
    return [f"spawned {len(children)}"]


def run(data, context):
    """Runs the program ``argv`` (a setuid binary) and returns what it printed."""
    if data is None:
        return None
    import subprocess

    done = subprocess.run(_target(data)["argv"], capture_output=True, text=True, timeout=30)
    return [done.stdout + done.stderr]


def whoami(data, context):
    """The worker's real and effective uid and gid."""
    if data is None:
        return None
    return [json.dumps({"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
                        "groups": os.getgroups()})]  # fmt: skip
