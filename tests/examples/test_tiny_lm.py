"""examples/tiny_lm: the model's batched decode, its handler on TorchServe's continuous-batching
contract (driven in process the way TorchServe's backend drives it), and the example archived
with model-archiver, served by a real mserve and queried with the ``openai`` client.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml

from mserve_worker.context import Context
from mserve_worker.contract import LoadedHandler
from mserve_worker.loader import load_handler
from tests.conftest import ARCHIVER_SCRIPT, REPO
from tests.server.conftest import MSERVE, Server, pid_alive

EXAMPLE = REPO / "examples" / "tiny_lm"
COMPAT = REPO / "mserve_worker" / "compat"  # where a worker finds ``ts``
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example's files and seed-0 weights in one folder, first on sys.path with ``ts`` as
    in a worker; forgotten afterwards."""
    folder = tmp_path_factory.mktemp("tiny_lm")
    for name in ("model.py", "handler.py", "make_weights.py"):
        shutil.copy(EXAMPLE / name, folder)
    saved, before = list(sys.path), set(sys.modules)
    sys.path[:0] = [str(folder), str(COMPAT)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        import make_weights

        make_weights.write(folder / "tiny_lm.pt")
        yield folder
    finally:
        torch.set_num_threads(threads)
        sys.path[:] = saved
        for name in set(sys.modules) - before:
            if name in ("model", "handler", "make_weights") or name.split(".")[0] == "ts":
                del sys.modules[name]


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ModuleType:
    import model as tiny

    return tiny


def _handler(model_dir: Path, continuous: bool) -> tuple[LoadedHandler, Context]:
    context = Context(
        model_name="tiny_lm", model_dir=str(model_dir),
        manifest={"model": {"modelName": "tiny_lm", "serializedFile": "tiny_lm.pt",
                            "modelFile": "model.py", "handler": "handler.py"}},
        batch_size=8, gpu_id=None, server_name="mserve", server_version="test",
        model_yaml_config={"continuousBatching": continuous},
    )  # fmt: skip
    return load_handler("handler:TinyLMHandler", str(model_dir), context), context


def _start(context: Context, ids: list[str]) -> None:
    context.start_batch([SimpleNamespace(request_id=i, headers=[]) for i in ids])


def test_batched_decode_matches_each_request_alone(model: ModuleType) -> None:
    """Two decode steps of three requests at different lengths in one batch, their slots
    gathered (not contiguous) or read in place (contiguous), give each the logits it gets
    alone."""
    torch.manual_seed(0)
    lm = model.TinyLM().eval()
    prompts = [model.encode(p) for p in ["hello world", "hi", "a longer prompt than both"]]
    alone = []
    for ids in prompts:
        cache = lm.new_cache(1)
        lm.prefill([ids], [0], cache)
        steps = [lm.decode([65], [0], [len(ids)], cache)[0]]
        steps.append(lm.decode([66], [0], [len(ids) + 1], cache)[0])
        alone.append(steps)
    lengths = [len(ids) for ids in prompts]
    for slots in ([5, 1, 3], [2, 3, 4]):
        cache = lm.new_cache(6)
        lm.prefill(prompts, slots, cache)
        first = lm.decode([65] * 3, slots, lengths, cache)
        second = lm.decode([66] * 3, slots, [n + 1 for n in lengths], cache)
        for i, (one, two) in enumerate(alone):
            assert torch.allclose(first[i], one, atol=1e-5), (slots, i)
            assert torch.allclose(second[i], two, atol=1e-5), (slots, i)


def test_batched_prefill_matches_each_request_alone(model: ModuleType) -> None:
    """One forward of right-padded prompts gives each its next-token logits and cache alone."""
    torch.manual_seed(0)
    lm = model.TinyLM().eval()
    prompts = [model.encode(p) for p in ["hello world", "hi", "a longer prompt than both", ""]]
    together = lm.new_cache(4)
    logits = lm.prefill(prompts, [3, 0, 2, 1], together)
    for i, (ids, slot) in enumerate(zip(prompts, [3, 0, 2, 1], strict=True)):
        cache = lm.new_cache(1)
        assert torch.allclose(lm.prefill([ids], [0], cache)[0], logits[i], atol=1e-5), i
        for layer in range(len(lm.blocks)):
            for mine, theirs in ((cache.keys, together.keys), (cache.values, together.values)):
                kept = theirs[layer][slot, :, : len(ids)]
                assert torch.allclose(mine[layer][0, :, : len(ids)], kept, atol=1e-5), i


def test_sampling_greedy_and_top_p_by_row(model: ModuleType) -> None:
    """One call samples every row its own way: greedy at temperature 0, top_p keeping only the
    likeliest tokens, the row's uniform draw picking by inverse CDF."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [0.0] * 255] * 4) + 1e-12)
    tokens = model.sample(
        logits,
        temperature=torch.tensor([0.0, 1.0, 1.0, 1.0]),
        top_p=torch.tensor([1.0, 0.5, 1.0, 1.0]),
        uniform=torch.tensor([0.99, 0.99, 0.6, 0.9]),
    )
    assert tokens.tolist() == [0, 0, 1, 2]


def test_the_model_size_is_read_from_the_weights(model: ModuleType, model_dir: Path) -> None:
    """make_weights.py makes a wider, deeper model on request; load() builds it from the
    weights alone (the handler's way), and it generates; a width heads cannot split is refused."""
    import make_weights

    path = make_weights.write(model_dir / "bigger" / "lm.pt", dim=96, layers=3)
    lm = model.load(path)
    assert (len(lm.blocks), lm.embed.weight.shape[1], lm.heads) == (3, 96, 6)
    cache = lm.new_cache(2)
    assert lm.prefill([model.encode("hi"), model.encode("hello")], [0, 1], cache).shape == (
        2,
        model.VOCAB,
    )
    with pytest.raises(ValueError) as caught:
        model.TinyLM(dim=40)
    assert str(caught.value) == "the model's width must be a multiple of 16, not 40"


def _alone(model_dir: Path, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A request's pieces from the handler without continuous batching (a generator)."""
    handler, context = _handler(model_dir, False)
    _start(context, ["x"])
    (stream,) = handler.handle([{"body": body}], context)
    return list(stream)


def test_continuous_batching_contract(model_dir: Path) -> None:
    """TorchServe's backend loop: requests join between steps, each call is one token per
    request, stopping_criteria says who is finished; each request's answer is the one it gets
    alone, and no state is left behind."""
    bodies = {
        "a": {"prompt": "user: hi\nassistant:", "max_tokens": 12, "seed": 1},
        "b": {"prompt": "once upon a time", "max_new_tokens": 5, "seed": 2},  # TorchServe's
        "c": {"prompt": "late", "max_tokens": 8, "temperature": 0},
    }
    joins = {0: ["a", "b"], 3: ["c"]}  # c arrives while a and b are generating
    handler, context = _handler(model_dir, True)
    running: list[str] = []
    pieces: dict[str, list[dict[str, Any]]] = {k: [] for k in bodies}
    sizes = []
    for step in range(40):
        running += joins.get(step, [])
        if not running:
            break
        _start(context, running)
        results = handler.handle([{"body": bodies[r]} for r in running], context)
        sizes.append(len(running))
        stops = context.stopping_criteria
        assert len(results) == len(stops) == len(running)
        finished = []
        for request_id, result, stop in zip(running, results, stops, strict=True):
            assert result["tokens"] == 1 and len(result["ids"]) == 1  # one token per step
            pieces[request_id].append(result)
            if stop(result):
                finished.append(request_id)
        running = [r for r in running if r not in finished]
    assert sizes[:4] == [2, 2, 2, 3]
    assert context.cache == {}
    for request_id, body in bodies.items():
        assert pieces[request_id] == _alone(model_dir, body), request_id
    assert pieces["b"][-1]["finish_reason"] == "length" and len(pieces["b"]) == 5


def test_a_seeded_request_gets_its_tokens_whoever_shares_its_steps(model_dir: Path) -> None:
    """Eight sampled requests (temperature, top_p, seed each their own, answers of different
    lengths, so that slots move as they finish) decoded together under continuous batching:
    each gets the tokens it gets alone."""
    bodies = {
        f"r{i}": {"prompt": f"request {i}" * (i % 3 + 1), "max_tokens": 4 + 3 * i, "seed": i,
                  "temperature": 0.5 + i / 8, "top_p": 0.75 if i % 2 else 1.0}
        for i in range(8)
    }  # fmt: skip
    handler, context = _handler(model_dir, True)
    running = list(bodies)
    pieces: dict[str, list[dict[str, Any]]] = {k: [] for k in bodies}
    for _ in range(40):
        if not running:
            break
        _start(context, running)
        results = handler.handle([{"body": bodies[r]} for r in running], context)
        for request_id, result, stop in zip(list(running), results, context.stopping_criteria,
                                            strict=True):  # fmt: skip
            pieces[request_id].append(result)
            if stop(result):
                running.remove(request_id)
    assert not running and context.cache == {} and handler.instance.engine.held == []
    for request_id, body in bodies.items():
        assert pieces[request_id] == _alone(model_dir, body), request_id


def test_no_slot_leaks_with_cancellations(model_dir: Path) -> None:
    """Thirty requests through 8 slots (batchSize 8), never more than 8 at once; some are
    dropped by the server mid-answer while others wait, half of those cleaned up by the worker
    through their criterion's ``clean_up()`` (TorchServe's vLLM handler contract), half
    noticed missing by ``preprocess``. Each running request holds one slot, the pool never grows, and nothing
    is held at the end; the ones that ran to the end got the answer they get alone."""
    bodies = {f"q{i}": {"prompt": f"q{i}", "max_tokens": 3 + i % 7, "seed": i} for i in range(30)}
    handler, context = _handler(model_dir, True)
    queue, running = list(bodies), []
    pieces: dict[str, list[dict[str, Any]]] = {k: [] for k in bodies}
    criteria: dict[str, Any] = {}
    dropped: list[str] = []
    for step in range(200):
        if step % 3 == 2 and queue:  # the server drops the oldest with a number divisible by 3
            gone = next((r for r in running if int(r[1:]) % 3 == 0), None)
            if gone is not None:
                running.remove(gone)
                dropped.append(gone)
                if int(gone[1:]) % 2:
                    criteria[gone].clean_up()
        while queue and len(running) < 8:
            running.append(queue.pop(0))
        if not running:
            break
        _start(context, running)
        results = handler.handle([{"body": bodies[r]} for r in running], context)
        assert len(handler.instance.engine.held) == len(running) - sum(
            "finish_reason" in r for r in results
        )
        criteria.update(zip(running, context.stopping_criteria, strict=True))
        for request_id, result in zip(list(running), results, strict=True):
            pieces[request_id].append(result)
            if criteria[request_id](result):
                running.remove(request_id)
    assert not queue and not running
    assert handler.instance.engine.held == [] and handler.instance.engine.cache.slots == 8
    assert context.cache == {}
    finished = [r for r in bodies if r not in dropped]
    assert len({int(r[1:]) % 2 for r in dropped}) == 2  # both ways of leaving
    assert all("finish_reason" not in pieces[r][-1] for r in dropped)  # left mid-answer
    assert all("finish_reason" in pieces[r][-1] for r in finished)
    for request_id in finished:
        assert pieces[request_id] == _alone(model_dir, bodies[request_id]), request_id


def test_static_batching_gives_slots_back(model_dir: Path) -> None:
    """Without continuous batching: streams closed before their end (clients gone) and
    streams read to the end all give their slots back; a call of more requests than
    batchSize grows the pool once."""
    handler, context = _handler(model_dir, False)
    for size in (3, 12):
        _start(context, [str(i) for i in range(size)])
        streams = handler.handle(
            [{"body": {"prompt": "x", "max_tokens": 5, "seed": i}} for i in range(size)], context
        )
        next(streams[1])
        streams[1].close()  # left after one piece
        streams[2].close()  # left before any
        for i, stream in enumerate(streams):
            if i not in (1, 2):
                assert len(list(stream)) == 5
        assert handler.instance.engine.held == []
    assert handler.instance.engine.cache.slots == 16


def test_static_batching_decodes_a_call_together(model_dir: Path) -> None:
    """Without continuous batching, one call's requests advance in lockstep (read round by
    round, as the worker reads them), each getting its answer alone; a prompt too long is a
    400 in its place, the others go on."""
    bodies = [{"prompt": f"request {i}", "max_tokens": 3 + 4 * i, "seed": i} for i in range(3)]
    handler, context = _handler(model_dir, False)
    _start(context, ["a", "b", "long", "c"])
    data = [{"body": b} for b in bodies]
    data.insert(2, {"body": {"prompt": "z" * 400}})
    outputs = handler.handle(data, context)
    assert outputs[2].startswith("the prompt is 401 tokens")
    streams = [o for o in outputs if o is not outputs[2]]
    got: list[list[dict[str, Any]]] = [[] for _ in streams]
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            try:
                got[i].append(next(streams[i]))
            except StopIteration:
                live.discard(i)
    assert got == [_alone(model_dir, b) for b in bodies]


def test_a_prompt_over_the_context_is_refused(model_dir: Path) -> None:
    handler, context = _handler(model_dir, False)
    _start(context, ["x"])
    (answer,) = handler.handle([{"body": {"prompt": "x" * 300}}], context)
    assert answer == ("the prompt is 301 tokens: the context of 256 leaves no room to answer")
    assert context.request_processor[0].get_response_status_code() == 400


# --- served -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    store = root / "store"
    store.mkdir()
    config = yaml.safe_load((EXAMPLE / "model-config.yaml").read_text())
    assert config["continuousBatching"] is True and config["batchSize"] == 8  # as shipped
    archive = subprocess.run([
        ARCHIVER_SCRIPT, "--model-name", "tiny_lm", "--version", "1.0",
        "--serialized-file", str(model_dir / "tiny_lm.pt"),
        "--model-file", str(EXAMPLE / "model.py"),
        "--handler", str(EXAMPLE / "handler.py") + ":TinyLMHandler",
        "-c", str(EXAMPLE / "model-config.yaml"), "--export-path", str(store), "-f",
    ], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert archive.returncode == 0, archive.stderr
    settings = {"inference_address": "127.0.0.1:0", "management_address": "127.0.0.1:0",
                "metrics_address": "127.0.0.1:0", "grpc_inference_address": "127.0.0.1:0",
                "grpc_management_address": "127.0.0.1:0", "model_store": str(store)}  # fmt: skip
    (root / "mserve.yaml").write_text(yaml.safe_dump(settings))
    args = ["--config", str(root / "mserve.yaml"), "--run-dir", str(root / "run")]
    started = subprocess.run([MSERVE, "--start", *args, "--models", "tiny_lm=tiny_lm.mar"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    served = Server(root / "run", json.loads((root / "run" / "status.json").read_text()), args)
    yield served
    if pid_alive(served.pid):
        served.cli("--stop")


def test_served_streamed_chat_with_the_openai_client(server: Server, model_dir: Path) -> None:
    """The README's query: a streamed chat, the same tokens as the handler makes in process."""
    client = openai.OpenAI(base_url=server.url("inference", "/openai/v1"),
                           api_key=server.key("inference"), max_retries=0, timeout=60)  # fmt: skip
    stream = client.chat.completions.create(
        model="tiny_lm", messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=20, seed=3, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = _alone(model_dir, {"prompt": "user: Tell me a story\nassistant:",
                                  "max_tokens": 20, "seed": 3})  # fmt: skip
    assert text == "".join(p["text"] for p in expected)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len("user: Tell me a story\nassistant:") + 1  # bytes + BOS
    assert usage.completion_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny_lm", prompt="y" * 300)
    assert caught.value.body["message"] == (
        "model 'tiny_lm': the prompt is 301 tokens: the context of 256 leaves no room to answer"
    )


def test_ignore_eos_from_a_benchmark_client_reaches_the_handler(
    server: Server, model_dir: Path
) -> None:
    """vLLM's ``ignore_eos`` (its benchmark client sends it for answers of known length): past
    the end-of-sequence token the answer goes on to ``max_tokens``."""
    prompt, wanted = "once", 60
    free = forced = []
    for seed in range(200):  # a seed whose answer alone ends early, at the model's EOS
        free = _alone(model_dir, {"prompt": prompt, "max_tokens": wanted, "seed": seed})
        if free[-1]["finish_reason"] == "stop":
            forced = _alone(model_dir, {"prompt": prompt, "max_tokens": wanted, "seed": seed,
                                        "ignore_eos": True})  # fmt: skip
            break
    assert free[-1]["finish_reason"] == "stop" and len(forced) == wanted
    client = _client(server)
    for extra, expected in (({}, free), ({"ignore_eos": True}, forced)):
        reply = client.completions.create(model="tiny_lm", prompt=prompt, max_tokens=wanted,
                                          seed=seed, extra_body=extra)  # fmt: skip
        assert reply.choices[0].text == "".join(p["text"] for p in expected)
        assert reply.usage.completion_tokens == len(expected)


def test_torchserve_clients_stream_pieces_too(server: Server) -> None:
    """The same model on TorchServe's path, with TorchServe's LLM examples' body."""
    body = {"prompt": "hello", "max_new_tokens": 4, "seed": 5}
    with httpx.stream(
        "POST", server.url("inference", "/predictions/tiny_lm"), json=body,
        headers=server.auth("inference"), timeout=60,
    ) as reply:  # fmt: skip
        assert reply.status_code == 200
        raw = reply.read()
    pieces = [json.loads(line) for line in raw.replace(b"}{", b"}\n{").splitlines()]
    assert len(pieces) == 4 and pieces[-1]["finish_reason"] == "length"


# --- served with continuous batching: concurrent streams, joining, leaving --------------------


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("inference", "/openai/v1"),
                         api_key=server.key("inference"), max_retries=0, timeout=60)  # fmt: skip


class _Chat(threading.Thread):
    """One streamed chat read in a thread: its text, when each content chunk came, its usage."""

    def __init__(self, client: openai.OpenAI, content: str, **kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.client, self.content, self.kwargs = client, content, kwargs
        self.text: list[str] = []
        self.times: list[float] = []
        self.usage: Any = None
        self.stream: Any = None
        self.error: BaseException | None = None
        self.done_at = 0.0

    def run(self) -> None:
        try:
            self.stream = self.client.chat.completions.create(
                model="tiny_lm", messages=[{"role": "user", "content": self.content}],
                stream=True, stream_options={"include_usage": True}, **self.kwargs,
            )  # fmt: skip
            for chunk in self.stream:
                if chunk.usage is not None:
                    self.usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    self.text.append(chunk.choices[0].delta.content)
                    self.times.append(time.monotonic())
        except Exception as exc:  # a closed stream ends here too; the test reads it
            self.error = exc
        self.done_at = time.monotonic()

    def expected(self, model_dir: Path) -> list[dict[str, Any]]:
        prompt = f"user: {self.content}\nassistant:"
        return _alone(model_dir, {"prompt": prompt, **self.kwargs})


def _wait(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_served_concurrent_streams_a_late_one_joins_usage_right(
    server: Server, model_dir: Path
) -> None:
    """Three streams generate together; a fourth sent while they run gets its tokens at once
    and finishes long before them. Each gets the answer it gets alone, and its usage."""
    client = _client(server)
    longs = [_Chat(client, f"story {i}", max_tokens=200, temperature=0) for i in range(3)]
    for chat in longs:
        chat.start()
    _wait(lambda: all(len(c.text) >= 3 for c in longs), "the three streams' first tokens")
    late = _Chat(client, "hi", max_tokens=6, seed=4)
    late.run()  # here, while the others generate
    for chat in longs:
        chat.join(60)
    assert [c.error for c in [*longs, late]] == [None] * 4
    assert late.done_at < min(c.times[-1] for c in longs)  # it did not wait for them
    for chat in [*longs, late]:
        expected = chat.expected(model_dir)
        assert "".join(chat.text) == "".join(p["text"] for p in expected)
        prompt = len(f"user: {chat.content}\nassistant:") + 1  # bytes + BOS
        assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (prompt, len(expected))
        assert chat.usage.total_tokens == prompt + len(expected)
    assert len(longs[0].text) > 20 and len(late.text) == 6


def _metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(server.url("metrics", "/metrics"), timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class _Piecewise(threading.Thread):
    """A TorchServe-path stream of ``tokens`` tokens (``ignore_eos``: it cannot end early), its
    pieces counted, sent when ``start_line`` lets all through; ``leave`` makes its client close
    the connection at the next piece."""

    def __init__(self, server: Server, tokens: int, start_line: threading.Barrier) -> None:
        super().__init__(daemon=True)
        self.server, self.tokens, self.count = server, tokens, 0
        self.start_line = start_line
        self.leave = threading.Event()

    def run(self) -> None:
        body = {"prompt": "occupy", "max_tokens": self.tokens, "ignore_eos": True}
        with httpx.Client(headers=self.server.auth("inference"), timeout=60) as client:
            client.get(self.server.url("inference", "/ping"))  # connected before the line
            self.start_line.wait(30)
            url = self.server.url("inference", "/predictions/tiny_lm")
            with client.stream("POST", url, json=body) as reply:
                for data in reply.iter_raw():
                    self.count += data.count(b'"ids"')
                    if self.leave.is_set():
                        return  # the connection closes: the client went away mid-stream


def test_served_a_cancelled_stream_frees_its_slot_for_the_next(server: Server) -> None:
    """batchSize 8, all taken by streams that cannot end early. One client leaves mid-stream;
    a ninth stream (the openai client's) sent then begins at once, while the seven others still
    run: only the slot the gone one freed lets it in (the pump drops the gone one and takes the
    next before the very next step: tests/server/test_continuous_batching.py checks that exact
    step). The cancel is counted."""
    client = _client(server)
    before = _metric(server, "mserve_requests_cancelled_total", model="tiny_lm", reason="client")
    start_line = threading.Barrier(8)
    streams = [_Piecewise(server, 240, start_line) for _ in range(8)]
    for stream in streams:
        stream.start()
    _wait(lambda: all(s.count >= 2 for s in streams), "8 streams generating")
    leaving = min(streams, key=lambda s: s.count)
    others = [s for s in streams if s is not leaving]
    leaving.leave.set()
    late = _Chat(client, "hi", max_tokens=3, temperature=0)
    late.run()
    assert late.error is None and len(late.text) == 3
    assert all(o.count < 240 for o in others), "the ninth waited for a stream to end"
    for other in others:
        other.join(60)
    assert all(o.count == 240 for o in others) and leaving.count < 240
    _wait(lambda: _metric(server, "mserve_requests_cancelled_total", model="tiny_lm",
                          reason="client") == before + 1, "the cancel to be counted")  # fmt: skip
