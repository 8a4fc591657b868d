"""Say when the server's event loop stalls, and what it was doing (``loop_stall_warn_s``).

Every request, worker frame and timer of the server goes through one event loop: a call that
blocks it (a file written on a busy disk, a C call holding the GIL in another thread, a thread
starved of CPU) delays every model's requests at once, and shows nowhere but in their tail
latency. The warm tier's Zipf benchmark lost half its p99 that way before a watchdog like this
one found where (docs/warm-tier.md). A task on the loop notes the time every quarter of the
threshold; a thread checks that it keeps doing so and, when it has not for longer than the
threshold, takes the loop thread's stack (once when the stall is seen, and again each
threshold while it lasts). When the loop runs again, the warning says how long it stalled and
where it was. Off by default: the thread wakes 4 times per threshold, and the stacks are for
someone looking into latency.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

FRAMES = 10  # innermost frames of each stack logged
SAMPLES = 4  # distinct stacks logged per stall, at most


class LoopWatch:
    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.every_s = max(threshold_s / 4, 0.002)
        self.stalls = 0
        self._tick = time.monotonic()
        self._stacks: list[str] = []  # taken by the thread during the current stall
        self._done = threading.Event()

    async def run(self) -> None:
        """The loop side, until cancelled (the server's chores are, at shutdown)."""
        loop_thread = threading.get_ident()
        thread = threading.Thread(
            target=self._watch, args=(loop_thread,), name="loop-watch", daemon=True
        )
        thread.start()
        try:
            while True:
                before = time.monotonic()
                self._tick = before
                await asyncio.sleep(self.every_s)
                late = time.monotonic() - before - self.every_s
                if late > self.threshold_s:
                    self._report(late)
                elif self._stacks:
                    self._stacks = []
        finally:
            self._done.set()

    def _report(self, late: float) -> None:
        stacks, self._stacks = self._stacks, []
        self.stalls += 1
        where = "\n".join(stacks) if stacks else "  (not sampled: the stall ended in between)"
        log.warning("the event loop stalled %.3f s (loop_stall_warn_s=%g); it was in:\n%s",
                    late, self.threshold_s, where)  # fmt: skip

    def _watch(self, loop_thread: int) -> None:
        """The thread side: the loop thread's stack while the loop has not ticked."""
        taken_at = 0.0
        while not self._done.wait(self.every_s):
            now = time.monotonic()
            stalled_s = now - self._tick - self.every_s
            if stalled_s <= self.threshold_s or now - taken_at < self.threshold_s:
                continue
            frame = sys._current_frames().get(loop_thread)
            if frame is None or len(self._stacks) >= SAMPLES:
                continue
            taken_at = now
            lines = traceback.format_stack(frame)[-FRAMES:]
            stack = f"  after {stalled_s:.3f} s:\n" + "".join(lines).rstrip("\n")
            if stack.split("\n", 1)[1:] not in [s.split("\n", 1)[1:] for s in self._stacks]:
                self._stacks = [*self._stacks, stack]
