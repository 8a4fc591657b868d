"""Tenants and generative models (docs/tenants.md): generated tokens per second as a quota,
charged as the tokens come and never cutting an answer short; ``in_flight`` counting a stream
until it ends; new sequences of a continuous-batching model admitted by weighted fair queuing.

One server for the module: ``gen`` (tests/handlers/generative, a word per streamed piece, OpenAI
API) and ``cb`` (tests/handlers/generator, TorchServe's continuous batching, 2 sequences per
step, declared generative so its chunks count as tokens)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import yaml
from click.testing import CliRunner

from archiver.cli import main as archiver_main
from server.errors import ConfigError
from server.tenants import key_hash, parse
from tests.server.conftest import (
    HANDLERS,
    Server,
    http,
    pid_alive,
    server_settings,
    start_daemon,
    wait_until,
)

NAMES = ("heavy", "light", "metered", "streamer", "single")
KEYS = {name: f"key-of-{name}-0123456789" for name in NAMES}
TENANTS = {
    "heavy": {"weight": 3},
    "light": {"weight": 1},
    # rates slow enough that what refills while a test runs (a few seconds under load) is a
    # small part of what the tests spend
    "metered": {"models": {"gen": {"tokens_per_second": 0.5, "token_burst": 10}}},
    "streamer": {"quota": {"tokens_per_second": 0.2, "token_burst": 4}},
    "single": {"models": {"gen": {"in_flight": 1}}},
}
CB_CONFIG = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 2, "maxBatchDelay": 1,
             "continuousBatching": True, "generative": {"input": "json"}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tenant_tokens")
    store = root / "store"
    store.mkdir()
    (root / "cb.yaml").write_text(yaml.safe_dump(CB_CONFIG))
    gen = HANDLERS / "generative"
    for args in (
        ["--model-name", "gen", "--handler", "lm:handle", "--model-path", str(gen),
         "-c", str(gen / "chat.yaml")],
        ["--model-name", "cb", "--handler", "generator:Generator", "--model-path",
         str(HANDLERS / "generator"), "-c", str(root / "cb.yaml")],
    ):  # fmt: skip
        out = CliRunner().invoke(
            archiver_main, [*args, "--export-path", str(store), "-f"], catch_exceptions=False
        )
        assert out.exit_code == 0, out.output
    tenants = {
        name: {"keys": [f"sha256:{key_hash(KEYS[name])}"], **spec} for name, spec in TENANTS.items()
    }
    (root / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    settings = server_settings(
        store, disable_token_authorization=False, tenants_file=str(root / "tenants.yaml")
    )
    server = start_daemon(
        root / "mserve.yaml", root / "run", settings, ("--models", "gen=gen.mar", "cb=cb.mar")
    )
    try:
        yield server
    finally:
        server.cli("--stop")
        if pid_alive(server.pid):
            subprocess.run(["kill", "-9", str(server.pid)], check=False)


def client(server: Server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("inference", "/openai/v1"), api_key=KEYS[name],
                         max_retries=0, timeout=30)  # fmt: skip


def chat(server: Server, name: str, words: int, slow: bool = False) -> Any:
    """A streamed chat answering ``words`` words, one token each."""
    say = "say: " + ("SLOW " if slow else "") + " ".join(f"w{i}" for i in range(words))
    return client(server, name).chat.completions.create(
        model="gen", messages=[{"role": "user", "content": say}], max_tokens=words + 1,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip


def predict_cb(server: Server, name: str, tokens: int, sleep_s: float = 0.01) -> Any:
    body = json.dumps({"name": name, "tokens": tokens, "sleep": sleep_s}).encode()
    return http("POST", server.url("inference", "/predictions/cb"), body,
                {"Authorization": f"Bearer {KEYS[name]}", "Content-Type": "application/json"})  # fmt: skip


def counts(server: Server, family: str, model: str) -> dict[str, float]:
    text = http("GET", server.url("metrics", "/metrics")).body.decode()
    found = {}
    for m in re.finditer(rf'^{family}\{{model="{model}",tenant="([^"]+)"\}} (\S+)$', text, re.M):
        found[m.group(1)] = float(m.group(2))
    return found


def test_a_tenant_over_its_token_quota_finishes_its_answer_then_waits(server: Server) -> None:
    """metered: 0.5 tokens/s, a burst of 10, on gen. An 8-token answer leaves 2; the next is
    let in and answered whole (never cut off) though it takes the bucket 6 below zero; the one
    after is refused until the rate has paid that back."""
    for _ in range(2):
        chunks = list(chat(server, "metered", 8))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.split() == [f"w{i}" for i in range(8)]
        assert chunks[-1].usage.completion_tokens == 8
    with pytest.raises(openai.RateLimitError) as err:
        chat(server, "metered", 8)
    message = str(err.value)
    found = re.search(
        r"tenant metered is over its token quota for model gen \(0.5 tokens/s, burst 10,"
        r" ([456]) tokens owed\); retry in (\d+\.\d{3}) s", message
    )  # fmt: skip
    assert found, message
    # (1 - (10 - 16 + refill)) / 0.5 tokens a second: 14 s less what refilled meanwhile
    wait_s = float(found.group(2))
    assert 10 < wait_s <= 14
    assert err.value.response.headers["Retry-After"] == str(math.ceil(wait_s))
    assert counts(server, "mserve_tenant_requests_refused_total", "gen")["metered"] == 1
    assert counts(server, "mserve_tenant_requests_served_total", "gen")["metered"] == 2
    assert counts(server, "mserve_tenant_tokens_charged_total", "gen")["metered"] == 16


def test_torchserve_style_streams_count_a_token_per_chunk(server: Server) -> None:
    """streamer: 0.2 tokens/s over all its models, a burst of 4. A one-step answer (whole, not
    streamed) costs 1; a continuous-batching stream of 6 steps (6 chunks) on /predictions is
    delivered whole, then the tenant waits."""
    whole = predict_cb(server, "streamer", 1)
    assert whole.status == 200
    assert "transfer-encoding" not in {k.lower() for k in whole.headers}
    reply = predict_cb(server, "streamer", 6)
    assert reply.status == 200
    lines = [json.loads(x) for x in reply.body.decode().splitlines()]
    assert [x["token"] for x in lines] == [f"streamer:{i}" for i in range(6)]
    over = predict_cb(server, "streamer", 1)
    assert over.status == 429
    assert over.json()["type"] == "QuotaExceededException"
    message = over.json()["message"]
    assert re.match(  # 3 owed, less what refilled meanwhile
        r"tenant streamer is over its token quota \(0\.2 tokens/s, burst 4, [23] tokens owed\);"
        r" retry in \d+\.\d{3} s$", message
    ), message  # fmt: skip
    assert 15 < int(over.headers["Retry-After"]) <= 20  # (1 + 3) / 0.2, less what refilled
    assert counts(server, "mserve_tenant_tokens_charged_total", "cb")["streamer"] == 7


def test_in_flight_counts_a_stream_until_it_ends_or_is_cancelled(server: Server) -> None:
    """single: one request in flight on gen. A stream holds its place from its first chunk to
    its last (it was counted out at its first chunk before), and a client that leaves gives
    it back."""
    stream = chat(server, "single", 10, slow=True)  # 50 ms a word
    assert next(iter(stream)).choices[0].delta.role == "assistant"  # the stream began
    with pytest.raises(openai.RateLimitError) as err:
        chat(server, "single", 1)
    assert "tenant single has 1 requests in flight for model gen, its quota (in_flight: 1)" in (
        str(err.value)
    )
    rest = list(stream)
    assert rest[-1].usage.completion_tokens == 11  # SLOW and w0..w9
    assert len(list(chat(server, "single", 2))) > 1  # its place is free again
    # a client that goes away mid-stream: its place comes back once the server sees it leave
    stream = chat(server, "single", 20, slow=True)
    next(iter(stream))
    stream.close()

    def admitted() -> bool:
        try:
            list(chat(server, "single", 1))
        except openai.RateLimitError:
            return False
        return True

    wait_until(admitted, 20, "the cancelled stream's place")


def test_continuous_batching_admits_new_sequences_by_weight(server: Server) -> None:
    """heavy (weight 3) and light (weight 1) keep 6 streams each waiting for cb's 2 seats: the
    sequences that join the running batch are 3 of heavy's per light's, read from the
    server's per-tenant counts of requests taken from the queue."""
    stop = threading.Event()
    failures: list[int] = []

    def load(name: str) -> None:
        while not stop.is_set():
            reply = predict_cb(server, name, 2)
            if reply.status != 200:
                failures.append(reply.status)

    threads = [threading.Thread(target=load, args=(name,), daemon=True)
               for name in ("heavy", "light") for _ in range(6)]  # fmt: skip
    for thread in threads:
        thread.start()
    served = "mserve_tenant_requests_served_total"
    try:
        wait_until(lambda: sum(counts(server, served, "cb").values()) >= 30, 60, "load")
        start = counts(server, served, "cb")
        wait_until(lambda: sum(counts(server, served, "cb").values()) - sum(start.values())
                   >= 160, 90, "160 sequences admitted")  # fmt: skip
        end = counts(server, served, "cb")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures
    heavy = end["heavy"] - start["heavy"]
    light = end["light"] - start["light"]
    # FIFO would admit them in arrival order, about 1:1 with 6 streams each
    assert 0.68 <= heavy / (heavy + light) <= 0.82, (heavy, light)


