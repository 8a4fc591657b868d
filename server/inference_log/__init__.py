"""Inference logging for model monitoring: each sampled request and its answer, written to
JSON-lines files and/or sent as CloudEvents exactly as KServe's logger sends them.

- :mod:`.policy`: a model version's logging settings (mode, sampling, batching, sinks,
  redaction), checked once when it is registered.
- :mod:`.records`: what one request becomes (a :class:`~.records.Record`), its JSON line and
  its CloudEvents.
- :mod:`.sinks`: where records go (rotated files, an HTTP CloudEvents receiver).
- :mod:`.logger`: the per-model logger the batch pump hands settled requests to; the request
  path only appends to a bounded queue, a background task per sink sends.

docs/inference-logging.md is the user's guide.
"""

from server.inference_log.logger import InferenceLogger
from server.inference_log.policy import MODES, LogPolicy

__all__ = ["MODES", "InferenceLogger", "LogPolicy"]
