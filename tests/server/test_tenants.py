"""Tenants (docs/tenants.md): keys per client, quotas (429 + Retry-After, over REST and gRPC),
weighted fair queuing read from the server's own per-tenant counts, reloads of the file.

One server for the module: a model whose every batch takes 10 ms (one worker, batches of one),
so a queue forms under load and the order it is served in shows in the counts."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml
from click.testing import CliRunner

from archiver.cli import main as archiver_main
from server.errors import ConfigError
from server.rpc.protos import inference_pb2, inference_pb2_grpc
from server.tenants import key_hash, parse
from tests.server.conftest import HANDLERS, MSERVE, Server, http, pid_alive, wait_until

KEYS = {name: f"key-of-{name}-0123456789" for name in ("heavy", "light", "capped", "late")}


def tenants_yaml(*extra: str) -> str:
    return "\n".join([
        "tenants:",
        "  heavy:",
        f"    keys: [sha256:{key_hash(KEYS['heavy'])}]",
        "    weight: 3",
        "  light:",
        f"    keys: ['{key_hash(KEYS['light'])}']",
        "  capped:",
        f"    keys: [sha256:{key_hash(KEYS['capped'])}]",
        "    models:",
        "      paced: {requests_per_second: 0.5, burst: 2}",
        "      gen: {requests_per_second: 0.2, burst: 1}",
        *extra,
    ]) + "\n"  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tenants")
    store = root / "store"
    store.mkdir()
    args = ["--model-name", "paced", "--handler", "paced", "--model-path",
            str(HANDLERS / "tenants"), "--export-path", str(store), "-f"]  # fmt: skip
    out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    gen = HANDLERS / "generative"
    args = ["--model-name", "gen", "--handler", "lm:handle", "--model-path", str(gen),
            "--export-path", str(store), "-c", str(gen / "chat.yaml"), "-f"]  # fmt: skip
    out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    # a sequence-batched model: its requests wait in its worker's lane (a fair queue too)
    (root / "seq.yaml").write_text("minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\n"
                                   "sequenceBatching: true\nmaxNumSequence: 8\n")  # fmt: skip
    args = ["--model-name", "seq", "--handler", "stateful:Stateful", "--model-path",
            str(HANDLERS / "stateful"), "--export-path", str(store), "-c", str(root / "seq.yaml"),
            "-f"]  # fmt: skip
    out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    # one seat: every other sequence waits for it (maxNumSequence)
    (root / "seat.yaml").write_text("minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\n"
                                    "sequenceBatching: true\nmaxNumSequence: 1\n")  # fmt: skip
    args = [*args[:1], "seat", *args[2:9], str(root / "seat.yaml"), "-f"]
    out = CliRunner().invoke(archiver_main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    (root / "tenants.yaml").write_text(tenants_yaml())
    settings: dict[str, Any] = {f"{api}_address": "127.0.0.1:0" for api in
                ("inference", "management", "metrics", "grpc_inference", "grpc_management")}  # fmt: skip
    settings.update(model_store=str(store), tenants_file=str(root / "tenants.yaml"))
    config = root / "mserve.yaml"
    config.write_text(yaml.safe_dump(settings))
    run_dir = root / "run"
    cli = ["--config", str(config), "--run-dir", str(run_dir)]
    started = subprocess.run(
        [MSERVE, "--start", *cli, "--models", "paced=paced.mar", "gen=gen.mar", "seq=seq.mar",
         "seat=seat.mar"],
        capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    server = Server(run_dir, json.loads((run_dir / "status.json").read_text()), cli)
    server.tenants_file = root / "tenants.yaml"  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.cli("--stop")
        if pid_alive(server.pid):
            subprocess.run(["kill", "-9", str(server.pid)], check=False)


def predict(server: Server, key: str, body: str = "hi") -> Any:
    return http("POST", server.url("inference", "/predictions/paced"), body.encode(),
                {"Authorization": f"Bearer {key}", "Content-Type": "text/plain"})  # fmt: skip


def counts(
    server: Server, family: str = "mserve_tenant_requests_served_total", model: str = "paced"
) -> dict[str, float]:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = {}
    for m in re.finditer(rf'^{family}\{{model="{model}",tenant="([^"]+)"\}} (\S+)$', text, re.M):
        found[m.group(1)] = float(m.group(2))
    return found


def test_each_tenant_key_is_accepted_and_others_refused(server: Server) -> None:
    for name in ("heavy", "light"):
        reply = predict(server, KEYS[name], name)
        assert (reply.status, reply.body) == (200, name.encode())
    assert predict(server, server.key("inference")).status == 200  # the default tenant's
    refused = predict(server, "not-a-key-of-anyone-at-all")
    assert refused.status == 401
    assert refused.json()["message"] == "the key sent is not the inference key"
    served = counts(server)
    assert served["heavy"] >= 1 and served["light"] >= 1 and served["default"] >= 1
    # only hashes are stored: no key of the file can be read from it
    text = server.tenants_file.read_text()  # type: ignore[attr-defined]
    assert not any(key in text for key in KEYS.values())


def test_a_sequence_batched_models_lanes_are_fair_queues_counted_per_tenant(
    server: Server,
) -> None:
    """A sequence's requests wait in its worker's lane, which serves tenants fairly too (one
    request per sequence waits there); what each tenant was served counts as the model's."""
    before = counts(server, model="seq")

    def add(key: str, n: int, sequence: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        if sequence is not None:
            headers["ts_request_sequence_id"] = sequence
        reply = http("POST", server.url("inference", "/predictions/seq"),
                     json.dumps({"add": n}).encode(), headers)  # fmt: skip
        assert reply.status == 200, reply.body
        return reply

    first = add(KEYS["heavy"], 2)
    sequence = first.headers["ts_request_sequence_id"]
    assert add(KEYS["heavy"], 3, sequence).json()["sum"] == 5  # its state kept, in order
    add(KEYS["light"], 1)
    after = counts(server, model="seq")
    assert after["heavy"] - before.get("heavy", 0) == 2
    assert after["light"] - before.get("light", 0) == 1


def test_a_sequence_goes_on_only_with_its_openers_tenant(server: Server) -> None:
    """A sequence's state is its opener's: another tenant naming its id is refused (409, the
    sequence untouched), and the opener goes on as if nothing happened."""

    def add(key: str, n: int, end: bool = False) -> Any:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                   "ts_request_sequence_id": "shared-7"}  # fmt: skip
        if end:
            headers["ts_request_sequence_end"] = "true"
        return http("POST", server.url("inference", "/predictions/seq"),
                    json.dumps({"add": n}).encode(), headers)  # fmt: skip

    assert add(KEYS["heavy"], 2).json()["sum"] == 2
    refused = add(KEYS["light"], 100)
    assert refused.status == 409, refused.body
    assert refused.json()["message"] == (
        "sequence shared-7 of model seq:1.0 was opened with another tenant's key; send the"
        " request without ts_request_sequence_id to start a sequence of your own, or with an"
        " id of your own"
    )
    assert add(KEYS["heavy"], 3, end=True).json()["sum"] == 5  # light's 100 never added


