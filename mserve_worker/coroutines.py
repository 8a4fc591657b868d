"""Async handlers: an ``async def handle`` (TorchServe's async worker contract, which its vLLM
and TensorRT-LLM handlers use) returns a coroutine, which the worker awaits on an event loop of
its own.

The loop runs forever in one daemon thread, started by the first coroutine a handler returns
(at load, for a module function's initialisation call, or with the first batch); a handler that
never returns one never starts it. Running forever rather than once per call means what a
handler leaves on the loop (an engine's background task, a client session) goes on between two
batches, as on TorchServe's loop. The calling thread waits for the result; an exception the
coroutine raises is raised in the caller, as a plain handler's would be.

Runs inside the model's own environment: standard library only, Python 3.8, nothing done at
import time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
# How often a batch running beside others (mserve_worker/inflight.py) looks whether every
# caller it serves has left, while its coroutine awaits.
_ABANDONED_POLL_S = 0.1


class Abandoned(Exception):
    """Every caller of the batch left while its coroutine awaited: it was cancelled (the
    handler saw ``asyncio.CancelledError`` at its ``await``)."""


def settle(value: Any, abandoned: Callable[[], bool] | None = None) -> Any:
    """``value`` itself, or, when it is awaitable (an ``async def``'s coroutine), its result
    once awaited on the worker's event loop. ``abandoned``: asked while it awaits; once true,
    the coroutine is cancelled and :class:`Abandoned` raised."""
    if not inspect.isawaitable(value):
        return value
    future = asyncio.run_coroutine_threadsafe(_wait_for(value), _running_loop())
    if abandoned is None:
        return future.result()
    while True:
        try:
            return future.result(timeout=_ABANDONED_POLL_S)
        except concurrent.futures.TimeoutError:
            if abandoned():
                future.cancel()
        except concurrent.futures.CancelledError:
            raise Abandoned("every caller of the batch left; its coroutine was cancelled") from None


async def _wait_for(awaitable: Awaitable[Any]) -> Any:
    return await awaitable  # run_coroutine_threadsafe takes coroutines only, not any awaitable


def _running_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_forever, args=(loop,), name="handler-event-loop", daemon=True
            )
            thread.start()
            _loop = loop
        return _loop


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)  # asyncio.get_event_loop() in the handler's code finds it
    loop.run_forever()
