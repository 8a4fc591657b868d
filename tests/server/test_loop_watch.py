"""server/loop_watch.py: a stall of the event loop is reported with where the loop was; an idle
loop is not a stall. A real loop, a real watchdog thread, a real blocking call."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from server.config import load_config
from server.errors import ConfigError
from server.loop_watch import LoopWatch


def _blocks_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous call on the loop does to every request


async def _watched(threshold_s: float, body: object) -> LoopWatch:
    watch = LoopWatch(threshold_s)
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.05)  # the watchdog's thread is up
    await body()  # type: ignore[operator]
    await asyncio.sleep(0.1)  # the loop runs again: the stall is reported
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return watch


def test_a_stall_is_reported_with_the_loop_threads_stack(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def stall() -> None:
        _blocks_the_loop(0.6)

    with caplog.at_level(logging.WARNING, logger="server.loop_watch"):
        watch = asyncio.run(_watched(0.1, stall))
    assert watch.stalls == 1
    [record] = caplog.records
    message = record.getMessage()
    assert message.startswith("the event loop stalled ")
    stalled_s = float(message.split()[4])
    assert 0.4 < stalled_s < 5
    assert "loop_stall_warn_s=0.1" in message
    # where it was: the blocking call, in the stack the thread took meanwhile
    assert "_blocks_the_loop" in message and "time.sleep(seconds)" in message


def test_an_idle_loop_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    async def idle() -> None:
        await asyncio.sleep(0.6)  # nothing to do is not blocked

    with caplog.at_level(logging.WARNING, logger="server.loop_watch"):
        watch = asyncio.run(_watched(0.1, idle))
    assert watch.stalls == 0
    assert not caplog.records


def test_the_setting_is_off_unless_set_and_must_be_positive() -> None:
    assert load_config(None, {}, {}).loop_stall_warn_s is None
    assert load_config(None, {}, {"MSERVE_LOOP_STALL_WARN_S": "0.25"}).loop_stall_warn_s == 0.25
    with pytest.raises(ConfigError, match="loop_stall_warn_s"):
        load_config(None, {"loop_stall_warn_s": -1}, {})