def _models() -> list[str]:
    return ["gen"]


@pytest.mark.parametrize(
    ("quota", "message"),
    [
        ("{token_burst: 100}", "line 4: tenant 'a': 'quota': 'token_burst' needs"
         " 'tokens_per_second'"),
        ("{tokens_per_second: -5}", "line 4: tenant 'a': 'quota': 'tokens_per_second' should"
         " be above 0"),
        ("{tokens_per_second: 5, token_burst: 0}", "line 4: tenant 'a': 'quota':"
         " 'token_burst' should be above 0"),
        ("{tokens_per_second: lots}", "line 4: tenant 'a': 'quota': 'tokens_per_second'"
         " should be a number, found 'lots'"),
        ("{tokens_per_sec: 5}", "line 4: tenant 'a': 'quota': unknown field 'tokens_per_sec'"
         " (fields: requests_per_second, burst, in_flight, tokens_per_second, token_burst)"),
    ],
)  # fmt: skip
def test_bad_token_quotas_are_refused_naming_the_line(quota: str, message: str) -> None:
    text = f"tenants:\n  a:\n    keys: [sha256:{'0' * 64}]\n    quota: {quota}\n"
    with pytest.raises(ConfigError) as err:
        parse(text, _models, "tenants.yaml")
    assert err.value.message.startswith(f"tenants.yaml {message}"), err.value.message


def test_a_token_quota_defaults_its_burst_to_a_seconds_worth() -> None:
    text = f"tenants:\n  a:\n    keys: [sha256:{'0' * 64}]\n    quota: {{tokens_per_second: 50}}\n"
    quota = parse(text, _models, "tenants.yaml")["a"].quota
    assert (quota.tokens_per_second, quota.token_burst) == (50, 50)
