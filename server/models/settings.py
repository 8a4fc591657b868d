"""A model version's effective settings, and where each came from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ModelSettings:
    """Effective settings; ``sources`` says where each came from (api, archive, server)."""

    batch_size: int
    max_batch_delay_ms: int
    response_timeout_s: float
    startup_timeout_s: float
    min_workers: int
    max_workers: int
    job_queue_size: int
    device_ids: tuple[int, ...] | None
    device_type: str | None = None  # the model config's deviceType: cpu, gpu, neuron
    retry_on_worker_death: bool = False
    idle_unload_s: float | None = None  # scale down to min_workers after this long unused
    # when a batch waits for more requests: "busy" only while its worker runs another batch,
    # "fill" up to max_batch_delay_ms even when the worker idles (TorchServe's way)
    batch_wait: str = "busy"
    sources: dict[str, str] = field(default_factory=dict)


def with_changes(settings: ModelSettings, source: str | None, **changes: Any) -> ModelSettings:
    """``settings`` with ``changes``; each that differs is recorded as from ``source``."""
    sources = dict(settings.sources)
    for key, value in changes.items():
        if value != getattr(settings, key) and source is not None:
            sources[key] = source
    return replace(settings, **changes, sources=sources)
