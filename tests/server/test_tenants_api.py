"""The tenants API (docs/tenants.md): list, describe with live usage, add and remove tenants,
change weights and quotas, make and revoke keys, each change written to the tenants file (its
comments kept) and applied as a reload; bad changes refused naming the field, the file left as
it was. Also what the tenant reaches beyond the API: the inference log's records, and a quota
refusal that starts no load on demand.

One server for the module (token authorization on: tenants are told apart by their keys), an
echo model with an inference log file, and tenants changed only through the API and by the
tests' own hand edits, each test leaving the file as it found it where later tests rely on it.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from click.testing import CliRunner

from archiver.cli import main as archiver_main
from archiver.workflow_cli import main as workflow_archiver
from server.rpc.protos import mserve_management_pb2 as mpb
from server.rpc.protos import mserve_management_pb2_grpc
from server.tenants import key_hash
from tests.server.conftest import (
    HANDLERS,
    Server,
    http,
    pid_alive,
    server_settings,
    start_daemon,
    wait_until,
)

KEY = "key-of-team-a-0123456789"
FILE = f"""\
# who may call this server (docs/tenants.md)
tenants:
  team-a:                 # the search team
    keys: [sha256:{key_hash(KEY)}]
    weight: 2             # twice the others' share
  default:
    weight: 1
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tenants-api")
    store = root / "store"
    store.mkdir()
    args = ["--model-name", "echo", "--handler", "echo:handle", "--model-path",
            str(HANDLERS / "echo_fn"), "--export-path", str(store), "-f"]  # fmt: skip
    out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    for version in ("1.0", "2.0"):  # a model with a second version to shadow onto
        out = CliRunner().invoke(archiver_main, [*args[:1], "twin", *args[2:7], str(root), "-f",
                                                 "--version", version], catch_exceptions=False)  # fmt: skip
        assert out.exit_code == 0, out.output
        (root / "twin.mar").rename(store / f"twin_{version}.mar")
    # a workflow: its function node `pre`, then the echo archive as its node `echoed`
    wf_store = root / "wf"
    wf_store.mkdir()
    (root / "spec.yaml").write_text(
        "models:\n  min-workers: 1\n  max-workers: 1\n  echoed:\n    url: echo.mar\n"
        "dag:\n  pre: [echoed]\n"
    )
    result = CliRunner().invoke(workflow_archiver, [
        "--workflow-name", "wf", "--spec-file", str(root / "spec.yaml"), "--handler",
        str(HANDLERS / "workflow" / "war" / "pipeline.py"), "--export-path", str(wf_store)])  # fmt: skip
    assert result.exit_code == 0, result.output
    (root / "tenants.yaml").write_text(FILE)
    settings = server_settings(
        store,
        disable_token_authorization=False,
        tenants_file=str(root / "tenants.yaml"),
        workflow_store=str(wf_store),
    )
    server = start_daemon(root / "mserve.yaml", root / "run", settings)
    server.tenants_file = root / "tenants.yaml"  # type: ignore[attr-defined]
    try:
        # an echo that logs every request to a file, and a lazy one that loads on demand
        for query in ("model_name=echo&initial_workers=1&inference_log=all"
                      "&inference_log_file=true",
                      "model_name=lazy&initial_workers=0"):  # fmt: skip
            reply = manage(server, "POST", f"/models?url=echo.mar&synchronous=true&{query}")
            assert reply.status == 200, reply.body
        for version in ("1.0", "2.0"):
            reply = manage(server, "POST", f"/models?url=twin_{version}.mar&initial_workers=1"
                                           "&synchronous=true")  # fmt: skip
            assert reply.status == 200, reply.body
        reply = manage(server, "POST", "/workflows?url=wf.war&workflow_name=wf")
        assert reply.status == 200, reply.body
        yield server
    finally:
        server.cli("--stop")
        if pid_alive(server.pid):
            subprocess.run(["kill", "-9", str(server.pid)], check=False)


