"""The parts of the inference APIs that do not depend on the transport: the Open Inference
Protocol's server and model metadata, the size check of an answer, and the request ids the
server makes. The REST frontend (server/rest/inference.py), the gRPC services (server/rpc/) and
the Ray Serve ingress (server/rayserve/) all answer through these, so they agree.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from archiver import __version__
from mserve_worker.oip.signature import SignatureError, parse_signature
from mserve_worker.protocol import TOO_LARGE_HEADER, ResponseItem
from server.errors import InternalError, ResponseTooLarge
from server.models.registry import Registry
from server.models.version import ModelVersion


def server_metadata() -> dict[str, Any]:
    """The Open Inference Protocol's server metadata (``GET /v2``, gRPC ``ServerMetadata``)."""
    return {"name": "mserve", "version": __version__, "extensions": ["binary_tensor_data"]}


def model_metadata(registry: Registry, name: str, version: str | None) -> dict[str, Any]:
    """A model's OIP metadata (``GET /v2/models/{m}``, gRPC ``ModelMetadata``): its versions
    and the signature its model config declares."""
    model = registry.get(name, version)
    versions = [mv.version for mv in registry.versions(name)]
    try:  # the worker refused to load a bad one, so this one reads
        signature = parse_signature(model.model_yaml_config).metadata()
    except SignatureError as exc:
        raise InternalError(f"model {model.label}: {exc}") from None
    return {"name": model.name, "versions": versions, "platform": "mserve", **signature}


def check_size(model: ModelVersion, result: ResponseItem, max_bytes: int) -> None:
    """Raise ResponseTooLarge for an answer over ``max_response_size_bytes`` (one the worker
    already refused to send included)."""
    size = len(result.body)
    if result.status == 413 and result.headers and result.headers[0][0] == TOO_LARGE_HEADER:
        size = int(result.headers[0][1])  # the worker kept the body: it was too large
    if size > max_bytes:
        raise ResponseTooLarge(
            f"the response of {model.label} is {size} bytes, more than"
            f" max_response_size_bytes={max_bytes}"
        )


_id_prefix = os.urandom(8).hex()
_id_counter = itertools.count()


def request_id() -> str:
    """32 hex digits, unique like uuid4's: random per server process, then a counter (one
    ``os.urandom`` per request was a getrandom() system call each)."""
    return f"{_id_prefix}{next(_id_counter):016x}"
