"""The gRPC frontend: TorchServe's inference (7070) and management (7071) services on grpc.aio,
on the server's event loop (docs/server.md, gRPC). The generated modules are in ``protos``."""
