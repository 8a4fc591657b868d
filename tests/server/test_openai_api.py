"""The OpenAI-compatible API through the official ``openai`` client, against one real mserve
(token authorization on: the inference key is the client's API key) serving the fixture models
of tests/handlers/generative/: ``gen`` (a generator handler, context 128), ``emb`` (embeddings),
``tslm`` (a TorchServe streaming handler behind ``input: text``) and ``echo`` (not generative).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import ARCHIVER_SCRIPT
from tests.server.conftest import HANDLERS, MSERVE, Server, pid_alive

pytestmark = pytest.mark.timeout(120)
GEN = HANDLERS / "generative"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("openai")
    store = root / "store"
    store.mkdir()
    archives = [
        ("gen", GEN, "lm:handle", GEN / "chat.yaml"),
        ("emb", GEN, "lm:handle", GEN / "embed.yaml"),
        ("tslm", GEN, "ts_lm:Reverser", GEN / "ts.yaml"),
        ("echo", HANDLERS / "echo_fn", "echo", None),
    ]
    for name, folder, handler, config in archives:
        args = [ARCHIVER_SCRIPT, "--model-name", name, "--handler", handler,
                "--model-path", str(folder), "--export-path", str(store), "-f"]  # fmt: skip
        if config is not None:
            args += ["-c", str(config)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    settings = {
        "inference_address": "127.0.0.1:0",
        "management_address": "127.0.0.1:0",
        "metrics_address": "127.0.0.1:0",
        "grpc_inference_address": "127.0.0.1:0",
        "grpc_management_address": "127.0.0.1:0",
        "model_store": str(store),
    }
    config_file = root / "mserve.yaml"
    config_file.write_text(yaml.safe_dump(settings))
    run_dir = root / "run"
    args = ["--config", str(config_file), "--run-dir", str(run_dir)]
    models = [f"{n}={n}.mar" for n, *_ in archives]
    started = subprocess.run([MSERVE, "--start", *args, "--models", *models],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    served = Server(run_dir, json.loads((run_dir / "status.json").read_text()), args)
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("inference", "/openai/v1"),
        api_key=server.key("inference"),
        max_retries=0,
        timeout=30,
    )


def _say(words: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"say: {words}"}]


# --- answers --------------------------------------------------------------------------------


def test_models_lists_the_generative_models(client: openai.OpenAI) -> None:
    ids = sorted(m.id for m in client.models.list())
    assert ids == ["emb", "gen", "tslm"]  # echo has no generative: section
    assert client.models.retrieve("gen").owned_by == "mserve"


def test_chat_answers_with_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gen", messages=[{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hello there"}],
        max_tokens=5, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == "gen"
    assert choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 5
    assert choice.finish_reason == "length"
    # the prompt as the handler got it: "system: be brief\nuser: hello there\nassistant:"
    assert reply.usage.prompt_tokens == 7
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == 12


def test_streamed_chat_matches_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "gen", "messages": _say("one two three four"),
                              "max_tokens": 10}  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == "one two three four"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_plain_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="gen", prompt="a b c", max_tokens=4, seed=7)
    assert whole.object == "text_completion"
    assert whole.usage.prompt_tokens == 3 and whole.usage.completion_tokens == 4
    stream = client.completions.create(
        model="gen", prompt="a b c", max_tokens=4, seed=7, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def test_n_choices_differ_and_a_seed_repeats_them(client: openai.OpenAI) -> None:
    def ask(seed: int) -> list[str]:
        reply = client.chat.completions.create(
            model="gen", messages=[{"role": "user", "content": "hi"}], n=3, seed=seed,
            max_tokens=8, temperature=1,
        )  # fmt: skip
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert reply.usage.completion_tokens == 24  # the prompt counts once
        return [c.message.content for c in reply.choices]

    first = ask(42)
    assert len(set(first)) == 3
    assert ask(42) == first
    assert ask(43) != first


def test_n_choices_as_a_fresh_servers_first_request(make_archive, start_server) -> None:
    """The n choices of one request run on one worker, one after the other: the server must
    take each choice's stream as it begins, whatever order they finish in (it once waited for
    choice 1 while choice 0's unread stream held the worker)."""
    make_archive("generative", "lm:handle", "gen", "-c", str(GEN / "chat.yaml"))
    server = start_server("gen=gen.mar")
    client = openai.OpenAI(
        base_url=server.url("inference", "/openai/v1"), api_key="-", max_retries=0, timeout=20
    )
    reply = client.chat.completions.create(
        model="gen", messages=[{"role": "user", "content": "hi"}], n=3, seed=1, max_tokens=6
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 18
    stream = client.chat.completions.create(model="gen", messages=_say("a b c"), n=3, stream=True)
    texts = {0: "", 1: "", 2: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "a b c", 1: "a b c", 2: "a b c"}


def test_n_choices_stream_each_with_its_index(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="gen", messages=_say("x y"), n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "x y", 1: "x y"}


def test_stop_cuts_the_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gen", messages=_say("one two STOP three"), stop=["STOP"]
    )
    assert reply.choices[0].message.content == "one two "
    assert reply.choices[0].finish_reason == "stop"
    # a stop string split over two pieces is held back, never half sent
    stream = client.chat.completions.create(
        model="gen", messages=_say("one ST OP two"), stop=" ST OP", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "one"


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="gen", prompt="say: a b c d e", max_tokens=3)
    assert reply.choices[0].text == "a b c"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_embeddings_float_and_base64(client: openai.OpenAI) -> None:
    texts = ["hello world", "mserve"]
    expected = [[float(sum(1 for ch in t if ord(ch) % 8 == i)) for i in range(8)] for t in texts]
    default = client.embeddings.create(model="emb", input=texts)  # the client asks for base64
    assert [d.embedding for d in default.data] == expected
    floats = client.embeddings.create(model="emb", input=texts, encoding_format="float")
    assert [d.embedding for d in floats.data] == expected
    assert floats.usage.prompt_tokens == 3


