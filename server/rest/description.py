"""The API description (OpenAPI 3.0) that ``OPTIONS /`` and ``GET /api-description`` answer with
on the inference and management ports, as TorchServe does; tools generate clients from it.

Written as data, one entry per route, and tested against the routers: every path and method
listed here is answered by the server (tests/server/test_api_description.py), and a fuzzer sends
schema-valid requests to a real server and checks every answer against it (status documented,
content type, body schema; tests/server/test_api_fuzz.py). So each operation lists every status
it can answer, and its parameters say what the server accepts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from archiver import __version__
from server.operations import MAX_PAGE, MAX_WORKERS
from server.rest.rollout_schemas import CANARY_BODY, SHADOW_BODY, TRAFFIC_BODY
from server.rest.rollout_schemas import SCHEMAS as ROLLOUT_SCHEMAS
from server.rest.tenant_schemas import NEW_TENANT_BODY, TENANT_BODY
from server.rest.tenant_schemas import SCHEMAS as TENANT_SCHEMAS

if TYPE_CHECKING:
    from server.http import Connection, Request


_NAME = {"type": "string", "minLength": 1}
_MODEL = {"name": "model_name", "in": "path", "required": True, "schema": _NAME}
_VERSION = {"name": "model_version", "in": "path", "required": True, "schema": _NAME}
_OPERATION = {
    "name": "operation", "in": "path", "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
    "description": "a custom operation: a v2 model class's op_<operation>",
}  # fmt: skip


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(description, _ref("Error"))


def _error_or_text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {
        "application/json": {"schema": _ref("Error")},
        "text/plain": {"schema": {"type": "string"}},
    }}  # fmt: skip


# Answers any operation can get: the server is stopping (503), or no key was given (401; not on
# the public health and description paths).
_STOPPING = _error("the server is shutting down")
_UNAUTHORIZED = {
    **_error("no valid key: `Authorization: Bearer <key>` is required"),
    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
}
PUBLIC_PATHS = ("/ping", "/v2/health/live", "/v2/health/ready", "/api-description")

_OBJECT = {"type": "object"}
SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "description": "TorchServe's error body",
        "required": ["code", "type", "message"],
        "properties": {
            "code": {"type": "integer", "description": "the HTTP status"},
            "type": {"type": "string", "description": "TorchServe's exception name"},
            "message": {"type": "string"},
        },
    },
    "OipError": {
        "type": "object",
        "description": "the Open Inference Protocol's error body, on /v1 and /v2 paths",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "OpenAIError": {
        "type": "object",
        "description": "OpenAI's error body, on /openai/ paths (docs/generative.md)",
        "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": "string", "nullable": True},
                           "code": {"type": "string", "nullable": True}},
        }},
    },
    "Status": {
        "type": "object", "required": ["status"], "properties": {"status": {"type": "string"}},
    },
    "ModelList": {
        "type": "object",
        "required": ["models"],
        "properties": {
            "models": {"type": "array", "items": {
                "type": "object", "required": ["modelName", "modelUrl"],
                "properties": {
                    "modelName": {"type": "string"}, "modelUrl": {"type": "string"},
                    "loadState": {"type": "string", "enum": ["loaded", "loading", "unloaded"]},
                },
            }},
            "nextPageToken": {"type": "string", "description": "present when more models follow"},
        },
    },
    "ModelDescription": {
        "type": "array",
        "description": "one entry per version (one unless 'all' was asked for); an archive still"
                       " downloading is listed with the fields known so far",
        "items": {
            "type": "object",
            "required": ["modelName", "modelVersion", "modelUrl", "status", "workers"],
            "properties": {
                "modelName": {"type": "string"},
                "modelVersion": {"type": "string", "nullable": True},
                "modelUrl": {"type": "string"},
                "status": {"type": "string", "enum": ["READY", "LOADING", "FAILED"]},
                "loadState": {"type": "string", "enum": ["loaded", "loading", "unloaded"]},
                "minWorkers": {"type": "integer"},
                "maxWorkers": {"type": "integer"},
                "batchSize": {"type": "integer"},
                "maxBatchDelay": {"type": "integer"},
                "workers": {"type": "array", "items": {
                    "type": "object",
                    "required": ["id", "pid", "status"],
                    "properties": {
                        "id": {"type": "string"},
                        "pid": {"type": "integer", "nullable": True},
                        "status": {"type": "string", "enum": ["READY", "UNLOADING"]},
                    },
                }},
            },
        },
    },
    "V2Metadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array"},
            "outputs": {"type": "array"},
        },
    },
    "V2ModelReady": {
        "type": "object",
        "required": ["name", "version", "ready"],
        "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                       "ready": {"type": "boolean"}},
    },
    "V1ModelReady": {
        "type": "object",
        "required": ["name", "ready"],
        "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}},
    },
    "Environments": {
        "type": "object",
        "required": ["root", "totalBytes", "environments"],
        "properties": {
            "root": {"type": "string"},
            "totalBytes": {"type": "integer", "minimum": 0},
            "environments": {"type": "array", "items": {
                "type": "object", "required": ["key", "inUse"],
                "properties": {"key": {"type": "string"}, "inUse": {"type": "boolean"}},
            }},
        },
    },
}  # fmt: skip


def _op(
    summary: str,
    answers: dict[str, Any],
    params: list[dict[str, Any]] | None = None,
    body: bool = False,
) -> dict[str, Any]:
    """An operation answering ``answers`` (status -> response) and, where it has them, 400 for
    a bad parameter, 413 for a body over max_request_size_bytes, and 503 while stopping."""
    responses = dict(answers)
    if params and any(p["in"] == "query" for p in params):
        responses.setdefault("400", _error("a parameter is not what it must be"))
    if body:
        responses.setdefault("413", _error("the body is over max_request_size_bytes"))
    responses.setdefault("503", _STOPPING)
    op: dict[str, Any] = {"summary": summary, "responses": dict(sorted(responses.items()))}
    if params:
        op["parameters"] = params
    if body:
        op["requestBody"] = {
            "description": "passed to the handler as it was sent",
            "content": {"application/json": {}, "text/plain": {"schema": {"type": "string"}},
                        "application/octet-stream": {"schema": {"type": "string",
                                                                "format": "binary"}}},
        }  # fmt: skip
    return op


def _query(
    name: str, schema: dict[str, Any], description: str, required: bool = False
) -> dict[str, Any]:
    param = {"name": name, "in": "query", "required": required, "schema": schema,
             "description": description}  # fmt: skip
    if not required:  # as TorchServe reads them, `?limit=` is `limit` left out
        param["allowEmptyValue"] = True
    return param


_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_WORKERS = {"type": "integer", "minimum": 0, "maximum": MAX_WORKERS}
_NOT_FOUND = _error("no such model (ModelNotFoundException) or version")

# What a prediction can answer: the handler's own answer, in the status, content type and body
# it chose (any status; TorchServe's PredictionException picks one), or the server's errors.
_PREDICTED = {
    "200": {"description": "the handler's answer, as it made it",
            "content": {"*/*": {}}},
    "default": {"description": "the handler's answer with the status it set"},
    "400": _error("the body could not be decoded for the handler, or a bad parameter"),
    "404": _NOT_FOUND,
    "413": _error("the request or the handler's answer is over its size limit"),
    "429": {**_error("the model's queue is full (job_queue_size): try again shortly"),
            "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
    "500": _error_or_text("the handler failed (for one request of a batch: the worker's"
                          " text/plain), or its worker died (naming it and how it ended)"),
    "503": _error("no worker can take it: none started, the model failed, or stopping"),
    "504": _error("the batch ran past response_timeout; its worker is replaced"),
}  # fmt: skip


def _predict(summary: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    return _op(summary, _PREDICTED, params, body=True)


_MODELS_PAGE = [
    _query("limit", _INT, f"models per page (default and most {MAX_PAGE}; out of range: "
                          f"{MAX_PAGE})"),
    _query("next_page_token", _INT, "where the page starts, from the previous answer"),
]  # fmt: skip
_LIST = _op("List registered models", {"200": _json("a page of models", _ref("ModelList"))},
            _MODELS_PAGE)  # fmt: skip
_DESCRIPTION = {"200": _json("this document", _OBJECT)}
_API_DESCRIPTION = {
    "get": _op("This description", _DESCRIPTION),
    "options": _op("This description", _DESCRIPTION),
}
_V2_READY = {"200": _json("ready", _ref("V2ModelReady")),
             "503": _json("not ready (no worker, or the model failed)", _ref("V2ModelReady")),
             "404": _NOT_FOUND}  # fmt: skip

INFERENCE_PATHS: dict[str, dict[str, Any]] = {
    "/ping": {"get": _op("Healthy when every model has its minimum workers ready", {
        "200": _json("healthy", _ref("Status")),
        "500": _json("unhealthy: a model lacks its minimum workers (TorchServe's answer)",
                     _ref("Status")),
    })},
    "/predictions/{model_name}": {
        "post": _predict("Predict with the default version", [_MODEL]),
        "put": _predict("Predict with the default version", [_MODEL]),
    },
    "/predictions/{model_name}/{model_version}": {
        "post": _predict("Predict with one version", [_MODEL, _VERSION]),
        "put": _predict("Predict with one version", [_MODEL, _VERSION]),
    },
    "/explanations/{model_name}": {
        "post": _predict("Explain with the default version", [_MODEL]),
        "put": _predict("Explain with the default version", [_MODEL]),
    },
    "/explanations/{model_name}/{model_version}": {
        "post": _predict("Explain with one version", [_MODEL, _VERSION]),
        "put": _predict("Explain with one version", [_MODEL, _VERSION]),
    },
    "/models": {"get": _LIST},
    "/v2/health/live": {"get": _op("KServe v2 liveness", {
        "200": _json("live", {"type": "object", "required": ["live"],
                              "properties": {"live": _BOOL}}),
    })},
    "/v2/health/ready": {"get": _op("KServe v2 readiness", {
        "200": _json("ready", {"type": "object", "required": ["ready"],
                               "properties": {"ready": _BOOL}}),
        "503": _json("not ready", {"type": "object", "required": ["ready"],
                                   "properties": {"ready": _BOOL}}),
    })},
    "/v2/models/{model_name}": {"get": _op("KServe v2 model metadata", {
        "200": _json("metadata", _ref("V2Metadata")), "404": _NOT_FOUND}, [_MODEL])},
    "/v2/models/{model_name}/ready": {"get": _op("KServe v2 model readiness", _V2_READY,
                                                 [_MODEL])},
    "/v2/models/{model_name}/infer": {"post": _predict("KServe v2 inference", [_MODEL])},
    "/v2/models/{model_name}/explain": {"post": _predict("KServe v2 explanation", [_MODEL])},
    "/v2/models/{model_name}/{operation}": {
        "post": _predict("A custom operation", [_MODEL, _OPERATION])
    },
    "/v2/models/{model_name}/versions/{model_version}": {
        "get": _op("KServe v2 model metadata, one version", {
            "200": _json("metadata", _ref("V2Metadata")), "404": _NOT_FOUND}, [_MODEL, _VERSION])
    },
    "/v2/models/{model_name}/versions/{model_version}/ready": {
        "get": _op("KServe v2 readiness, one version", _V2_READY, [_MODEL, _VERSION])
    },
    "/v2/models/{model_name}/versions/{model_version}/infer": {
        "post": _predict("KServe v2 inference, one version", [_MODEL, _VERSION])
    },
    "/v2/models/{model_name}/versions/{model_version}/{operation}": {
        "post": _predict("A custom operation, one version", [_MODEL, _VERSION, _OPERATION])
    },
    "/api-description": _API_DESCRIPTION,
    # KServe v1 (as TorchServe serves it) and the Open Inference Protocol's server metadata
    "/v2": {"get": _op("KServe v2 server metadata", {"200": _json("the server", {
        "type": "object", "required": ["name", "version", "extensions"],
        "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                       "extensions": {"type": "array", "items": {"type": "string"}}},
    })})},
    "/v1/models": {"get": _op("KServe v1: the models served", {"200": _json("their names", {
        "type": "object", "required": ["models"],
        "properties": {"models": {"type": "array", "items": {"type": "string"}}},
    })})},
    "/v1/models/{model_name}": {"get": _op("KServe v1 model readiness", {
        "200": _json("ready", _ref("V1ModelReady")), "404": _NOT_FOUND,
        "503": _json("not ready (no worker, or the model failed)", _ref("V1ModelReady")),
    }, [_MODEL])},
    "/v1/models/{model_name}:predict": {"post": _predict("KServe v1 prediction", [_MODEL])},
    "/v1/models/{model_name}:explain": {"post": _predict("KServe v1 explanation", [_MODEL])},
}  # fmt: skip

# The OpenAI-compatible API (server/openai/, docs/generative.md): OpenAI's request bodies and
# answers, its error body on every refusal.
_OPENAI_ANSWERS = {
    "400": _error("a bad parameter, a prompt over the model's context, or a model that is not"
                  " generative"),
    "404": _error("no such model (model_not_found)"),
    "500": _error("the handler failed before its answer began (after: a last SSE error event)"),
}  # fmt: skip


def _openai(summary: str, answer: str) -> dict[str, Any]:
    op = _op(summary, {
        "200": {"description": answer, "content": {
            "application/json": {"schema": _OBJECT},
            "text/event-stream": {"schema": {"type": "string"}},
        }},
        **_OPENAI_ANSWERS,
    })  # fmt: skip
    op["requestBody"] = {"required": True, "description": "OpenAI's request body",
                         "content": {"application/json": {"schema": _OBJECT}}}  # fmt: skip
    op["responses"].setdefault("413", _error("the body is over max_request_size_bytes"))
    return op


INFERENCE_PATHS.update({
    "/openai/v1/chat/completions": {"post": _openai(
        "OpenAI chat completions", "the completion, or with `stream: true` its chunks as"
        " server-sent events ending in `data: [DONE]`")},
    "/openai/v1/completions": {"post": _openai(
        "OpenAI completions", "the completion, or with `stream: true` its chunks as"
        " server-sent events ending in `data: [DONE]`")},
    "/openai/v1/embeddings": {"post": _openai("OpenAI embeddings", "the embeddings")},
    "/openai/v1/models": {"get": _op("OpenAI: the generative models", {
        "200": _json("their model cards", _OBJECT)})},
    "/openai/v1/models/{model_name}": {"get": _op("OpenAI: one generative model", {
        "200": _json("its model card", _OBJECT), "404": _error("no such generative model")},
        [_MODEL])},
})  # fmt: skip

_SYNC = _query("synchronous", _BOOL, "wait for the workers before answering (default false)")
_STATUS = _json("done", _ref("Status"))
_STARTED = _json("accepted; the workers start in the background", _ref("Status"))
_SCALE = {
    "200": _STATUS, "202": _STARTED, "404": _NOT_FOUND,
    "400": _error("a bad parameter, or (synchronous) a worker that could not load the handler"),
}  # fmt: skip
_SCALE_PARAMS = [
    _query("min_worker", _WORKERS, "workers to keep"),
    _query("max_worker", _WORKERS, "upper bound (at least min_worker)"), _SYNC,
]  # fmt: skip

_RELOADED = {
    "200": _json("the workers switched to the code on disk", {
        "type": "object", "required": ["status", "workers", "seconds"],
        "properties": {"status": {"type": "string"}, "workers": {"type": "integer"},
                       "code": {"type": "object", "nullable": True},
                       "seconds": {"type": "number"}}}),
    "400": _error("the new code failed (its file and line), the old code serves on; or"
                  " the model runs continuous batching or is a parallel model"),
    "404": _NOT_FOUND,
}  # fmt: skip


def _json_body(op: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``op`` taking a JSON body of ``schema``; a body that is not JSON or breaks the schema is
    a 400 naming the field, one over max_request_size_bytes a 413."""
    op["requestBody"] = {"required": True, "description": schema["description"],
                         "content": {"application/json": {"schema": schema}}}  # fmt: skip
    op["responses"]["413"] = _error("the body is over max_request_size_bytes")
    op["responses"] = dict(sorted(op["responses"].items()))
    return op


