"""The tiny LM's handler, written to TorchServe's continuous-batching contract, which also runs
without it.

With ``continuousBatching: true`` in the model config the server calls ``handle`` again and
again; each call holds the requests still generating plus new ones. As in TorchServe's examples,
each request's state lives in ``context.cache`` keyed by its request id, ``preprocess`` takes
the new ones, ``inference`` prefills them in one forward and runs one decode step for the
running ones in another (one token per request), and ``postprocess`` sets
``context.stopping_criteria``: one callable per request that says, from its result, whether it
is finished (and then drops its state), with a ``clean_up()`` the worker calls when the server
drops the request. Each call's result is one piece of each request's streamed answer. Every
request holds a slot of the model's KV cache from its prefill to its end (``_Engine``).

Without continuous batching, ``handle`` returns one generator per request: the whole answer,
streamed a token at a time, the requests of one call decoded together until the last one ends
(static batching).

A request's body: the OpenAI API's JSON (``prompt``, ``max_tokens``, ``temperature``,
``top_p``, ``seed``; docs/generative.md), TorchServe's LLM examples' ``{"prompt",
"max_new_tokens"}``, or the prompt as plain text; ``ignore_eos`` makes every answer
``max_tokens`` long (benchmarks). Each piece is ``{"text", "tokens", "ids"}``,
the first with ``prompt_tokens``, the last with ``finish_reason``.
"""

from __future__ import annotations

import codecs
import collections
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
from model import CONTEXT, EOS, VOCAB, TinyLM, encode, load, sample
from ts.torch_handler.base_handler import BaseHandler

DEFAULT_MAX_TOKENS = 64
# Sampled tokens are kept to printable ASCII, newline and EOS: the weights are untrained, and
# noise that prints is nicer to look at than noise that does not decode. Row 0 is added to the
# logits of a request that may end, row 1 to those of one with ``ignore_eos``.
BIAS = torch.full((2, VOCAB), float("-inf"))
BIAS[:, 32:127] = 0.0
BIAS[:, 10] = 0.0
BIAS[0, EOS] = 0.0


class _State:
    """One request's generation: its prompt, options, slot and length in the cache, its next
    input token and its random draws (its own generator: seeded, its tokens do not depend on
    who shares its steps)."""

    def __init__(self, body: Any) -> None:
        if isinstance(body, (bytes, bytearray)):
            body = body.decode("utf-8", "replace")
        if isinstance(body, str):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            body = parsed if isinstance(parsed, dict) else {"prompt": body}
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise ValueError('send {"prompt": "..."} or the prompt as text')
        self.ids = encode(body["prompt"])
        wanted = body.get("max_tokens") or body.get("max_new_tokens") or DEFAULT_MAX_TOKENS
        self.max_tokens = min(int(wanted), CONTEXT - len(self.ids))
        temperature = body.get("temperature")
        self.temperature = 1.0 if temperature is None else float(temperature)
        top_p = body.get("top_p")
        self.top_p = 1.0 if top_p is None else float(top_p)
        seed = body.get("seed")
        self.random = random.Random(None if seed is None else int(seed))  # None: from the OS
        self.ignore_eos = bool(body.get("ignore_eos"))  # fixed lengths, for benchmarks
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.slot = -1  # none held
        self.length = 0  # positions in its slot
        self.next_token = -1
        self.made = 0

    def take(self, token: int) -> dict[str, Any]:
        """The piece that sampled ``token`` makes; ``finish_reason`` in it when it is the last."""
        self.next_token = token
        self.made += 1
        piece: dict[str, Any] = {"ids": [token], "tokens": 1}
        if self.made == 1:
            piece["prompt_tokens"] = len(self.ids)
        if token == EOS:
            piece["text"] = self.decoder.decode(b"", final=True)
            piece["finish_reason"] = "stop"
        else:
            piece["text"] = self.decoder.decode(bytes([token]))
            if self.made >= self.max_tokens:
                piece["text"] += self.decoder.decode(b"", final=True)
                piece["finish_reason"] = "length"
        return piece


