"""Reports which ``mlrun`` it imported: mserve's stand-in, or an installed one (which marks
itself with ``INSTALLED_MLRUN``)."""

import mlrun


def handle(data, context):
    if data is None:
        return None
    installed = getattr(mlrun, "INSTALLED_MLRUN", False)
    return [{"mlrun": mlrun.__file__, "installed": installed} for _ in data]
