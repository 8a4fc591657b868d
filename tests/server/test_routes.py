"""The inference paths' one table (server/rest/routes.py), which the inference port and the Ray
Serve ingress both route by: every path family, the versions, the url_path header's value, the
readiness GET beside a custom operation named ``ready``, and what is no path at all. End to end,
the same paths are served in test_inference_http.py, test_oip_http.py and tests/ray/."""

from __future__ import annotations

import pytest

from server.errors import BadRequest
from server.rest.routes import (
    INFER,
    MODELS,
    PING,
    V1_MODELS,
    V1_READY,
    V2_LIVE,
    V2_MODEL,
    V2_MODEL_READY,
    V2_READY,
    V2_SERVER,
    Route,
    match,
)

POST_PUT = ("POST", "PUT")


@pytest.mark.parametrize(
    ("path", "method", "route"),
    [
        ("/predictions/m", "POST", Route(INFER, POST_PUT, "m", None, "", "", "")),
        ("/predictions/m/2.0", "PUT", Route(INFER, POST_PUT, "m", "2.0", "", "", "")),
        ("/predictions/m/v1/chat/completions", "POST",
         Route(INFER, POST_PUT, "m", "v1", "", "", "chat/completions")),
        ("/explanations/m/1.0", "POST", Route(INFER, POST_PUT, "m", "1.0", "explain", "", "")),
        ("/ping", "GET", Route(PING, ("GET",))),
        ("/models", "GET", Route(MODELS, ("GET",))),
        ("/v1/models", "GET", Route(V1_MODELS, ("GET",))),
        ("/v1/models/m", "GET", Route(V1_READY, ("GET",), "m")),
        ("/v1/models/m:predict", "POST", Route(INFER, ("POST",), "m", None, "", "v1")),
        ("/v1/models/m:explain", "POST", Route(INFER, ("POST",), "m", None, "explain", "v1")),
        ("/v2", "GET", Route(V2_SERVER, ("GET",))),
        ("/v2/health/live", "GET", Route(V2_LIVE, ("GET",))),
        ("/v2/health/ready", "HEAD", Route(V2_READY, ("GET",))),
        ("/v2/models/m", "GET", Route(V2_MODEL, ("GET",), "m")),
        ("/v2/models/m/versions/3", "GET", Route(V2_MODEL, ("GET",), "m", "3")),
        ("/v2/models/m/ready", "GET", Route(V2_MODEL_READY, ("GET",), "m")),
        ("/v2/models/m/versions/3/ready", "HEAD", Route(V2_MODEL_READY, ("GET",), "m", "3")),
        # a custom operation that happens to be called "ready" is a POST
        ("/v2/models/m/ready", "POST", Route(INFER, ("POST",), "m", None, "ready", "")),
        ("/v2/models/m/infer", "POST", Route(INFER, ("POST",), "m", None, "", "v2")),
        ("/v2/models/m/versions/3/predict", "POST", Route(INFER, ("POST",), "m", "3", "", "v2")),
        ("/v2/models/m/explain", "POST", Route(INFER, ("POST",), "m", None, "explain", "v2")),
        ("/v2/models/m/op_describe", "POST", Route(INFER, ("POST",), "m", None, "op_describe", "")),
    ],
)  # fmt: skip
def test_each_path_family(path: str, method: str, route: Route) -> None:
    assert match([p for p in path.split("/") if p], method) == route


@pytest.mark.parametrize(
    "path",
    ["/", "/predictions", "/pingg", "/models/m", "/v1", "/v1/models/m/x", "/v1/models/m:train",
     "/v1/other/m", "/v2/health", "/v2/health/dead", "/v2/other/m", "/v2/models/m/a/b"],
)  # fmt: skip
def test_no_such_path(path: str) -> None:
    assert match([p for p in path.split("/") if p], "POST") is None


def test_an_operation_that_is_no_name_is_refused() -> None:
    with pytest.raises(BadRequest) as caught:
        match(["v2", "models", "m", "not-a-name"], "POST")
    assert caught.value.message == (
        "operation 'not-a-name' is not a valid name (letters, digits and '_')"
    )


def test_explain_is_an_explanation_on_every_family() -> None:
    assert match(["explanations", "m"], "POST").explain  # type: ignore[union-attr]
    assert match(["v1", "models", "m:explain"], "POST").explain  # type: ignore[union-attr]
    assert not match(["predictions", "m"], "POST").explain  # type: ignore[union-attr]
