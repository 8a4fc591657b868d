"""``mserve-container``: the container image's entry point (deploy/docker/Dockerfile).

What ``docker run IMAGE [ARGS]`` and a pod's ``args`` run, so that both mserve's own chart and
the runtimes written for TorchServe's image start the server unchanged:

- no arguments: ``mserve --start --foreground`` (the config baked into the image);
- arguments that start with ``-``: those flags after ``mserve --start --foreground`` (our Helm
  chart's form);
- a server command, ``mserve ...`` or ``torchserve ...`` (KServe's TorchServe runtime passes
  ``torchserve --start --model-store=... --ts-config=...``): run as given, attached: a
  ``--start`` gets ``--foreground``, so the server is the container's main process (TorchServe's
  image starts a daemon and keeps the container alive with ``tail -f /dev/null``, which hides a
  dead server from Kubernetes and its SIGTERM from the server);
- anything else (a shell, a one-off command): run as given, as TorchServe's image does.

Behind KServe (its TorchServe runtime sets ``TS_SERVICE_ENVELOPE``), TorchServe's image answers
on KServe's predictor port 8080 through a wrapper in front of the APIs that config.properties
puts on 8085; mserve speaks KServe's protocols itself, so ``torchserve`` there serves its
inference API on 8080 (unless ``MSERVE_INFERENCE_ADDRESS`` says where).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from typing import NoReturn

SERVER_COMMANDS = ("mserve", "torchserve")
# where KServe sends predictions (its default container port for HTTP)
KSERVE_HTTP_ADDRESS = "0.0.0.0:8080"


def command_for(args: list[str], environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment the entry point runs for ``args``."""
    env = dict(environ)
    if not args or args[0].startswith("-"):
        return ["mserve", "--start", "--foreground", *args], env
    if args[0] not in SERVER_COMMANDS:
        return list(args), env
    command = list(args)
    if "--start" in command and "--foreground" not in command:
        command.append("--foreground")
    if command[0] == "torchserve" and "TS_SERVICE_ENVELOPE" in env:
        env.setdefault("MSERVE_INFERENCE_ADDRESS", KSERVE_HTTP_ADDRESS)
    return command, env


def main() -> NoReturn:
    command, env = command_for(sys.argv[1:], os.environ)
    program = shutil.which(command[0], path=env.get("PATH"))
    if program is None:
        print(f"mserve-container: {command[0]}: command not found", file=sys.stderr)
        sys.exit(127)
    os.execve(program, command, env)