# docs/rollouts.md and docs/shadow.md (server/rest/rollouts.py): on a model *name*
_BAD_BODY = _error("the body is not JSON, a field is wrong (named), or a version of the model is"
                   " being unregistered")  # fmt: skip
_TRAFFIC = _json("the model's traffic", _ref("Traffic"))
_CANARY = _json("the canary", _ref("Canary"))
_NO_CANARY = _error("no such model, or it has no canary")
_SHADOW = _json("the shadow", _ref("Shadow"))
_NO_SHADOW = _error("no such model, or it has no shadow")
_ACTION = {
    "name": "action", "in": "path", "required": True,
    "schema": {"type": "string", "enum": ["pause", "resume", "promote", "abort"]},
    "description": "pause or resume its steps; promote: the canary takes every request and"
                   " becomes the default; abort: back to the baseline",
}  # fmt: skip
_SWAP_PARAMS = [
    _query("to", _NAME, "the registered version that replaces this one", True),
    _query("workers", {"type": "integer", "minimum": 1, "maximum": MAX_WORKERS},
           "the new version's workers at the end (default: this one's now, at least 1)"),
    _query("unregister", _BOOL, "unregister this version at the end (default false)"),
    _query("overlap", _BOOL, "start each new worker before draining an old one, one worker"
                             " over the memory budget meanwhile (default false)"),
    _query("synchronous", _BOOL, "answer when the swap has ended (default false)"),
]  # fmt: skip
ROLLOUT_PATHS: dict[str, dict[str, Any]] = {
    "/models/{model_name}/traffic": {
        "get": _op("The split between the model's versions and what each served", {
            "200": _TRAFFIC, "404": _NOT_FOUND}, [_MODEL]),
        "put": _json_body(_op("Set the split and/or the sticky key (the shadow stays)", {
            "200": _TRAFFIC, "400": _BAD_BODY, "404": _NOT_FOUND}, [_MODEL]), TRAFFIC_BODY),
        "delete": _op("Clear the split: the default version takes every request (a canary and"
                      " the shadow stay)", {"200": _TRAFFIC, "404": _NOT_FOUND}, [_MODEL]),
    },
    "/models/{model_name}/canary": {
        "get": _op("The canary's state", {"200": _CANARY, "404": _NO_CANARY}, [_MODEL]),
        "post": _json_body(_op("Start a canary of a version over the baseline", {
            "200": _CANARY,
            "400": _error("the body is not JSON, a field is wrong (named), the model has one"
                          " version, or a swap is running"),
            "404": _NOT_FOUND}, [_MODEL]), CANARY_BODY),
        "delete": _op("Forget the canary (aborted first when it runs)", {
            "200": _CANARY, "404": _NO_CANARY}, [_MODEL]),
    },
    "/models/{model_name}/canary/{action}": {
        "put": _op("Pause, resume, promote or abort the canary", {
            "200": _CANARY, "404": _NO_CANARY}, [_MODEL, _ACTION]),
    },
    "/models/{model_name}/shadow": {
        "get": _op("The shadow's settings, counts and kept differing pairs", {
            "200": _SHADOW, "404": _NO_SHADOW}, [_MODEL]),
        "put": _json_body(_op("Shadow a share of the traffic onto another version", {
            "200": _SHADOW, "400": _BAD_BODY, "404": _NOT_FOUND}, [_MODEL]), SHADOW_BODY),
        "delete": _op("Stop the shadow (answers its last counts)", {
            "200": _SHADOW, "404": _NO_SHADOW}, [_MODEL]),
    },
    "/models/{model_name}/reload": {
        "put": _op("Hot-reload the default version's handler code (docs/hot-reload.md)",
                   _RELOADED, [_MODEL]),
    },
    "/models/{model_name}/{model_version}/swap": {
        "put": _op("Replace this version by another in place, one worker at a time within the"
                   " memory budget (docs/swap.md)", {
            "200": _STATUS,
            "202": _json("accepted; GET /models/{model_name} shows its progress",
                         _ref("Status")),
            "400": _error("a bad parameter, a version not registered, a swap or canary running,"
                          " a version being unregistered; synchronous: the swap failed on a bad"
                          " archive and rolled back"),
            "404": _NOT_FOUND,
            "500": _error("synchronous: a worker died during the swap, which rolled back"),
            "504": _error("synchronous: a worker did not load in time; the swap rolled back"),
        }, [_MODEL, _VERSION, *_SWAP_PARAMS]),
    },
}  # fmt: skip

