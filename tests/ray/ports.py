"""Ports for Serve's HTTP proxy in the Ray tests and scripts/bench_ray.py."""

import random
import socket


def free_proxy_port() -> int:
    """A free port for Serve's proxy, outside both the kernel's ephemeral range and Ray's
    worker ports (10002-19999), which Ray's own processes keep taking while it starts."""
    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")