class _Engine:
    """The model and a pool of its cache's slots: ``start`` prefills new requests in one
    forward, ``step`` decodes running ones in one forward, each sampling all of them in one
    go. A request holds its slot until its last piece or ``release``. The slots held are kept
    contiguous (a leaving request's hole is filled by moving the last one into it), which lets
    a step read them in place instead of gathering them."""

    def __init__(self, model: TinyLM, slots: int) -> None:
        self.model = model
        self.bias = BIAS.to(model.device)
        self.cache = model.new_cache(max(1, slots))
        self.held: list[_State] = []  # held[i] is in slot i

    def start(self, states: list[_State]) -> list[dict[str, Any]]:
        if len(self.held) + len(states) > self.cache.slots:
            self.cache.grow(max(2 * self.cache.slots, len(self.held) + len(states)))
        for state in states:
            state.slot, state.length = len(self.held), len(state.ids)
            self.held.append(state)
        logits = self.model.prefill([s.ids for s in states], [s.slot for s in states], self.cache)
        return self._sample(states, logits)

    def step(self, states: list[_State]) -> list[dict[str, Any]]:
        """One token more for each of ``states`` (all holding slots), in their order."""
        order = sorted(range(len(states)), key=lambda i: states[i].slot)
        ranked = [states[i] for i in order]
        logits = self.model.decode(
            [s.next_token for s in ranked], [s.slot for s in ranked],
            [s.length for s in ranked], self.cache,
        )  # fmt: skip
        for state in ranked:
            state.length += 1
        pieces = self._sample(ranked, logits)
        out: list[dict[str, Any]] = [{}] * len(states)
        for i, piece in zip(order, pieces, strict=True):
            out[i] = piece
        return out

    def release(self, state: _State) -> None:
        """Give ``state``'s slot back (again: nothing); the last slot held moves into it."""
        slot = state.slot
        if slot < 0:
            return
        state.slot = -1
        last = self.held.pop()
        if last is not state:
            n = last.length
            for kind in (self.cache.keys, self.cache.values):
                for layer in kind:
                    layer[slot, :, :n] = layer[last.slot, :, :n]
            last.slot = slot
            self.held[slot] = last

    def _sample(self, states: list[_State], logits: torch.Tensor) -> list[dict[str, Any]]:
        device = logits.device
        rows = torch.tensor([s.ignore_eos for s in states], dtype=torch.long, device=device)
        tokens = sample(
            logits + self.bias[rows],
            torch.tensor([s.temperature for s in states], device=device),
            torch.tensor([s.top_p for s in states], device=device),
            torch.tensor([s.random.random() for s in states], device=device),
        ).tolist()
        pieces = []
        for state, token in zip(states, tokens, strict=True):
            pieces.append(state.take(token))
            if "finish_reason" in pieces[-1]:
                self.release(state)
        return pieces


class _Lockstep:
    """Static batching: the requests of one call decoded together, a step for all the
    unfinished ones whenever one of them needs its next piece (the server reads the streams
    round by round); a request that finished early waits for no one, one whose client left
    is dropped from the steps and gives its slot back."""

    def __init__(self, engine: _Engine, states: list[_State]) -> None:
        self.engine = engine
        self.states = states
        self.ready: list[collections.deque[dict[str, Any]]] = [collections.deque() for _ in states]
        self.live = set(range(len(states)))
        self.prefilled = False

    def pieces(self, i: int) -> Iterator[dict[str, Any]]:
        try:
            while True:
                if not self.ready[i]:
                    self._step()
                piece = self.ready[i].popleft()
                yield piece
                if "finish_reason" in piece:
                    return
        finally:
            self.live.discard(i)
            self.engine.release(self.states[i])

    def _step(self) -> None:
        live = sorted(self.live)
        states = [self.states[i] for i in live]
        if self.prefilled:
            pieces = self.engine.step(states)
        else:  # the ones still here: a stream closed before any step takes no slot
            self.prefilled = True
            pieces = self.engine.start(states)
        for i, piece in zip(live, pieces, strict=True):
            self.ready[i].append(piece)
            if "finish_reason" in piece:
                self.live.discard(i)