def manage(server: Server, method: str, path: str, body: Any = None, key: str | None = None) -> Any:
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    if data is None and method in ("POST", "PUT", "DELETE"):
        data = b""
    headers = {"Authorization": f"Bearer {key or server.key('management')}",
               "Content-Type": "application/json"}  # fmt: skip
    return http(method, server.url("management", path), data, headers)


def predict(server: Server, key: str, model: str = "echo", body: str = "hi") -> Any:
    return http("POST", server.url("inference", f"/predictions/{model}"), body.encode(),
                {"Authorization": f"Bearer {key}", "Content-Type": "text/plain"})  # fmt: skip


def file_of(server: Server) -> Path:
    return server.tenants_file  # type: ignore[attr-defined]


def test_tenants_are_listed_and_described_without_their_keys(server: Server) -> None:
    listing = manage(server, "GET", "/tenants")
    assert listing.status == 200, listing.body
    rows = {row["name"]: row for row in listing.json()["tenants"]}
    assert listing.json()["file"] == str(file_of(server))
    assert rows["team-a"] == {"name": "team-a", "weight": 2, "keys": 1, "quota": {}, "models": {}}
    assert rows["default"]["weight"] == 1
    assert key_hash(KEY) not in listing.body.decode()  # not even the hash
    assert predict(server, KEY).status == 200
    one = manage(server, "GET", "/tenants/team-a").json()
    assert one["keys"] == [f"sha256:{key_hash(KEY)[:12]}"]  # an id: 12 digits of the hash
    assert one["usage"]["served"]["echo"] >= 1
    assert one["usage"]["in_flight"] is None and one["usage"]["bucket_tokens"] is None
    missing = manage(server, "GET", "/tenants/nobody")
    assert missing.status == 404
    assert missing.json()["message"] == "no tenant 'nobody' (tenants: default, team-a)"
    # the management key, as every management path: the inference key or a tenant's is refused
    assert manage(server, "GET", "/tenants", key=KEY).status == 401
    assert manage(server, "GET", "/tenants", key=server.key("inference")).status == 401


def test_a_tenant_added_through_the_api_gets_a_key_that_works_at_once(server: Server) -> None:
    before = file_of(server).read_text()
    added = manage(server, "POST", "/tenants", {"name": "team-b", "weight": 3,
                                                "quota": {"requests_per_second": 50}})  # fmt: skip
    assert added.status == 200, added.body
    answer = added.json()
    key = answer["key"]
    assert answer["id"] == f"sha256:{key_hash(key)[:12]}"
    assert answer["weight"] == 3 and answer["keys"] == 1
    assert answer["quota"] == {"requests_per_second": 50, "burst": 50}
    assert predict(server, key, body="b").status == 200  # no wait for the file's poll
    text = file_of(server).read_text()
    assert key not in text and f"sha256:{key_hash(key)}" in text  # the hash only
    # the file as it was, comments and order kept, the new tenant after the others
    assert text.startswith(before)
    assert "# the search team" in text and "# twice the others' share" in text
    new = yaml.safe_load(text)["tenants"]["team-b"]
    assert new == {"keys": [f"sha256:{key_hash(key)}"], "weight": 3,
                   "quota": {"requests_per_second": 50}}  # fmt: skip
    # shown once: describing it gives the id, never the key
    assert key not in manage(server, "GET", "/tenants/team-b").body.decode()
    bad_name = manage(server, "POST", "/tenants", {"name": "team b!"})
    assert bad_name.status == 400
    assert bad_name.json()["message"] == (
        "body: 'name' should be 1-63 letters, digits, . _ - (found 'team b!')"
    )
    again = manage(server, "POST", "/tenants", {"name": "team-b"})
    assert again.status == 409
    assert again.json()["message"] == "tenant 'team-b' exists already: PUT /tenants/team-b changes it"  # fmt: skip
    # removed: its key stops at once, and the file is as before
    removed = manage(server, "DELETE", "/tenants/team-b")
    assert removed.status == 200 and removed.json() == {"name": "team-b", "removed": True}
    assert predict(server, key).status == 401
    assert file_of(server).read_text() == before
    refused = manage(server, "DELETE", "/tenants/default")
    assert refused.status == 400
    assert "the default tenant is the server's own inference key's" in refused.json()["message"]


