"""schemathesis against the API description each port serves (``GET /api-description``), on a
real server with real models: every schema-valid request it generates must get an answer the
description documents (status, content type, body schema), and never a server error.

Bounded and reproducible: a few derandomized examples per operation, no example database, no
shrinking (a failure is reported as found). Each operation is fuzzed twice: with generated path
parameters (unknown models, mostly) and with the registered models' names, so that the routes
that reach a worker are exercised too.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import Server, http

EXAMPLES = 25  # per operation, kind of path parameters and generation mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Token authorization is off on this server; the key is sent anyway, as a client would, so that a
# negative case does not leave it out and expect a 401.
KEY = {"Authorization": "Bearer fuzz"}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # each example is an HTTP round trip; the request's own timeout bounds it
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
    suppress_health_check=list(HealthCheck),
)
# The rollout and swap operations (docs/rollouts.md, shadow.md, swap.md) get fewer examples per
# run: on this server's one-version models each canary, shadow and swap is refused (400) before
# anything starts, for each needs a second version, so a few examples cover their answers; 25
# each nearly doubled the test (1183 examples and 90 s at load 8, against 586 and 64 s), past
# its timeout on a loaded machine. Nothing long runs: the fuzzer starts no swap or canary.
FEW_EXAMPLES = 5
# The tenants paths (docs/tenants.md) answer 404 on this server, which has no tenants_file: a
# few examples show it.
FEW = ("/traffic", "/canary", "/canary/{action}", "/shadow", "/swap", "/tenants",
       "/tenants/{tenant_name}", "/keys", "/keys/{key_id}")  # fmt: skip
# Real models, by the path parameters that name them: two handlers that answer whatever they
# get (the body as it came, or its text upper-cased), whatever operation they are called for.
MODELS = [
    {"model_name": "echo", "model_version": "1.0", "operation": "describe"},
    {"model_name": "shout", "model_version": "1.0", "operation": "op_x"},
]


@pytest.fixture
def fuzz_server(make_archive, start_server) -> Server:
    make_archive("echo_fn", "echo:handle", "echo")
    make_archive("echo_fn", "echo:shout", "shout")
    return start_server(
        "echo=echo.mar",
        "shout=shout.mar",
        config={
            "disable_token_authorization": True,
            "enable_model_api": True,
            # nothing leaves this machine: a generated http(s) URL is refused (403), not fetched
            "allowed_urls": "^https://fuzz[.]invalid/.*$",
        },
    )


def _fuzz(server: Server, api: str, fixed: dict[str, list[dict[str, Any]]]) -> Counter:
    """Fuzz every operation of ``api``'s served description; ``fixed`` pins query parameters
    per operation label (one run per entry). Returns what was seen: examples and statuses per
    operation."""
    document = http("GET", server.url(api, "/api-description")).json()
    schema = schemathesis.openapi.from_dict(document)
    base_url = server.url(api, "")
    seen: Counter = Counter()
    session = requests.Session()
    operations = [result.ok() for result in schema.get_all_operations()]
    # Unregistering a real model is fine (200 once, then 404 as described), but it would leave
    # the operations after it nothing real to work on: deletions go last, one version first.
    operations.sort(key=lambda op: (op.method == "delete", -len(op.path_parameters)))
    for operation in operations:
        label = f"{operation.method.upper()} {operation.path}"
        names = {p.name for p in operation.path_parameters}
        variants: list[dict[str, Any] | None] = [None]
        if names:
            for model in MODELS:  # none where the path names no model (/tenants/{tenant_name})
                fixed_names = {k: v for k, v in model.items() if k in names}
                if fixed_names:
                    variants.append(fixed_names)
        # negative cases: parameters the description constrains, given values it does not allow
        modes = list(GenerationMode) if operation.query else [GenerationMode.POSITIVE]
        for path_parameters, query, mode in itertools.product(
            variants, fixed.get(label, [None]), modes
        ):
            strategy = operation.as_strategy(
                mode, path_parameters=path_parameters, query=query, headers=KEY
            )
            checks = CHECKS if mode.is_positive else [*CHECKS, negative_data_rejection]
            examples = FEW_EXAMPLES if operation.path.endswith(FEW) else EXAMPLES
            _run(strategy, label, base_url, session, seen, checks, examples)
    return seen


def _run(
    strategy: Any,
    label: str,
    base_url: str,
    session: requests.Session,
    seen: Counter,
    checks: list[Any],
    examples: int,
) -> None:
    @settings(FUZZ, max_examples=examples)
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, session=session, timeout=60)
        seen[label, "examples"] += 1
        seen[label, response.status_code] += 1
        seen["examples"] += 1
        if response.status_code >= 500:
            seen["5xx"] += 1
        case.validate_response(response, checks=checks)

    run()


def _report(seen: Counter) -> None:
    """Per operation: examples, then how many got each status (shown with pytest -s)."""
    labels = sorted({k[0] for k in seen if isinstance(k, tuple)})
    for label in labels:
        statuses = {k[1]: n for k, n in seen.items() if isinstance(k, tuple) and k[0] == label
                    and k[1] != "examples"}  # fmt: skip
        print(f"  {label}: {seen[label, 'examples']} examples, statuses {dict(sorted(statuses.items()))}")  # fmt: skip


def test_the_inference_api_answers_as_described(fuzz_server: Server) -> None:
    started = time.monotonic()
    seen = _fuzz(fuzz_server, "inference", {})
    _report(seen)
    print(f"inference: {seen['examples']} examples, {seen['5xx']} 5xx, {time.monotonic() - started:.1f} s")  # fmt: skip
    assert seen["5xx"] == 0
    # the workers answered: predictions reached a model
    assert seen["POST /predictions/{model_name}", 200] > 0
    assert fuzz_server.predict("echo", "still here").body == b"still here"


def test_the_management_api_answers_as_described(fuzz_server: Server) -> None:
    # Registering or scaling the real models starts processes: worker counts are pinned to 0 or
    # 1 (the description allows up to 1024, more than this machine can start), and
    # registrations take the archives that are in the store. Unregistering is fine: it answers
    # 200 once and 404 afterwards, as described.
    small = {"initial_workers": 0, "synchronous": True}
    scale = {"min_worker": 1, "max_worker": 1}
    fixed = {
        "POST /models": [{}, {"url": "echo.mar", **small}],
        "PUT /models/{model_name}": [scale],
        "PUT /models/{model_name}/{model_version}": [scale],
        # a swap starts the new version's workers: one, should a second version ever be here
        "PUT /models/{model_name}/{model_version}/swap": [{"workers": 1}],
    }
    started = time.monotonic()
    seen = _fuzz(fuzz_server, "management", fixed)
    _report(seen)
    print(f"management: {seen['examples']} examples, {seen['5xx']} 5xx, {time.monotonic() - started:.1f} s")  # fmt: skip
    assert seen["5xx"] == 0
    assert seen["POST /models", 200] > 0
