"""``OPTIONS /`` and ``GET /api-description``: TorchServe's API description, checked against the
routes the server really answers."""

from __future__ import annotations

import json
import urllib.request

import pytest

from server.rest.description import INFERENCE_PATHS, MANAGEMENT_PATHS, describe
from server.rollouts.policy import CANARY_FIELDS
from server.rollouts.shadow_settings import SHADOW_FIELDS
from tests.server.conftest import http


@pytest.fixture
def server(make_archive, start_server):
    make_archive("probe", "probe:handle", "probe")
    return start_server("probe=probe.mar")


def _options(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="OPTIONS")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


@pytest.mark.parametrize("api", ["inference", "management"])
def test_options_and_get_answer_the_openapi_document(server, api: str) -> None:
    status, document = _options(server.url(api, "/"))
    assert status == 200
    assert document["openapi"].startswith("3.")
    assert document["info"]["title"] == f"mserve {api} API"
    assert http("GET", server.url(api, "/api-description")).json() == document
    expected = INFERENCE_PATHS if api == "inference" else MANAGEMENT_PATHS
    assert set(document["paths"]) == set(expected)
    assert "/predictions/{model_name}" in document["paths"] or api == "management"


def test_the_root_is_only_the_description(server) -> None:
    """``/`` answers ``OPTIONS`` alone, and only where there is a description; the metrics port
    has none."""
    for api in ("inference", "management"):
        reply = http("GET", server.url(api, "/"))
        assert reply.status == 404
        assert reply.json()["message"] == "no such path: GET /"
        reply = http("POST", server.url(api, "/api-description"), b"{}")
        assert reply.status == 405 and reply.headers["Allow"] == "GET, OPTIONS"
    reply = http("OPTIONS", server.url("metrics", "/"))
    assert reply.status == 404
    assert reply.json()["message"] == "no such path: OPTIONS /"


def test_every_described_route_is_served(server) -> None:
    """Each path and method listed is routed (any answer but "no such path" or 405). An unknown
    model is used, so the mutating ones change nothing."""
    routes = [("inference", p, m) for p, ms in INFERENCE_PATHS.items() for m in ms]
    routes += [("management", p, m) for p, ms in MANAGEMENT_PATHS.items() for m in ms]
    unrouted = []
    for api, path, method in routes:
        url = server.url(api, path.format(model_name="nosuch", model_version="1.0",
                                          operation="op_x", action="pause",
                                          tenant_name="nosuch", key_id="sha256:00000000"))  # fmt: skip
        body = b"{}" if method in ("post", "put") else None
        reply = http(method.upper(), url, body, {"Content-Type": "application/json"})
        body = reply.json() if reply.body else {}
        message = body.get("message", body.get("error", ""))  # {"error"} on KServe's paths
        if reply.status == 405 or (reply.status == 404 and "no such path" in message):
            unrouted.append((api, method, path, reply.status))
    assert not unrouted
    assert len(routes) > 30
    assert server.predict("probe", {"tag": "still here"}).status == 200


@pytest.mark.parametrize("api", ["inference", "management"])
def test_every_operation_but_the_public_ones_needs_a_bearer_key(api: str) -> None:
    """Token authorization as TorchServe clients use it: `Authorization: Bearer <key>`, 401
    without one, except on the health and description paths."""
    document = describe(api)
    assert document["components"]["securitySchemes"] == {"bearerAuth": {
        "type": "http", "scheme": "bearer",
        "description": "a key from the server's key file (token authorization)"}}  # fmt: skip
    assert document["security"] == [{"bearerAuth": []}]
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            if path in ("/ping", "/v2/health/live", "/v2/health/ready", "/api-description"):
                assert op["security"] == [] and "401" not in op["responses"], (method, path)
            else:
                assert "security" not in op, (method, path)
                unauthorized = op["responses"]["401"]
                assert "WWW-Authenticate" in unauthorized["headers"]
                schema = unauthorized["content"]["application/json"]["schema"]
                # KServe's paths answer the Open Inference Protocol's {"error": message}, the
                # OpenAI API's OpenAI's {"error": {"message", "type", ...}}
                kserve = path.startswith(("/v1/", "/v2/")) or path == "/v2"
                openai = path.startswith("/openai/")
                body = "OipError" if kserve else "OpenAIError" if openai else "Error"
                assert schema == {"$ref": f"#/components/schemas/{body}"}, (method, path)


def test_parameters_say_what_the_server_accepts() -> None:
    management = describe("management")["paths"]
    register = {p["name"]: p for p in management["/models"]["post"]["parameters"]}
    assert register["url"]["required"] and register["url"]["schema"]["minLength"] == 1
    assert register["batch_size"]["schema"] == {"type": "integer", "minimum": 1}
    assert register["initial_workers"]["schema"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 1024,
    }
    assert register["synchronous"]["schema"] == {"type": "boolean"}
    assert register["runtime"]["schema"]["enum"] == ["python", "python2", "python3"]
    assert all(p["allowEmptyValue"] for p in register.values() if not p["required"])
    statuses = set(management["/models"]["post"]["responses"])
    assert statuses == {"200", "202", "400", "401", "403", "404", "409", "413", "502", "503", "504"}


def test_the_rollout_bodies_are_described_as_the_parsers_read_them() -> None:
    """PUT /traffic, POST /canary and PUT /shadow take JSON bodies (docs/rollouts.md,
    docs/shadow.md): the description gives their fields and the parsers' bounds, so a generated
    client sends what the server accepts; and the swap's `to` is required."""
    paths = describe("management")["paths"]

    def body(path: str, method: str) -> dict:
        op = paths[path][method]
        assert {"400", "413"} <= set(op["responses"]), (method, path)
        return op["requestBody"]["content"]["application/json"]["schema"]

    traffic = body("/models/{model_name}/traffic", "put")
    assert set(traffic["properties"]) == {"weights", "sticky"}
    assert traffic["properties"]["weights"]["maxProperties"] == 16
    canary = body("/models/{model_name}/canary", "post")
    assert canary["required"] == ["version"] and canary["additionalProperties"] is False
    assert set(canary["properties"]) == set(CANARY_FIELDS)
    assert canary["properties"]["steps"]["maxItems"] == 20
    shadow = body("/models/{model_name}/shadow", "put")
    assert set(shadow["properties"]) == set(SHADOW_FIELDS)
    assert shadow["properties"]["samples"]["maximum"] == 200
    actions = paths["/models/{model_name}/canary/{action}"]["put"]["parameters"][1]
    assert actions["schema"]["enum"] == ["pause", "resume", "promote", "abort"]
    swap = {p["name"]: p for p in paths["/models/{model_name}/{model_version}/swap"]["put"][
        "parameters"]}  # fmt: skip
    assert swap["to"]["required"] and not swap["workers"]["required"]
    assert describe("management")["components"]["schemas"]["Traffic"]["required"] == [
        "weights", "split", "sticky", "served", "canary", "shadow"]  # fmt: skip