def test_a_quota_changed_through_the_api_applies_as_a_reload(server: Server) -> None:
    reloads = _reloads(server)
    changed = manage(server, "PUT", "/tenants/team-a",
                     {"quota": {"requests_per_second": 0.01, "burst": 1}})  # fmt: skip
    assert changed.status == 200, changed.body
    assert changed.json()["quota"] == {"requests_per_second": 0.01, "burst": 1}
    assert changed.json()["weight"] == 2  # a field left out stays
    assert _reloads(server) == reloads + 1  # the reload path, counted as one
    assert predict(server, KEY).status == 200
    over = predict(server, KEY)
    assert over.status == 429 and over.headers["Retry-After"]
    usage = manage(server, "GET", "/tenants/team-a").json()["usage"]
    assert usage["refused"]["echo"] >= 1
    assert 0 <= usage["bucket_tokens"] < 1
    # the lazy model has no worker: a request over quota is refused before any load starts
    lazy = predict(server, KEY, "lazy")
    assert lazy.status == 429
    described = manage(server, "GET", "/models/lazy").json()[0]
    assert described["loadState"] == "unloaded" and described["workers"] == []
    # null removes the quota; the tenant is served again at once
    cleared = manage(server, "PUT", "/tenants/team-a", {"quota": None})
    assert cleared.status == 200 and cleared.json()["quota"] == {}
    assert predict(server, KEY).status == 200
    assert "quota" not in yaml.safe_load(file_of(server).read_text())["tenants"]["team-a"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"weight": 0}, "tenant 'team-a': 'weight' should be above 0"),
        ({"weight": "heavy"}, "body: 'weight' should be a number, found 'heavy'"),
        ({"quota": {"burst": 5}}, "tenant 'team-a': 'quota': 'burst' needs 'requests_per_second'"),
        ({"quota": {"in_flight": 1.5}}, "tenant 'team-a': 'quota': 'in_flight' should be a whole number"),
        ({"quota": {"per_day": 5}}, "tenant 'team-a': 'quota': unknown field 'per_day'"),
        ({"models": {"nosuch": {"in_flight": 1}}}, "tenant 'team-a': unknown model 'nosuch' in its quotas (models: echo, lazy, twin, wf__echoed, wf__pre)"),
        ({"keys": ["sha256:00"]}, "body: unknown field 'keys' (fields: weight, quota, models)"),
        (b"{not json", "body: not JSON"),
        ([1, 2], "body: should be a JSON object with weight, quota, models"),
        ({"quota": [1]}, "body: 'quota' should be an object of quota fields"),
        ({"models": [1]}, "body: 'models' should be an object: model name -> quota"),
    ],
)  # fmt: skip
def test_a_bad_change_is_refused_naming_the_field(server: Server, body: Any, message: str) -> None:
    before = file_of(server).read_text()
    reply = manage(server, "PUT", "/tenants/team-a", body)
    assert reply.status == 400, reply.body
    assert reply.json()["message"].startswith(message)
    assert file_of(server).read_text() == before


