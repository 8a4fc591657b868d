"""The single-node servers of tests/server, to compare Ray Serve's answers with."""

from tests.server.conftest import start_server  # noqa: F401  (a fixture)
