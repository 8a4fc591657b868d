"""Reports the environment its worker got: the variable names, a few values, and whether it
could read another process's /proc/<pid>/environ (the body's ``read_environ_of``)."""

import os


def handle(data, context):
    if data is None:
        return None
    out = []
    for row in data:
        body = row.get("body")
        answer = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "names": sorted(os.environ),
            "values": {k: os.environ.get(k) for k in ("PLAIN", "HF_TOKEN", "MY_API_TOKEN")},
        }
        pid = body.get("read_environ_of") if isinstance(body, dict) else None
        if pid:
            try:
                with open(f"/proc/{int(pid)}/environ", "rb") as f:
                    answer["read"] = f.read().decode("latin-1")
            except OSError as exc:
                answer["read_error"] = exc.strerror
        out.append(answer)
    return out