# docs/tenants.md (server/rest/tenants.py): each change is written to tenants_file
_TENANT = {"name": "tenant_name", "in": "path", "required": True, "schema": _NAME,
           "description": "a tenant of tenants_file (GET /tenants lists them)"}  # fmt: skip
_KEY_ID = {
    "name": "key_id",
    "in": "path",
    "required": True,
    "schema": _NAME,
    "description": "sha256: and at least 8 hex digits of the key's hash (its id)",
}
_NO_TENANT = _error("no tenants_file, or no such tenant (or key)")
_UNWRITTEN = _error(
    "the tenant exists already, or the file does not read now (a hand edit"
    " half done) or cannot be written: nothing changed"
)
_NEW_KEY = _json("the key, shown this once", _ref("TenantKey"))
TENANT_PATHS: dict[str, dict[str, Any]] = {
    "/tenants": {
        "get": _op("The tenants in force (no key)", {
            "200": _json("the tenants", _ref("Tenants")), "404": _NO_TENANT}),
        "post": _json_body(_op("Add a tenant, with a key made by the server", {
            "200": _NEW_KEY, "400": _error("the body is not JSON or a field is wrong (named)"),
            "404": _NO_TENANT, "409": _UNWRITTEN}), NEW_TENANT_BODY),
    },
    "/tenants/{tenant_name}": {
        "get": _op("A tenant, its keys' ids and its live usage", {
            "200": _json("the tenant", _ref("Tenant")), "404": _NO_TENANT}, [_TENANT]),
        "put": _json_body(_op("Change a tenant's weight and quotas", {
            "200": _json("the tenant", _ref("TenantSummary")),
            "400": _error("the body is not JSON or a field is wrong (named)"),
            "404": _NO_TENANT, "409": _UNWRITTEN}, [_TENANT]), TENANT_BODY),
        "delete": _op("Remove a tenant: its keys stop working", {
            "200": _json("removed", _ref("TenantRemoved")),
            "400": _error("the default tenant cannot be removed"), "404": _NO_TENANT,
            "409": _UNWRITTEN}, [_TENANT]),
    },
    "/tenants/{tenant_name}/keys": {
        "post": _op("Add a key to a tenant (rotation), made by the server", {
            "200": _NEW_KEY, "404": _NO_TENANT, "409": _UNWRITTEN}, [_TENANT]),
    },
    "/tenants/{tenant_name}/keys/{key_id}": {
        "delete": _op("Revoke one of a tenant's keys", {
            "200": _json("revoked", _ref("TenantRemoved")),
            "400": _error("the id is not 8-64 hex digits, or it names several keys"),
            "404": _NO_TENANT, "409": _UNWRITTEN}, [_TENANT, _KEY_ID]),
    },
}  # fmt: skip

