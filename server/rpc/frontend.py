"""The gRPC frontend, opened: TorchServe's inference and management services, each on its own
address, and the Open Inference Protocol's next to TorchServe's inference service, with token
authorization and TLS as the REST listeners have them. Imports grpc (~0.1 s): the server
process imports this module only when it serves gRPC, in a thread (server/lifecycle.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from server.auth import Keys
from server.config import ServerConfig, grpc_tls, split_address
from server.metrics.server_metrics import Metrics
from server.models.registry import Registry
from server.rollouts.router import Router
from server.rpc.inference import PING, InferenceService
from server.rpc.management import ManagementService
from server.rpc.mserve_management import MserveManagementService
from server.rpc.oip import PROBES, OipService
from server.rpc.server import GrpcListener, TokenGuard, credentials
from server.tls import server_context

log = logging.getLogger("mserve")


@dataclass(frozen=True)
class Opened:
    api: str  # "inference" or "management"
    listener: GrpcListener
    address: str  # host:port as bound
    url: str  # grpc:// or grpcs://


async def open_listeners(
    config: ServerConfig,
    registry: Registry,
    metrics: Metrics,
    keys: Keys | None,
    router: Router | None = None,
) -> list[Opened]:
    """Start a listener per gRPC API on this event loop; each one opened, in order."""
    tls = None
    if grpc_tls(config):
        assert config.certificate_file and config.private_key_file  # checked by the config
        # checks the files
        server_context(config.certificate_file, config.private_key_file, config.tls_security_level)
        tls = credentials(config.certificate_file, config.private_key_file)
    torchserve = InferenceService(registry, metrics, config.max_response_size_bytes, router)
    services = {
        # TorchServe's service and the Open Inference Protocol's share the inference port
        "inference": [torchserve.add_to(), OipService(registry, torchserve).add_to()],
        # TorchServe's management service, and mserve's own calls beside it (hot reload)
        "management": [
            ManagementService(registry, config.enable_model_api).add_to(),
            MserveManagementService(registry, router).add_to(),
        ],
    }
    max_request = {"inference": config.max_request_size_bytes, "management": 1 << 20}
    # the probes are exempt as their REST paths are (token_exempt_paths): Ping as /ping,
    # ServerLive and ServerReady as /v2/health/live and /v2/health/ready
    probes = {"/ping": (PING,), **PROBES}
    exempt = frozenset(
        m for path, methods in probes.items() if path in config.token_exempt_paths
        for m in methods
    )  # fmt: skip
    opened = []
    for api, added in services.items():
        guard = (
            None
            if keys is None
            else TokenGuard(keys, api, api, exempt, registry.redact, config.torchserve)
        )
        listener = GrpcListener(api, added, guard, max_request[api], config.max_response_size_bytes)
        key = f"grpc_{api}_address"
        _, host, port = split_address(getattr(config, key), key)
        bound = listener.bind(host, port, tls)
        await listener.start()
        address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        opened.append(Opened(api, listener, address, f"{'grpcs' if tls else 'grpc'}://{address}"))
        log.info("gRPC %s API listening on %s", api, opened[-1].url)
    return opened
