"""The supervisor side of worker processes: launching, channels, supervision.

The code that runs *inside* a worker (runtime, protocol codec, context, handler SDK) is the
top-level package ``mserve_worker``, so that it never shares a name with a model's own modules.
"""
