"""The API description (OpenAPI 3.0) that ``OPTIONS /`` and ``GET /api-description`` answer with
on the inference and management ports, as TorchServe does; tools generate clients from it.

Written as data, one entry per route, and tested against the routers: every path and method
listed here is answered by the server (tests/server/test_api_description.py).
"""

from __future__ import annotations

from typing import Any

from archiver import __version__

_MODEL = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
_VERSION = {"name": "model_version", "in": "path", "required": True, "schema": {"type": "string"}}
_OPERATION = {"name": "operation", "in": "path", "required": True, "schema": {"type": "string"},
              "description": "a custom operation: a v2 model class's op_<operation>"}  # fmt: skip
_ERROR = {"description": "TorchServe's error body: {code, type, message}"}
_JSON = {"description": "JSON", "content": {"application/json": {}}}


def _query(name: str, kind: str, description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": {"type": kind},
            "description": description}  # fmt: skip


def _op(summary: str, params: list[dict[str, Any]] | None = None, body: bool = False,
        ok: str = "200") -> dict[str, Any]:  # fmt: skip
    op: dict[str, Any] = {"summary": summary, "responses": {ok: _JSON, "default": _ERROR}}
    if params:
        op["parameters"] = params
    if body:
        op["requestBody"] = {"description": "passed to the handler as it was sent",
                             "content": {"*/*": {}}}  # fmt: skip
    return op


def _predict(summary: str, versioned: bool) -> dict[str, Any]:
    params = [_MODEL, _VERSION] if versioned else [_MODEL]
    return {"post": _op(summary, params, body=True), "put": _op(summary, params, body=True)}


_MODELS_PAGE = [
    _query("limit", "integer", "models per page (default and most 100)"),
    _query("next_page_token", "string", "where the page starts, from the previous answer"),
]

INFERENCE_PATHS: dict[str, dict[str, Any]] = {
    "/ping": {"get": _op("Healthy when every model has its minimum workers ready")},
    "/predictions/{model_name}": _predict("Predict with the default version", False),
    "/predictions/{model_name}/{model_version}": _predict("Predict with one version", True),
    "/explanations/{model_name}": _predict("Explain with the default version", False),
    "/explanations/{model_name}/{model_version}": _predict("Explain with one version", True),
    "/models": {"get": _op("List registered models", _MODELS_PAGE)},
    "/v2/health/live": {"get": _op("KServe v2 liveness")},
    "/v2/health/ready": {"get": _op("KServe v2 readiness")},
    "/v2/models/{model_name}": {"get": _op("KServe v2 model metadata", [_MODEL])},
    "/v2/models/{model_name}/ready": {"get": _op("KServe v2 model readiness", [_MODEL])},
    "/v2/models/{model_name}/infer": {"post": _op("KServe v2 inference", [_MODEL], body=True)},
    "/v2/models/{model_name}/explain": {"post": _op("KServe v2 explanation", [_MODEL], body=True)},
    "/v2/models/{model_name}/{operation}": {
        "post": _op("A custom operation", [_MODEL, _OPERATION], body=True)
    },
    "/v2/models/{model_name}/versions/{model_version}": {
        "get": _op("KServe v2 model metadata, one version", [_MODEL, _VERSION])
    },
    "/v2/models/{model_name}/versions/{model_version}/ready": {
        "get": _op("KServe v2 readiness, one version", [_MODEL, _VERSION])
    },
    "/v2/models/{model_name}/versions/{model_version}/infer": {
        "post": _op("KServe v2 inference, one version", [_MODEL, _VERSION], body=True)
    },
    "/v2/models/{model_name}/versions/{model_version}/{operation}": {
        "post": _op("A custom operation, one version", [_MODEL, _VERSION, _OPERATION],
                    body=True)
    },
    "/api-description": {"get": _op("This description"), "options": _op("This description")},
}
# KServe v1 and the Open Inference Protocol's server metadata (docs/server.md); errors there are
# {"error": message}
INFERENCE_PATHS.update({
    "/v2": {"get": _op("KServe v2 server metadata")},
    "/v1/models": {"get": _op("KServe v1: the models served")},
    "/v1/models/{model_name}": {"get": _op("KServe v1 model readiness", [_MODEL])},
    "/v1/models/{model_name}:predict": {"post": _op("KServe v1 prediction", [_MODEL], body=True)},
    "/v1/models/{model_name}:explain": {"post": _op("KServe v1 explanation", [_MODEL], body=True)},
})  # fmt: skip

_SYNC = _query("synchronous", "boolean", "wait for the workers before answering")
MANAGEMENT_PATHS: dict[str, dict[str, Any]] = {
    "/models": {
        "get": _op("List registered models", _MODELS_PAGE),
        "post": _op("Register a model archive", [
            _query("url", "string", "archive in the model store, or an allowed path", True),
            _query("model_name", "string", "name to register it under"),
            _query("handler", "string", "handler to use instead of the archive's"),
            _query("batch_size", "integer", "requests per handler call"),
            _query("max_batch_delay", "integer", "ms to wait for a batch to fill"),
            _query("initial_workers", "integer", "workers to start"),
            _query("response_timeout", "integer", "seconds one batch may take"),
            _query("startup_timeout", "integer", "seconds a worker may take to load"),
            _query("runtime", "string", "python, python2 or python3"),
            _query("synchronous", "boolean", "wait for the workers (default true)"),
        ]),
    },
    "/models/{model_name}": {
        "get": _op("Describe the default version", [_MODEL]),
        "put": _op("Scale the default version", [
            _MODEL, _query("min_worker", "integer", "workers to keep"),
            _query("max_worker", "integer", "upper bound"), _SYNC,
        ]),
        "delete": _op("Unregister the default version", [_MODEL]),
    },
    "/models/{model_name}/{model_version}": {
        "get": _op("Describe one version, or all with 'all'", [_MODEL, _VERSION]),
        "put": _op("Scale one version", [
            _MODEL, _VERSION, _query("min_worker", "integer", "workers to keep"),
            _query("max_worker", "integer", "upper bound"), _SYNC,
        ]),
        "delete": _op("Unregister one version", [_MODEL, _VERSION]),
    },
    "/models/{model_name}/{model_version}/set-default": {
        "put": _op("Make this version the default", [_MODEL, _VERSION])
    },
    "/environments": {
        "get": _op("The per-model environment cache"),
        "delete": _op("Remove cached environments no registered model uses"),
    },
    "/api-description": {"get": _op("This description"), "options": _op("This description")},
}


def describe(api: str) -> dict[str, Any]:
    """The OpenAPI document of ``api`` ("inference" or "management")."""
    paths = INFERENCE_PATHS if api == "inference" else MANAGEMENT_PATHS
    return {
        "openapi": "3.0.1",
        "info": {"title": f"mserve {api} API", "version": __version__,
                 "description": "TorchServe-compatible model server"},
        "paths": paths,
    }
