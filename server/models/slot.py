"""A worker slot of a model version: the place one supervised worker lives in, restarted there
when it dies, until the slot is retired (server/models/version.py runs it)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

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
    retire: asyncio.Event = field(default_factory=asyncio.Event)
    worker: Worker | None = None
    first_start: asyncio.Future[None] | None = None
    task: asyncio.Task[None] | None = None
    on_demand: bool = False  # started by a request to a model that had no worker
    lane: JobQueue | None = None  # sequence batching: the requests of its sequences

    @property
    def idle(self) -> bool:
        return self.worker is None or self.worker.state is not WorkerState.BUSY
