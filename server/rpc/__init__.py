"""The gRPC frontend: TorchServe's inference (7070) and management (7071) services on grpc.aio,
on the server's event loop (docs/apis.md, gRPC). The generated modules are in ``protos``."""
