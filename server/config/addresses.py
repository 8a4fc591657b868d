"""The listeners' addresses as the config writes them (``[http://|https://]host:port``): their
parts, and whether a listener serves TLS."""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.errors import ConfigError

if TYPE_CHECKING:
    from server.config.server_config import ServerConfig

ADDRESS_KEYS = ("inference_address", "management_address", "metrics_address")
GRPC_ADDRESS_KEYS = ("grpc_inference_address", "grpc_management_address")


def split_address(value: str, key: str) -> tuple[bool, str, int]:
    """(TLS, host, port) of ``[http://|https://]host:port`` (port 0 = any free port); a bare
    port means 127.0.0.1, as does an empty host."""
    tls = False
    lower = value.lower()
    if lower.startswith(("http://", "https://")):
        tls = lower.startswith("https://")
        value = value.split("://", 1)[1].rstrip("/")
    host, sep, port = value.rpartition(":")
    if not sep or "]" in port:
        host, port = "127.0.0.1", value
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not host:port") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{key}: port {number} is out of range 0-65535")
    return tls, host.strip("[]") or "127.0.0.1", number


def grpc_tls(config: ServerConfig) -> bool:
    """Whether the gRPC frontend serves TLS: TorchServe's ``enable_grpc_ssl``, or an address
    written ``https://``; both of its ports alike."""
    return config.enable_grpc_ssl or any(
        split_address(getattr(config, key), key)[0] for key in GRPC_ADDRESS_KEYS
    )


def parse_address(value: str, key: str) -> tuple[str, int]:
    """(host, port) of an address (see split_address)."""
    return split_address(value, key)[1:]