def test_keys_are_made_and_revoked_through_the_api(server: Server) -> None:
    made = manage(server, "POST", "/tenants/team-a/keys")
    assert made.status == 200, made.body
    new_key, new_id = made.json()["key"], made.json()["id"]
    assert made.json()["keys"] == 2
    assert predict(server, new_key).status == 200 and predict(server, KEY).status == 200
    old_id = f"sha256:{key_hash(KEY)[:12]}"
    assert sorted(manage(server, "GET", "/tenants/team-a").json()["keys"]) == sorted(
        [old_id, new_id]
    )
    short = manage(server, "DELETE", "/tenants/team-a/keys/sha256:abc")
    assert short.status == 400
    assert short.json()["message"].startswith(
        "key id 'sha256:abc' should be 'sha256:' and at least 8"
    )
    unknown = manage(server, "DELETE", "/tenants/team-a/keys/sha256:0000000000")
    assert unknown.status == 404
    assert unknown.json()["message"] == (f"tenant 'team-a' has no key 'sha256:0000000000' (its"
                                         f" keys: {', '.join(sorted([old_id, new_id]))})")  # fmt: skip
    revoked = manage(server, "DELETE", f"/tenants/team-a/keys/{new_id}")
    assert revoked.status == 200 and revoked.json() == {
        "name": "team-a",
        "revoked": new_id,
        "keys": 1,
    }
    assert predict(server, new_key).status == 401 and predict(server, KEY).status == 200
    assert key_hash(new_key) not in file_of(server).read_text()


def test_a_file_that_does_not_read_is_not_overwritten(server: Server) -> None:
    path = file_of(server)
    good = path.read_text()
    broken = good.replace("weight: 2", "weight: -2")
    failed = _reloads(server, "failed")
    path.write_text(broken)
    wait_until(lambda: _reloads(server, "failed") > failed, 10, "the broken file's reload")
    try:
        reply = manage(server, "PUT", "/tenants/team-a", {"weight": 5})
        assert reply.status == 409
        message = reply.json()["message"]
        assert re.match(r".*/tenants[.]yaml line \d+: tenant 'team-a': 'weight' should be"
                        r" above 0: the file does not read now", message), message  # fmt: skip
        assert path.read_text() == broken
        assert predict(server, KEY).status == 200  # the tenants read before stay
    finally:
        fixed = _reloads(server)
        path.write_text(good)
        wait_until(lambda: _reloads(server) > fixed, 10, "the mended file's reload")


def test_the_servers_own_key_is_hashed_once_and_follows_reloads_and_rotation(
    server: Server,
) -> None:
    """The server's own inference key (the default tenant's) is hashed once and then compared,
    not hashed per request: still served as the file says once the file comes to name it, and
    refused once rotated."""
    own = server.key("inference")

    def served(tenant: str) -> int:
        usage = manage(server, "GET", f"/tenants/{tenant}").json()["usage"]
        return int(usage["served"].get("echo", 0))

    before = served("default")
    assert [predict(server, own).status for _ in range(2)] == [200, 200]  # hashed, then kept
    assert served("default") == before + 2
    path = file_of(server)
    good = path.read_text()
    reloads = _reloads(server)
    path.write_text(good.rstrip("\n") + f"\n  owner:\n    keys: [sha256:{key_hash(own)}]\n")
    wait_until(lambda: _reloads(server) > reloads, 10, "the file's reload")
    try:
        assert predict(server, own).status == 200
        assert served("owner") == 1  # the reload forgot the key was no tenant's
    finally:
        reloads = _reloads(server)
        path.write_text(good)
        wait_until(lambda: _reloads(server) > reloads, 10, "the restored file's reload")
    before = served("default")
    assert predict(server, own).status == 200
    rotated = http("GET", server.url("management", "/token?type=inference"), None,
                   {"Authorization": f"Bearer {server.key('API')}"})  # fmt: skip
    assert rotated.status == 200, rotated.body
    new = rotated.json()["inference"]["key"]
    refused = predict(server, own)  # the kept key was the old one: refused all the same
    assert refused.status == 401
    assert refused.json()["message"] == "the key sent is not the inference key"
    assert [predict(server, new).status for _ in range(2)] == [200, 200]
    assert served("default") == before + 3


def test_each_logged_request_names_its_tenant(server: Server) -> None:
    rid = predict(server, KEY, body="logged").headers["X-Request-Id"]
    plain = http("POST", server.url("inference", "/predictions/echo"), b"mine",
                 {**server.auth("inference"), "Content-Type": "text/plain"})  # fmt: skip
    lines_file = server.run_dir / "inference_log" / "echo" / "1.0.jsonl"

    def lines() -> dict[str, Any]:
        if not lines_file.exists():
            return {}
        return {r["request_id"]: r for r in map(json.loads, lines_file.read_text().splitlines())}

    other = plain.headers["X-Request-Id"]
    wait_until(lambda: rid in lines() and other in lines(), 10, "the inference log's lines")
    assert lines()[rid]["tenant"] == "team-a"
    assert lines()[other]["tenant"] == "default"  # the server's own inference key


