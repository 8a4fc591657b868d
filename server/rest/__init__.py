"""The REST routers, one per API: TorchServe's inference API with KServe v1 and the Open
Inference Protocol (inference.py), its management API (management.py), and the OpenAPI
description of both (description.py). They sit on the HTTP layer (server/http/) beside the
gRPC services (server/rpc/), and share the model operations (server/operations.py)."""
