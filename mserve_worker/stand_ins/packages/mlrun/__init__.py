"""mserve's stand-in for ``mlrun``: only ``mlrun.serving.V2ModelServer``.

Imported only where the model's environment has no real ``mlrun``; see
:mod:`mserve_worker.stand_ins`.
"""

from mserve_worker import stand_ins as _stand_ins

from . import serving  # `import mlrun` then `mlrun.serving.V2ModelServer`, as with mlrun

__all__ = ["serving"]


def __getattr__(name):  # type: ignore[no-untyped-def]
    raise _stand_ins.missing(__name__, name)
