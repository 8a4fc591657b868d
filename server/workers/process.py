"""Parent side of one worker process: spawn, handshake, run batches, stop.

The channel is a Unix socketpair: the child inherits one end as a file descriptor (no socket
paths to clean up or guess), and exits when it reads EOF, so no worker outlives the server.
Everything that crosses it is a frame from ``mserve_worker.protocol``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import psutil

from mserve_worker import protocol
from mserve_worker.imports import valid_names
from mserve_worker.protocol import Frame, Kind, MetricEntry, RequestItem, ResponseItem
from server.config.model_settings import Parallel
from server.errors import HandlerError, HandlerLoadFailed, WorkerDied, WorkerTimeout
from server.logs import worker_facts
from server.workers.channel import Batch, BatchExpired, Channel, ChannelClosed
from server.workers.launch import Launcher, Process
from server.workers.ranks import rank_envs

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 50


class WorkerState(str, Enum):
    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    # an evicted model's idle worker kept alive, its handler built (the warm tier's parked
    # workers, mserve_worker/park.py): no slot holds it; a wake makes it READY again
    PARKED = "PARKED"


# Read per batch, bound once: on Python 3.11 an Enum member lookup goes through
# EnumType.__getattr__ (~65 ns, a global ~5 ns; docs/explanations/costs.md).
_BUSY, _READY, _RESULT = WorkerState.BUSY, WorkerState.READY, Kind.RESULT


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: interpreter, model folder, and the INIT message body."""

    python: str
    model_dir: Path
    init: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    max_payload_bytes: int = 2**31 - 1
    # parallelType pp, tp, pptp: the worker is parallel.ranks processes (server/workers/ranks.py)
    parallel: Parallel = field(default_factory=Parallel)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class Worker:
    """One worker process. ``start`` returns once the handler is loaded; several batches may be
    in flight at once (they are pipelined, see ``channel``).

    A parallel model's worker (``spec.parallel.torchrun``) is a group of ranks: this object is
    rank 0, the one the server talks to, and ``peers`` the others, each a ``Worker`` with its
    own process and channel. All load together; with tp and pptp each batch is sent to every
    rank, and only rank 0 answers; the death of any rank ends the whole group."""

    def __init__(self, worker_id: str, model_label: str, gpu: str | None, spec: WorkerSpec) -> None:
        self.id = worker_id
        self.model_label = model_label
        self.gpu = gpu  # physical id, as CUDA_VISIBLE_DEVICES names it
        self.spec = spec
        self.state = WorkerState.STARTING
        self.started_at = time.time()
        self.load_s: float | None = None
        self.load_ms: float | None = None  # spawn to READY (TorchServe's WorkerLoadTime)
        self.style: str | None = None
        self.concurrent = False  # it runs the batches it is sent at once (READY's concurrent)
        # the code its handler runs, {"digest", "files"}: READY's, then each reload's commit
        self.code: dict[str, Any] | None = None
        # while it prepares a hot reload: no new batch is sent to it (the other workers take
        # the queue); done when it has prepared
        self._held: asyncio.Future[None] | None = None
        # how the worker confined itself (mserve_worker/confine.py): what was applied, or why
        # nothing was; None until it is ready, or when the sandbox is off
        self.sandbox: dict[str, Any] | None = None
        # (path, bytes) of the checkpoints it mapped from the page cache: what the warm tier
        # keeps when its model is evicted (server/models/warm.py)
        self.mapped: list[tuple[str, int]] = []
        self.parks = False  # it can be parked when its model is evicted (READY's parks)
        self._park_ids = 0
        self.wakes = 0  # times it was woken from parked
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._proc: Process | None = None
        self._channel: Channel | None = None
        self._pipes: list[asyncio.Task[None]] = []
        self._exit_watch: asyncio.Task[None] | None = None
        # killed by us because it passed startup_timeout_s or a batch response_timeout_s
        self.timed_out = False
        # batches it answered (a result or the handler's error): whether it answered anything
        # before it timed out (TorchServe's count of consecutive unanswered requests)
        self.answered_batches = 0
        self._killing: asyncio.Future[None] | None = None
        self._batch_ids = 0
        self._on_withdraw: Callable[[Batch, str], None] | None = None
        self._bad_metrics_logged = False
        self._log = logging.getLogger(f"mserve.model.{model_label}")
        self.rank: int | None = None  # its rank in a parallel worker's group
        self.peers: list[Worker] = []  # ranks 1..n-1, when this is rank 0
        self.lost_rank: Worker | None = None  # the rank whose end ended the group
        self._on_exit: Callable[[Worker], None] | None = None
        self._stopping = False

    @property
    def facts(self) -> dict[str, str]:
        """What a log line about this worker carries (server/logs.py)."""
        init = self.spec.init
        return worker_facts(str(init.get("model_name")), str(init.get("model_version")), self.id)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    def rss_bytes(self) -> int:
        """The worker's resident memory; a parallel worker's: all its ranks'."""
        try:
            own = psutil.Process(self.pid).memory_info().rss if self.pid else 0
        except psutil.Error:
            own = 0
        return own + sum(peer.rss_bytes() for peer in self.peers)

    @property
    def _lockstep(self) -> bool:
        """Its ranks run every batch together (tp, pptp): a request one rank skipped would
        leave the others waiting in their collectives, so none is skipped."""
        return bool(self.peers) and self.spec.parallel.broadcast

    @property
    def reorders(self) -> bool:
        """Whether a batch may be sent ``ahead`` (send_batch): it runs one batch at a time, and
        alone (no ranks that would have to run the batches in the same order)."""
        return not self.concurrent and not self.peers

    def on_lost(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the worker's channel is gone, busy or idle (None: stop)."""
        if self._channel is not None:
            self._channel.on_lost = callback
            if callback is not None and self._channel.closed:
                asyncio.get_running_loop().call_soon(callback)

    def on_chunk(self, callback: Callable[[Batch, Frame], None] | None) -> None:
        """Call ``callback`` with the running batch and each CHUNK frame the worker sends."""
        if self._channel is not None:
            self._channel.on_chunk = callback

    def on_step(self, callback: Callable[[Frame], None] | None) -> None:
        """Call ``callback`` with each STEP frame: the worker runs continuous batching itself
        (server/models/continuous.py)."""
        if self._channel is not None:
            self._channel.on_step = callback

    def on_withdraw(self, callback: Callable[[Batch, str], None] | None) -> None:
        """Have :meth:`withdraw` call ``callback`` instead (continuous batching: the requests of
        a joined batch are the pump's to drop)."""
        self._on_withdraw = callback

    def join(self, items: list[RequestItem]) -> Batch:
        """Send requests to a worker that runs continuous batching: they join its next step.
        Their answers come in STEP frames, never a RESULT: the batch is not awaited."""
        channel = self._channel
        assert channel is not None
        self._batch_ids += 1
        channel.send(protocol.batch_frame(self._batch_ids, items, check=False))
        self.state = _BUSY
        return Batch(self._batch_ids, len(items), 0.0, channel.no_answer)

    def leave(self, batch: Batch, request_ids: list[str]) -> None:
        """Tell a continuous-batching worker to drop requests of a joined batch before its next
        step (a no-op once the channel is closed)."""
        if self._channel is not None:
            self._channel.send(protocol.cancel_frame(batch.batch_id, request_ids))

    def pause_reading(self) -> None:
        """Back-pressure from a streamed response: see :meth:`Channel.pause_reading`."""
        if self._channel is not None:
            self._channel.pause_reading()

    def resume_reading(self) -> None:
        if self._channel is not None:
            self._channel.resume_reading()

    def stop_streaming(self, batch: Batch, request_id: str) -> None:
        """The caller of a request streaming in ``batch`` (the running one) went away."""
        if self._channel is not None and not self._lockstep:  # its chunks are dropped
            self._channel.cancel_running(batch, [request_id])

    def chunks_broke_protocol(self, reason: str) -> None:
        """A CHUNK frame the worker should not have sent: drop the channel, as for any breach
        (its batches fail with the reason, see :meth:`_lost`)."""
        if self._channel is not None:
            self._channel.broken = reason
            self._channel.close()

    async def ended(self) -> str:
        """Why the worker was lost while idle: how its process ended, or its protocol breach."""
        return (await self._lost()).message

    def exit_text(self) -> str:
        lost = self.lost_rank
        if lost is not None and lost is not self:
            return f"{lost.exit_text()}; the worker's other ranks were killed with it"
        return f"worker {self.id} (pid {self.pid}) {describe_exit(self.returncode)}"

    async def _watch_exit(self) -> None:
        """When the process ends, drop its channel and kill what is left of its process group.

        The channel's EOF alone is not enough: a child the handler forked (multiprocessing, a
        DataLoader worker) inherits the socket and keeps it open, and the dead worker's batches
        would then wait for their timeout instead of failing at once. Such children would also
        outlive the worker, holding its memory."""
        assert self._proc is not None
        await self._proc.wait()
        if self._channel is not None and not self._channel.closed:
            self._channel.abort()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # ESRCH when nothing of the group is left
        if self._on_exit is not None:
            self._on_exit(self)

    def _rank_exited(self, rank: Worker) -> None:
        """A rank of this parallel worker ended: the others cannot go on without it (their
        collectives wait for it), so all go now, and rank 0's channel with them: its batches
        fail naming that rank, and its slot starts a new group."""
        if self._stopping:
            return
        if self.lost_rank is None:
            self.lost_rank = rank
            if rank is not self:
                log.warning("%s; killing worker %s's other ranks", rank.exit_text(), self.id,
                            extra=self.facts)  # fmt: skip
        for other in (self, *self.peers):
            proc = other._proc
            if other is not rank and proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

    async def _pipe(self, stream: asyncio.StreamReader, level: int, name: str = "stdout") -> None:
        """Re-log the worker's output line by line under the model's name, keeping a tail."""
        extra = {"stream": name}  # TorchServe's log layout names the stream
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").rstrip()
            self.stderr_tail.append(text)
            self._log.log(level, "[worker %s] %s", self.id, text, extra=extra)

    async def _next_frame(self) -> Frame:
        """The next handshake frame; the worker's death or a protocol breach is WorkerDied."""
        assert self._channel is not None
        frame = await self._channel.next_control()
        if frame is not None:
            return frame
        raise await self._lost()

    async def _lost(self) -> WorkerDied:
        """What to say once the channel is gone: the protocol breach, or how the process ended."""
        assert self._channel is not None
        if self._channel.broken:
            await self.kill()
            return WorkerDied(
                f"worker {self.id} broke the protocol ({self._channel.broken}); killed"
            )
        await self._wait_exit(2.0)
        return WorkerDied(self.exit_text())

    async def _send(self, frame: Frame) -> None:
        assert self._channel is not None
        self._channel.send(frame)
        await self._channel.drain()

    async def start(self, timeout_s: float, launcher: Launcher) -> None:
        """Spawn, say INIT, wait for READY; else ``HandlerLoadFailed`` with the worker's error.
        A parallel worker starts all its ranks at once (each waits for the others in its
        rendezvous); when one fails, all are killed and that failure is raised."""
        parallel = self.spec.parallel
        if not parallel.torchrun:
            await self._start(timeout_s, launcher)
            return
        envs = rank_envs(parallel, self.spec.init.get("model_name", ""), self.id)
        ranks: list[Worker] = []
        for rank, env in enumerate(envs):
            spec = replace(self.spec, env={**self.spec.env, **env},
                           init={**self.spec.init, "rank": rank})  # fmt: skip
            worker = self if rank == 0 else Worker(f"{self.id} rank {rank}", self.model_label,
                                                   self.gpu, spec)  # fmt: skip
            worker.spec, worker.rank = spec, rank
            ranks.append(worker)
        self.peers = ranks[1:]
        tasks = [asyncio.create_task(w._start(timeout_s, launcher)) for w in ranks]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
            if failed or not all(t.done() for t in tasks):
                self._stopping = True  # no rank's end is news any more
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.gather(*(w.kill() for w in ranks))
        if failed:  # the first to fail: the others wait in their rendezvous, or were killed
            raise failed[0].exception()  # type: ignore[misc]
        for worker in ranks:  # from now on, the end of one is the end of all
            worker._on_exit = self._rank_exited
            if worker.returncode is not None:
                self._rank_exited(worker)

    async def _start(self, timeout_s: float, launcher: Launcher) -> None:
        parent, child = socket.socketpair()
        try:
            self._proc = await launcher.launch(
                self.spec.python, str(self.spec.model_dir), self.spec.env, child.fileno(),
                self.spec.init.get("model_name", ""),
                user=(self.spec.init.get("sandbox") or {}).get("user"),  # its own uid
            )  # fmt: skip
        finally:
            child.close()
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._pipes = [
            asyncio.create_task(self._pipe(self._proc.stdout, logging.INFO)),
            asyncio.create_task(self._pipe(self._proc.stderr, logging.INFO, "stderr")),
        ]
        max_payload = self.spec.max_payload_bytes
        _, self._channel = await asyncio.get_running_loop().create_unix_connection(
            lambda: Channel(max_payload), sock=parent
        )
        self._exit_watch = asyncio.create_task(self._watch_exit())
        log.info(
            "worker %s of %s started, pid %s, gpu %s", self.id, self.model_label, self.pid,
            self.gpu, extra=self.facts,
        )  # fmt: skip
        try:
            imports = await asyncio.wait_for(self._handshake(), timeout_s)
        except asyncio.TimeoutError:
            self.timed_out = True
            await self.kill()
            raise HandlerLoadFailed(
                f"worker {self.id} of {self.model_label} did not load its handler within"
                f" startup_timeout_s={timeout_s:g}"
            ) from None
        except WorkerDied as exc:
            raise HandlerLoadFailed(
                f"{exc.message} while loading; last output:\n{self.tail()}"
            ) from None
        if imports is not None:
            launcher.learned(
                self.spec.python, self.spec.init.get("model_name", ""), imports,
                getattr(self._proc, "preloaded", frozenset()),
            )  # fmt: skip

    async def _handshake(self) -> list[str] | None:
        """HELLO, INIT, READY; the installed packages the handler imported, as the worker
        reports them (None when it does not, or says something that is no list of names)."""
        hello = await self._next_frame()
        if hello.kind != Kind.HELLO or hello.meta.get("protocol") != protocol.PROTOCOL_VERSION:
            raise HandlerLoadFailed(f"worker {self.id} spoke an unexpected protocol: {hello.meta}")
        await self._send(Frame(Kind.INIT, self.spec.init))
        reply = await self._next_frame()
        if reply.kind == Kind.LOAD_FAILED:
            await self.stop(2.0)
            raise HandlerLoadFailed(
                f"handler of {self.model_label} failed to load: {reply.meta.get('error')}\n"
                f"{reply.meta.get('traceback', '')}".rstrip()
            )
        if reply.kind != Kind.READY:
            raise HandlerLoadFailed(f"worker {self.id} sent {reply.kind!r} instead of READY")
        self._channel.start_serving()
        self.load_s = reply.meta.get("load_s")
        self.load_ms = (time.time() - self.started_at) * 1000
        self.style = reply.meta.get("style")
        # an async handler with asyncCommunication runs the batches it is sent at once
        self.concurrent = self._channel.concurrent = reply.meta.get("concurrent") is True
        code = reply.meta.get("code")
        self.code = code if isinstance(code, dict) else None
        confined = reply.meta.get("sandbox")
        self.sandbox = confined if isinstance(confined, dict) else None
        self.mapped = _mapped_files(reply.meta.get("mapped"))
        self.parks = bool(self.mapped) and reply.meta.get("parks") is True
        self.state = WorkerState.READY
        log.info(
            "worker %s of %s ready in %.2f s (handler style %s%s)",
            self.id, self.model_label, time.time() - self.started_at, self.style,
            _phases(self.started_at, reply.meta.get("phases"), self.load_s), extra=self.facts,
        )  # fmt: skip
        unusable = reply.meta.get("gpu_unusable")
        if isinstance(unusable, str):
            log.warning("worker %s of %s was given GPU %s but cannot use it: %s",
                        self.id, self.model_label, self.gpu, unusable,
                        extra=self.facts)  # fmt: skip
        if "imports" not in reply.meta:
            return None
        try:
            return valid_names(reply.meta["imports"])
        except ValueError as exc:
            log.warning("worker %s of %s reported unusable imports (%s); ignored",
                        self.id, self.model_label, exc, extra=self.facts)  # fmt: skip
            return None

    def tail(self, lines: int = 20) -> str:
        return "\n".join(list(self.stderr_tail)[-lines:])

    @property
    def waiting_requests(self) -> int:
        """Requests sent to this worker that it has not started (they wait in its socket)."""
        return 0 if self._channel is None else self._channel.waiting

    def send_batch(self, items: list[RequestItem], timeout_s: float, ahead: bool = False) -> Batch:
        """Queue one batch for the worker. Several may be in flight: they run in order, and each
        one's timeout starts when the worker starts it. ``ahead`` (only where :attr:`reorders`):
        it runs before those sent earlier that the worker has not started."""
        channel = self._channel
        assert channel is not None
        self._batch_ids += 1
        frame = protocol.batch_frame(self._batch_ids, items, check=False, ahead=ahead)
        batch = channel.submit(self._batch_ids, frame, len(items), timeout_s)
        if ahead:
            channel.flush_now()
        if self._lockstep:  # every rank runs it; rank 0 answers (TorchServe's broadcast)
            for peer in self.peers:
                if peer._channel is not None:
                    peer._channel.send(frame)
        self.state = _BUSY
        return batch

    async def reload_step(self, reload_id: int, step: str, timeout_s: float) -> protocol.Reloaded:
        """One step of a hot reload of the handler's code (server/models/reload.py): sent in
        turn with the batches, so the worker runs it after those already sent; while it
        prepares, it is sent no new batch (the other workers serve the queue). A worker that
        is lost, breaks the protocol or takes longer than ``timeout_s`` raises
        :class:`WorkerDied` (killed: its slot restarts it with the code on disk)."""
        channel = self._channel
        if channel is None or channel.closed:
            raise WorkerDied(f"worker {self.id} of {self.model_label} is gone")
        frame = protocol.reload_frame(reload_id, step)
        held = None
        if step == protocol.PREPARE and self._held is None:  # it runs what it has, then this
            held = self._held = asyncio.get_running_loop().create_future()
        pending = channel.submit(reload_id, frame, 0, timeout_s)
        try:
            await channel.drain()
            reply = await pending.future
        except BatchExpired:
            await self.kill()
            raise WorkerDied(
                f"worker {self.id} of {self.model_label} did not finish the reload's {step}"
                f" within {timeout_s:g} s; it was killed and restarts with the code on disk"
            ) from None
        except ChannelClosed:
            raise await self._lost() from None
        finally:
            if held is not None:
                self._held = None
                held.set_result(None)
            if channel.in_flight == 0 and self.state is WorkerState.BUSY:
                self.state = WorkerState.READY
        try:
            answer = protocol.parse_reloaded(reply)
        except protocol.ProtocolError as exc:
            await self.kill()
            raise WorkerDied(f"worker {self.id} answered a reload wrongly ({exc}); killed") from exc
        if answer.reload_id != reload_id or answer.step != step:
            await self.kill()
            raise WorkerDied(
                f"worker {self.id} answered reload {answer.reload_id} {answer.step} to reload"
                f" {reload_id} {step}; killed"
            )
        if answer.ok and step != protocol.PREPARE:  # the code it serves from now on
            self.code = answer.code
        return answer

    async def park(self, timeout_s: float) -> protocol.Parked:
        """Park the idle worker (it trims its heap and keeps its handler and mapped weights;
        state PARKED until :meth:`unpark`). Only for a worker that :attr:`parks`, with no batch
        in flight. One lost, too slow or answering wrongly raises :class:`WorkerDied` (killed);
        a park the worker refused comes back with ``ok`` false, the worker as it was."""
        channel = self._channel
        if channel is None or channel.closed:
            raise WorkerDied(f"worker {self.id} of {self.model_label} is gone")
        self._park_ids += 1
        park_id = self._park_ids
        pending = channel.submit(park_id, protocol.park_frame(park_id), 0, timeout_s)
        channel.flush_now()
        try:
            reply = await pending.future
        except BatchExpired:
            await self.kill()
            raise WorkerDied(
                f"worker {self.id} of {self.model_label} did not park within {timeout_s:g} s;"
                " killed"
            ) from None
        except ChannelClosed:
            raise await self._lost() from None
        try:
            answer = protocol.parse_parked(reply)
            if answer.park_id != park_id:
                raise protocol.ProtocolError(f"answered park {answer.park_id} to park {park_id}")
        except protocol.ProtocolError as exc:
            await self.kill()
            raise WorkerDied(f"worker {self.id} answered a park wrongly ({exc}); killed") from exc
        if answer.ok:
            self.state = WorkerState.PARKED
        return answer

    def unpark(self) -> bool:
        """The parked worker serves again (READY): no frame, its next batch wakes it. False
        when it was lost while parked (its process ended, its channel closed)."""
        channel = self._channel
        if (
            self.state is not WorkerState.PARKED or channel is None or channel.closed
            or self.returncode is not None
        ):  # fmt: skip
            return False
        self.state = WorkerState.READY
        self.wakes += 1
        return True

    @property
    def held(self) -> bool:
        """Whether it prepares a hot reload: no batch is to be sent to it meanwhile."""
        return self._held is not None

    def can_take(self) -> bool:
        """Whether a batch sent now goes out at once (the channel is open and not full): what
        ``await drain()`` would not have to wait for."""
        return self._held is None and self._channel is not None and self._channel.writable

    def withdraw(self, batch: Batch, request_id: str) -> None:
        """The caller of a request in ``batch`` went away: if the worker has not started the
        batch, it skips that request (no-op otherwise)."""
        if self._on_withdraw is not None:
            self._on_withdraw(batch, request_id)
        elif self._channel is not None and not self._lockstep:  # its answer is dropped
            self._channel.cancel(batch, [request_id])

    async def batch_result(self, batch: Batch, items: list[RequestItem]) -> list[ResponseItem]:
        """The answer to a sent batch. A timeout kills the worker (504 to its callers); a batch
        the worker had not started when it died raises :class:`ChannelClosed` (``started``
        False), so that its jobs can go to another worker."""
        channel = self._channel
        assert channel is not None
        batch_id, timeout_s = batch.batch_id, batch.timeout_s
        try:
            await channel.drain()
            reply = await batch.future
        except BatchExpired:
            # the callers get their 504 now, at the deadline; killing the process tree and
            # waiting for it to go can take seconds, and the batches behind this one are
            # requeued when its channel closes
            self.timed_out = True
            self._killing = asyncio.ensure_future(self.kill())
            raise WorkerTimeout(
                f"worker {self.id} of {self.model_label} did not answer within"
                f" response_timeout_s={timeout_s:g}; it is being killed and replaced"
            ) from None
        except ChannelClosed as exc:
            if not exc.started:
                raise
            raise await self._lost() from None
        finally:
            if channel.in_flight == 0 and self.state is WorkerState.BUSY:
                self.state = WorkerState.READY
        self.answered_batches += 1
        if reply.kind == Kind.BATCH_FAILED:
            raise HandlerError(f"handler of {self.model_label} failed: {reply.meta.get('error')}")
        if reply.kind != Kind.RESULT:
            raise WorkerDied(f"worker {self.id} sent {reply.kind!r} instead of a result")
        try:
            return self._responses(batch_id, reply, len(items))
        except WorkerDied:
            await self.kill()
            raise

    def answered(self, batch: Batch, size: int) -> list[ResponseItem] | None:
        """The responses of a batch whose future is done, when the worker answered it as it
        should; None for anything else (failed, expired, lost, malformed), which
        :meth:`batch_result` turns into the right error. Synchronous, so the common case is
        settled from the future's callback without waking a task."""
        future = batch.future
        if future.cancelled() or future.exception() is not None:
            return None
        reply = future.result()
        if reply.kind is not _RESULT:
            return None
        try:
            responses = self._responses(batch.batch_id, reply, size)
        except WorkerDied:
            return None
        channel = self._channel
        if channel is not None and channel.in_flight == 0 and self.state is _BUSY:
            self.state = _READY
        self.answered_batches += 1
        return responses

    def result_metrics(self, batch: Batch) -> tuple[float | None, list[MetricEntry]]:
        """The handler's time and the metrics it recorded, from an answered batch's RESULT;
        malformed metrics are dropped (logged once per worker): the answers were fine."""
        return self.frame_metrics(batch.future.result())

    def frame_metrics(self, reply: Frame) -> tuple[float | None, list[MetricEntry]]:
        """:meth:`result_metrics` of a RESULT or STEP frame."""
        meta = reply.meta
        if "metrics" not in meta and type(meta.get("handler_ms")) is float:
            return meta["handler_ms"], []
        try:
            return protocol.parse_result_metrics(reply)
        except protocol.ProtocolError as exc:
            if not self._bad_metrics_logged:
                self._bad_metrics_logged = True
                log.warning("worker %s sent malformed metrics (dropped): %s", self.id, exc,
                            extra=self.facts)  # fmt: skip
            return None, []

    def _responses(self, batch_id: int, reply: Frame, size: int) -> list[ResponseItem]:
        try:
            got_id, responses = protocol.parse_result(reply)
        except protocol.ProtocolError as exc:
            raise WorkerDied(f"worker {self.id} sent a malformed result ({exc}); killed") from exc
        if got_id != batch_id or len(responses) != size:
            raise WorkerDied(
                f"worker {self.id} answered batch {got_id} with {len(responses)} items"
                f" (expected batch {batch_id} with {size}); killed"
            )
        return responses

    async def drain(self) -> None:
        """Wait while the worker's socket is full (it is not reading): back-pressure; and while
        it prepares a hot reload (:meth:`reload_step`)."""
        while self._held is not None:
            await asyncio.shield(self._held)
        if self._channel is not None:
            await self._channel.drain()

    async def _wait_exit(self, timeout_s: float) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._proc.wait(), timeout_s)

    async def kill(self) -> None:
        """SIGKILL the worker's whole process tree (a handler may have started children); a
        parallel worker's: every rank's."""
        if self.peers:
            self._stopping = True
            await asyncio.gather(*(peer.kill() for peer in self.peers))
        if self._proc is None or self._proc.returncode is not None:
            await self._close()
            return
        try:
            tree = psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        await self._wait_exit(5.0)
        await self._close()

    async def stop(self, deadline_s: float) -> None:
        """Close the channel (the worker exits on EOF), SIGTERM at the deadline, then SIGKILL;
        a parallel worker's ranks all at once."""
        if self.peers:
            self._stopping = True  # ranks ending now is the stop, not a rank lost
            await asyncio.gather(self._stop(deadline_s), *(p._stop(deadline_s) for p in self.peers))
            return
        await self._stop(deadline_s)

    async def _stop(self, deadline_s: float) -> None:
        self.state = WorkerState.STOPPING
        if self._channel is not None:
            self._channel.close()
        if self._proc is not None and self._proc.returncode is None:
            try:
                await asyncio.wait_for(self._proc.wait(), deadline_s)
            except asyncio.TimeoutError:
                log.warning(
                    "worker %s ignored channel close for %.1f s; SIGTERM", self.id, deadline_s,
                    extra=self.facts,
                )  # fmt: skip
                self._proc.terminate()
                try:
                    await asyncio.wait_for(self._proc.wait(), 2.0)
                except asyncio.TimeoutError:
                    log.warning("worker %s ignored SIGTERM; SIGKILL", self.id, extra=self.facts)
                    await self.kill()
        await self._close()
        self.state = WorkerState.STOPPED

    async def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        watch, proc = self._exit_watch, self._proc
        if watch is not None and proc is not None and proc.returncode is None:
            watch.cancel()  # the process outlived kill(): nothing more to watch for
        for task in self._pipes:
            try:
                await asyncio.wait_for(task, 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
        self._pipes = []
        self.state = WorkerState.STOPPED


def default_python() -> str:
    return sys.executable


def _phases(launched: float, reported: Any, load_s: Any) -> str:
    """READY's ``phases`` (the worker's clock times, same machine) as the steps of its start:
    the process up, INIT received, the handler loaded and, of that, the weights (and touching
    their pages, and converting a legacy checkpoint when it did); empty when the worker said
    nothing usable."""
    if not isinstance(reported, dict):
        return ""
    times = {k: v for k, v in reported.items() if isinstance(v, (int, float))}
    if not {"started", "init", "ready"} <= times.keys():
        return ""
    text = (
        f"; process up {times['started'] - launched:.3f} s, INIT {times['init'] - launched:.3f}"
        f" s, ready {times['ready'] - launched:.3f} s after launch"
    )
    if isinstance(load_s, (int, float)):
        text += f"; handler loaded in {load_s:.3f} s"
        if times.get("weights_s"):
            text += f", weights {times['weights_s']:.3f} s"
            text += f" (pages touched {times.get('populate_s', 0.0):.3f} s)"
        if times.get("convert_s"):
            text += f", a legacy checkpoint converted {times['convert_s']:.3f} s"
    return text


def _mapped_files(reported: Any) -> list[tuple[str, int]]:
    """READY's ``mapped``, ``[[path, bytes], ...]``; anything else in it is left out (a
    worker's word, bounded: at most 4096 files)."""
    if not isinstance(reported, list):
        return []
    out = []
    for entry in reported[:4096]:
        if (
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
            and type(entry[1]) is int and entry[1] >= 0 and os.path.isabs(entry[0])
        ):  # fmt: skip
            out.append((entry[0], entry[1]))
    return out
