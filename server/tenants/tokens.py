"""What an admitted request costs its tenant while it runs: a place among its requests in
flight until its answer, a stream included, has ended; and on a generative model the tokens it
generates, charged to the tenant's token buckets as they come (docs/tenants.md).

Tokens are counted where every answer passes, whatever the frontend (REST, gRPC, the OpenAI
API): each streamed chunk (server/streaming.py calls :meth:`Usage.chunk`) and a whole answer
once it is there. A chunk's count is the one the OpenAI API reports as usage
(docs/generative.md): a JSON piece's ``tokens``, else the length of its ``ids``, else 1 for
text; any other chunk is one token. A request in progress is never cut off: its tokens are
charged as they come and may take the bucket below zero, a debt that refuses the tenant's next
requests until the rate has paid it back (as LiteLLM's and Envoy AI Gateway's token limits do).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from mserve_worker import fastjson
from mserve_worker.protocol import ResponseItem


def piece_tokens(fields: dict[str, Any], text: str) -> int:
    """The tokens of a JSON piece (``text`` its text, or ""): ``tokens``, else ``len(ids)``,
    else 1 for non-empty text. The OpenAI API's usage (server/openai/pieces.py) counts so too."""
    tokens = fields.get("tokens")
    if type(tokens) is not int:
        ids = fields.get("ids")
        tokens = len(ids) if isinstance(ids, list) else (1 if text else 0)
    return max(tokens, 0)


def json_piece(data: bytes) -> tuple[dict[str, Any], str] | None:
    """A chunk's fields and text when it is a JSON piece (an object with ``text`` or
    ``tokens``); None for anything else, which counts as plain text."""
    if data[:1] != b"{":
        return None
    try:
        fields = fastjson.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(fields, dict) or ("text" not in fields and "tokens" not in fields):
        return None
    text = fields.get("text")
    return fields, text if isinstance(text, str) else ""


def chunk_tokens(data: bytes) -> int:
    """The tokens of one chunk (or whole answer) of a generative model."""
    piece = json_piece(data)
    if piece is not None:
        return piece_tokens(*piece)
    return 1 if data else 0


class Counted(Protocol):
    """A quota's live state, as a request's usage changes it (registry._Limits)."""

    in_flight: int


class Bucket(Protocol):
    tokens: float

    def wait_s(self, now: float) -> float: ...


class Usage:
    """One admitted request's charge: counted in ``counted`` (``in_flight`` quotas) until it
    ends, its tokens taken from ``buckets`` (token quotas of a generative model) as they come
    and added up in ``tally`` under ``model`` (mserve_tenant_tokens_charged_total). A job's
    stream calls :meth:`chunk` per chunk and :meth:`ended` when it ends, finished, broken or
    cancelled; a whole answer is charged from :meth:`settled`."""

    __slots__ = ("buckets", "counted", "model", "open", "tally")

    def __init__(
        self, counted: list[Counted], buckets: list[Bucket], tally: dict[str, int], model: str
    ) -> None:
        self.counted = counted
        self.buckets = buckets
        self.tally = tally
        self.model = model
        self.open = True
        for lim in counted:
            lim.in_flight += 1

    def chunk(self, data: bytes) -> None:
        if self.buckets and self.open:
            self.charge(chunk_tokens(data))

    def charge(self, tokens: int) -> None:
        """Take ``tokens`` from the buckets, below zero if need be: the request goes on."""
        if not tokens:
            return
        now = time.monotonic()
        for bucket in self.buckets:
            bucket.wait_s(now)  # refilled up to now first
            bucket.tokens -= tokens
        self.tally[self.model] = self.tally.get(self.model, 0) + tokens

    def ended(self) -> None:
        if self.open:
            self.open = False
            for lim in self.counted:
                lim.in_flight -= 1

    def settled(self, future: asyncio.Future[Any]) -> None:
        """The request's future is done: a whole answer is charged and counted out; a stream
        is counted out when it ends (it calls :meth:`ended`)."""
        if future.cancelled() or future.exception() is not None:
            self.ended()
            return
        result = future.result()
        if type(result) is ResponseItem:
            if self.buckets and result.status < 300:
                self.charge(chunk_tokens(bytes(result.body)))
            self.ended()
            return
        if getattr(result, "meter", self) is not self:
            result.meter = self  # a stream opened without the job's meter: from here on
        if getattr(result, "finished", True):
            self.ended()
