"""mserve's stand-in for ``mlrun.serving.v2_serving``: ``V2ModelServer`` only.

A package rather than a module, so that ``from mlrun.serving.v2_serving import X`` for a name we
lack reports :func:`mserve_worker.stand_ins.missing`'s message.
"""

from mserve_worker import stand_ins as _stand_ins
from mserve_worker.sdk.v2_model import V2ModelServer

__all__ = ["V2ModelServer"]


def __getattr__(name):  # type: ignore[no-untyped-def]
    raise _stand_ins.missing(__name__, name)
