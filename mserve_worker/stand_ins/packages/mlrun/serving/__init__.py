"""mserve's stand-in for ``mlrun.serving``: ``V2ModelServer`` only."""

from mserve_worker import stand_ins as _stand_ins

from . import v2_serving
from .v2_serving import V2ModelServer

__all__ = ["V2ModelServer", "v2_serving"]


def __getattr__(name):  # type: ignore[no-untyped-def]
    raise _stand_ins.missing(__name__, name)