class _Stop:
    """TorchServe's stopping criterion: called with the request's result after each step;
    ``clean_up`` when the server dropped the request (TorchServe's vLLM handler contract)."""

    def __init__(self, handler: TinyLMHandler, request_id: str) -> None:
        self.handler = handler
        self.request_id = request_id

    def __call__(self, result: Any) -> bool:
        finished = not isinstance(result, dict) or "finish_reason" in result
        if finished:
            self.handler.drop(self.request_id)
        return finished

    def clean_up(self) -> None:
        self.handler.drop(self.request_id)


class TinyLMHandler(BaseHandler):
    def initialize(self, context: Any) -> None:
        threads = (context.model_yaml_config.get("handler") or {}).get("threads")
        if threads:
            torch.set_num_threads(int(threads))
        self.context = context
        properties = context.system_properties
        weights = os.path.join(properties["model_dir"], context.manifest["model"]["serializedFile"])
        # the GPU the server gave this worker (its cuda:0 inside it), as TorchServe's handlers pick
        gpu_id = properties.get("gpu_id")
        on_gpu = gpu_id is not None and torch.cuda.is_available()
        self.device = torch.device(f"cuda:{gpu_id}" if on_gpu else "cpu")
        self.model = load(weights, self.device)
        self.initialized = True
        context.cache = {}
        self.continuous = bool(context.model_yaml_config.get("continuousBatching"))
        # one slot per request of a batch, more if more are ever asked for at once
        self.engine = _Engine(self.model, int(properties.get("batch_size") or 1))

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        self.context = context
        if self.continuous:
            return self.postprocess(self.inference(self.preprocess(data)))
        out: list[Any] = []
        states = []
        for idx, row in enumerate(data):
            try:
                states.append(self._start(row))
            except ValueError as exc:
                context.set_response_status(400, str(exc), idx)
                out.append(str(exc))
                continue
            out.append(None)
        lockstep = _Lockstep(self.engine, states)
        streams = iter(lockstep.pieces(i) for i in range(len(states)))
        return [next(streams) if o is None else o for o in out]

    # TorchServe's continuous batching ------------------------------------------------------

    def preprocess(self, data: list[Any]) -> tuple[list[str], list[str]]:
        """(new request ids, ids to decode); new requests get their state in the cache."""
        cache = self.context.cache
        ids = list(self.context.request_ids.values())
        for gone in [k for k in cache if k not in ids]:  # left between steps (cancelled)
            self.drop(gone)
        new, running = [], []
        for idx, (request_id, row) in enumerate(zip(ids, data, strict=True)):
            if request_id in cache:
                running.append(request_id)
                continue
            try:
                state = self._start(row)
            except ValueError as exc:
                self.context.set_response_status(400, str(exc), idx)
                cache[request_id] = {
                    "error": str(exc),
                    "stopping_criteria": _Stop(self, request_id),
                }
                continue
            cache[request_id] = {"state": state, "stopping_criteria": _Stop(self, request_id)}
            new.append(request_id)
        return new, running

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The new requests prefilled together, the running ones decoded together."""
        new, running = data
        cache = self.context.cache
        results: dict[str, Any] = {}
        for ids, call in ((new, self.engine.start), (running, self.engine.step)):
            if ids:
                results.update(zip(ids, call([cache[r]["state"] for r in ids]), strict=True))
        return [
            results.get(r, cache.get(r, {}).get("error")) for r in self.context.request_ids.values()
        ]

    def postprocess(self, data: Any) -> list[Any]:
        self.context.stopping_criteria = [
            self.context.cache[r]["stopping_criteria"] for r in self.context.request_ids.values()
        ]
        return data

    def drop(self, request_id: str) -> None:
        """Forget a request that finished or that the server dropped, its slot given back."""
        entry = self.context.cache.pop(request_id, None)
        if entry is not None and "state" in entry:
            self.engine.release(entry["state"])

    # one request at a time -----------------------------------------------------------------

    def _start(self, row: Any) -> _State:
        body = row.get("body") if isinstance(row, dict) else row
        if body is None and isinstance(row, dict):
            body = row.get("data")
        state = _State(body)
        if state.max_tokens < 1:
            raise ValueError(
                f"the prompt is {len(state.ids)} tokens: the context of {CONTEXT} leaves no room"
                " to answer"
            )
        return state
