"""The console scripts ``mserve`` and ``torchserve`` (the latter from the opt-in
``mserve-torchserve`` package): what runs first.

A daemon start forks the server-to-be before anything else is imported (server/daemon.py's
:class:`~server.daemon.Prefork`), then imports the CLI (server/cli.py). Imports the standard
library and server/daemon.py only, so that the fork comes first thing.
"""

from __future__ import annotations

import sys

from server.daemon import Prefork, is_daemon_start


def main() -> None:
    """The ``mserve`` command."""
    args = sys.argv[1:]
    prefork = Prefork.start() if is_daemon_start(args) else None
    from server.cli import main as cli_main

    cli_main(args, prefork=prefork)


def torchserve_main() -> None:
    """The ``torchserve`` command (the opt-in ``mserve-torchserve`` package installs it): the
    server in TorchServe's layout, so that replacing the package is the whole migration."""
    args = sys.argv[1:]
    prefork = Prefork.start(keep_console=True) if is_daemon_start(args) else None
    from server.cli import main as cli_main

    cli_main(args, prefork=prefork, torchserve=True)