def test_a_records_tenant_is_in_its_line_and_its_events() -> None:
    """In process: the JSON line (both of its forms) and the CloudEvents name the tenant, and
    the cloudevents SDK reads ``ce-tenant`` back as an extension attribute."""
    from cloudevents.core.bindings.http import HTTPMessage, from_http_event

    from server.inference_log.records import Encoder, Record

    encoder = Encoder("m", "1.0", [], "http://localhost:8080/", "default")

    def record(tenant: str | None, logged: dict[str, Any] | None = None) -> Record:
        return Record("r1", "r1", "", "", time.time(), 10, "application/json", b"{}", 200,
                      "application/json", b"{}", None, logged, tenant=tenant)  # fmt: skip

    assert json.loads(encoder.line(record("team-a")))["tenant"] == "team-a"
    assert json.loads(encoder.line(record("team-a", {"request": {}})))["tenant"] == "team-a"
    assert "tenant" not in json.loads(encoder.line(record(None)))
    for message in encoder.events(record("team-a"), True, True):
        event = from_http_event(HTTPMessage(dict(message.headers.items()), message.body))
        assert event.get_extension("tenant") == "team-a"
    assert all("ce-tenant" not in m.headers for m in encoder.events(record(None), True, True))


def test_a_workflows_steps_are_the_callers_tenants(server: Server) -> None:
    """Each node's request is the caller's: served in its lane, charged to its quotas (before,
    a workflow ran as no tenant: a way around them)."""
    reply = http("POST", server.url("inference", "/wfpredict/wf"), b"  flow  ",
                 {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert (reply.status, reply.body) == (200, b"flow")
    served = manage(server, "GET", "/tenants/team-a").json()["usage"]["served"]
    assert served["wf__pre"] == 1 and served["wf__echoed"] == 1
    capped = manage(server, "PUT", "/tenants/team-a",
                    {"models": {"wf__echoed": {"requests_per_second": 0.01, "burst": 1}}})  # fmt: skip
    assert capped.status == 200, capped.body
    try:
        assert http("POST", server.url("inference", "/wfpredict/wf"), b"once",
                    {"Authorization": f"Bearer {KEY}"}).status == 200  # fmt: skip
        over = http("POST", server.url("inference", "/wfpredict/wf"), b"twice",
                    {"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert over.status == 429
        assert "tenant team-a is over its quota for model wf__echoed" in over.json()["message"]
        # the step's Retry-After is the workflow's: a token every 100 s, one just spent
        assert over.headers["Retry-After"] in ("99", "100")
    finally:
        assert manage(server, "PUT", "/tenants/team-a", {"models": None}).status == 200


def test_a_shadow_copy_is_the_callers_but_not_charged(server: Server) -> None:
    """A shadow's copy goes in the caller's lane on the shadow version, and is never charged to
    the caller's quotas: the shadow is the operator's experiment, not the tenant's traffic."""
    shadow = manage(server, "PUT", "/models/twin/shadow", {"version": "2.0", "share": 100})
    assert shadow.status == 200, shadow.body
    capped = manage(server, "PUT", "/tenants/team-a",
                    {"models": {"twin": {"requests_per_second": 0.01, "burst": 2}}})  # fmt: skip
    assert capped.status == 200, capped.body
    try:
        # two tokens, two requests: each shadowed, and neither copy took a token
        assert [predict(server, KEY, "twin").status for _ in range(2)] == [200, 200]

        def compared() -> int:
            counts = manage(server, "GET", "/models/twin/shadow").json()["counts"]
            return sum(counts.get(k, 0) for k in ("equal", "different", "refused"))

        wait_until(lambda: compared() == 2, 10, "both shadow copies compared")
        counts = manage(server, "GET", "/models/twin/shadow").json()["counts"]
        assert counts["equal"] == 2 and counts.get("refused", 0) == 0
        usage = manage(server, "GET", "/tenants/team-a").json()["usage"]
        assert usage["served"]["twin"] == 4  # both versions count for the model: 2 + 2 copies
        assert usage["refused"].get("twin", 0) == 0
        assert predict(server, KEY, "twin").status == 429  # the third is the tenant's own
    finally:
        manage(server, "DELETE", "/models/twin/shadow")
        assert manage(server, "PUT", "/tenants/team-a", {"models": None}).status == 200


def test_grpc_manages_tenants_as_rest_does(server: Server) -> None:
    """mserve's gRPC management service: the same operations on the same code, REST's JSON
    answers, and its errors as gRPC codes (the management key in the metadata)."""
    auth = (("authorization", f"Bearer {server.key('management')}"),)
    with grpc.insecure_channel(server.status["grpc_management"]) as channel:
        stub = mserve_management_pb2_grpc.MserveManagementServiceStub(channel)

        def call(**fields: str) -> Any:
            return json.loads(stub.Tenants(mpb.TenantsRequest(**fields), metadata=auth).msg)

        assert "team-a" in {row["name"] for row in call()["tenants"]}
        added = call(action="add", body=json.dumps({"name": "grpc-team", "weight": 4}))
        assert predict(server, added["key"]).status == 200
        assert call(action="get", tenant_name="grpc-team")["usage"]["served"] == {"echo": 1}
        assert call(action="set", tenant_name="grpc-team", body='{"weight": 1}')["weight"] == 1
        made = call(action="add_key", tenant_name="grpc-team")
        revoked = call(action="revoke_key", tenant_name="grpc-team", key_id=added["id"])
        assert revoked == {"name": "grpc-team", "revoked": added["id"], "keys": 1}
        assert predict(server, added["key"]).status == 401
        assert predict(server, made["key"]).status == 200
        with pytest.raises(grpc.RpcError) as err:
            call(action="set", tenant_name="grpc-team", body='{"weight": -1}')
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "tenant 'grpc-team': 'weight' should be above 0"
        with pytest.raises(grpc.RpcError) as err:
            call(action="get", tenant_name="nobody")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert call(action="remove", tenant_name="grpc-team") == {
            "name": "grpc-team",
            "removed": True,
        }
        with pytest.raises(grpc.RpcError) as err:
            stub.Tenants(mpb.TenantsRequest(), metadata=(("authorization", f"Bearer {KEY}"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            call(action="rename", tenant_name="team-a")
        assert err.value.details() == (
            "action 'rename': expected list, get, add, set, remove, add_key or revoke_key"
        )
        with pytest.raises(grpc.RpcError) as err:
            call(action="get")
        assert err.value.details() == "parameter 'tenant_name' is required"


def test_a_quota_naming_an_unregistered_model_can_be_removed_through_the_api(
    server: Server,
) -> None:
    """A model unregistered under a tenant's quota: the next change says so (400 naming it),
    and the change that removes that quota is taken. Last: it unregisters ``lazy``."""
    capped = manage(server, "PUT", "/tenants/team-a", {"models": {"lazy": {"in_flight": 1}}})
    assert capped.status == 200, capped.body
    assert manage(server, "DELETE", "/models/lazy").status == 200
    refused = manage(server, "PUT", "/tenants/team-a", {"weight": 2})
    assert refused.status == 400
    assert refused.json()["message"].startswith(
        "tenant 'team-a': unknown model 'lazy' in its quotas (models: echo, twin, "
    )
    removed = manage(server, "PUT", "/tenants/team-a", {"models": None})
    assert removed.status == 200 and removed.json()["models"] == {}


def _reloads(server: Server, outcome: str = "ok") -> float:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = re.search(rf'^mserve_tenants_reloads_total\{{outcome="{outcome}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0