def test_sequences_waiting_for_a_seat_get_it_in_the_fair_order(server: Server) -> None:
    """Past maxNumSequence a new sequence waits for a seat; the seats go by the fair queue's
    order, not by arrival: six of heavy's (weight 3) come before two of light's (weight 1),
    and light's first is seated first, its second after three of heavy's."""

    def send(key: str, sequence: str, end: bool = False) -> Any:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                   "ts_request_sequence_id": sequence}  # fmt: skip
        if end:
            headers["ts_request_sequence_end"] = "true"
        reply = http("POST", server.url("inference", "/predictions/seat"), b'{"add": 1}', headers)
        assert reply.status == 200, reply.body
        return reply

    def depth() -> int:
        reply = http("GET", server.url("management", "/models/seat"), None,
                     {"Authorization": f"Bearer {server.key('management')}"})  # fmt: skip
        return int(reply.json()[0]["queueDepth"])

    send(KEYS["heavy"], "holder")  # takes the one seat and keeps it
    seated: list[str] = []  # in the order their first requests were answered
    lock = threading.Lock()

    def first(key: str, sequence: str) -> None:
        send(key, sequence)
        with lock:
            seated.append(sequence)

    threads = []
    for names, key in ((["h1", "h2", "h3", "h4", "h5", "h6"], KEYS["heavy"]),
                       (["l1", "l2"], KEYS["light"])):  # fmt: skip
        for name in names:
            threads.append(threading.Thread(target=first, args=(key, name), daemon=True))
            threads[-1].start()
        # all of heavy's wait before light's come: in arrival order light's would be last
        wait_until(lambda: depth() == len(threads), 30, f"{len(threads)} waiting")
    send(KEYS["heavy"], "holder", end=True)  # frees the seat
    for n in range(1, 9):  # one seat: each is answered, then ended, freeing it for the next
        wait_until(lambda n=n: len(seated) >= n, 30, f"sequence {n} seated")
        assert len(seated) == n  # never two at once
        name = seated[-1]
        send(KEYS["heavy" if name[0] == "h" else "light"], name, end=True)
    for thread in threads:
        thread.join(30)
    # tags: heavy's 1/3 apart after the holder's 0, light's 1 apart from 0; a tie (1.0) goes
    # to the one that came first
    assert [name[0] for name in seated] == list("lhhhlhhh"), seated


