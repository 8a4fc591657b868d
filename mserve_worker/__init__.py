"""mserve's in-worker code: the runtime, the frame codec, the handler context and the SDK.

It runs inside each model's own Python environment, so it imports the standard library only and
keeps to Python 3.8. The name is distinctive on purpose: a model may ship its own ``server.py``,
``utils.py`` or ``archiver.py`` without clashing with anything of ours. Handlers import the SDK
from ``mserve_worker.sdk`` (docs/handlers.md).
"""
