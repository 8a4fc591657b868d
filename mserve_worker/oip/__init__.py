"""The Open Inference Protocol (KServe v2) and KServe v1, inside a worker.

- :mod:`.tensors`: the codec, sans-IO and independent of HTTP: OIP request and response
  structures to and from ``(name, datatype, shape, data)`` tensors, JSON ``data`` and the binary
  tensor data extension. A gRPC front end reuses it (its raw contents are the binary form).
- :mod:`.signature`: the inputs and outputs a model declares in its model config YAML, and the
  checks of a request against them.
- :mod:`.serving`: what each handler style receives for a v1 or v2 request, and how its results
  become the answer.

Standard library only, Python 3.8+; numpy is used when the model's environment has it, imported
when a worker serves its first tensor request.
"""