def test_answers_are_strict_json_even_when_a_vector_holds_nan(server: Server) -> None:
    """Python's json would write NaN and Infinity, which no strict parser (JavaScript's, Go's)
    reads: OpenAI answers carry them as null."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in an answer")

    reply = httpx.post(
        server.url("inference", "/openai/v1/embeddings"),
        json={"model": "emb", "input": "NAN here", "encoding_format": "float"},
        headers=server.auth("inference"), timeout=30,
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    vector = json.loads(reply.content, parse_constant=refuse)["data"][0]["embedding"]
    assert vector == [None, None, None, 0.0, 0.0, 2.0, 2.0, 0.0]


def test_a_torchserve_streaming_handler_behind_input_text(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="tslm", prompt="one two three", max_tokens=10)
    assert reply.choices[0].text == "three two one"
    assert reply.usage.completion_tokens == 3  # one token a piece
    stream = client.completions.create(model="tslm", prompt="a b", stream=True)
    assert [c.choices[0].text for c in stream] == ["b ", "a", ""]


def test_sse_on_the_wire(server: Server) -> None:
    body = {"model": "gen", "messages": _say("hi you"), "stream": True}
    with httpx.stream(
        "POST", server.url("inference", "/openai/v1/chat/completions"), json=body,
        headers=server.auth("inference"), timeout=30,
    ) as reply:  # fmt: skip
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream"
        raw = reply.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


# --- refusals ---------------------------------------------------------------------------------


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=_say("x"))
    assert caught.value.body == {
        "message": "The model `nope` does not exist", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found",
    }  # fmt: skip


def test_a_model_without_generative_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="echo", messages=_say("x"))
    assert caught.value.body["message"] == (
        "model 'echo' is not generative: its model config has no `generative:` section, so it"
        " is not served under /openai/ (docs/generative.md)"
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="gen", input="x")
    assert caught.value.body["message"] == (
        "model 'gen' does not serve embeddings: its `generative:` section lacks `embeddings: true`"
    )
    # not among the listed models: retrieving it is OpenAI's 404, with the same reason
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("echo")
    assert caught.value.body["code"] == "model_not_found"
    assert "is not generative" in caught.value.body["message"]


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"temperature": 5}, "temperature", "temperature: 5 is greater than the maximum of 2"),
        ({"top_p": -1}, "top_p", "top_p: -1 is less than the minimum of 0"),
        ({"n": 0}, "n", "n: 0 is less than the minimum of 1"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: 0 is less than the minimum of 1"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role",
         "messages[0].role: 'wizard' is not one of ['system', 'developer', 'user',"
         " 'assistant', 'tool']"),
        ({"messages": []}, "messages", "messages: [] should be non-empty"),
    ],
)  # fmt: skip
def test_bad_parameters_name_the_parameter(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str, message: str
) -> None:
    request: dict[str, Any] = {"model": "gen", "messages": _say("x"), **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    assert caught.value.body == {
        "message": message, "type": "invalid_request_error", "param": param, "code": None
    }  # fmt: skip


def test_what_would_change_the_answer_is_refused_not_ignored(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gen", messages=_say("x"), logprobs=True)
    assert caught.value.body == {
        "message": "logprobs: log probabilities are not supported by mserve's OpenAI API",
        "type": "invalid_request_error", "param": "logprobs", "code": "unsupported_parameter",
    }  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(openai.BadRequestError, match="function calling"):
        client.chat.completions.create(model="gen", messages=_say("x"), tools=[tool])


def test_max_tokens_over_the_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gen", messages=_say("x"), max_tokens=500)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert caught.value.body["message"] == (
        "max_tokens=500 is more than the context length of model 'gen' (128 tokens)"
    )


def test_a_prompt_over_the_context_gets_the_handlers_words(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="gen", prompt="w " * 70, stream=True)
    assert caught.value.body["message"] == (
        "model 'gen': the prompt is 70 tokens, more than this model's context of 64"
    )


def test_malformed_json_and_a_wrong_key(server: Server, client: openai.OpenAI) -> None:
    url = server.url("inference", "/openai/v1/chat/completions")
    reply = httpx.post(url, content=b"{nope", headers=server.auth("inference"), timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("the request body is not valid JSON")
    wrong = client.with_options(api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.body["type"] == "authentication_error"


def test_a_handler_raising_mid_stream_ends_with_an_error_event(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="gen", messages=[{"role": "user", "content": "FAIL now"}], max_tokens=6,
        stream=True,
    )  # fmt: skip
    got = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert len("".join(got).split()) == 2  # the two words before the failure arrived
    assert "the model broke mid-stream" in caught.value.message
    # the model serves on
    reply = client.chat.completions.create(model="gen", messages=_say("ok"))
    assert reply.choices[0].message.content == "ok"


def test_a_client_leaving_mid_stream_stops_the_generation(
    server: Server, client: openai.OpenAI
) -> None:
    body = {"model": "gen", "messages": [{"role": "user", "content": "SLOW"}],
            "max_tokens": 120, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", server.url("inference", "/openai/v1/chat/completions"), json=body,
        headers=server.auth("inference"), timeout=30,
    ) as reply:  # fmt: skip
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
    # 120 words at 50 ms would hold the one worker for 6 s: the next request is served at once
    started = time.monotonic()
    reply2 = client.chat.completions.create(model="gen", messages=_say("next"))
    assert reply2.choices[0].message.content == "next"
    assert time.monotonic() - started < 3.0


# --- seams: request ids, token counters ------------------------------------------------------


def test_the_clients_request_id_names_the_jobs_and_the_answers(
    server: Server, client: openai.OpenAI
) -> None:
    """X-Request-ID, as on /predictions: the handler's request id (``<id>.<i>`` per choice when
    there are several), the answer's X-Request-Id and its ``id``; one not usable is replaced."""
    ask = {"model": "gen", "messages": [{"role": "user", "content": "WHOAMI"}], "max_tokens": 3}
    raw = client.chat.completions.with_raw_response.create(
        **ask, extra_headers={"X-Request-ID": "client-42"}
    )
    reply = raw.parse()
    assert raw.headers["x-request-id"] == "client-42"
    assert reply.id == "chatcmpl-client-42"
    assert reply.choices[0].message.content == "client-42"  # what the handler was given
    two = client.chat.completions.create(**ask, n=2, extra_headers={"X-Request-ID": "c-2"})
    assert sorted(c.message.content for c in two.choices) == ["c-2.0", "c-2.1"]
    with client.chat.completions.with_streaming_response.create(
        **ask, stream=True, extra_headers={"X-Request-ID": "streamed-1"}
    ) as streamed:  # fmt: skip
        assert streamed.headers["x-request-id"] == "streamed-1"
        chunks = list(streamed.parse())
    assert chunks[0].id == "chatcmpl-streamed-1"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "streamed-1"
    # a refusal names it too; an id that could break a header or a log line is not taken
    url = server.url("inference", "/openai/v1/completions")
    headers = {**server.auth("inference"), "X-Request-ID": "refused-1"}
    refused = httpx.post(url, json={"model": "gen", "prompt": "w " * 100}, headers=headers,
                         timeout=30)  # fmt: skip
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "refused-1"
    headers["X-Request-ID"] = "not usable"
    ours = httpx.post(url, json={"model": "gen", "prompt": "hi", "max_tokens": 1},
                      headers=headers, timeout=30)  # fmt: skip
    assert ours.status_code == 200 and ours.headers["x-request-id"] not in ("", "not usable")
    assert ours.json()["id"] == "cmpl-" + ours.headers["x-request-id"]