def test_the_access_log_names_the_tenant(server: Server) -> None:
    reply = predict(server, KEYS["light"], "logged")
    rid = reply.headers["X-Request-Id"]
    access = server.run_dir / "logs" / "access.log"
    wait_until(lambda: rid in access.read_text(), 10, "the access log line")
    line = next(x for x in access.read_text().splitlines() if rid in x)
    assert line.endswith(f" {rid} - light")  # request id, trace id (none), tenant


def test_mserve_top_shows_what_each_tenant_was_served(server: Server) -> None:
    from server.top_data import Reader

    reader = Reader(server.status)
    try:
        row = next(m for m in reader.read().models if m.name == "paced")
    finally:
        reader.close()
    served = counts(server)
    assert row.tenants.startswith("tenants: ")
    assert f"light {served['light']:.0f} (" in row.tenants


def test_over_quota_is_429_with_retry_after_and_takes_no_slot(server: Server) -> None:
    replies = [predict(server, KEYS["capped"]) for _ in range(3)]
    assert [r.status for r in replies[:2]] == [200, 200]  # the burst
    over = replies[2]
    assert over.status == 429
    assert over.headers["Retry-After"] in ("1", "2")  # a token every 2 s, partly refilled
    body = over.json()
    assert body["type"] == "QuotaExceededException"
    assert body["message"].startswith(
        "tenant capped is over its quota for model paced (0.5 requests/s, burst 2); retry in"
    )
    assert counts(server)["capped"] == 2  # the refused one was never queued nor served
    assert counts(server, "mserve_tenant_requests_refused_total")["capped"] >= 1
    # gRPC: RESOURCE_EXHAUSTED, the hint in the trailing metadata
    with grpc.insecure_channel(server.status["grpc_inference"]) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="paced", input={"data": b"x"})
        with pytest.raises(grpc.RpcError) as err:
            stub.Predictions(request, metadata=[("authorization", f"Bearer {KEYS['capped']}")])
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant capped is over its quota" in err.value.details()
        trailing = dict(err.value.trailing_metadata() or ())
        assert trailing["retry-after"] in ("1", "2")
        stub.Predictions(request, metadata=[("authorization", f"Bearer {KEYS['heavy']}")])


def test_the_openai_api_key_is_the_tenants_key(server: Server) -> None:
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url("inference", "/openai/v1"), api_key=key,
                             max_retries=0, timeout=30)  # fmt: skip

    say = [{"role": "user", "content": "say: hello"}]
    reply = client(KEYS["light"]).chat.completions.create(model="gen", messages=say, max_tokens=2)
    assert reply.choices[0].message.content
    assert counts(server, model="gen")["light"] == 1
    with pytest.raises(openai.AuthenticationError):
        client("not-a-key-of-anyone-at-all").chat.completions.create(model="gen", messages=say)
    capped = client(KEYS["capped"])
    capped.chat.completions.create(model="gen", messages=say, max_tokens=2)  # the burst
    with pytest.raises(openai.RateLimitError) as err:
        capped.chat.completions.create(model="gen", messages=say, max_tokens=2)
    assert err.value.response.headers["Retry-After"] in ("4", "5")  # a token every 5 s
    assert "tenant capped is over its quota for model gen" in str(err.value)


def _load(server: Server, key: str, stop: threading.Event) -> Callable[[], None]:
    def run() -> None:
        while not stop.is_set():
            assert predict(server, key).status == 200

    return run


def _saturate(server: Server, per_tenant: dict[str, int]) -> tuple[threading.Event, list[Any]]:
    stop = threading.Event()
    keys = [KEYS.get(name) or server.key("inference") for name, n in per_tenant.items()
            for _ in range(n)]  # fmt: skip
    threads = [threading.Thread(target=_load(server, key, stop), daemon=True) for key in keys]
    for thread in threads:
        thread.start()
    return stop, threads


