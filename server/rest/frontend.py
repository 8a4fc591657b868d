"""The REST listeners, opened: the inference, management and metrics APIs, each on its own
address (``http://`` or ``https://``), with its router, request size bound, access log and
token authorization."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from server.accesslog import AccessLogFile
from server.auth import Guard, Keys
from server.config import ServerConfig, split_address
from server.errors import MserveError
from server.http import HttpServer
from server.metrics.server_metrics import Metrics, MetricsAPI
from server.models.registry import Registry
from server.rest.inference import InferenceAPI
from server.rest.management import ManagementAPI
from server.rest.rollouts import RolloutAPI
from server.rest.workflows import WorkflowAPI
from server.rollouts.router import Router
from server.tls import server_context
from server.workflows.registry import Workflows

log = logging.getLogger("mserve")

# the management and metrics APIs take small bodies whatever max_request_size says
MANAGEMENT_MAX_REQUEST_BYTES = 1 << 20
METRICS_MAX_REQUEST_BYTES = 1 << 16


@dataclass(frozen=True)
class Opened:
    api: str  # "inference", "management" or "metrics"
    listener: HttpServer
    address: str  # host:port as bound
    url: str  # http:// or https://


async def open_listeners(
    config: ServerConfig, registry: Registry, metrics: Metrics, keys: Keys | None,
    access_log: AccessLogFile | None, router: Router | None = None,
) -> list[Opened]:  # fmt: skip
    """Listen on each REST API's address, in order; a port that cannot be bound stops the
    start, naming the API and the setting."""
    workflows = WorkflowAPI(
        Workflows(registry), config.enable_model_api, config.max_response_size_bytes
    )
    rollouts = RolloutAPI(router) if router is not None else None  # /models/{m}/traffic ...
    routers = {
        "inference": InferenceAPI(
            registry, metrics, config.max_response_size_bytes, workflows, router
        ),
        "management": ManagementAPI(registry, keys, config.enable_model_api, workflows, rollouts),
        "metrics": MetricsAPI(metrics),
    }
    max_request = {
        "inference": config.max_request_size_bytes,
        "management": MANAGEMENT_MAX_REQUEST_BYTES,
        "metrics": METRICS_MAX_REQUEST_BYTES,
    }
    addresses = {name: split_address(getattr(config, f"{name}_address"), name)
                 for name in routers}  # fmt: skip
    tls = None
    if any(secure for secure, _, _ in addresses.values()):
        assert config.certificate_file and config.private_key_file  # checked by the config
        tls = server_context(
            config.certificate_file, config.private_key_file, config.tls_security_level
        )
    opened = []
    for name, router in routers.items():
        secure, host, port = addresses[name]
        listener = HttpServer(
            router,
            access_log if name != "metrics" else None,
            max_request[name],
            keepalive_s=config.keepalive_timeout_s,
            read_timeout_s=config.read_timeout_s,
            max_connections=config.max_connections,
            on_answer=metrics.status if name != "metrics" else None,
            guard=guard(config, keys, name),
            redact=registry.redact,
        )
        try:
            bound = await listener.listen(host, port, tls if secure else None)
        except OSError as exc:
            raise MserveError(
                f"cannot listen on {host}:{port} for the {name} API: {exc.strerror}"
                f" (set {name}_address to another port, or 0 for any free port)"
            ) from exc
        address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        opened.append(
            Opened(name, listener, address, f"{'https' if secure else 'http'}://{address}")
        )
        log.info("%s API listening on %s", name, opened[-1].url)
    return opened


def guard(config: ServerConfig, keys: Keys | None, api: str) -> Guard | None:
    """Token authorization for one listener: the inference key on the inference port, the
    management key on the management port and, when asked, on the metrics port."""
    if keys is None or (api == "metrics" and not config.metrics_need_token):
        return None
    kind = "inference" if api == "inference" else "management"
    exempt = config.token_exempt_paths if api != "metrics" else ()
    return Guard(keys, kind, api, exempt)