def _counter(server: Server, name: str, model: str) -> float:
    text = httpx.get(server.url("metrics", "/metrics"), timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_token_counters_follow_the_usage(server: Server, client: openai.OpenAI) -> None:
    """mserve_prompt_tokens_total and mserve_generated_tokens_total{model,version} add up the
    usage of each answer, streamed or whole (the Grafana tokens/s panel reads them)."""
    before = [_counter(server, n, "gen") for n in ("mserve_prompt_tokens_total",
                                                   "mserve_generated_tokens_total")]  # fmt: skip
    whole = client.chat.completions.create(model="gen", messages=_say("a b c"), max_tokens=9)
    chunks = list(client.completions.create(
        model="gen", prompt="one two", max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    streamed = chunks[-1].usage
    after = [_counter(server, n, "gen") for n in ("mserve_prompt_tokens_total",
                                                  "mserve_generated_tokens_total")]  # fmt: skip
    assert after[0] - before[0] == whole.usage.prompt_tokens + streamed.prompt_tokens
    assert after[1] - before[1] == whole.usage.completion_tokens + streamed.completion_tokens == 7
    text = httpx.get(server.url("metrics", "/metrics"), timeout=10).text
    assert 'mserve_generated_tokens_total{model="gen",version="1.0"}' in text
    # the stream's first token is timed; the whole answer is not a stream
    assert _counter(server, "mserve_time_to_first_token_seconds_count", "gen") >= 1
