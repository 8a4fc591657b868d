"""A worker slot of a model version: the place one supervised worker lives in, restarted there
when it dies, until the slot is retired (server/models/version.py runs it)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.models.batching import JobQueue
from server.workers.process import Worker, WorkerState

# A worker in these states serves requests (busy with a batch or not).
SERVING = (WorkerState.READY, WorkerState.BUSY)


class Ended(enum.Enum):
    """How one worker's life in a slot ended, when not with a backoff to restart after."""

    RETIRED = "retired"
    FIRST_START_FAILED = "first start failed"  # the caller waiting on it removes the slot


@dataclass(eq=False)  # identity: slots live in sets
class Slot:
    # every worker started in the slot has this id, as a TorchServe worker keeps its port
    # across its restarts (``W-9000-<model>`` in its log lines and metrics)
    worker_id: str = ""
    retire: asyncio.Event = field(default_factory=asyncio.Event)
    worker: Worker | None = None
    first_start: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None
    on_demand: bool = False  # started by a request to a model that had no worker
    # a model that had no worker coming back (residency.py, warm_keeper.py): the warm tier's
    # files its admission took (a load on demand), and what its first worker ready is told
    # (a scale from 0)
    taken: list[str] = field(default_factory=list)
    on_ready: Callable[[Worker], None] | None = None
    # its model's parked worker, taken from the warm tier by its admission: woken instead of
    # a new one started (mserve_worker/park.py)
    parked: Worker | None = None
    # or what the park of its model's last worker hands over, when the model was asked for
    # while that worker was being parked (server/models/warm.py)
    parking: asyncio.Future[Any] | None = None
    # retired by an eviction with the warm tier keeping workers: its idle worker is parked
    # rather than stopped when it leaves
    park: bool = False
    # a failed first start is told to whoever waits on it, and the slot retries all the same,
    # as after a lost worker (a startup model in TorchServe's layout); else the slot ends
    keep_trying: bool = False
    lane: JobQueue | None = None  # sequence batching: the requests of its sequences
    # its recovery, as TorchServe's WorkerThread keeps it: when it lost its worker with none
    # loaded since (monotonic; None while a worker is loaded), the losses since, and how far
    # along the backoff sequence its restarts are (a worker that loads starts it again)
    recovering_since: float | None = None
    losses: int = 0
    backoff_step: int = 0

    @property
    def idle(self) -> bool:
        return self.worker is None or self.worker.state is not WorkerState.BUSY
