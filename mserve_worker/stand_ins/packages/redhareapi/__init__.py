"""mserve's stand-in for ``redhareapi`` (kernel files' SDK): ``Kernel`` only.

Imported only where the model's environment has no real ``redhareapi``; see
:mod:`mserve_worker.stand_ins`.
"""

from mserve_worker import stand_ins as _stand_ins
from mserve_worker.sdk.kernel import Kernel

__all__ = ["Kernel"]


def __getattr__(name):  # type: ignore[no-untyped-def]
    raise _stand_ins.missing(__name__, name)