MANAGEMENT_PATHS: dict[str, dict[str, Any]] = {
    "/models": {
        "get": _LIST,
        "post": _op("Register a model archive", {
            "200": _STATUS,
            "202": _STARTED,
            "400": _error("a bad parameter, an archive that cannot be loaded (the handler's own"
                          " error), a sha256 mismatch"),
            "403": _error("the archive is outside the model store, allowed_paths and"
                          " allowed_urls"),
            "404": _error("no such archive in the model store, or url is empty"),
            "409": _error("this version of the model is already registered"),
            "413": _error("the archive behind the URL is over download_max_bytes"),
            "502": _error("the URL's server answered an error, refused or broke off"),
            "504": _error("the URL's server timed out"),
        }, [
            _query("url", _NAME, "archive in the model store, or an allowed path or URL", True),
            _query("model_name", {"type": "string"}, "name to register it under"),
            _query("handler", {"type": "string"}, "handler to use instead of the archive's"),
            _query("batch_size", {"type": "integer", "minimum": 1}, "requests per handler call"),
            _query("max_batch_delay", {"type": "integer", "minimum": 0},
                   "ms a batch may wait for more requests"),
            _query("batch_wait", {"type": "string", "enum": ["busy", "fill"]},
                   "busy (default): a batch waits for more requests only while its worker is"
                   " busy; fill: up to max_batch_delay, as TorchServe"),
            _query("initial_workers", _WORKERS,
                   "workers to start; 0: the first request starts one (load on demand)"),
            _query("idle_unload_timeout", {"type": "integer", "minimum": 0},
                   "seconds without requests before the model scales down to minWorkers; 0: never"),
            _query("response_timeout", {"type": "integer", "minimum": 1},
                   "seconds one batch may take"),
            _query("startup_timeout", {"type": "integer", "minimum": 1},
                   "seconds a worker may take to load"),
            _query("runtime", {"type": "string", "enum": ["python", "python2", "python3"]},
                   "TorchServe's runtime; all run the model's Python 3"),
            _query("synchronous", _BOOL, "wait for the workers (default true)"),
            _query("sha256", {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"},
                   "the archive's digest: registration fails if it differs"),
            _query("inference_log", {"type": "string",
                                     "enum": ["off", "request", "response", "all"]},
                   "log requests and/or responses for monitoring (docs/inference-logging.md)"),
            _query("inference_log_sample", {"type": "integer", "minimum": 1},
                   "log every Nth request"),
            _query("inference_log_batch", {"type": "integer", "minimum": 1},
                   "records per send to a sink"),
            _query("inference_log_url", {"type": "string"},
                   "a receiver of KServe's logger's CloudEvents"),
            _query("inference_log_file", _BOOL, "JSON-lines files under the run dir"),
            _query("inference_log_redact", {"type": "string"},
                   "comma-separated key names or JSON pointers to redact"),
            _query("archive_signatures", {"type": "string", "enum": ["off", "warn", "require"]},
                   "check the archive's signature; only stricter than the server's"),
            _query("weights_scan", {"type": "string", "enum": ["off", "warn", "require"]},
                   "scan pickled weights for code; only stricter than the server's"),
        ]),
    },
    "/models/{model_name}": {
        "get": _op("Describe the default version", {
            "200": _json("the model", _ref("ModelDescription")), "404": _NOT_FOUND}, [_MODEL]),
        "put": _op("Scale the default version", _SCALE, [_MODEL, *_SCALE_PARAMS]),
        "delete": _op("Unregister the default version", {"200": _STATUS, "404": _NOT_FOUND},
                      [_MODEL]),
    },
    "/models/{model_name}/{model_version}": {
        "get": _op("Describe one version, or all with 'all'", {
            "200": _json("the model", _ref("ModelDescription")), "404": _NOT_FOUND},
            [_MODEL, _VERSION]),
        "put": _op("Scale one version", _SCALE, [_MODEL, _VERSION, *_SCALE_PARAMS]),
        "delete": _op("Unregister one version", {"200": _STATUS, "404": _NOT_FOUND},
                      [_MODEL, _VERSION]),
    },
    "/models/{model_name}/{model_version}/sbom": {
        "get": _op("The CycloneDX SBOM of the environment the version runs in", {
            "200": {"description": "CycloneDX JSON (docs/weights-safety.md)", "content": {
                "application/vnd.cyclonedx+json": {"schema": {"type": "object"}}}},
            "404": _NOT_FOUND,
            "503": _error("no SBOM can be made: cyclonedx-bom is missing, or it failed"),
        }, [_MODEL, _VERSION]),
    },
    "/models/{model_name}/{model_version}/reload": {
        "put": _op("Hot-reload the version's handler code on its workers (docs/hot-reload.md)",
                   _RELOADED, [_MODEL, _VERSION]),
    },
    "/models/{model_name}/{model_version}/set-default": {
        "put": _op("Make this version the default", {"200": _STATUS, "404": _NOT_FOUND},
                   [_MODEL, _VERSION])
    },
    "/environments": {
        "get": _op("The per-model environment cache", {
            "200": _json("the cache", _ref("Environments"))}),
        "delete": _op("Remove cached environments no registered model uses", {
            "200": _json("what was removed", {
                "type": "object", "required": ["removed"],
                "properties": {"removed": {"type": "array", "items": {"type": "string"}}}})}),
    },
    "/token": {"get": _op("Rotate a key (send the API key)", {
        "200": _json("the new key and when it expires", {"type": "object"}),
        "404": _error("token authorization is off: there are no keys"),
    }, [_query("type", {"type": "string", "enum": ["management", "inference"]},
               "which key to replace", True)])},
    **ROLLOUT_PATHS,
    **TENANT_PATHS,
    "/api-description": _API_DESCRIPTION,
}  # fmt: skip


def _oip_errors(value: Any) -> Any:
    """The same responses with the OIP error body (``{"error"}``), as /v1 and /v2 paths answer."""
    return _swap_error(value, "OipError")


def _swap_error(value: Any, schema: str) -> Any:
    """``value`` with TorchServe's error body replaced by ``schema``."""
    if isinstance(value, dict):
        if value == _ref("Error"):
            return _ref(schema)
        return {k: _swap_error(v, schema) for k, v in value.items()}
    if isinstance(value, list):
        return [_swap_error(v, schema) for v in value]
    return value


def _secured(paths: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every operation but the public ones may answer 401; the public ones need no key."""
    out: dict[str, dict[str, Any]] = {}
    for path, methods in paths.items():
        out[path] = {}
        for method, op in methods.items():
            op = dict(op)
            if path in PUBLIC_PATHS:
                op["security"] = []
            else:
                op["responses"] = dict(sorted({**op["responses"], "401": _UNAUTHORIZED}.items()))
            if path.startswith(("/v1/", "/v2/")) or path == "/v2":
                op["responses"] = _oip_errors(op["responses"])
            elif path.startswith("/openai/"):
                op["responses"] = _swap_error(op["responses"], "OpenAIError")
            out[path][method] = op
    return out


def describe(api: str) -> dict[str, Any]:
    """The OpenAPI document of ``api`` ("inference" or "management")."""
    paths = INFERENCE_PATHS if api == "inference" else MANAGEMENT_PATHS
    return {
        "openapi": "3.0.1",
        "info": {"title": f"mserve {api} API", "version": __version__,
                 "description": "TorchServe-compatible model server"},
        "paths": _secured(paths),
        "components": {
            "schemas": {**SCHEMAS, **ROLLOUT_SCHEMAS, **TENANT_SCHEMAS},
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "a key from the server's key file (token authorization)",
            }},
        },
        "security": [{"bearerAuth": []}],
    }  # fmt: skip


def answer_description(api: str, conn: Connection, req: Request) -> bool:
    """Answer ``OPTIONS /`` or ``GET /api-description`` with ``api``'s document, as TorchServe
    does on both ports; False for any other request, for the router to route. The routers ask
    first, so that these two paths mean the same on both ports."""
    if req.parts == ["api-description"] or (req.method == "OPTIONS" and req.parts == [""]):
        req.allow("GET", "OPTIONS")
        conn.answer_json(req, 200, describe(api))
        return True
    return False
