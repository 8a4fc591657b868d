"""The frontend's side of the span exporter process (server/tracing/export.py): a bounded queue
of compact span records, written in batches over a pipe from the event loop, and the child's
supervision. The request path only appends a tuple; encoding OTLP and sending it run in the
child, whose CPU the frontend's event loop does not share (the GIL made the SDK's export thread
take ~140 us of the frontend's CPU per traced request).

Never blocking a request: the pipe is non-blocking; while the child is busy, slow or down,
records wait in the queue (up to ``MAX_QUEUE``), then are dropped and counted
(``mserve_trace_spans_dropped_total{reason="queue_full"}``), with one warning per burst of
drops. Spans the child could not export are counted too (``reason="export_failed"``), as are
those lost with a child that died (``"exporter_exited"``). A child that dies is restarted
(backoff from 1 s to 60 s); its first exit is logged with the tail of its stderr, the next ones
only at debug level until it has lived a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import marshal
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from server.tracing.export import FRAME

if TYPE_CHECKING:
    from server.tracing.settings import TraceSettings

log = logging.getLogger("server.tracing")

MAX_QUEUE = 8192  # records (a request's is ~8 spans) waiting while the pipe is full
FLUSH_RECORDS = 256  # a frame: written at once when this many wait
FLUSH_S = 0.05  # else this long after the first one
PIPE_BYTES = 1 << 20  # the pipe's buffer, where the kernel allows it
CLOSE_S = 12.0  # at stop: the child's last export (OTEL_EXPORTER_OTLP_TIMEOUT: 10 s unless set)
REASONS = ("queue_full", "export_failed", "exporter_exited")


def span_count(record: tuple[Any, ...]) -> int:
    """How many spans the child would make of ``record`` (what a drop counts)."""
    if record[0] != "q":
        return 1
    enqueued, _, sent, _, _, _, handler_ms, phases, stream = record[11]
    count = 1 + (stream is not None)
    if enqueued is not None:
        count += 3 if sent else 1
        if sent and handler_ms is not None:
            count += 1 + (len(phases) if type(phases) is list else 0)
    return count


class ExportProcess:
    """The exporter child and its queue. ``put`` and the callbacks run on the event loop."""

    def __init__(self, settings: TraceSettings) -> None:
        self.argv = [
            sys.executable, "-m", "server.tracing.export",
            json.dumps({"endpoint": settings.endpoint, "protocol": settings.protocol}),
        ]  # fmt: skip
        self.endpoint = settings.endpoint
        self.dropped = dict.fromkeys(REASONS, 0)  # spans, by reason
        self._records: list[tuple[Any, ...]] = []
        self._pending = b""  # a frame the pipe took only part of
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._reports = bytearray()
        self._stderr = bytearray()  # its tail, for the log when it exits
        self._burst = 0  # spans dropped since the queue last drained
        self._failing = 0  # spans the child failed to export since its last success
        self._backoff_s = 1.0
        self._quiet = False  # an exit was logged: the next ones at debug level
        self._closing = False

    # --- the request path -----------------------------------------------------------------

    def put(self, record: tuple[Any, ...]) -> None:
        """Queue one record for the child (never blocks; drops and counts when full)."""
        records = self._records
        if len(records) >= MAX_QUEUE or self._closing:
            self._drop([record], "queue_full")
            return
        records.append(record)
        if len(records) >= FLUSH_RECORDS:
            self.flush()
        elif self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Write the queued records, a frame at a time, while the pipe takes them."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._records and not self._pending and self._proc is not None:
            batch = self._records[:FLUSH_RECORDS]
            del self._records[:FLUSH_RECORDS]
            try:
                data = marshal.dumps(batch, 4)
            except ValueError:  # a value marshal cannot write: a bug of ours, not the client's
                log.exception("tracing: %d span records could not be encoded", len(batch))
                continue
            self._write(FRAME.pack(len(data)) + data, batch)
        if not self._records and self._burst:
            log.warning("tracing: the span queue drained; %d spans were dropped", self._burst)
            self._burst = 0

    def _write(self, data: bytes, batch: list[tuple[Any, ...]]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        fd = self._proc.stdin.fileno()
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            written = 0
        except OSError:  # the child is gone; its stdout's end says so (_on_report)
            self._drop(batch, "exporter_exited")
            return
        if written < len(data):
            self._pending = data[written:]
            assert self._loop is not None
            self._loop.add_writer(fd, self._on_writable)

    def _on_writable(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        fd = self._proc.stdin.fileno()
        try:
            written = os.write(fd, self._pending)
        except BlockingIOError:
            return
        except OSError:
            self._loop.remove_writer(fd)  # type: ignore[union-attr]
            self._pending = b""
            return
        self._pending = self._pending[written:]
        if not self._pending:
            self._loop.remove_writer(fd)  # type: ignore[union-attr]
            self.flush()

    def _drop(self, records: list[tuple[Any, ...]], reason: str) -> None:
        spans = sum(span_count(r) for r in records)
        self.dropped[reason] += spans
        if reason == "queue_full":
            if not self._burst:
                log.warning(
                    "tracing: the span exporter is falling behind; dropping spans until it "
                    "catches up (mserve_trace_spans_dropped_total)"
                )
            self._burst += spans

    # --- the child ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child, on the running loop (which then reads its reports)."""
        self._loop = asyncio.get_running_loop()
        self._restart()

    def _spawn(self) -> None:
        assert self._loop is not None
        proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # a ^C to the server's terminal is the server's to handle
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(pipe.fileno(), False)
        self._loop.add_reader(proc.stdout.fileno(), self._on_report)
        self._loop.add_reader(proc.stderr.fileno(), self._on_stderr)
        self._proc, self._started_at = proc, time.monotonic()
        self._reports.clear()
        self._stderr.clear()
        log.debug("tracing: span exporter process started, pid %d", proc.pid)
        self.flush()

    def _on_report(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._gone()
            return
        reports = self._reports
        reports += chunk
        while len(reports) >= FRAME.size:
            (size,) = FRAME.unpack_from(reports)
            if len(reports) < FRAME.size + size:
                break
            kind, spans, message = marshal.loads(bytes(reports[FRAME.size : FRAME.size + size]))
            del reports[: FRAME.size + size]
            self._reported(kind, spans, message)

    def _reported(self, kind: str, spans: int, message: str) -> None:
        if kind == "failed":
            self.dropped["export_failed"] += spans
            if not self._failing:
                log.warning(
                    "tracing: exporting spans to %s failed: %s (spans are lost until it "
                    "works again; mserve_trace_spans_dropped_total)", self.endpoint, message,
                )  # fmt: skip
            self._failing += spans
        elif kind == "recovered" and self._failing:
            log.warning(
                "tracing: exporting spans to %s works again; %d spans were lost",
                self.endpoint, self._failing,
            )  # fmt: skip
            self._failing = 0

    def _on_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        try:
            chunk = os.read(self._proc.stderr.fileno(), 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._loop.remove_reader(self._proc.stderr.fileno())  # type: ignore[union-attr]
            return
        self._stderr += chunk
        del self._stderr[:-4096]

    def _gone(self) -> None:
        """The child's stdout ended: it exited (or is about to). Forget it, reap it, and
        unless the server is stopping start another after the backoff."""
        proc, loop = self._proc, self._loop
        assert proc is not None and loop is not None
        self._proc = None
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            loop.remove_reader(pipe.fileno())
        assert proc.stdin is not None
        if not proc.stdin.closed:
            loop.remove_writer(proc.stdin.fileno())
        if self._pending:
            self._pending = b""
            self.dropped["exporter_exited"] += 1  # a frame cut short: at least its first span
        if self._closing:
            return
        lived_s = time.monotonic() - self._started_at
        if lived_s > 60:
            self._backoff_s, self._quiet = 1.0, False
        self._reap(proc, time.monotonic() + 5)

    def _reap(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        code = proc.poll()
        if code is None and time.monotonic() < deadline:
            self._loop.call_later(0.05, self._reap, proc, deadline)  # type: ignore[union-attr]
            return
        if code is None:
            proc.kill()
            code = proc.wait()
        with contextlib.suppress(BlockingIOError, OSError):
            self._stderr += os.read(proc.stderr.fileno(), 1 << 16)  # type: ignore[union-attr]
        _close(proc)
        tail = self._stderr.decode("utf-8", "replace").strip()[-2000:]
        level = logging.DEBUG if self._quiet else logging.WARNING
        log.log(
            level, "tracing: the span exporter process exited with code %s; restarting it in "
            "%g s%s", code, self._backoff_s, f"; its last output:\n{tail}" if tail else "",
        )  # fmt: skip
        self._quiet = True
        self._loop.call_later(self._backoff_s, self._restart)  # type: ignore[union-attr]
        self._backoff_s = min(60.0, self._backoff_s * 2)

    def _restart(self) -> None:
        if self._closing or self._proc is not None:
            return
        try:
            self._spawn()
        except OSError as exc:
            log.log(logging.DEBUG if self._quiet else logging.WARNING,
                    "tracing: the span exporter process could not start: %s", exc)  # fmt: skip
            self._quiet = True
            self._loop.call_later(self._backoff_s, self._restart)  # type: ignore[union-attr]
            self._backoff_s = min(60.0, self._backoff_s * 2)

    async def close(self) -> None:
        """At stop: write what is queued, end the child's input, and give it ``CLOSE_S`` for
        its last export; then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + CLOSE_S
        self.flush()
        while (self._records or self._pending) and self._proc is not None:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
            self.flush()
        self._closing = True
        proc = self._proc
        if proc is None:
            return
        assert proc.stdin is not None and self._loop is not None
        self._loop.remove_writer(proc.stdin.fileno())
        proc.stdin.close()  # the child exports what it read, then exits
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            log.warning("tracing: the span exporter did not finish within %g s", CLOSE_S)
            proc.terminate()
            try:
                await asyncio.to_thread(proc.wait, 2)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._proc is not None:  # its reports until the end are read: unhook it now
            self._gone()
        _close(proc)


def _close(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