def test_saturating_tenants_share_the_model_by_weight(server: Server) -> None:
    """heavy (weight 3) and light (weight 1), 8 connections each: shares near 3:1, read from
    the server's counts over a window taken once both queue."""
    stop, threads = _saturate(server, {"heavy": 8, "light": 8})
    try:
        base = counts(server)
        wait_until(lambda: sum(counts(server).values()) - sum(base.values()) >= 40, 60, "load")
        start = counts(server)
        wait_until(lambda: sum(counts(server).values()) - sum(start.values()) >= 240, 120,
                   "240 requests served")  # fmt: skip
        end = counts(server)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    heavy = end["heavy"] - start["heavy"]
    light = end["light"] - start["light"]
    share = heavy / (heavy + light)
    # start-time fair queuing serves 3 of heavy's per light's while both queue: 0.75, give or
    # take the requests in flight at the window's edges
    assert 0.68 <= share <= 0.82, (heavy, light)


def test_a_quiet_tenant_is_not_starved_by_a_noisy_one(server: Server) -> None:
    """light sends one request at a time beside the default tenant (the server's own key, the
    same weight) on 16 connections: each of light's requests waits for a few of the noisy
    one's (the batch running, the one sent after it), not for its 16 queued ones (FIFO)."""
    stop, threads = _saturate(server, {"default": 16})
    try:
        wait_until(lambda: counts(server).get("default", 0) > 0, 30, "load")
        before = counts(server)
        for _ in range(10):
            assert predict(server, KEYS["light"]).status == 200
        after = counts(server)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    noisy_meanwhile = after["default"] - before["default"]
    assert after["light"] - before["light"] == 10
    assert noisy_meanwhile < 10 * 6, noisy_meanwhile  # FIFO: ~16 per quiet request


def test_the_file_is_reloaded_and_a_broken_one_kept_out(server: Server) -> None:
    path: Path = server.tenants_file  # type: ignore[attr-defined]
    assert predict(server, KEYS["late"]).status == 401
    path.write_text(tenants_yaml("  late:", f"    keys: [sha256:{key_hash(KEYS['late'])}]"))
    wait_until(lambda: predict(server, KEYS["late"]).status == 200, 20, "the new tenant's key")
    # weight 0 on line 4: refused, named; the tenants read before stay
    broken = tenants_yaml("  late:", f"    keys: [sha256:{key_hash(KEYS['late'])}]")
    path.write_text(broken.replace("weight: 3", "weight: 0"))
    log = server.run_dir / "logs" / "mserve.log"
    wait_until(lambda: "'weight' should be above 0" in log.read_text(), 20, "the reload's error")
    line = next(x for x in log.read_text().splitlines() if "'weight' should be above 0" in x)
    assert f"{path} line 4: tenant 'heavy': 'weight' should be above 0;" in line
    assert "the previous tenants stay in force" in line
    assert predict(server, KEYS["late"]).status == 200
    assert predict(server, KEYS["heavy"]).status == 200
    path.write_text(tenants_yaml())


def _models() -> list[str]:
    return ["paced"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants:\n  a:\n    keys: [sha256:" + "0" * 64 + "]\n  b:\n    keys: ['" + "0" * 64
         + "']\n", "line 5: tenant 'b': duplicate key (also a key of tenant 'a')"),
        ("tenants:\n  a:\n    keys: [sha256:" + "0" * 64 + "]\n    weight: 0\n",
         "line 4: tenant 'a': 'weight' should be above 0"),
        ("tenants:\n  a:\n    keys: [sha256:" + "0" * 64 + "]\n    models:\n      nope: {in_flight: 2}\n",
         "line 5: tenant 'a': unknown model 'nope' in its quotas (models: paced)"),
        ("tenants:\n  a:\n    keys: [my-plain-secret-key]\n",
         "line 3: tenant 'a': a key should be stored as its sha256 hash"),
        ("tenants:\n  a:\n    weight: 2\n", "line 3: tenant 'a' has no 'keys'"),
        ("tenants:\n  a:\n    keys: []\n    wieght: 2\n",
         "line 4: tenant 'a': unknown field 'wieght' (fields: keys, weight, quota, models)"),
        ("tenants:\n  a:\n    keys: []\n    quota: {burst: 3}\n",
         "line 4: tenant 'a': 'quota': 'burst' needs 'requests_per_second'"),
        ("tenants: [\n", "line 2: not valid YAML"),
    ],
)  # fmt: skip
def test_bad_files_are_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(text, _models, "tenants.yaml")
    assert err.value.message.startswith(f"tenants.yaml {message}"), err.value.message
