"""The tiny LM's handler, written to TorchServe's continuous-batching contract, which also runs
without it.

With ``continuousBatching: true`` in the model config the server calls ``handle`` again and
again; each call holds the requests still generating plus new ones. As in TorchServe's examples,
each request's state lives in ``context.cache`` keyed by its request id, ``preprocess`` prefills
the new ones, ``inference`` runs one batched decode step (one token per request), and
``postprocess`` sets ``context.stopping_criteria``: one callable per request that says, from its
result, whether it is finished (and then drops its state). Each call's result is one piece of
each request's streamed answer.

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
from collections.abc import Iterator
from typing import Any

import torch
from model import CONTEXT, EOS, TinyLM, encode, sample
from ts.torch_handler.base_handler import BaseHandler

DEFAULT_MAX_TOKENS = 64
# Sampled tokens are kept to printable ASCII, newline and EOS: the weights are untrained, and
# noise that prints is nicer to look at than noise that does not decode.
ALLOWED = torch.full((258,), float("-inf"))
ALLOWED[32:127] = 0.0
ALLOWED[10] = 0.0
NO_EOS = ALLOWED.clone()
ALLOWED[EOS] = 0.0


class _State:
    """One request's generation: its cache, its next input token and its sampler."""

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
        self.generator = torch.Generator()
        seed = body.get("seed")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))
        self.ignore_eos = bool(body.get("ignore_eos"))  # fixed lengths, for benchmarks
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.cache: Any = None
        self.next_token = -1
        self.made = 0

    def take(self, logits: torch.Tensor, cache: Any) -> dict[str, Any]:
        """Sample the next token from ``logits``; the piece it makes."""
        self.cache = cache
        allowed = NO_EOS if self.ignore_eos else ALLOWED
        token = sample(logits + allowed, self.temperature, self.top_p, self.generator)
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


class _Lockstep:
    """Static batching: the requests of one call decoded together, a step for all the
    unfinished ones whenever one of them needs its next piece (the server reads the streams
    round by round); a request that finished early waits for no one, one whose client left
    is dropped from the steps."""

    def __init__(self, model: Any, states: list[_State]) -> None:
        self.model = model
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

    def _step(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            for i, state in enumerate(self.states):
                self._took(i, state.take(*self.model.prefill(state.ids)))
            return
        live = sorted(self.live)
        states = [self.states[i] for i in live]
        logits, caches = self.model.decode(
            [s.next_token for s in states], [s.cache for s in states]
        )
        for j, i in enumerate(live):
            self._took(i, self.states[i].take(logits[j], caches[j]))

    def _took(self, i: int, piece: dict[str, Any]) -> None:
        self.ready[i].append(piece)
        if "finish_reason" in piece:
            self.live.discard(i)


class _Stop:
    """TorchServe's stopping criterion: called with the request's result after each step."""

    def __init__(self, cache: dict[str, Any], request_id: str) -> None:
        self.cache = cache
        self.request_id = request_id

    def __call__(self, result: Any) -> bool:
        finished = not isinstance(result, dict) or "finish_reason" in result
        if finished:
            self.cache.pop(self.request_id, None)
        return finished


class TinyLMHandler(BaseHandler):
    def initialize(self, context: Any) -> None:
        threads = (context.model_yaml_config.get("handler") or {}).get("threads")
        if threads:
            torch.set_num_threads(int(threads))
        self.context = context
        properties = context.system_properties
        weights = os.path.join(properties["model_dir"], context.manifest["model"]["serializedFile"])
        self.model = TinyLM()
        self.model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        self.model.eval()
        self.initialized = True
        context.cache = {}
        self.continuous = bool(context.model_yaml_config.get("continuousBatching"))

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
        lockstep = _Lockstep(self.model, states)
        streams = iter(lockstep.pieces(i) for i in range(len(states)))
        return [next(streams) if o is None else o for o in out]

    # TorchServe's continuous batching ------------------------------------------------------

    def preprocess(self, data: list[Any]) -> tuple[list[str], list[str]]:
        """(new request ids, ids to decode); new requests get their state in the cache."""
        cache = self.context.cache
        ids = list(self.context.request_ids.values())
        for gone in [k for k in cache if k not in ids]:  # left between steps (cancelled)
            del cache[gone]
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
                    "stopping_criteria": _Stop(cache, request_id),
                }
                continue
            cache[request_id] = {"state": state, "stopping_criteria": _Stop(cache, request_id)}
            new.append(request_id)
        return new, running

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> list[Any]:
        new, running = data
        cache = self.context.cache
        results: dict[str, Any] = {}
        for request_id in new:
            state = cache[request_id]["state"]
            logits, kv = self.model.prefill(state.ids)
            results[request_id] = state.take(logits, kv)
        if running:
            states = [cache[r]["state"] for r in running]
            logits, kvs = self.model.decode(
                [s.next_token for s in states], [s.cache for s in states]
            )
            for i, (request_id, state) in enumerate(zip(running, states, strict=True)):
                results[request_id] = state.take(logits[i], kvs[i])
        return [
            results.get(r, cache.get(r, {}).get("error")) for r in self.context.request_ids.values()
        ]

    def postprocess(self, data: Any) -> list[Any]:
        self.context.stopping_criteria = [
            self.context.cache[r]["stopping_criteria"] for r in self.context.request_ids.values()
        ]
        return data

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
